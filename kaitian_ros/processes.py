"""The launcher's child processes: a node's command line, a child tied to its parent (no
orphans), stopping process groups with escalating signals, and where their prefixed output
lines go (a text stream, or :class:`CapturedOutput` in the benchmarks and tests)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kaitian_ros.scenario import NodeSpec

STOP_GRACE_S = 5.0


_PR_SET_PDEATHSIG = 1


ROUTER = "router"  # name and executable of the router's child process


class LineOut(Protocol):
    """Where a launcher writes the prefixed node lines: a text stream, or anything that takes
    ``write``/``flush`` like one (``CapturedOutput``, the live view's console lines)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not glibc: children are not tied to the launcher
        return None


# resolved in the parent: a dlopen in the child, between fork and exec, could block on a loader
# lock some other thread of the launcher held at the fork
_PRCTL = _load_prctl()


def die_with_parent() -> None:
    """Child side: get SIGTERM if the launcher disappears, even by SIGKILL (no orphans).

    Runs as ``preexec_fn`` although the launcher has threads (PLW1509): only the child itself can
    ask for the kernel's parent-death signal. So it does as little as it can: no imports and no
    library loading, a prctl, setsid and one signal disposition."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setsid()  # own process group: the terminal's Ctrl-C reaches only the launcher, which forwards it
    # SIGINT ignored until the node's run_node installs its handler: a graph stopped in its first
    # seconds would otherwise print a KeyboardInterrupt traceback per node still importing torch
    # (the stop escalates to SIGTERM after STOP_GRACE_S, which ends such a node quietly)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def node_command(spec: NodeSpec, params_file: Path) -> list[str]:
    if spec.executable == ROUTER:
        return [sys.executable, "-u", "-m", "kaitian_ros.cli", "router", "--listen", spec.parameters["listen"]]
    return [sys.executable, "-u", "-m", f"kaitian_ros.nodes.{spec.executable}", "--ros-args",
            "-r", f"__node:={spec.name}", "--params-file", str(params_file)]


DEFAULT_ESCALATION = ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0))


def stop_process_groups(processes: list[subprocess.Popen],
                        escalation: tuple[tuple[int, float], ...] = DEFAULT_ESCALATION) -> None:
    """Signal each live process's group, escalating (signal, grace seconds) until all exit."""
    for sig, grace in escalation:
        alive = [p for p in processes if p.poll() is None]
        if not alive:
            break
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.05)


@dataclass
class Child:
    spec: NodeSpec
    process: subprocess.Popen
    reader: threading.Thread
    restarts: int = 0          # respawns so far
    restarted_at: float = 0.0  # monotonic time of the last respawn (0: never)
    respawn_at: float = 0.0    # monotonic time of a scheduled respawn (0: none)
    handled: bool = False      # the current process's exit was seen (respawn scheduled or final)
    last_exit: int | None = None


class CapturedOutput:
    """A thread-safe ``out`` for a Launcher that keeps the prefixed node lines (for harnesses
    that start graphs: benchmarks and tests read them back for pids and diagnostics)."""

    def __init__(self, echo: bool = False) -> None:
        self.lines: list[str] = []
        self.echo = echo
        self._lock = threading.Lock()
        self._partial = ""

    def write(self, text: str) -> int:
        with self._lock:
            self._partial += text
            *done, self._partial = self._partial.split("\n")
            self.lines.extend(done)
            if self.echo:
                for line in done:
                    print(line, file=sys.stderr, flush=True)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self, last: int | None = None) -> str:
        with self._lock:
            lines = self.lines + ([self._partial] if self._partial else [])
            return "\n".join(lines if last is None else lines[-last:])
