"""Free TCP ports for routers and rendezvous stores; a helper below every layer (imports only
the standard library), shared by the launchers, ``training.launch``, the benchmarks and tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port the kernel just handed out (bind to port 0 on loopback), so parallel graphs
    and process groups never collide. Another process may take it before the caller listens on
    it: callers that can, retry (``launcher.start_on_free_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
