"""The ``kaitian`` command: launch, router, node/topic/param introspection, bags, train, bench.

User mistakes print one line on stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kaitian_ros.cli_error import CliError
from kaitian_ros.cli_graph import cmd_bag, cmd_node, cmd_param, cmd_topic

if TYPE_CHECKING:  # imported where used: `kaitian` starts without them
    from kaitian_ros.fork_server import ForkServer
    from kaitian_ros.scenario import Scenario

BENCHES = ("transport", "inference", "adaptivity", "training", "chaos", "digits")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise CliError(f"{self.prog}: {message}")


def cmd_launch(args: argparse.Namespace) -> int:
    import os

    from kaitian_ros.fork_server import ForkServer, preload_modules
    from kaitian_ros.runtime import zenoh_session as zs
    from kaitian_ros.scenario import (
        SECURITY_KEY,
        ScenarioError,
        load_scenario,
        parse_overrides,
        select_nodes,
    )

    try:
        overrides = parse_overrides(args.overrides)
        if args.secure is not None:  # --secure DIR: security:=DIR, given last so that it wins
            overrides.append((SECURITY_KEY, args.secure))
        scenario = select_nodes(load_scenario(args.scenario, overrides), _names(args.only), _names(args.exclude))
    except ScenarioError as exc:
        raise CliError(str(exc)) from None
    if args.connect and args.router:
        raise CliError("kaitian launch: --router (host the graph's router here) and --connect (join the router "
                       "on another host) exclude each other")
    # the flags win over the scenario's own router settings; either of --router/--connect
    # replaces both of the file's
    if not args.router and not args.connect:
        args.router, args.connect = scenario.router or None, scenario.connect or None
    if args.listen is None and scenario.listen:
        args.listen = scenario.listen
    host_router = not args.connect
    router = args.connect or args.router or zs.router_endpoint()
    try:
        if args.connect:
            zs.split_endpoint(args.connect)
        if args.listen is not None:
            # every process of this launcher (nodes, its own sessions) listens there: the other
            # host's peers connect to it directly
            listen = zs.peer_listen_endpoint(args.listen)
            if zs.split_endpoint(listen)[2] != "0":
                raise ValueError(f"--listen {args.listen}: give an address, or an endpoint with port 0 - every "
                                 f"process of the launch (nodes, the launcher's own sessions) listens on a port "
                                 f"of its own")
            os.environ["KAITIAN_LISTEN"] = listen
    except ValueError as exc:
        raise CliError(f"kaitian launch: {exc}") from None
    # the launch's fork server, started first: the checks run in a fork of it (this process
    # never imports torch), then the nodes fork from it
    env = dict(os.environ, KAITIAN_RUNTIME="embedded", PYTHONUNBUFFERED="1")
    server = ForkServer.start(env, preload_modules(n.executable for n in scenario.nodes))
    try:
        return _launch_checked(args, scenario, router, host_router, server, env)
    finally:
        if server is not None:
            server.close()


def _launch_checked(args: argparse.Namespace, scenario: Scenario, router: str, host_router: bool,
                    server: ForkServer | None, env: dict[str, str]) -> int:
    """`cmd_launch` once the scenario and the router are settled: the checks, then the graph."""
    import os

    from kaitian_ros.launcher import launch, router_seen_here
    from kaitian_ros.preflight import forked_preflight
    from kaitian_ros.runtime import security
    from kaitian_ros.runtime import zenoh_session as zs

    problem = forked_preflight(scenario, server, env)
    if problem:
        raise CliError(f"kaitian launch {scenario.name}: {problem}")
    try:
        secure = security.for_launch(scenario.security)
    except security.SecurityError as exc:
        raise CliError(f"kaitian launch {scenario.name}: {exc}") from None
    if secure is not None:
        # this process's own sessions (live view, router, /launch) join as role node
        os.environ.update({security.ENV_DIR: str(secure.cert_dir), security.ENV_ROLE: security.NODE})
    if not host_router:
        problem = zs.router_problem(router)
        if problem:
            raise CliError(f"kaitian launch {scenario.name}: {problem}", 1)
    if _spans_hosts(router, host_router) and not os.environ.get("KAITIAN_LISTEN"):
        print("[launch] note: nodes listen on 127.0.0.1 only, so nodes on other hosts cannot reach them; "
              "give --listen <this host's address>", flush=True)
    view = None
    if any(n.executable == "coordinator" for n in scenario.nodes):
        from kaitian_ros.live_view import LiveView

        # with --no-view it still listens: the summary at exit is told either way
        view = LiveView(router_seen_here(router, host_router), scenario, show=not args.no_view)
    try:
        code = launch(scenario, router, duration_s=args.duration, on_tick=view.tick if view else None,
                      out=view.output if view else sys.stdout, warm_start=not args.no_warm_start,
                      host_router=host_router, fork=server if server is not None else True)
    except RuntimeError as exc:
        raise CliError(str(exc), 1) from None
    finally:
        if view is not None:
            view.close()
    if view is not None:
        print(view.summary_text(), flush=True)
    return code


def _names(values: Sequence[str] | None) -> tuple[str, ...]:
    """Node names of repeatable, comma-separated --only/--exclude options."""
    return tuple(name.strip() for value in values or () for name in value.split(",") if name.strip())


def _spans_hosts(router: str, host_router: bool) -> bool:
    """Whether the graph reaches beyond this host: it joins a router elsewhere, or hosts one
    on an address other hosts can reach."""
    from kaitian_ros.runtime import zenoh_session as zs

    if not host_router:
        return True
    try:
        address = zs.split_endpoint(router)[1]
    except ValueError:  # not an IP endpoint (a unix socket, ...): this host only
        return False
    return not (address.startswith("127.") or address in ("localhost", "[::1]"))


def cmd_router(args: argparse.Namespace) -> int:
    from kaitian_ros.processes import take_sigint
    from kaitian_ros.runtime import security
    from kaitian_ros.runtime import zenoh_session as zs

    endpoint = args.listen or zs.router_endpoint()
    # a launcher starts its children with SIGINT held back until they take it; SIGTERM (the
    # launcher's escalation, or its death) ends the router as quietly as Ctrl-C
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        take_sigint()
        session = zs.open_session("router", listen=endpoint)
    except (zs.SessionError, security.SecurityError) as exc:
        raise CliError(f"cannot listen on {endpoint}: {exc}", 1) from None
    except KeyboardInterrupt:  # stopped while it started
        return 0
    print(f"router listening on {_shown_endpoint(endpoint)} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0


def _shown_endpoint(endpoint: str) -> str:
    """The endpoint as the session uses it: tls/ and a note when KAITIAN_SECURITY is on."""
    from kaitian_ros.runtime import security

    secure = security.from_env()
    if secure is None:
        return endpoint
    return f"{security.secure_endpoint(endpoint)} (TLS + access control, role {secure.role})"


def cmd_certs(args: argparse.Namespace) -> int:
    from kaitian_ros import certs

    try:
        made = certs.create(args.directory, hosts=args.host, days=args.days, force=args.force)
    except certs.CertError as exc:
        raise CliError(f"kaitian certs create: {exc}") from None
    except OSError as exc:
        raise CliError(f"kaitian certs create: {exc.filename or args.directory}: {exc.strerror}", 1) from None
    print(f"wrote {', '.join(made.files)} in {made.directory} (valid {args.days} days; "
          f"hosts {', '.join(made.hosts)}; keys 0600)")
    print(f"use it: kaitian launch <scenario> --secure {made.directory}   "
          f"(tools: KAITIAN_SECURITY={made.directory} kaitian topic list)")
    print(f"keep {made.directory / 'ca.key'} away from the robot: whoever holds it can mint any role")
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if importlib.util.find_spec("matplotlib") is None and not {"-h", "--help"} & set(rest):
        # checked first: a benchmark runs for minutes before it draws its plot
        raise CliError("kaitian bench: the benchmarks draw their plots with matplotlib, which is not installed: "
                       "pip install 'kaitian_ros[bench]'")
    module = importlib.import_module(f"kaitian_ros.bench.{args.bench}")
    return int(module.main(rest) or 0)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from kaitian_ros.training.launch import main_train

    return int(main_train(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kaitian", description="kaitian_ros: heterogeneous collaborative inference "
                                                 "and training on ROS 2 or the embedded Zenoh runtime")
    parser.add_argument("--router", help="zenoh endpoint of the graph's router "
                                         "(default $KAITIAN_ROUTER or tcp/127.0.0.1:7447)")
    common = _Parser(add_help=False)
    common.add_argument("--router", default=argparse.SUPPRESS, help="zenoh endpoint of the graph's router")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def cmd(subparsers: Any, name: str, **kw: Any) -> _Parser:
        """A (sub)command that also takes the common options (--router)."""
        return subparsers.add_parser(name, parents=[common], **kw)

    p = cmd(sub, "launch", help="start a scenario's node graph (like ros2 launch)")
    p.add_argument("scenario", help="scenario name in config/ (e.g. hetero_inference) or a .yaml path")
    p.add_argument("overrides", nargs="*", help="launch arguments name:=value")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--no-view", action="store_true", help="no live terminal view")
    p.add_argument("--no-warm-start", action="store_true",
                   help="respawn nodes in fresh processes (default: keep one interpreter with torch and the "
                        "middleware imported, about 230 MB, to respawn the next node from)")
    p.add_argument("--secure", metavar="DIR", help="TLS + access control with the certificates in DIR "
                                                   "(made by `kaitian certs create DIR`; same as security:=DIR)")
    p.add_argument("--connect", metavar="ENDPOINT",
                   help="join the graph whose router runs on another host (e.g. tcp/192.168.1.10:7447) "
                        "instead of hosting one here (--router)")
    p.add_argument("--listen", metavar="ADDRESS",
                   help="this host's address the nodes listen on (a port per process), reachable from the "
                        "graph's other hosts (default: 127.0.0.1, this host only)")
    p.add_argument("--only", action="append", metavar="NODE[,NODE]",
                   help="run only these nodes of the scenario here (the others run on another host)")
    p.add_argument("--exclude", action="append", metavar="NODE[,NODE]",
                   help="run every node of the scenario here but these (they run on another host)")

    p = cmd(sub, "certs", help="make a graph's TLS certificates (CA + coordinator/scheduler/compute/node)")
    csub = p.add_subparsers(dest="certs_cmd", required=True, parser_class=_Parser)
    q = csub.add_parser("create", help="write ca.pem/ca.key and <role>.pem/<role>.key into DIR")
    q.add_argument("directory", metavar="DIR")
    q.add_argument("--force", action="store_true", help="replace certificates already in DIR")
    q.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="another host name or address the graph's peers are reached at (repeatable; "
                        "localhost, 127.0.0.1 and ::1 are always included)")
    q.add_argument("--days", type=int, default=365, help="validity in days (default 365)")

    p = cmd(sub, "router", help="run a zenoh router for a graph")
    p.add_argument("--listen", help="endpoint to listen on (default tcp/127.0.0.1:7447)")

    p = cmd(sub, "node", help="node introspection")
    p.add_argument("node_cmd", choices=["list"])

    p = cmd(sub, "topic", help="topic introspection")
    tsub = p.add_subparsers(dest="topic_cmd", required=True, parser_class=_Parser)
    q = cmd(tsub, "list")
    q.add_argument("-t", "--show-types", action="store_true")
    for name in ("echo", "hz"):
        q = cmd(tsub, name)
        q.add_argument("topic")
        q.add_argument("type", nargs="?", help="message type (default: discovered)")
        q.add_argument("--timeout", type=float, help="stop after this many seconds")
        if name == "echo":
            q.add_argument("--once", action="store_true")
            q.add_argument("--count", type=int, default=0)
            q.add_argument("--full-arrays", action="store_true", help="print long arrays in full")
        else:
            q.add_argument("--window", type=int, default=100)

    p = cmd(sub, "param", help="parameters of a running node")
    psub = p.add_subparsers(dest="param_cmd", required=True, parser_class=_Parser)
    q = cmd(psub, "list")
    q.add_argument("node")
    for name in ("get", "describe"):
        q = cmd(psub, name)
        q.add_argument("node")
        q.add_argument("name")
    q = cmd(psub, "set")
    q.add_argument("node")
    q.add_argument("name")
    q.add_argument("value")
    q = cmd(psub, "dump")
    q.add_argument("node")

    p = cmd(sub, "bag", help="record topics into a rosbag2 (MCAP), summarise a bag (like ros2 bag)")
    bsub = p.add_subparsers(dest="bag_cmd", required=True, parser_class=_Parser)
    q = cmd(bsub, "record", help="record topics until Ctrl-C/SIGTERM or --duration",
                        description="Record what the graph publishes into a rosbag2 folder in MCAP storage, "
                                    "the CDR bytes as they arrived, with every message definition embedded. "
                                    "Latched topics' last samples are included.")
    q.add_argument("topics", nargs="*", metavar="TOPIC",
                   help="topics to record (default: every topic the graph publishes, also those that appear "
                        "later, except the tensor chunks /kaitian/chunks/*)")
    q.add_argument("-o", "--output", type=Path, metavar="DIR",
                   help="bag folder to create (default rosbag2_YYYY_MM_DD-HH_MM_SS); must not exist")
    q.add_argument("--duration", type=float, metavar="S", help="stop after this many seconds")
    q.add_argument("--include-chunks", action="store_true",
                   help="with no TOPIC: record the tensor chunk topics too (heavy: MiBs per frame)")
    q = cmd(bsub, "info", help="topics, types, counts, duration and storage of a bag")
    q.add_argument("bag", type=Path, metavar="DIR", help="bag folder (or its .mcap file)")

    # bench/train parse their own options (and -h) in their modules: no help option here
    p = cmd(sub, "bench", help="benchmarks (compare baselines side by side, write JSON + PNG)",
                       add_help=False)
    p.add_argument("bench", choices=BENCHES)
    cmd(sub, "train", help="collaborative training across this host's devices", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        # bench/train pass their own flags through to their modules
        args, rest = parser.parse_known_args(argv)
        if args.command not in ("bench", "train") and rest:
            raise CliError(f"kaitian: unrecognized arguments: {' '.join(rest)}")
        if args.command == "launch":
            return cmd_launch(args)
        if args.command == "router":
            return cmd_router(args)
        if args.command == "certs":
            return cmd_certs(args)
        if args.command == "node":
            return cmd_node(args)
        if args.command == "topic":
            return cmd_topic(args)
        if args.command == "param":
            return cmd_param(args)
        if args.command == "bag":
            return cmd_bag(args)
        if args.command == "bench":
            return cmd_bench(args, rest)
        return cmd_train(args, rest)
    except CliError as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
