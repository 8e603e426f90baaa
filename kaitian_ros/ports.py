"""Free TCP ports for routers and rendezvous stores; a helper below every layer (imports only
the standard library), shared by the launchers, ``training.launch``, the benchmarks and tests."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PORT_ATTEMPTS = 5  # fresh ports tried before giving up: a port is taken first only under a race


def free_port() -> int:
    """A TCP port the kernel just handed out (bind to port 0 on loopback), so parallel graphs
    and process groups never collide. Another process may take it before the caller listens on
    it: callers that can, retry (`on_free_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The port was taken between `free_port` and the listen on it."""


def on_free_port(attempt: Callable[[int], T], attempts: int = PORT_ATTEMPTS, *, first: int | None = None,
                 what: str = "a listener") -> T:
    """``attempt(port)`` on a fresh free port (``first`` for the first try, when one was chosen
    already), again on another while it raises `PortTaken`: parallel test workers, graphs and
    benchmarks pick their ports at the same moment. Raises `PortTaken` after ``attempts``."""
    port = first if first is not None else free_port()
    for _ in range(attempts):
        try:
            return attempt(port)
        except PortTaken:
            port = free_port()
    raise PortTaken(f"{what} could not listen on a free port {attempts} times (another process took each one first)")
