"""Child processes, one module for the launcher, the benchmarks and ``kaitian train``: starting
a child tied to its parent (no orphans, :func:`start_child`), stopping children with escalating
signals (:func:`stop_children`), and where their prefixed output lines go (a text stream, or
:class:`CapturedOutput` in the benchmarks and tests). Free ports for their routers and
rendezvous stores come from ``ports.free_port``.

A helper below every layer: it imports only the standard library, so ``training.launch`` uses
it as the launchers do."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

STOP_GRACE_S = 5.0


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class LineOut(Protocol):
    """Where a launcher writes the prefixed node lines: a text stream, or anything that takes
    ``write``/``flush`` like one (``CapturedOutput``, the live view's console lines)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class ChildProcess(Protocol):
    """What stopping a child needs of it: a ``subprocess.Popen``, or a node forked by the fork
    server (``fork_server.ForkedProcess``)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int, /) -> None: ...


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not glibc: children are not tied to their parent
        return None


# resolved in the parent: a dlopen in the child, between fork and exec, could block on a loader
# lock some other thread of the parent held at the fork
_PRCTL = _load_prctl()


def _tie() -> None:
    """Child side, before exec: get SIGTERM when the parent disappears, even by SIGKILL. The
    kernel ties it to the parent's thread that started the child."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def tie_own_group() -> None:
    """Child side: the parent-death tie, in a process group of its own (SIGINT kept)."""
    _tie()
    os.setsid()  # own process group: a terminal's Ctrl-C reaches only the parent, which forwards it


def die_with_parent() -> None:
    """Child side: get SIGTERM if the parent disappears, even by SIGKILL (no orphans), in a
    process group of its own, SIGINT held back (blocked) until the program takes it
    (:func:`accept_sigint`).

    Runs as ``preexec_fn`` although the parent has threads (PLW1509): only the child itself can
    ask for the kernel's parent-death signal. So it does as little as it can: no imports and no
    library loading, a prctl, setsid and one signal mask."""
    tie_own_group()
    # SIGINT blocked, not ignored: a Ctrl-C in a node's first seconds (importing torch) would
    # otherwise print a KeyboardInterrupt traceback - or, ignored, be lost, and the node would
    # run on until the stop escalates to SIGTERM. Blocked, it waits (pending, across exec) until
    # the node's run_node has its handler and unblocks it; the node then stops at once, quietly.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def accept_sigint() -> None:
    """Deliver SIGINT from now on (it was held back by :func:`die_with_parent`); one that came
    meanwhile reaches the handler now. Call it once the handler is installed."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def take_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt in this process from now on, whatever it inherited:
    SIGINT ignored (a shell's background job) or held back (:func:`die_with_parent`, a parent
    that blocked it). One held back until now raises here."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    accept_sigint()


def name_process(name: str) -> None:
    """The name `ps` and `top` show for this process (the kernel keeps 15 bytes of it)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_NAME, name.encode()[:15])


def start_child(command: Sequence[str], *, own_group: bool = True, defer_sigint: bool = False,
                **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)`` of a child the kernel ends (SIGTERM) when this
    process dies, even by SIGKILL (the kernel watches the thread that starts it: start
    long-lived children from a thread that outlives them, as the main thread does).

    ``own_group``: the child leads a process group of its own, which :func:`stop_children`
    signals as a whole (its own children too); a terminal's Ctrl-C then reaches only this
    process, which forwards it. Without it the child stays in this process's group and gets a
    terminal's signals itself. ``defer_sigint`` (with ``own_group``): SIGINT is held back until
    the child's program calls :func:`accept_sigint` (the nodes' ``run_node`` and ``kaitian
    router`` do, once their handler is in place; a program that does not never sees Ctrl-C)."""
    if defer_sigint and not own_group:
        raise ValueError("defer_sigint needs own_group: the terminal's SIGINT would reach the child")
    preexec = die_with_parent if defer_sigint else (tie_own_group if own_group else _tie)
    return subprocess.Popen(command, preexec_fn=preexec, **popen)  # noqa: PLW1509 - see die_with_parent


def tie_to_parent() -> None:
    """The same tie, asked by a child that was started otherwise (a ``multiprocessing`` child):
    SIGTERM when its parent dies; it exits at once if the parent was gone before the tie took
    effect."""
    if _PRCTL is None:
        return
    _tie()
    if os.getppid() == 1:
        os._exit(0)


DEFAULT_ESCALATION = ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0))


def _send(process: ChildProcess, sig: int) -> None:
    """``sig`` to the child's process group where it leads one, else to the child alone."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)


def stop_children(processes: Sequence[ChildProcess],
                  escalation: tuple[tuple[int, float], ...] = DEFAULT_ESCALATION) -> None:
    """Signal each live child (its process group, where it leads one), escalating (signal, grace
    seconds) until all exit."""
    for sig, grace in escalation:
        alive = [p for p in processes if p.poll() is None]
        if not alive:
            break
        for process in alive:
            _send(process, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.05)


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
