"""Runtime layer: the only place that imports a middleware (zenoh or rclpy).

``KAITIAN_RUNTIME=embedded|ros`` picks one; the default is ``ros`` when rclpy imports,
``embedded`` otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kaitian_ros.processes import accept_sigint
from kaitian_ros.runtime.api import Runtime
from kaitian_ros.runtime.node_args import NodeArgsError, parse_node_args


def runtime_kind() -> str:
    kind = os.environ.get("KAITIAN_RUNTIME", "").strip().lower()
    if kind in ("embedded", "ros"):
        return kind
    if kind:
        raise ValueError(f"KAITIAN_RUNTIME must be 'embedded' or 'ros', got {kind!r}")
    return "ros" if importlib.util.find_spec("rclpy") is not None else "embedded"


def create_runtime(default_name: str, argv: Sequence[str] | None = None) -> Any:
    """A Runtime for a node named by ``-r __node:=`` (else ``default_name``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if runtime_kind() == "ros":
        from kaitian_ros.runtime.ros import RosRuntime

        return RosRuntime(default_name, argv)
    from kaitian_ros.runtime.embedded import EmbeddedRuntime

    return EmbeddedRuntime(parse_node_args(argv, default_name))


class _StoppedWhileStarting(BaseException):
    """SIGINT or SIGTERM while a node was being built (not an Exception: no handler of the
    node's own may swallow it)."""


STOP_RETRY_S = 0.01  # a stop that a callback swallowed is raised again this much later


def _stop_again_when_swallowed(starting: Callable[[], bool]) -> Callable[[Any], None]:
    """An `sys.unraisablehook` for the start of a node. Python runs a signal's handler between
    any two bytecodes, also inside a callback that cannot pass an exception on (a weakref's,
    which importlib uses for its module locks; a `__del__`): there the stop raised by the handler
    is printed as "Exception ignored" and the build goes on. This hook keeps that off the log and
    raises the stop again a moment later (SIGALRM, same handler), from wherever the build is
    then."""
    default = sys.unraisablehook

    def hook(info: Any) -> None:
        if starting() and isinstance(info.exc_value, _StoppedWhileStarting):
            signal.setitimer(signal.ITIMER_REAL, STOP_RETRY_S)
            return
        default(info)

    return hook


def run_node(node_factory: Callable[[Runtime], Any], default_name: str,
             argv: Sequence[str] | None = None) -> int:
    """Entry point body of every node executable: build, spin until SIGINT/SIGTERM, clean up."""
    try:
        rt = create_runtime(default_name, argv)
    except (NodeArgsError, ValueError) as exc:
        print(f"{default_name}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - e.g. no router reachable, or rclpy's init: one line, exit code 1
        print(f"{default_name}: cannot start runtime: {exc}", file=sys.stderr)
        return 1

    starting = True

    def stop(signum: int, frame: Any) -> None:
        rt.shutdown()
        if starting:  # building a node takes seconds (a model, its cost measurement): give that up
            raise _StoppedWhileStarting

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    default_unraisable = sys.unraisablehook
    sys.unraisablehook = _stop_again_when_swallowed(lambda: starting)
    try:
        try:
            accept_sigint()  # a Ctrl-C held back while this process started is handled here
            node = node_factory(rt)
        finally:
            starting = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            sys.unraisablehook = default_unraisable
    except _StoppedWhileStarting:
        rt.close()
        return 0
    except ValueError as exc:  # bad parameters: one clear line, non-zero exit
        rt.logger.error(f"refusing to start: {exc}")
        rt.close()
        return 2
    except Exception:  # a bug or an unexpected OS error: say so and exit (the middleware's threads
        rt.logger.exception("failed to start")  # would otherwise keep a half-built node alive)
        rt.close()
        return 1
    try:
        rt.spin()
    finally:
        close = getattr(node, "close", None)
        if close is not None:
            close()
        rt.close()
    return 0
