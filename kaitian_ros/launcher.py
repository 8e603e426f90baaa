"""``kaitian launch``: the embedded launcher (what ``ros2 launch`` is on a ROS 2 machine).

Hosts the Zenoh router, starts every node of the scenario as its own process with its
parameters (same ROS-style command line launch_ros uses), prefixes each output line with the
node name, forwards Ctrl-C/SIGTERM, and exits non-zero naming the node when one dies.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from kaitian_ros.scenario import NodeSpec, Scenario

STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the launcher disappears, even by SIGKILL (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setsid()  # own process group: the terminal's Ctrl-C reaches only the launcher, which forwards it


def node_command(spec: NodeSpec, params_file: Path) -> list[str]:
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
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.05)


def preflight(scenario: Scenario) -> str:
    """'' if every node's ``model`` and ``device`` can be used on this machine, else one line
    saying which cannot and which nodes name it: checked before any process starts, so a typo
    is one clear error instead of every node refusing to start (the launcher starts all nodes
    on this host, so this host's devices are the ones that count)."""
    problems: dict[str, list[str]] = {}
    for spec in scenario.nodes:
        checks = [("model", _model_problem)]
        if spec.executable == "compute":  # trainers name devices their own way (cpu:<tag>)
            checks.append(("device", _device_problem))
        for key, check in checks:
            value = spec.parameters.get(key)
            if isinstance(value, str) and (problem := check(value)):
                problems.setdefault(problem, []).append(spec.name)
    return "; ".join(f"{problem} (node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})"
                     for problem, nodes in problems.items())


def _model_problem(name: str) -> str:
    from kaitian_ros.core.models import MODEL_NAMES

    if name in MODEL_NAMES:
        return ""
    if ":" not in name:
        return (f"unknown model '{name}' (valid: {', '.join(MODEL_NAMES)}, or a 'package.module:callable' "
                f"import path)")
    module, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        return f"model '{name}': cannot import {module!r}: {' '.join(str(exc).split())}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"model '{name}': module {module!r} has no attribute {attr!r}"
        obj = getattr(obj, part)
    return "" if callable(obj) else f"model '{name}' is not callable"


def _device_problem(name: str) -> str:
    from kaitian_ros.nodes.inference_common import check_device

    try:
        check_device(name)
    except ValueError as exc:
        return " ".join(str(exc).split())
    return ""


@dataclass
class Child:
    spec: NodeSpec
    process: subprocess.Popen
    reader: threading.Thread


class Launcher:
    def __init__(self, scenario: Scenario, router_endpoint: str, *, out: TextIO = sys.stdout,
                 host_router: bool = True) -> None:
        self.scenario = scenario
        self.router_endpoint = router_endpoint
        self.out = out
        self.host_router = host_router
        self.children: list[Child] = []
        self._router: Any = None
        self._stopping = threading.Event()
        self._print_lock = threading.Lock()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="kaitian_launch_")
        self.params_file = Path(self._tmpdir.name) / f"{scenario.name}.yaml"

    def say(self, line: str) -> None:
        with self._print_lock:
            self.out.write(line + "\n")
            self.out.flush()

    def start(self) -> None:
        if self.host_router:
            from kaitian_ros.runtime import zenoh_session as zs

            try:
                self._router = zs.open_session("router", listen=self.router_endpoint)
            except Exception as exc:
                raise RuntimeError(f"cannot host the router on {self.router_endpoint}: {exc} "
                                   f"(is another graph running? pick one with --router)") from None
            self.say(f"[launch] router listening on {self.router_endpoint}")
        self.params_file.write_text(yaml.safe_dump(self.scenario.parameter_file_dict(), sort_keys=False))
        env = dict(os.environ, KAITIAN_ROUTER=self.router_endpoint, KAITIAN_RUNTIME="embedded",
                   PYTHONUNBUFFERED="1")
        for spec in self.scenario.nodes:
            process = subprocess.Popen(node_command(spec, self.params_file), env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                       text=True, bufsize=1)
            reader = threading.Thread(target=self._pump, args=(spec.name, process), daemon=True)
            reader.start()
            self.children.append(Child(spec, process, reader))
            self.say(f"[launch] started {spec.name} ({spec.executable}) pid {process.pid}")

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.say(f"[{name}] {line.rstrip()}")

    def wait(self, duration_s: float | None = None, on_tick: Callable[[], None] | None = None) -> int:
        """Supervise until all nodes end, one dies, ``duration_s`` passes, or stop() is called."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while not self._stopping.is_set():
            if on_tick is not None:
                on_tick()
            for child in self.children:
                code = child.process.poll()
                if code is not None and code != 0:
                    self.say(f"[launch] node '{child.spec.name}' died unexpectedly (exit code {code}); "
                             f"stopping the graph")
                    self.stop()
                    return 1
            if all(c.process.poll() is not None for c in self.children):
                self.say("[launch] all nodes finished")
                self.stop()
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._stopping.wait(0.1)
        self.stop()
        return 0

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        """SIGINT every node, then SIGTERM, then SIGKILL; never leave a process behind."""
        self._stopping.set()
        stop_process_groups([c.process for c in self.children])
        for child in self.children:
            child.process.wait()
            child.reader.join(timeout=1.0)
        if self._router is not None:
            try:
                self._router.close()
            except Exception:
                pass
            self._router = None
        self._tmpdir.cleanup()


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


def free_port() -> int:
    """A TCP port the kernel just handed out (bind to port 0), so parallel graphs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_on_free_port(scenario: Scenario, *, out: TextIO = sys.stdout, attempts: int = 5) -> Launcher:
    """Start a graph whose router listens on a fresh loopback port (``launcher.router_endpoint``).

    A port can be taken between ``free_port()`` and the router's listen: retry a few times.
    """
    for _ in range(attempts):
        launcher = Launcher(scenario, f"tcp/127.0.0.1:{free_port()}", out=out)
        try:
            launcher.start()
        except RuntimeError:
            launcher.stop()
            continue
        return launcher
    raise RuntimeError("could not host a router on a free port")


def launch(scenario: Scenario, router_endpoint: str, *, duration_s: float | None = None,
           on_tick: Callable[[], None] | None = None, out: TextIO = sys.stdout) -> int:
    """Run a scenario until Ctrl-C/SIGTERM (or ``duration_s``); the exit code for the CLI."""
    launcher = Launcher(scenario, router_endpoint, out=out)

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
