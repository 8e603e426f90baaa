"""``kaitian launch``: the embedded launcher (what ``ros2 launch`` is on a ROS 2 machine).

Runs the Zenoh router as a supervised child process (``kaitian router``, respawned after
``ROUTER_RESPAWN.delay_s`` if it dies: peers keep talking to each other directly meanwhile and
reconnect to the new one), starts every node of the scenario as its own process with its
parameters (same ROS-style command line launch_ros uses), prefixes each output line with the
node name and forwards Ctrl-C/SIGTERM. While it supervises (``wait``), a node that exits is
respawned after its ``respawn_delay`` if its scenario says so (compute nodes, coordinator and
scheduler by default), at most ``respawn_max_retries`` times; each death and restart is printed
and published on ``/diagnostics`` (as node ``launch``). A node that dies without respawn, or
beyond its retries, or that refused to start (exit code 2: bad parameters, which a respawn
would repeat), stops the graph and the launcher exits non-zero naming it.

A respawn starts from a warm interpreter when one is ready (``kaitian_ros.warm_start``: an
interpreter that already imported torch and the middleware at a low CPU priority, waiting
for the node to become), which skips the 1.5-3 s of imports of a fresh process; the launcher
keeps one ready from ``WARM_START_AFTER_S`` after the graph started (``warm_start=False``: never),
one per command prefix that nodes start under (a network namespace in the benchmarks): a node
respawns from the interpreter started under its own prefix.

Nodes start as forks of one interpreter that imported torch once (``kaitian_ros.fork_server``;
``fork=False``: each a fresh interpreter), except the router and nodes under a command prefix.

A graph may span hosts (docs/deployment.md): one launcher hosts the router, on an address the
other hosts reach, and the others join it (``host_router=False``), each starting its share of
the scenario's nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kaitian_ros import warm_start
from kaitian_ros.fork_server import WARM, ForkedProcess, ForkServer, preload_modules
from kaitian_ros.launcher_diagnostics import Supervision
from kaitian_ros.ports import PortTaken, on_free_port
from kaitian_ros.processes import LineOut, start_child, stop_children
from kaitian_ros.runtime import security
from kaitian_ros.runtime import zenoh_session as zs
from kaitian_ros.scenario import NodeSpec, Respawn, Scenario

REFUSED_TO_START = 2  # a node's exit code for bad parameters/arguments: a respawn would fail the same way
WARM_START_AFTER_S = 1.0  # after the graph (or the last warm takeover) started: its own imports first
# after a takeover, the next warm interpreter waits this long: its imports and preparation take
# a core for 2-3 s and the memory bandwidth with it, and right after the takeover they slowed
# the node that had just respawned (its first requests 30-60 % over its pre-fault latency)
WARM_REFILL_AFTER_S = 10.0
WARM_START_FAILURES = 3  # warm interpreters that died unused before the launcher stops starting them
ROUTER_RESPAWN = Respawn(enabled=True, delay_s=0.5, max_retries=20)
ROUTER_READY_S = 20.0
ROUTER_READY_LINE = "router listening on"
# the fork server's preparation of a compute node: building the model and at most the node's
# profile_budget_s (10 s by default) of measurement, on cores busy starting the other nodes
PREPARE_TIMEOUT_S = 120.0


ROUTER = "router"  # name and executable of the router's child process


def node_module(spec: NodeSpec, params_file: Path) -> tuple[str, list[str]]:
    """The module a node's process runs and its arguments (its command line after ``-m``)."""
    if spec.executable == ROUTER:
        return "kaitian_ros.cli", ["router", "--listen", spec.parameters["listen"]]
    return f"kaitian_ros.nodes.{spec.executable}", ["--ros-args", "-r", f"__node:={spec.name}",
                                                      "--params-file", str(params_file)]


def node_command(spec: NodeSpec, params_file: Path) -> list[str]:
    module, argv = node_module(spec, params_file)
    return [sys.executable, "-u", "-m", module, *argv]


@dataclass
class Child:
    """One of the launcher's children (a node or the router) and its respawn bookkeeping."""

    spec: NodeSpec
    process: subprocess.Popen | ForkedProcess
    reader: threading.Thread
    restarts: int = 0          # respawns so far
    restarted_at: float = 0.0  # monotonic time of the last respawn (0: never)
    respawn_at: float = 0.0    # monotonic time of a scheduled respawn (0: none)
    handled: bool = False      # the current process's exit was seen (respawn scheduled or final)
    last_exit: int | None = None


@dataclass
class WarmInterpreter:
    """A started ``kaitian_ros.warm_start`` process; `name` labels its output (the node it
    became, once it became one)."""

    process: subprocess.Popen | ForkedProcess
    reader: threading.Thread
    name: str = "warm"


@dataclass
class WarmSlot:
    """The warm interpreter kept for the nodes under one command prefix (``()``: none)."""

    prefix: tuple[str, ...]
    warm: WarmInterpreter | None = None
    due: float = 0.0  # monotonic time to start the next one
    failures: int = 0  # started ones that died unused


class Launcher:
    def __init__(self, scenario: Scenario, router_endpoint: str, *, out: LineOut = sys.stdout,
                 host_router: bool = True, node_prefix: Mapping[str, Sequence[str]] | None = None,
                 node_env: Mapping[str, Mapping[str, str]] | None = None, warm_start: bool = True,
                 fork: bool | ForkServer = True) -> None:
        """`fork`: start a fork server for the nodes (True), none (False), or fork them from
        this running one, which the launcher then leaves running when it stops (a program
        that launches many graphs, such as the test suite, pays the server's imports once)."""
        self.scenario = scenario
        # per node: a command prefix and extra environment, kept on respawn (benchmarks run a
        # node inside a network namespace: `ip netns exec NS`, its own listen address)
        self.node_prefix = {name: list(prefix) for name, prefix in (node_prefix or {}).items()}
        self.node_env = {name: dict(env) for name, env in (node_env or {}).items()}
        self.router_endpoint = router_endpoint
        self.out = out
        # host_router=False: the graph's router runs elsewhere (another launcher, maybe on
        # another host) and this launcher's nodes join it there
        self.host_router = host_router
        # where this host's processes connect: a router hosted on an any-address
        # (tcp/0.0.0.0:7447, reachable from other hosts) is reached at loopback here
        self.connect_endpoint = router_seen_here(router_endpoint, host_router)
        self.children: list[Child] = []
        self._stopping = threading.Event()
        self._print_lock = threading.Lock()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="kaitian_launch_")
        self.params_file = Path(self._tmpdir.name) / f"{scenario.name}.yaml"
        # TLS + access control for every process of the graph (SecurityError: unusable directory)
        self.security = security.for_launch(scenario.security)
        # a warm interpreter per command prefix that a node may be respawned under (module docstring)
        self.warm_slots = {p: WarmSlot(p) for p in sorted({self._prefix_of(n.name) for n in scenario.nodes
                                                           if n.respawn.enabled})} if warm_start else {}
        self.fork = bool(fork)
        self.fork_server: ForkServer | None = fork if isinstance(fork, ForkServer) else None
        self._owns_fork_server = self.fork_server is None

    def say(self, line: str) -> None:
        with self._print_lock:
            self.out.write(line + "\n")
            self.out.flush()

    def start(self) -> None:
        if self.security is not None:
            self.say(f"[launch] security on: TLS + access control, certificates in {self.security.cert_dir}")
        if self.host_router:
            self.children.append(self._start_router())
        self.params_file.write_text(yaml.safe_dump(self.scenario.parameter_file_dict(), sort_keys=False))
        if self.fork_server is None and self.fork and any(self._forkable(spec) for spec in self.scenario.nodes):
            self.fork_server = ForkServer.start(self._base_env(),
                                                preload_modules(n.executable for n in self.scenario.nodes))
            if self.fork_server is None:
                self.say("[launch] no fork server: every node starts a fresh interpreter")
        self._prepare_compute()
        for spec in self.scenario.nodes:
            if self._stopping.is_set():  # Ctrl-C while the fork server prepared: start nothing more
                break
            process, reader = self.spawn(spec)
            self.children.append(Child(spec, process, reader))
        for slot in self.warm_slots.values():
            slot.due = max(slot.due, time.monotonic() + WARM_START_AFTER_S)

    def _prepare_compute(self) -> None:
        """Have the fork server build the compute nodes' model and measure their start-up
        costs, once per model, device and thread count, before it forks any node: the compute
        nodes and the coordinator (and its planner) forked afterwards take them instead of each
        building the same model (about 2 s of CPU per compute node for ResNet-18, 1 s per model
        graph)."""
        if self.fork_server is None:
            return
        for spec in self.scenario.nodes:
            if spec.executable == "compute" and self._forkable(spec) and not self._stopping.is_set():
                done = self.fork_server.prepare(node_module(spec, self.params_file)[1], PREPARE_TIMEOUT_S)
                if done.news:
                    self.say(f"[launch] fork server: {done.text}")

    @property
    def nodes(self) -> list[Child]:
        """The scenario's nodes (every child but the router)."""
        return [c for c in self.children if c.spec.executable != ROUTER]

    def _start_router(self) -> Child:
        """The router's process, once it listens; RuntimeError if it cannot (port taken, ...)."""
        spec = NodeSpec(ROUTER, ROUTER, {"listen": self.router_endpoint}, ROUTER_RESPAWN)
        ready = threading.Event()
        process, reader = self.spawn(spec, ready)
        end = time.monotonic() + ROUTER_READY_S
        while not ready.wait(0.05):
            if process.poll() is not None or time.monotonic() > end:
                stop_children([process])
                reader.join(timeout=1.0)
                raise RuntimeError(f"cannot host the router on {self.router_endpoint} "
                                   f"(is another graph running? pick one with --router)")
        return Child(spec, process, reader)

    def _base_env(self) -> dict[str, str]:
        return dict(os.environ, KAITIAN_ROUTER=self.connect_endpoint, KAITIAN_RUNTIME="embedded",
                    PYTHONUNBUFFERED="1")

    def _node_env(self, spec: NodeSpec) -> dict[str, str]:
        """What a node's environment adds to the base one: its role's certificate, its own."""
        return security.child_env(self.security, spec.executable) | self.node_env.get(spec.name, {})

    def _forkable(self, spec: NodeSpec) -> bool:
        """A fork shares the server's namespaces: a node under a command prefix starts fresh."""
        return spec.executable != ROUTER and not self.node_prefix.get(spec.name)

    def spawn(self, spec: NodeSpec, ready: threading.Event | None = None
              ) -> tuple[subprocess.Popen | ForkedProcess, threading.Thread]:
        """A process of `spec` - forked from the fork server, else a fresh one - whose output
        the launcher prints under its name."""
        env = self._base_env() | self._node_env(spec)
        process: subprocess.Popen | ForkedProcess | None = None
        if self.fork_server is not None and self._forkable(spec):
            process = self.fork_server.fork(*node_module(spec, self.params_file), env, spec.name)
        if process is None:
            command = self.node_prefix.get(spec.name, []) + node_command(spec, self.params_file)
            process = start_child(command, defer_sigint=True, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1)
        reader = threading.Thread(target=self._pump, args=(lambda: spec.name, process, ready), daemon=True)
        reader.start()
        self.say(f"[launch] started {spec.name} ({spec.executable}) pid {process.pid}")
        return process, reader

    def _pump(self, name: Callable[[], str], process: subprocess.Popen | ForkedProcess,
              ready: threading.Event | None = None) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.say(f"[{name()}] {line.rstrip()}")
            if ready is not None and line.startswith(ROUTER_READY_LINE):
                ready.set()

    def _prefix_of(self, name: str) -> tuple[str, ...]:
        return tuple(self.node_prefix.get(name, ()))

    def _warm_args(self, prefix: tuple[str, ...] = ()) -> list[str]:
        """The warm interpreter's arguments under `prefix`: it prepares (model, start-up costs)
        for every compute node under that prefix it may become."""
        compute = [node_module(n, self.params_file)[1] for n in self.scenario.nodes
                   if n.executable == "compute" and n.respawn.enabled and self._prefix_of(n.name) == prefix]
        return ["--prepare-compute", json.dumps(compute)] if compute else []

    def _start_warm(self, slot: WarmSlot) -> None:
        """A fork of the fork server where it can (its imports done), else a fresh interpreter."""
        process: subprocess.Popen | ForkedProcess | None = None
        args, env = self._warm_args(slot.prefix), self._base_env()
        if self.fork_server is not None and not slot.prefix:
            process = self.fork_server.fork(WARM, args, env, "warm")
        if process is None:
            process = start_child([*slot.prefix, sys.executable, "-u", "-m", WARM, *args],
                                  defer_sigint=True, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True, bufsize=1)
        warm = WarmInterpreter(process, threading.Thread())
        warm.reader = threading.Thread(target=self._pump, args=(lambda: warm.name, process), daemon=True)
        warm.reader.start()
        slot.warm = warm

    def _tend_warm(self, now: float) -> None:
        """Start the warm interpreters that are due; count those that died unused."""
        for slot in self.warm_slots.values():
            if slot.warm is not None and slot.warm.process.poll() is not None:
                slot.failures += 1
                where = f" under {' '.join(slot.prefix)}" if slot.prefix else ""
                self.say(f"[launch] warm interpreter{where} exited unused (exit code {slot.warm.process.returncode})"
                         + ("; no more warm starts" if slot.failures >= WARM_START_FAILURES else ""))
                slot.warm = None
                slot.due = now + WARM_START_AFTER_S
            if slot.warm is None and now >= slot.due and slot.failures < WARM_START_FAILURES \
                    and not self._stopping.is_set():
                self._start_warm(slot)

    def _respawn(self, spec: NodeSpec, now: float) -> tuple[subprocess.Popen | ForkedProcess, threading.Thread]:
        """The node's new process: the warm interpreter under its prefix becoming it if one is
        ready, else a fresh one."""
        slot = self.warm_slots.get(self._prefix_of(spec.name))
        warm = slot.warm if slot is not None else None
        if slot is None or warm is None or warm.process.poll() is not None or spec.executable == ROUTER:
            return self.spawn(spec)
        slot.warm, slot.due = None, now + WARM_REFILL_AFTER_S
        module, argv = node_module(spec, self.params_file)
        order = warm_start.Order(module, tuple(argv), self._node_env(spec))
        try:
            assert warm.process.stdin is not None
            warm.process.stdin.write(order.to_line())
            warm.process.stdin.close()
        except (BrokenPipeError, OSError):
            return self.spawn(spec)
        warm.name = spec.name
        self.say(f"[launch] {spec.name} respawns from the warm interpreter")
        self.say(f"[launch] started {spec.name} ({spec.executable}) pid {warm.process.pid}")
        return warm.process, warm.reader

    def wait(self, duration_s: float | None = None, on_tick: Callable[[], None] | None = None) -> int:
        """Supervise until all nodes end, one dies for good, ``duration_s`` passes, or stop()
        is called; nodes with respawn are restarted meanwhile."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        report = Supervision(self)
        try:
            while not self._stopping.is_set():
                if on_tick is not None:
                    on_tick()
                failed = self._supervise_once()
                if failed is not None:
                    self.stop()
                    return failed
                report.maybe_publish()
                if all(c.process.poll() is not None and not c.respawn_at for c in self.nodes):
                    self.say("[launch] all nodes finished")
                    self.stop()
                    return 0
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._stopping.wait(0.1)
        finally:
            report.close()
        self.stop()
        return 0

    def _supervise_once(self) -> int | None:
        """Schedule respawns of nodes that exited, start those due; the launcher's exit code
        if a node died for good, else None."""
        now = time.monotonic()
        self._tend_warm(now)
        for child in self.children:
            if child.respawn_at:
                if now >= child.respawn_at and not self._stopping.is_set():
                    child.respawn_at = 0.0
                    child.restarts += 1
                    child.restarted_at = now
                    child.process, child.reader = self._respawn(child.spec, now)
                    child.handled = False
                continue
            code = child.process.poll()
            if child.handled or code is None:
                continue
            child.handled, child.last_exit = True, code
            policy = child.spec.respawn
            if code == REFUSED_TO_START:
                self.say(f"[launch] node '{child.spec.name}' refused to start (exit code {code}: bad parameters "
                         f"or arguments, see its output); not respawned, stopping the graph")
                return 1
            if policy.enabled and child.restarts < policy.max_retries:
                child.respawn_at = now + policy.delay_s
                self.say(f"[launch] node '{child.spec.name}' exited (exit code {code}); respawning in "
                         f"{policy.delay_s:g} s (restart {child.restarts + 1} of {policy.max_retries})")
            elif code != 0:
                why = (f"respawned {child.restarts} times already (respawn_max_retries)" if policy.enabled
                       else "no respawn")
                self.say(f"[launch] node '{child.spec.name}' died unexpectedly (exit code {code}; {why}); "
                         f"stopping the graph")
                return 1
        return None

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        """SIGINT every node, then SIGTERM, then SIGKILL; never leave a process behind."""
        self._stopping.set()
        # taken first: the supervising thread and the caller may both be stopping the graph
        for slot in self.warm_slots.values():
            warm, slot.warm = slot.warm, None
            if warm is not None:  # nothing of its own to lose: it holds SIGINT back until it becomes a node
                warm.process.kill()
                warm.process.wait()
                warm.reader.join(timeout=1.0)
        # the router last: nodes shutting down still talk to each other through it
        for group in (self.nodes, [c for c in self.children if c.spec.executable == ROUTER]):
            stop_children([c.process for c in group])
            for child in group:
                child.process.wait()
                child.reader.join(timeout=1.0)
        if self.fork_server is not None and self._owns_fork_server:
            self.fork_server.close()
        self._tmpdir.cleanup()


def router_seen_here(router_endpoint: str, host_router: bool) -> str:
    """Where this host's processes connect to the graph's router: the one this launch hosts on
    ``router_endpoint`` (at loopback when that is an any-address such as ``tcp/0.0.0.0:7447``,
    reachable from other hosts), or the one at ``router_endpoint`` on another host."""
    return zs.local_endpoint(router_endpoint) if host_router else router_endpoint


def start_on_free_port(scenario: Scenario, *, out: LineOut = sys.stdout, host: str = "127.0.0.1",
                       **launcher_options: Any) -> Launcher:
    """Start a graph whose router listens on a fresh port of ``host`` (loopback by default;
    ``launcher.router_endpoint``), another port while one is taken before the router listens;
    ``launcher_options`` go to :class:`Launcher`. Raises `PortTaken` after `PORT_ATTEMPTS`."""

    def attempt(port: int) -> Launcher:
        launcher = Launcher(scenario, f"tcp/{host}:{port}", out=out, **launcher_options)
        try:
            launcher.start()
        except RuntimeError as exc:
            launcher.stop()
            raise PortTaken(str(exc)) from exc
        return launcher

    return on_free_port(attempt, what="the graph's router")


def launch(scenario: Scenario, router_endpoint: str, *, duration_s: float | None = None,
           on_tick: Callable[[], None] | None = None, out: LineOut = sys.stdout, warm_start: bool = True,
           host_router: bool = True, fork: bool | ForkServer = True) -> int:
    """Run a scenario until Ctrl-C/SIGTERM (or ``duration_s``); the exit code for the CLI.
    ``host_router``: host the graph's router on ``router_endpoint`` (else join the one there);
    ``fork`` as `Launcher` takes it."""
    launcher = Launcher(scenario, router_endpoint, out=out, warm_start=warm_start, host_router=host_router,
                        fork=fork)

    def forward(signum: int, frame: Any) -> None:
        launcher.say(f"[launch] {signal.Signals(signum).name} received, stopping nodes")
        launcher.request_stop()

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait(duration_s, on_tick)
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
