"""A pre-started interpreter that becomes a node when the launcher respawns one.

A node process spends its first 1.5-3 s on this machine importing torch and the middleware
before it does anything of its own; a compute node killed with SIGKILL was back in the plan
5.5 s later, 1 s of it the respawn delay and most of the rest imports. `kaitian launch` keeps
one interpreter that has already imported what every node imports (`PRELOAD`) waiting on its
standard input. A respawn hands it the node to become - one JSON line: the node's module, its
arguments and its environment - and it runs that node's ``main`` at once; the launcher then
starts the next warm interpreter.

A compute node costs more than its imports: building and tracing its model and timing every op
for its cost profile took another 2 s. The launcher names the compute nodes that may respawn
(`--prepare-compute`, their command lines as JSON); after the imports the interpreter does
that work for them (`compute_prepare.prepare`: model built, costs measured at slowdown 1), and a compute
node it becomes takes the result instead of doing it again.

The imports and preparations run on a thread of their own at a low CPU priority (``nice`` 10; on Linux a
thread's nice value is its own), so a waiting interpreter hardly slows the running nodes, while
the node it becomes runs on the main thread at normal priority - without the privilege a
process needs to lower its own nice value again. Needed before its imports finished, it asks
for normal priority for the rest (granted to root or with CAP_SYS_NICE/RLIMIT_NICE).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kaitian_ros.nodes.preparation import refused
from kaitian_ros.processes import name_process

# what every node imports (the fork server adds each scenario's node modules to it)
NODE_IMPORTS = ("numpy", "yaml", "zenoh", "kaitian_ros.runtime.embedded")
PRELOAD = ("torch", *NODE_IMPORTS, "kaitian_ros.nodes.inference_common")
# nice 10: a tenth of a core against normal-priority work - the imports finish within seconds
# on a busy machine instead of starving behind every other background job, as at 19
IDLE_NICE = 10


@dataclass(frozen=True)
class Order:
    """The node a warm interpreter becomes."""

    module: str  # e.g. kaitian_ros.nodes.compute: a module with main(argv) -> int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    def to_line(self) -> str:
        return json.dumps({"module": self.module, "argv": list(self.argv), "env": dict(self.env)}) + "\n"

    @staticmethod
    def from_line(line: str) -> Order:
        """The order in `line` (ValueError when it is not one)."""
        try:
            raw = json.loads(line)
            module, argv, env = raw["module"], raw["argv"], raw["env"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not an order: {exc}") from None
        check_node(module, argv, env)
        return Order(module, tuple(argv), dict(env))


def check_node(module: Any, argv: Any, env: Any, also: Sequence[str] = ()) -> None:
    """ValueError unless `module` names a kaitian_ros node (or one of the modules `also`
    allows) and `argv`, `env` are strings: what an interpreter told which node to become (a
    warm one, a fork) may run."""
    if not isinstance(module, str) or not (module.startswith("kaitian_ros.nodes.") or module in also) or \
            not all(isinstance(a, str) for a in argv) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("not an order: module must be a kaitian_ros node, argv and env strings")


def run_node_main(module: str, argv: Sequence[str]) -> int:
    """Become the node: run `module`'s ``main(argv)`` with ``sys.argv`` as its own command line
    would have set it; its exit code."""
    sys.argv = [module, *argv]
    node: Any = importlib.import_module(module)
    return int(node.main(list(argv)) or 0)


def _preload(modules: Sequence[str], compute_argvs: Sequence[Sequence[str]] = ()) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: imports at normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)
    for name in modules:
        with contextlib.suppress(ImportError):  # the node that needs it reports it when it imports it itself
            importlib.import_module(name)
    for argv in compute_argvs:
        try:
            from kaitian_ros.nodes import compute_prepare

            done = compute_prepare.prepare(list(argv))
            if done.news:  # not when forked from a fork server that prepared it
                print(f"warm interpreter: {done.text}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - a node that cannot be prepared starts the slow way
            failed = refused(f"{type(exc).__name__}: {exc}")
            print(f"warm interpreter: {failed.text}", file=sys.stderr, flush=True)


def parse_prepare(text: str) -> list[list[str]]:
    """The `--prepare-compute` value: a JSON list of compute node argument lists (ValueError)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--prepare-compute: not JSON: {exc}") from None
    if not isinstance(raw, list) or not all(isinstance(a, list) and all(isinstance(x, str) for x in a) for a in raw):
        raise ValueError("--prepare-compute: expected a JSON list of argument lists")
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    compute_argvs: list[list[str]] = []
    if args[:1] == ["--prepare-compute"] and len(args) == 2:
        try:
            compute_argvs = parse_prepare(args[1])
        except ValueError as exc:
            print(f"warm interpreter: {exc}", file=sys.stderr)
            return 2
    elif args:
        print(f"warm interpreter: unknown arguments {args} (only --prepare-compute JSON)", file=sys.stderr)
        return 2
    loader = threading.Thread(target=_preload, args=(PRELOAD, compute_argvs), name="kaitian-preload", daemon=True)
    loader.start()
    line = sys.stdin.readline()
    if not line:  # the launcher stopped without needing this interpreter
        return 0
    try:
        order = Order.from_line(line)
    except ValueError as exc:
        print(f"warm interpreter: {exc}", file=sys.stderr)
        return 2
    if loader.is_alive():  # needed before its imports finished: the rest at normal priority if allowed
        with contextlib.suppress(OSError, AttributeError):  # lowering a nice value needs CAP_SYS_NICE or RLIMIT_NICE
            os.setpriority(os.PRIO_PROCESS, loader.native_id or 0, 0)
        loader.join()
    if order.module != "kaitian_ros.nodes.compute" and "kaitian_ros.nodes.compute_prepare" in sys.modules:
        # a scheduler or coordinator becoming this interpreter must not carry a compute node's
        # prepared model (ResNet-18 at 224x224: about 200 MB)
        sys.modules["kaitian_ros.nodes.compute_prepare"].drop_prepared()
    os.environ.update(order.env)
    # named after the node it became in ps and top (a fork of the launcher's fork server was "warm")
    name_process(next((a.split(":=", 1)[1] for a in order.argv if a.startswith("__node:=")),
                      order.module.rsplit(".", 1)[-1]))
    return run_node_main(order.module, order.argv)


if __name__ == "__main__":
    sys.exit(main())
