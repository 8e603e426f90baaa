"""Progress of a long command (training epochs, benchmark runs) on stderr, where it stays out
of the results on stdout: a rich bar on a terminal, plain ``[progress]`` lines elsewhere.

Cheap by construction, as benchmarks measure latency and throughput on the same cores: it
draws only when told of a step (no refresh thread), at most ``MAX_REDRAWS_PER_S`` times a
second on a terminal and one plain line per ``PLAIN_EVERY_S`` elsewhere (the last step always).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from kaitian_ros.terminal_text import printable

MAX_REDRAWS_PER_S = 4.0
PLAIN_EVERY_S = 2.0
BAR_COLUMNS_WIDTH = 20 + 2 * 8 + 5  # bar, done/total, elapsed time, the spaces between


class Progress:
    def __init__(self, what: str, total: int, *, stream: TextIO | None = None, tty: bool | None = None,
                 plain_every_s: float = PLAIN_EVERY_S) -> None:
        self.what = what
        self.total = max(0, int(total))
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.plain_every_s = plain_every_s
        self.done = 0
        self.last_draw = -float("inf")
        self.bar: Any = None
        self.task: Any = None

    def update(self, done: int, note: str = "") -> None:
        """``done`` of ``total`` steps are finished; ``note`` says how the last one went."""
        self.done = max(0, min(int(done), self.total)) if self.total else max(0, int(done))
        note = printable(note)
        now = time.monotonic()
        last = self.total > 0 and self.done >= self.total
        if self.tty:
            self._draw(note, now, force=last)
        elif last or now - self.last_draw >= self.plain_every_s:
            self.last_draw = now
            total = f"/{self.total}" if self.total else ""
            print(f"[progress] {self.what}: {self.done}{total}" + (f" - {note}" if note else ""),
                  file=self.stream, flush=True)

    def advance(self, note: str = "") -> None:
        self.update(self.done + 1, note)

    def _draw(self, note: str, now: float, force: bool) -> None:
        from rich import progress as bars
        from rich.console import Console

        if self.bar is None:
            console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
            self.bar = bars.Progress(
                bars.TextColumn("{task.description}", markup=False), bars.BarColumn(bar_width=20),
                bars.MofNCompleteColumn(), bars.TimeElapsedColumn(),
                bars.TextColumn("{task.fields[note]}", markup=False),
                console=console, auto_refresh=False, transient=False, redirect_stdout=False, redirect_stderr=False)
            self.bar.start()
            self.task = self.bar.add_task(printable(self.what), total=self.total or None, note="")
        # a row wider than the terminal loses its bar (rich collapses columns): the note gives way
        room = self.bar.console.width - len(self.what) - BAR_COLUMNS_WIDTH
        if len(note) > room:
            note = note[:max(0, room - 1)] + "…" if room > 1 else ""
        self.bar.update(self.task, completed=self.done, note=note)
        if force or now - self.last_draw >= 1.0 / MAX_REDRAWS_PER_S:
            self.last_draw = now
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.refresh()
            bar.stop()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
