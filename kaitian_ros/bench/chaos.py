"""``kaitian bench chaos``: faults injected one after another into the running default graph
(``config/hetero_inference.yaml``: camera, coordinator, scheduler, compute_0..2 with EMULATED
speeds), each measured for lost, duplicated and out-of-order frames, time to recover, the
nodes' memory and, for forgeries, whether they had an effect.

Real processes: the graph is started by the embedded launcher, which respawns what is killed;
the bench's own probe node subscribes to the camera topic, ``/kaitian/fused``, the plans,
assignments, profiles, telemetry and ``/diagnostics``; an attacker process of its own
(``chaos_attack``) sends the floods, forgeries and fuzz. Faults, in order:

* ``kill_compute``: SIGKILL of the compute node with the largest share of the running plan;
* ``kill_scheduler``, ``kill_coordinator``: SIGKILL of the authority; the launcher respawns it;
* ``kill_router``: SIGKILL of the router when the launcher runs it as a child (else null, with
  the reason);
* ``flood``: unsolicited valid-looking INPUT chunks at the busiest compute node's chunk topic
  (20 s at 1000 chunks/s by default);
* ``link_collapse``: one compute node (``compute_0``) runs inside a network namespace behind a
  veth pair with a tbf rate limit for the whole run (1000 Mbit/s); the fault drops the rate
  to 1 Mbit/s both ways for 20 s, then restores it (root only; else null);
* ``forge_plan``, ``forge_assignment``, ``forge_telemetry``: forged control messages, first the
  implausible ones (which must be rejected and counted), then one plausible one (which nothing
  can tell from a restart without the security option); ``*_secure``: the same with the
  security option on (null until it exists);
* ``fuzz``: fuzzed messages on every topic a node of the graph subscribes to.

Every fault is preceded by a wait for a healthy graph and a pre-fault window (reference latency
and RSS) and followed by an observation of ``settle_s``. Frames are matched by header stamp;
definitions of every number are in :mod:`kaitian_ros.bench.chaos_metrics` and docs/chaos.md.
"""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench import chaos_metrics as cm
from kaitian_ros.launcher import CapturedOutput

DEFAULT_JSON = Path("bench/results/chaos.json")
SCENARIO = "hetero_inference"
CAMERA_TOPIC = "/camera/image_raw"
FAULTS = ("kill_compute", "kill_scheduler", "kill_coordinator", "kill_router", "flood", "link_collapse",
          "forge_plan", "forge_assignment", "forge_telemetry", "fuzz")
RETIRED = "retired incarnation"  # a listener's reason for a message of an incarnation it left
SECURE_FAULTS = ("forge_plan_secure", "forge_assignment_secure", "forge_telemetry_secure")
ANSWER_S = 6.0  # a frame unanswered this long is unanswered (the coordinator's request timeout is 5 s)
LEAD_S = 1.0  # a fault's frames start this long before it: frames in flight when it hit count
RSS_PERIOD_S = 0.25
MEM_FLOOR_MB = 2048  # the flood is stopped if the machine's available memory falls below this
LINK_NODE = "compute_0"
LINK_NAMES: dict[str, Any] = {"netns_prefix": "kaitian_chaos", "veth_prefix": "kc", "subnet": "10.232"}
# the line each node logs once its subscriptions exist (the end of its constructor)
INSTANT_S = 5.0  # the latency "during" a fault without duration: its first seconds
LIFTED = ("adaptation", "variants")  # details that targets read: kept beside the metrics
COMPUTE_CERT = "compute certificate (reported apart)"
READY_MARK = {"coordinator": " -> trunk ", "compute": ", slowdown ", "scheduler": ": policy "}


class GraphFailed(RuntimeError):
    """The graph stopped (a node died for good): the run ends with what it measured."""


@dataclass(frozen=True)
class Settings:
    quick: bool
    pre_s: float
    settle_s: float
    extra_s: float  # the observation is extended by at most this while not recovered
    warmup_s: float
    flood_s: float
    flood_rate: float
    collapse_s: float
    link_mbit: float
    collapse_mbit: float
    fuzz_count: int
    fuzz_msgs_per_s: float
    fuzz_bytes_per_s: float
    variant_s: float  # observation after each forged message (>= two /diagnostics periods)
    healthy_timeout_s: float

    @classmethod
    def make(cls, quick: bool, **over: Any) -> Settings:
        base: dict[str, Any] = dict(quick=quick, pre_s=4.0 if quick else 6.0, settle_s=10.0 if quick else 30.0,
                    extra_s=10.0 if quick else 15.0, warmup_s=6.0 if quick else 10.0,
                    flood_s=8.0 if quick else 20.0, flood_rate=1000.0, collapse_s=8.0 if quick else 20.0,
                    link_mbit=1000.0, collapse_mbit=1.0, fuzz_count=1000 if quick else 10_000,
                    fuzz_msgs_per_s=2000.0, fuzz_bytes_per_s=50e6, variant_s=2.5,
                    healthy_timeout_s=30.0)
        base.update({k: v for k, v in over.items() if v is not None})
        return cls(**base)


# =========================================================================== recording
class TimedOutput(CapturedOutput):
    """The launcher's output with each line's arrival time (respawns, ready lines, exceptions)."""

    def __init__(self, echo: bool = False) -> None:
        super().__init__(echo)
        self.timed: list[tuple[float, str]] = []
        self._seen = 0

    def write(self, text: str) -> int:
        n = super().write(text)
        now = time.monotonic()
        with self._lock:
            self.timed.extend((now, line) for line in self.lines[self._seen:])
            self._seen = len(self.lines)
        return n

    def between(self, t0: float, t1: float = math.inf) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, line) for t, line in self.timed if t0 <= t <= t1]


class Recorder:
    """What the probe receives, stamped with the probe's monotonic clock. Frames and answers
    count only with the camera's ``frame_id``: fuzzed images on the camera topic are valid
    frames too, and the coordinator answers them."""

    def __init__(self, frame_id: str) -> None:
        self.frame_id = frame_id
        self.lock = threading.Lock()
        self.frames: list[cm.Frame] = []
        self.frame_t: dict[cm.Stamp, float] = {}
        self.answers: list[cm.Answer] = []
        self.request_ids: list[tuple[float, int]] = []
        self.plans: list[tuple[float, Any]] = []
        self.assignments: list[tuple[float, Any]] = []
        self.profiles: dict[str, Any] = {}
        self.telemetry_sample: Any = None
        self.diags: dict[str, list[tuple[float, int, str, dict[str, str]]]] = {}

    @staticmethod
    def _stamp(msg: Any) -> cm.Stamp:
        return int(msg.header.stamp.sec), int(msg.header.stamp.nanosec)

    def on_camera(self, msg: Any) -> None:
        t = time.monotonic()
        if msg.header.frame_id != self.frame_id:
            return
        stamp = self._stamp(msg)
        with self.lock:
            if stamp not in self.frame_t:
                self.frame_t[stamp] = t
                self.frames.append(cm.Frame(stamp, t))

    def on_fused(self, msg: Any) -> None:
        t = time.monotonic()
        if msg.header.frame_id != self.frame_id:
            return
        stamp = self._stamp(msg)
        with self.lock:
            sent = self.frame_t.get(stamp)
            self.answers.append(cm.Answer(stamp, t, bool(msg.complete), None if sent is None else (t - sent) * 1e3))
            self.request_ids.append((t, int(msg.request_id)))

    def on_plan(self, msg: Any) -> None:
        with self.lock:
            self.plans.append((time.monotonic(), msg))

    def on_assignment(self, msg: Any) -> None:
        with self.lock:
            self.assignments.append((time.monotonic(), msg))

    def on_profile(self, msg: Any) -> None:
        with self.lock:
            self.profiles[msg.node_id] = msg

    def on_telemetry(self, msg: Any) -> None:
        if msg.request_id:
            self.telemetry_sample = msg

    def on_diag(self, array: Any) -> None:
        t = time.monotonic()
        with self.lock:
            for status in array.status:
                name = status.name.removeprefix("kaitian: ")
                values = {kv.key: kv.value for kv in status.values}
                self.diags.setdefault(name, []).append((t, int(status.level), status.message, values))

    def snapshot(self) -> tuple[list[cm.Frame], list[cm.Answer]]:
        with self.lock:
            return list(self.frames), list(self.answers)


def read_rss_mb(pid: int) -> float | None:
    """VmRSS of a live process in MB (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def mem_available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


# =========================================================================== the graph
class ChaosGraph:
    """The default graph under the launcher's supervision (respawn on), the probe, RSS sampling."""

    def __init__(self, settings: Settings, *, links: Any = None, overrides: Sequence[str] = (),
                 echo: bool = False) -> None:
        from kaitian_ros.scenario import load_scenario

        self.settings = settings
        self.scenario = load_scenario(SCENARIO, list(overrides))
        self.links = links
        self.out = TimedOutput(echo)
        self.rec = Recorder(str(self.scenario.node("image_source").parameters.get("frame_id", "camera")))
        self.rss: dict[str, list[tuple[float, float]]] = {}
        self.rss_lock = threading.Lock()
        self.guards: list[Callable[[str], None]] = []
        self.launcher: Any = None
        self.rt: Any = None
        self.exit_code: int | None = None
        self._closing = threading.Event()
        self._env_before: dict[str, str | None] = {}
        self.t0 = time.monotonic()
        self.compute_names = [n.name for n in self.scenario.nodes if n.executable == "compute"]

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        from kaitian_ros.launcher import start_on_free_port
        from kaitian_ros.nodes import inference_common as ic
        from kaitian_ros.runtime.api import QoS
        from kaitian_ros.runtime.diagnostics import DIAGNOSTICS_TOPIC
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.node_args import NodeArgs

        host, prefix, env = "127.0.0.1", {}, {}
        if self.links is not None:
            # everyone listens where the namespace reaches it; the node inside without shared
            # memory, so that its bytes really cross the emulated link
            host = self.links.root_ip()
            self._setenv("KAITIAN_LISTEN", f"tcp/{host}:0")  # this process's sessions and every child's
            prefix[LINK_NODE] = self.links.exec_prefix(0)
            env[LINK_NODE] = {"KAITIAN_LISTEN": f"tcp/{self.links.device_ip(0)}:0", "KAITIAN_SHM": "0"}
        self.launcher = start_on_free_port(self.scenario, out=self.out, host=host, node_prefix=prefix, node_env=env)
        self.endpoint = self.launcher.router_endpoint
        threading.Thread(target=self._supervise, daemon=True).start()
        self.rt = EmbeddedRuntime(NodeArgs("chaos_probe"), router=self.endpoint)
        r = self.rec
        self.rt.create_subscription(CAMERA_TOPIC, "Image", r.on_camera, QoS.BEST_EFFORT)
        self.rt.create_subscription(ic.FUSED_TOPIC, "FusedOutput", r.on_fused)
        self.rt.create_subscription(ic.PLAN_TOPIC, "LoadAssignment", r.on_plan, QoS.LATCHED)
        self.rt.create_subscription(ic.ASSIGNMENT_TOPIC, "LoadAssignment", r.on_assignment, QoS.LATCHED)
        self.rt.create_subscription(ic.PROFILES_TOPIC, "CostProfile", r.on_profile, QoS.LATCHED)
        self.rt.create_subscription(ic.TELEMETRY_TOPIC, "NodeTelemetry", r.on_telemetry)
        self.rt.create_subscription(DIAGNOSTICS_TOPIC, "DiagnosticArray", r.on_diag)
        self._spin = threading.Thread(target=self.rt.spin, daemon=True)
        self._spin.start()
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _setenv(self, key: str, value: str) -> None:
        self._env_before.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    def _supervise(self) -> None:
        self.exit_code = self.launcher.wait()

    def _sample_rss(self) -> None:
        while not self._closing.is_set():
            now = time.monotonic()
            for child in list(self.launcher.children):
                if child.process.poll() is None and (mb := read_rss_mb(child.process.pid)) is not None:
                    with self.rss_lock:
                        self.rss.setdefault(child.spec.name, []).append((now, mb))
            avail = mem_available_mb()
            if avail is not None and avail < MEM_FLOOR_MB:
                for guard in list(self.guards):
                    guard(f"memory guard: {avail:.0f} MB available (< {MEM_FLOOR_MB} MB)")
            self._closing.wait(RSS_PERIOD_S)

    def close(self) -> None:
        self._closing.set()
        if self.rt is not None:
            self.rt.shutdown()
            self._spin.join(timeout=5.0)
            self.rt.close()
            self.rt = None
        if self.launcher is not None:
            self.launcher.request_stop()
            self.launcher.stop()
            self.launcher = None
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def check(self) -> None:
        if self.exit_code is not None:
            raise GraphFailed(f"the graph stopped (launcher exit code {self.exit_code}):\n{self.out.text(30)}")

    # --- processes ---------------------------------------------------------------------
    def child(self, name: str) -> Any:
        for c in self.launcher.children:
            if c.spec.name == name:
                return c
        return None

    def pid(self, name: str) -> int:
        return self.child(name).process.pid

    def kill(self, name: str) -> tuple[float, int]:
        """SIGKILL a node (no goodbye); (monotonic time, its pid)."""
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return time.monotonic(), pid

    def restarts(self) -> dict[str, int]:
        return {c.spec.name: c.restarts for c in self.launcher.children}

    def respawned(self, name: str, after: float) -> tuple[float, int] | None:
        """(time, pid) of the launcher's first start of ``name`` after ``after``."""
        mark = f"[launch] started {name} ("
        for t, line in self.out.between(after):
            if line.startswith(mark):
                return t, int(line.rsplit(" ", 1)[1])
        return None

    def ready_after(self, name: str, after: float) -> float | None:
        """When ``name`` logged the end of its construction after ``after``."""
        spec = self.scenario.node(name)
        mark = READY_MARK.get(spec.executable)
        for t, line in self.out.between(after):
            if line.startswith(f"[{name}] ") and (mark is None or mark in line):
                return t
        return None

    def respawned_how(self, name: str, after: float) -> str:
        """How the launcher brought ``name`` back after ``after``: from a warm interpreter with
        its model and costs prepared, from one without (still preparing, or not a compute
        node), or as a fresh process."""
        warm = prepared = False
        for _, line in self.out.between(after):
            warm = warm or line.startswith(f"[launch] {name} respawns from the warm interpreter")
            prepared = prepared or (line.startswith(f"[{name}] ") and "by the warm interpreter" in line)
        return "warm interpreter, prepared" if prepared else "warm interpreter" if warm else "fresh process"

    def exceptions(self, t0: float, t1: float) -> dict[str, int]:
        """Unhandled exceptions in callbacks that nodes logged between t0 and t1."""
        out: dict[str, int] = {}
        for _, line in self.out.between(t0, t1):
            if "callback raised" in line and line.startswith("["):
                node = line[1:line.index("]")]
                out[node] = out.get(node, 0) + 1
        return out

    # --- state ---------------------------------------------------------------------------
    def incarnations(self, node: str) -> set[str]:
        """Every incarnation the real ``node`` (coordinator, scheduler) reported on /diagnostics."""
        with self.rec.lock:
            return {v["incarnation"] for _, _, _, v in self.rec.diags.get(node, []) if v.get("incarnation")}

    def _real(self, msgs: list[tuple[float, Any]], node: str) -> list[tuple[float, Any]]:
        """The messages of the real authority: the probe also receives what the attacker forges."""
        real = self.incarnations(node)
        return [(t, m) for t, m in msgs if not real or _hex(m.incarnation) in real]

    def latest_plan(self, before: float = math.inf) -> Any:
        with self.rec.lock:
            plans = [(t, m) for t, m in self.rec.plans if t <= before]
        plans = self._real(plans, "coordinator")
        return plans[-1][1] if plans else None

    def latest_assignment(self, before: float = math.inf) -> Any:
        with self.rec.lock:
            msgs = [(t, m) for t, m in self.rec.assignments if t <= before]
        msgs = self._real(msgs, "scheduler")
        return msgs[-1][1] if msgs else None

    def plans_between(self, t0: float, t1: float) -> list[tuple[float, Any]]:
        with self.rec.lock:
            plans = [(t, m) for t, m in self.rec.plans if t0 <= t <= t1]
        return self._real(plans, "coordinator")

    def assignments_between(self, t0: float, t1: float) -> list[tuple[float, Any]]:
        with self.rec.lock:
            msgs = [(t, m) for t, m in self.rec.assignments if t0 <= t <= t1]
        return self._real(msgs, "scheduler")

    def takeovers(self) -> list[str]:
        """Listeners that follow an authority run other than the real one's (a forged or fuzzed
        LoadAssignment with a new incarnation was taken for a restart)."""
        out = []
        coordinator = self.diag("coordinator").get("incarnation")
        for n in self.compute_names:
            follows = self.diag(n).get("coordinator_incarnation")
            if coordinator and follows and follows != coordinator:
                out.append(f"{n} follows coordinator run {follows}, the coordinator is {coordinator}")
        scheduler = self.diag("scheduler").get("incarnation")
        follows = self.diag("coordinator").get("scheduler_incarnation")
        if scheduler and follows and follows != scheduler:
            out.append(f"coordinator follows scheduler run {follows}, the scheduler is {scheduler}")
        return out

    def diag(self, node: str, before: float = math.inf) -> dict[str, str]:
        with self.rec.lock:
            readings = [r for r in self.rec.diags.get(node, []) if r[0] <= before]
        return dict(readings[-1][3]) if readings else {}

    def diag_since(self, node: str, t: float) -> list[dict[str, str]]:
        """Every /diagnostics reading of ``node`` received after ``t``."""
        with self.rec.lock:
            return [dict(v) for rt, _, _, v in self.rec.diags.get(node, []) if rt > t]

    def logged_since(self, nodes: Sequence[str], t: float, text: str) -> bool:
        """Whether one of ``nodes`` logged a line containing ``text`` after ``t``."""
        heads = tuple(f"[{n}] " for n in nodes)
        return any(line.startswith(heads) and text in line for _, line in self.out.between(t))

    def diag_time(self, node: str) -> float | None:
        with self.rec.lock:
            readings = self.rec.diags.get(node, [])
            return readings[-1][0] if readings else None

    def diag_series(self, node: str, t0: float, t1: float) -> list[tuple[float, dict[str, str]]]:
        """The last reading before t0 (the baseline) and every reading in [t0, t1]."""
        with self.rec.lock:
            readings = [(t, v) for t, _, _, v in self.rec.diags.get(node, [])]
        before = [r for r in readings if r[0] < t0][-1:]
        return before + [r for r in readings if t0 <= r[0] <= t1]

    def wait_diag_after(self, nodes: Sequence[str], t: float, timeout_s: float = 5.0) -> None:
        """Until every node published /diagnostics after ``t`` (or the timeout)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all((self.diag_time(n) or 0.0) > t for n in nodes):
                return
            time.sleep(0.05)

    def counter(self, node: str, key: str, t0: float, t1: float, ident: str = "") -> int:
        """How much a /diagnostics counter of ``node`` grew in [t0, t1] (restarts: see
        chaos_metrics.counter_increase; ``ident`` names the value that identifies a run)."""
        series = self.diag_series(node, t0, t1)
        return cm.counter_increase([(v.get(ident, "") if ident else "", _int(v.get(key, "0"))) for _, v in series])

    def reasons(self, node: str, t0: float, t1: float) -> dict[str, int]:
        return cm.reason_increase([("", v) for _, v in self.diag_series(node, t0, t1)])

    def coordinator_drops(self, t0: float, t1: float) -> int:
        """Frames the coordinator dropped by design in [t0, t1] (its counters)."""
        return sum(self.counter("coordinator", k, t0, t1 + 1.5, "incarnation")
                   for k in ("dropped_busy", "dropped_no_plan"))

    def busiest_compute(self) -> str:
        """The compute node with the largest share of the running plan."""
        plan = self.latest_plan()
        if plan is None or not len(plan.node_ids):
            return self.compute_names[0]
        shares = list(plan.shares)
        return str(plan.node_ids[max(range(len(shares)), key=lambda i: shares[i])])

    def idle_compute(self) -> str | None:
        plan = self.latest_plan()
        used = set(plan.node_ids) if plan is not None else set()
        idle = [n for n in self.compute_names if n not in used]
        return idle[-1] if idle else None

    def latest_request_id(self) -> int:
        with self.rec.lock:
            return self.rec.request_ids[-1][1] if self.rec.request_ids else 0

    def latencies(self, t0: float, t1: float) -> list[float]:
        _, answers = self.rec.snapshot()
        return [a.latency_ms for a in answers if a.complete and a.latency_ms is not None and t0 <= a.t <= t1]

    def rss_samples(self) -> dict[str, list[tuple[float, float]]]:
        with self.rss_lock:
            return {k: list(v) for k, v in self.rss.items()}

    # --- waiting -----------------------------------------------------------------------
    def wait_serving(self, timeout_s: float) -> float:
        """Until complete answers arrive; the time it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            self.check()
            if len(self.latencies(time.monotonic() - 2.0, math.inf)) >= 3:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise RuntimeError(f"no complete frames within {timeout_s:.0f} s:\n{self.out.text(40)}")

    def wait_healthy(self, timeout_s: float, baseline_ms: float | None) -> tuple[bool, float]:
        """Until every node runs (no respawn pending) and recent complete answers are within
        25 % of the run's baseline latency; (healthy, seconds waited)."""
        t0 = time.monotonic()
        while True:
            self.check()
            now = time.monotonic()
            down = any(c.respawn_at or c.process.poll() is not None for c in self.launcher.children)
            recent = self.latencies(now - 2.0, now)
            ok = not down and len(recent) >= 3 and (baseline_ms is None or
                                                    statistics.median(recent[-5:]) <= 1.25 * baseline_ms)
            if ok or now - t0 >= timeout_s:
                return ok, now - t0
            time.sleep(0.2)


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return 0


def _float(text: str) -> float:
    """A /diagnostics value as a float ("nan" is NaN; unreadable text is 0, not an effect)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return 0.0


def _hex(incarnation: int) -> str:
    return f"{int(incarnation):016x}"


# =========================================================================== the attacker
class Attacker:
    """A ``chaos_attack serve`` process: publishes what the bench hands it, fuzzes."""

    def __init__(self, endpoint: str, topics: dict[str, str], env: dict[str, str | None] | None = None) -> None:
        """``env``: variables set for the attacker (None: removed, e.g. its certificate)."""
        cmd = [sys.executable, "-u", "-m", "kaitian_ros.bench.chaos_attack", "serve"]
        for topic, type_name in topics.items():
            cmd += ["--topic", f"{topic}={type_name}"]
        full = dict(os.environ, KAITIAN_ROUTER=endpoint)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        self.proc = subprocess.Popen(cmd, env=full,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        ready = self._reply(60.0)
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"attacker did not start: {ready.get('error') or ready}")

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        box: list[str] = []
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None and stderr is not None  # started with pipes
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            err = stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"no answer from the attacker within {timeout_s:.0f} s {err[-800:]}")
        return json.loads(box[0])

    def command(self, timeout_s: float = 60.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None  # started with pipes
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"attacker: {reply.get('error')}")
        return reply

    def publish(self, topic: str, cdr: bytes, copies: int = 1) -> None:
        self.command(op="publish", topic=topic, cdr_b64=base64.b64encode(cdr).decode(), copies=copies)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _encode(msg: Any, type_name: str) -> bytes:
    from kaitian_ros.runtime import interfaces

    return bytes(interfaces.encode(msg, type_name))


# =========================================================================== faults
@dataclass
class Injected:
    """What a fault's injection reports: when it ended, the recovery reference, details, and
    (optionally) work to do after the observation (more details, intervals the coordinator was
    down)."""

    end: float
    ref: float
    details: dict[str, Any] = field(default_factory=dict)
    start: float | None = None  # when the fault really began (default: when inject was called)
    after: Callable[[float, float], dict[str, Any]] | None = None
    down: list[tuple[float, float]] = field(default_factory=list)
    repair: Callable[[], str] | None = None  # after the measurement: put the graph right again
    effect: bool | None = None  # forgeries
    top: dict[str, Any] = field(default_factory=dict)  # results that belong beside lost, recover_s, ...


class Run:
    """One bench run: the graph, the settings, the attacker and the results."""

    def __init__(self, g: ChaosGraph, s: Settings, secure_dir: str | None = None) -> None:
        self.g, self.s = g, s
        self.secure_dir = secure_dir  # the graph runs with the security option (these certificates)
        self.attacker: Attacker | None = None
        self.secure_attackers: list[tuple[str, Attacker | None, str]] = []
        self.baseline_ms: float | None = None
        self.results: dict[str, Any] = {}

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.g.t0, 3)

    def attacker_for(self) -> Attacker:
        if self.attacker is None:
            self.attacker = Attacker(self.g.endpoint, fuzz_topics(self.g))
        return self.attacker

    def attackers(self) -> list[tuple[str, Attacker | None, str]]:
        """(who, attacker or None, why it could not join): without the security option the one
        attacker; with it, one holding the graph's ``node`` certificate (a camera, a tool), one
        without any, and - reported apart, not judged by the target - one holding the
        ``compute`` certificate (what a compromised compute node holds)."""
        if self.secure_dir is None:
            return [("no certificate (security option off)", self.attacker_for(), "")]
        if not self.secure_attackers:
            envs: tuple[tuple[str, dict[str, str | None]], ...] = (
                ("no certificate", {"KAITIAN_SECURITY": None, "KAITIAN_SECURITY_ROLE": None}),
                ("node certificate", {"KAITIAN_SECURITY": self.secure_dir, "KAITIAN_SECURITY_ROLE": "node"}),
                (COMPUTE_CERT, {"KAITIAN_SECURITY": self.secure_dir, "KAITIAN_SECURITY_ROLE": "compute"}))
            for who, env in envs:
                try:
                    self.secure_attackers.append((who, Attacker(self.g.endpoint, fuzz_topics(self.g), env), ""))
                except RuntimeError as exc:  # refused by the graph: it sends nothing
                    self.secure_attackers.append((who, None, " ".join(str(exc).split())[:300]))
        return self.secure_attackers

    def close_attackers(self) -> None:
        for a in [self.attacker] + [a for _, a, _ in self.secure_attackers]:
            if a is not None:
                a.close()

    def run(self, name: str, inject: Callable[[], Injected],
            prepare: Callable[[], object] | None = None) -> dict[str, Any]:
        g, s = self.g, self.s
        healthy, waited = g.wait_healthy(s.healthy_timeout_s, self.baseline_ms)
        if prepare is not None:
            prepare()
        pre0 = time.monotonic()
        time.sleep(s.pre_s)
        called = time.monotonic()
        pre_lat = g.latencies(pre0, called)
        pre_ms = statistics.median(pre_lat) if pre_lat else self.baseline_ms
        inj = inject()
        start = inj.start if inj.start is not None else called
        until = inj.end + s.settle_s
        while time.monotonic() < until:
            g.check()
            time.sleep(0.2)
        _, answers = g.rec.snapshot()
        while cm.recovery(answers, inj.ref, pre_ms).recover_s is None and time.monotonic() < until + s.extra_s:
            g.check()
            time.sleep(0.5)
            _, answers = g.rec.snapshot()
        until = max(until, time.monotonic())
        details = dict(inj.details)
        if inj.after is not None:
            details.update(inj.after(start, until))
        result = self.measure(start, inj.end, until, inj.ref, pre0, pre_ms, inj.down)
        result["forgery_effect"] = inj.effect
        result.update(inj.top)
        result.update({k: details.pop(k) for k in LIFTED if k in details})
        result.update({"healthy_before": healthy, "waited_for_healthy_s": round(waited, 1), "details": details})
        if inj.repair is not None:
            result["repair"] = inj.repair()
        result["targets"] = [t.__dict__ for t in cm.targets(cm.fault_kind(name), result)]
        return result

    def measure(self, start: float, end: float, until: float, ref: float, pre0: float, pre_ms: float | None,
                down: Sequence[tuple[float, float]]) -> dict[str, Any]:
        g = self.g
        frames, answers = g.rec.snapshot()
        ws, we = start - LEAD_S, until - ANSWER_S
        counts = cm.count_frames(frames, answers, ws, we, answer_s=ANSWER_S, down=down,
                                 by_design=g.coordinator_drops(ws, we))
        rec = cm.recovery(answers, ref, pre_ms, until=until)
        rss: dict[str, Any] = {}
        for node, samples in sorted(g.rss_samples().items()):
            d = cm.rss_delta(samples, (pre0, start), (start, until), until)
            rss[node] = {"pre_mb": _r(d.pre_mb), "peak_delta_mb": _r(d.peak_delta_mb),
                         "settled_delta_mb": _r(d.settled_delta_mb)}
        peaks = {n: v["peak_delta_mb"] for n, v in rss.items() if v["peak_delta_mb"] is not None}
        settled = {n: v["settled_delta_mb"] for n, v in rss.items() if v["settled_delta_mb"] is not None}
        peak_node = max(peaks, key=lambda n: peaks[n]) if peaks else None
        settled_node = max(settled, key=lambda n: settled[n]) if settled else None
        return {
            "lost": counts.lost, "duplicated": counts.duplicated, "out_of_order": counts.out_of_order,
            "recover_s": _r(rec.recover_s, 2), "peak_rss_delta_mb": peaks[peak_node] if peak_node is not None else None,
            "settled_rss_delta_mb": settled[settled_node] if settled_node is not None else None, "forgery_effect": None,
            "frames": counts.as_dict(), "first_complete_s": _r(rec.first_complete_s, 2),
            "latency_back_s": _r(rec.latency_back_s, 2), "pre_latency_ms": _r(pre_ms),
            "output_gap_s": _r(cm.max_gap([a.t for a in answers if a.complete], start, until), 2),
            "latency_during_ms": _r(cm.median_or_none(
                a.latency_ms for a in answers if a.complete and a.latency_ms is not None
                and start <= a.t <= max(end, start + INSTANT_S))),
            "latency_max_ms": _r(max((a.latency_ms for a in answers if a.complete and a.latency_ms is not None
                                      and start <= a.t <= until), default=None)),
            "peak_rss_node": peak_node, "settled_rss_node": settled_node,
            "settle_s": _r(until - end), "rss": rss,
            "window": {"pre": self.rel(pre0), "start": self.rel(start), "end": self.rel(end), "until": self.rel(until),
                       "frames_from": self.rel(ws), "frames_to": self.rel(we)},
        }

    # --- kills -------------------------------------------------------------------------
    def kill_compute(self) -> Injected:
        g = self.g
        victim = g.busiest_compute()
        before = g.latest_plan()
        t, pid = g.kill(victim)

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned(victim, t)
            ready = g.ready_after(victim, re[0]) if re else None
            plans = g.plans_between(t, until)
            left = next((pt for pt, m in plans if victim not in list(m.node_ids)), None)
            back = next((pt for pt, m in plans if left is not None and pt > left and victim in list(m.node_ids)), None)
            return {"victim": victim, "old_pid": pid, "new_pid": re[1] if re else None,
                    "respawned_after_s": _r(re[0] - t, 2) if re else None,
                    "respawned_from": g.respawned_how(victim, t) if re else None,
                    "ready_after_s": _r(ready - t, 2) if ready else None,
                    "plan_before": _plan_text(before), "left_plan_after_s": _r(left - t, 2) if left else None,
                    "back_in_plan_after_s": _r(back - t, 2) if back else None,
                    "redispatched": g.counter("coordinator", "redispatched", start, until, "incarnation"),
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "plans": _plans(plans, t)}

        return Injected(end=t, ref=t, after=after)

    def kill_authority(self, name: str) -> Injected:
        g = self.g
        if g.child(name) is None:
            raise LookupError(name)
        old = g.latest_plan() if name == "coordinator" else g.latest_assignment()
        old_inc = int(old.incarnation) if old is not None else 0
        max_id_before = g.latest_request_id()
        t, pid = g.kill(name)
        inj = Injected(end=t, ref=t)

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned(name, t)
            ready = g.ready_after(name, re[0]) if re else None
            if name == "coordinator":
                inj.down.append((t, ready if ready is not None else until))
            msgs = g.plans_between(t, until) if name == "coordinator" else g.assignments_between(t, until)
            new = next(((mt, m) for mt, m in msgs if int(m.incarnation) != old_inc), None)
            followers = g.compute_names if name == "coordinator" else ["coordinator"]
            key = "coordinator_incarnation" if name == "coordinator" else "scheduler_incarnation"
            followed: dict[str, float | None] = {}
            if new is not None:
                for f in followers:
                    followed[f] = next((dt for dt, v in g.diag_series(f, new[0], until)
                                        if v.get(key) == _hex(new[1].incarnation) and dt >= new[0]), None)
            adaptation = new is not None and all(v is not None for v in followed.values())
            out = {"victim": name, "old_pid": pid, "new_pid": re[1] if re else None,
                   "respawned_after_s": _r(re[0] - t, 2) if re else None,
                   "ready_after_s": _r(ready - t, 2) if ready else None,
                   "old_incarnation": _hex(old_inc), "new_incarnation": _hex(new[1].incarnation) if new else None,
                   f"new_{'plan' if name == 'coordinator' else 'assignment'}_after_s":
                       _r(new[0] - t, 2) if new else None,
                   "followed_after_s": {f: _r(v - t, 2) if v else None for f, v in followed.items()},
                   "adaptation": adaptation,
                   "adaptation_s": _r(max(v for v in followed.values() if v is not None) - t, 2)
                   if adaptation and followed else None}
            if name == "coordinator":
                with g.rec.lock:
                    ids = [rid for rt, rid in g.rec.request_ids if rt > t]
                out["request_ids_continue_above"] = (min(ids) > max_id_before) if ids else None
            return out

        inj.after = after
        return inj

    def kill_router(self) -> Injected:
        g = self.g
        t, pid = g.kill("router")

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned("router", t)
            since = re[0] if re else until
            plan, assignment = g.latest_plan(), g.latest_assignment()
            # after the router's restart the control plane's latched state must agree end to end
            followed = plan is not None and all(g.diag(n).get("coordinator_incarnation") == _hex(plan.incarnation)
                                                for n in g.compute_names)
            proposal = assignment is not None and g.diag("coordinator").get("scheduler_version") == str(
                int(assignment.version))
            fresh = (g.diag_time("coordinator") or 0.0) > since and (g.diag_time("scheduler") or 0.0) > since
            return {"victim": "router", "old_pid": pid, "new_pid": re[1] if re else None,
                    "respawned_after_s": _r(re[0] - t, 2) if re else None,
                    "adaptation": bool(re and followed and proposal and fresh),
                    "compute_nodes_follow_plan": followed, "coordinator_follows_assignment": proposal,
                    "diagnostics_after_restart": fresh}

        return Injected(end=t, ref=t, after=after)

    # --- flood -------------------------------------------------------------------------
    def flood_prepare(self) -> None:
        """Start the flood's attacker before the pre-fault window (its imports and model build
        take seconds of CPU); it floods on "go"."""
        g, s = self.g, self.s
        victim = g.busiest_compute()
        p = g.scenario.node(victim).parameters
        cmd = [sys.executable, "-u", "-m", "kaitian_ros.bench.chaos_attack", "flood", "--node", victim,
               "--seconds", str(s.flood_s), "--rate", str(s.flood_rate), "--model", str(p["model"]),
               "--height", str(p["input_height"]), "--width", str(p["input_width"]),
               "--num-classes", str(p["num_classes"]), "--slab-rows", str(p["slab_rows"]), "--wait-go"]
        proc = subprocess.Popen(cmd, env=dict(os.environ, KAITIAN_ROUTER=g.endpoint), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stdout is not None and proc.stderr is not None  # started with pipes
        line = proc.stdout.readline()
        if '"ready"' not in line:
            proc.kill()
            raise RuntimeError(f"the flood attacker did not start: {line.strip()} {proc.stderr.read()[-600:]}")
        self._flood = (victim, proc)

    def flood(self) -> Injected:
        g, s = self.g, self.s
        victim, proc = self._flood
        stopped: list[str] = []

        def guard(why: str) -> None:
            if proc.poll() is None and not stopped:
                stopped.append(why)
                proc.send_signal(signal.SIGTERM)

        g.guards.append(guard)
        start = time.monotonic()
        assert proc.stdin is not None  # started with pipes
        proc.stdin.write("go\n")
        proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=s.flood_s + 60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        finally:
            g.guards.remove(guard)
        end = time.monotonic()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        stats = json.loads(lines[-1]) if lines else {"error": err.strip()[-400:]}

        def after(start: float, until: float) -> dict[str, Any]:
            plans = g.plans_between(start, until)
            left = next((pt for pt, m in plans if victim not in list(m.node_ids)), None)
            return {"victim": victim, "attacker": stats, "stopped_early": stopped[0] if stopped else None,
                    "victim_rejected": g.reasons(victim, start, until + 1.5),
                    "victim_left_plan_after_s": _r(left - start, 2) if left else None,
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "plans": _plans(plans, start)}

        return Injected(end=end, ref=end, start=start, after=after)

    # --- link collapse -----------------------------------------------------------------
    def link_collapse(self) -> Injected:
        g, s = self.g, self.s
        before = g.latest_plan()
        sent0 = _tbf_bytes(g.links)
        t0 = time.monotonic()
        g.links.set_rate(0, s.collapse_mbit)
        try:
            end_at = t0 + s.collapse_s
            while time.monotonic() < end_at:
                g.check()
                time.sleep(0.1)
        finally:
            g.links.set_rate(0, s.link_mbit)
        end = time.monotonic()
        sent = {dev: n - sent0.get(dev, 0) for dev, n in _tbf_bytes(g.links).items()}

        def after(start: float, until: float) -> dict[str, Any]:
            plans = g.plans_between(start, until)
            left = next((pt for pt, m in plans if pt <= end and LINK_NODE not in list(m.node_ids)), None)
            back = next((pt for pt, m in plans
                         if left is not None and pt > end and LINK_NODE in list(m.node_ids)), None)
            alive = [(dt, v.get("alive", "")) for dt, v in g.diag_series("coordinator", start, until)]
            dropped = next((dt for dt, a in alive if LINK_NODE not in a.split(",")), None)
            return {"node": LINK_NODE, "rate_mbit": s.link_mbit, "collapsed_to_mbit": s.collapse_mbit,
                    "collapse_s": _r(end - start, 1), "plan_before": _plan_text(before),
                    "bytes_through_tbf_during_collapse": sent,
                    "node_declared_dead_after_s": _r(dropped - start, 2) if dropped else None,
                    "left_plan_after_s": _r(left - start, 2) if left else None,
                    "back_in_plan_after_restore_s": _r(back - end, 2) if back else None,
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "redispatched": g.counter("coordinator", "redispatched", start, until, "incarnation"),
                    "plans": _plans(plans, start)}

        return Injected(end=end, ref=end, start=t0, after=after)

    # --- forgeries ---------------------------------------------------------------------
    def forge(self, kind: str) -> Injected:
        """Each forged message of ``kind`` from each attacker in turn; with the security option,
        the plausible one of an attacker holding a node certificate goes last (it may take an
        authority over)."""
        g, s = self.g, self.s
        attackers = self.attackers()
        authority = {"plan": "coordinator", "assignment": "scheduler"}.get(kind)
        t0 = time.monotonic()
        done = []
        joined = [(who, a) for who, a, _ in attackers if a is not None]  # in order: the strongest last
        for who, attacker in joined:
            for v in forgery_variants(g, kind):
                watch = list(v.listeners) + ([authority] if authority else [])
                before = {n: g.diag(n) for n in watch}
                tv = time.monotonic()
                attacker.publish(v.topic, v.cdr)
                time.sleep(s.variant_s)
                g.wait_diag_after(watch, tv + 1.05)
                counts = {n: cm.reason_increase([("", before[n]), ("", g.diag(n))]) for n in watch}
                # a listener that took the authority's answer to this impostor first (a new
                # incarnation) refuses the forgery as of a retired incarnation: counted all the same
                counted = bool(v.reason) and all(counts[n].get(v.reason, 0) + counts[n].get(RETIRED, 0) >= 1
                                                 for n in v.listeners)
                effect = v.marker(tv)  # at any time after it was sent (an authority may undo it at once)
                row = {"name": v.name, "attacker": who, "implausible": v.implausible, "what": v.what,
                       "listeners": list(v.listeners), "expected_reason": v.reason, "counted": counted,
                       "rejected": counts, "effect": effect, "consequence": v.consequence if effect else ""}
                # what the listeners and the authority logged about incarnations (who followed whom, when)
                heads = tuple(f"[{n}] " for n in watch)
                row["log"] = [f"+{lt - tv:.3f} s {line[:200]}" for lt, line in g.out.between(tv)
                              if line.startswith(heads) and ("incarnation" in line or "impostor" in line)][:12]
                if authority:  # the authority watches its own topic (impostors), and may re-announce
                    row["authority"] = {"name": authority, "impostor_counted": counts[authority].get("impostor", 0),
                                        "reincarnated": g.diag(authority).get("incarnation")
                                        != before[authority].get("incarnation")}
                done.append(row)
        for who, joined_as, why in attackers:
            if joined_as is None:  # it could not join: nothing it could send reached anyone
                done.append({"name": "all", "attacker": who, "implausible": None, "what": "could not join the graph",
                             "listeners": [], "expected_reason": "", "counted": False, "rejected": {},
                             "effect": False, "consequence": "", "refused": why})
        end = time.monotonic()
        effect = _any_effect(d["effect"] for d in done if d["attacker"] != COMPUTE_CERT)
        inj = Injected(end=end, ref=end, start=t0, details={"variants": done}, effect=effect)
        inj.details["attackers"] = [who for who, _, _ in attackers]
        if any(d["attacker"] == COMPUTE_CERT for d in done):
            inj.top["forgery_effect_compute_certificate"] = _any_effect(
                d["effect"] for d in done if d["attacker"] == COMPUTE_CERT)

        def repair() -> str:
            # what is still taken over after the window (an authority may have re-announced
            # itself already); forged telemetry leaves the scheduler's request count ahead
            names = _taken_over(g.takeovers())
            if kind == "telemetry" and (effect or inj.top.get("forgery_effect_compute_certificate")):
                names = sorted(set(names) | {"scheduler"})
            return self.repair(names) if names else "nothing to repair: every listener follows the real authorities"

        inj.repair = repair
        return inj

    def repair(self, names: Sequence[str]) -> str:
        """Kill -9 the authorities a forgery took over; the launcher respawns them (a new
        incarnation, which every listener follows)."""
        g = self.g
        t = time.monotonic()
        for name in names:
            old = g.diag(name).get("incarnation")
            g.kill(name)
            end = time.monotonic() + 60.0
            while time.monotonic() < end:
                g.check()
                new = g.diag(name).get("incarnation")
                mine = [x for x in g.takeovers() if x.startswith("coordinator follows") == (name == "scheduler")]
                if new and new != old and not mine:
                    break
                time.sleep(0.2)
        ok, _ = g.wait_healthy(60.0, self.baseline_ms)
        left = g.takeovers()
        return (f"{', '.join(names)} killed and respawned; after {time.monotonic() - t:.1f} s every listener follows "
                f"the real authorities: {'yes' if not left else 'NO (' + '; '.join(left) + ')'}, graph "
                f"{'healthy' if ok else 'NOT healthy'}")

    # --- fuzz --------------------------------------------------------------------------
    def fuzz(self) -> Injected:
        g, s = self.g, self.s
        attacker = self.attacker_for()
        seeds = fuzz_seeds(g)
        t0 = time.monotonic()
        restarts0 = g.restarts()
        topics: dict[str, Any] = {}
        takeovers: dict[str, str] = {}  # what a fuzzed LoadAssignment took over -> by which topic
        uncounted, hangs = 0, 0
        for topic, (type_name, seed, listeners) in seeds.items():
            g.check()
            rate = min(s.fuzz_msgs_per_s, s.fuzz_bytes_per_s / max(1, len(seed)))
            before = {n: g.diag(n) for n in listeners}
            tb = time.monotonic()
            reply = attacker.command(timeout_s=s.fuzz_count / rate + 120.0, op="fuzz", topic=topic,
                                     seed_b64=base64.b64encode(seed).decode(), count=s.fuzz_count, rate=rate,
                                     seed=len(topics))
            te = time.monotonic()
            settled = self._wait_counts_settle(listeners, te)
            per: dict[str, Any] = {}
            for n in listeners:
                diag_after = g.diag(n)
                fresh = (g.diag_time(n) or 0.0) > te
                reasons = cm.reason_increase([("", before[n]), ("", diag_after)])
                runtime = sum(reasons.get(k, 0)
                              for k in ("malformed", "wrong type", "type hash mismatch", "queue full"))
                expected = reply["undecodable"] + reply["wrong_type"]
                exact = reasons.get("queue full", 0) == 0
                missing = max(0, expected - runtime) if not exact else (
                    abs(reasons.get("malformed", 0) - reply["undecodable"])
                    + abs(reasons.get("wrong type", 0) - reply["wrong_type"]))
                exc = g.exceptions(tb, time.monotonic()).get(n, 0)
                uncounted += missing + exc
                hangs += 0 if fresh else 1
                per[n] = {"rejected": reasons, "expected_runtime_rejects": expected,
                          "runtime_rejects": runtime, "accounting": "exact" if exact else "at least (queue full)",
                          "missing": missing, "unhandled_exceptions": exc, "diagnostics_after": fresh}
            g.wait_diag_after(g.compute_names + ["coordinator", "scheduler"], te)
            taken = g.takeovers()
            for line in taken:
                if line not in takeovers:
                    takeovers[line] = topic
            topics[topic] = {"type": type_name, "sent": reply["sent"], "undecodable": reply["undecodable"],
                             "wrong_type": reply["wrong_type"], "decodable": reply["decodable"],
                             "by_class": reply["by_class"], "rate": round(rate), "seconds": reply["seconds"],
                             "counts_settled": settled, "subscribers": per,
                             "serving_after": len(g.latencies(te, time.monotonic())) > 0,
                             "authority_taken_over": [line for line, by in takeovers.items() if by == topic]}
            print(f"    fuzz {topic}: {reply['sent']} sent ({reply['undecodable']} undecodable, "
                  f"{reply['wrong_type']} wrong type) in {reply['seconds']} s; "
                  + ", ".join(f"{n}: {v['runtime_rejects']} counted, {v['missing']} missing" for n, v in per.items()),
                  flush=True)
        end = time.monotonic()
        restarts = g.restarts()
        crashes = sum(restarts.get(n, 0) - restarts0.get(n, 0) for n in restarts)
        inj = Injected(end=end, ref=end, start=t0)

        def after(start: float, until: float) -> dict[str, Any]:
            return {"topics": topics, "serving_after": len(g.latencies(until - 5.0, until)) > 0}

        inj.after = after
        inj.top = {"crashes": crashes, "hangs": hangs, "uncounted": uncounted,
                   "authority_taken_over": sorted(takeovers)}
        inj.details = {"per_topic": s.fuzz_count}
        if takeovers:
            inj.repair = lambda: (self.repair(_taken_over(g.takeovers())) if g.takeovers()
                                  else "nothing to repair: the authorities re-announced themselves")
        return inj

    def _wait_counts_settle(self, nodes: Sequence[str], t: float, timeout_s: float = 15.0) -> bool:
        """Until each node's reject total is the same in two reports after ``t``: the node has
        worked through its queue."""
        g = self.g
        end = time.monotonic() + timeout_s
        last: dict[str, tuple[float, str]] = {}
        stable: set[str] = set()
        while time.monotonic() < end and stable != set(nodes):
            for n in nodes:
                dt = g.diag_time(n)
                if dt is None or dt <= t:
                    continue
                total = g.diag(n).get("rejected", "0")
                if n in last and last[n][0] != dt and last[n][1] == total:
                    stable.add(n)
                last[n] = (dt, total)
            time.sleep(0.1)
        return stable == set(nodes)


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    implausible: bool
    topic: str
    cdr: bytes
    listeners: tuple[str, ...]
    reason: str  # the rejected.<reason> each listener must count ("" for a plausible one)
    marker: Callable[[float], bool | None]  # the listeners took it at some time after the given one
    consequence: str


def forgery_variants(g: ChaosGraph, kind: str) -> list[Variant]:
    """The forged messages of one kind, implausible first, then the plausible one."""
    from kaitian_ros.core.authority import new_incarnation
    from kaitian_ros.core.policy import Assignment
    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.runtime import interfaces

    computes = tuple(g.compute_names)
    slow = computes[-1]
    if kind == "plan":
        real = g.latest_plan()
        inc, ver = int(real.incarnation), int(real.version)

        def plan(incarnation: int, version: int, shares: tuple[float, ...] = (1.0,), nodes: tuple[str, ...] = (slow,),
                 strategy: str = "single") -> bytes:
            msg = ic.assignment_msg(Assignment(version, 0, nodes, shares, "adaptive", "chaos forgery", 1.0),
                                    incarnation)
            return _encode(_with(msg, strategy=strategy), "LoadAssignment")

        def has_version(v: int) -> Callable[[float], bool]:
            return lambda since: any(str(v) in d.get("plans", "").split(",") for n in computes
                                     for d in g.diag_since(n, since))

        def follows(incarnation: int) -> Callable[[float], bool]:
            # a compute node logs each coordinator restart it follows: seen even if undone at once
            return lambda since: g.logged_since(computes, since, f"restarted: incarnation {_hex(incarnation)}") or any(
                d.get("coordinator_incarnation") == _hex(incarnation) for n in computes for d in g.diag_since(n, since))

        fake = new_incarnation()
        return [
            Variant("version_jump", f"the coordinator's incarnation, v{ver + 2**31} (a jump of 2**31)", True,
                    ic.PLAN_TOPIC, plan(inc, ver + 2**31), computes, "implausible version", has_version(ver + 2**31),
                    "compute nodes would run a plan the coordinator never made"),
            Variant("no_incarnation", "incarnation 0", True, ic.PLAN_TOPIC, plan(0, ver + 500), computes,
                    "no incarnation", has_version(ver + 500), "compute nodes would follow no authority"),
            Variant("bad_shares", "the coordinator's incarnation, a NaN share", True, ic.PLAN_TOPIC,
                    plan(inc, ver + 700, (math.nan, 1.0), computes[:2], "stripes"), computes, "bad plan",
                    has_version(ver + 700), "compute nodes would build a plan from NaN shares"),
            Variant("new_incarnation", f"a new incarnation from v1: all rows to {slow}", False, ic.PLAN_TOPIC,
                    plan(fake, 1), computes, "", follows(fake),
                    "compute nodes follow the forged coordinator run and refuse the real one's plans as retired: "
                    "every frame times out until the coordinator restarts"),
        ]
    if kind == "assignment":
        real = g.latest_assignment()
        inc, ver = int(real.incarnation), int(real.version)
        nxt = g.latest_request_id() + 1

        def proposal(incarnation: int, version: int, effective: int, shares: tuple[float, ...]) -> bytes:
            return _encode(ic.assignment_msg(Assignment(version, effective, computes, shares, "adaptive",
                                                        "chaos forgery", 1.0), incarnation), "LoadAssignment")

        def coordinator_has(key: str, value: str) -> Callable[[float], bool]:
            return lambda since: (key == "scheduler_incarnation" and g.logged_since(
                ["coordinator"], since, f"restarted: incarnation {value}")) or any(
                d.get(key) == value for d in g.diag_since("coordinator", since))

        fake = new_incarnation()
        only_slow = tuple(1.0 if n == slow else 0.0 for n in computes)
        return [
            Variant("version_jump", f"the scheduler's incarnation, v{ver + 2**31}", True, ic.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 2**31, nxt, only_slow), ("coordinator",), "implausible version",
                    coordinator_has("scheduler_version", str(ver + 2**31)),
                    "the coordinator would refuse every later real proposal as stale"),
            Variant("effective_far_ahead", "effective from a request 10**9 ahead", True, ic.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 300, nxt + 10**9, only_slow), ("coordinator",),
                    "implausible effective_from_request", coordinator_has("scheduler_version", str(ver + 300)),
                    "the coordinator would hold a proposal forever"),
            Variant("negative_share", "a negative share", True, ic.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 400, nxt, (-1.0,) + (1.0,) * (len(computes) - 1)), ("coordinator",),
                    "bad assignment", coordinator_has("scheduler_version", str(ver + 400)),
                    "the coordinator would plan with a negative share"),
            Variant("no_incarnation", "incarnation 0", True, ic.ASSIGNMENT_TOPIC,
                    proposal(0, ver + 500, nxt, only_slow), ("coordinator",), "no incarnation",
                    coordinator_has("scheduler_incarnation", _hex(0)), "the coordinator would follow no authority"),
            Variant("new_incarnation", f"a new incarnation from v1: all rows to {slow}", False, ic.ASSIGNMENT_TOPIC,
                    proposal(fake, 1, nxt + 2, only_slow), ("coordinator",), "",
                    coordinator_has("scheduler_incarnation", _hex(fake)),
                    "the coordinator follows the forged scheduler run and retires the real one: adaptation stops "
                    "until the scheduler restarts"),
        ]
    # telemetry: the scheduler decides from it (the coordinator takes heartbeats only)
    idle = g.idle_compute()
    busy = g.busiest_compute()

    def telemetry(node: str, request_id: int, **fields: Any) -> bytes:
        base = dict(node_id=node, device="cpu", request_id=request_id, plan_version=1, rows=10, work=1e9, share=0.5,
                    compute_ms=40.0, transfer_ms=1.0, wait_ms=1.0, bytes_in=1000, bytes_out=1000)
        base.update(fields)
        return _encode(interfaces.make("NodeTelemetry", **base), "NodeTelemetry")

    def scheduler_value(key: str, value: str) -> Callable[[float], bool]:
        return lambda since: any(d.get(key) == value for d in g.diag_since("scheduler", since))

    def speed_not_finite(node: str) -> Callable[[float], bool]:
        # what taking the sample does: the node's speed estimate becomes NaN. Not a rising sample
        # count: an idle node's count also rises when real work reaches it.
        def seen(since: float) -> bool:
            return any(not math.isfinite(_float(d.get(f"{node}.speed_flops_per_ms", "0")))
                       or any(k.startswith("share.") and not math.isfinite(_float(v)) for k, v in d.items())
                       for d in g.diag_since("scheduler", since))
        return seen

    ahead = int((time.time() + 1800) * 1e6)  # half an hour ahead: inside the one-hour clock skew allowed
    nxt = g.latest_request_id() + 1
    return [
        Variant("request_id_max", "request id 2**64-1", True, ic.TELEMETRY_TOPIC, telemetry(busy, 2**64 - 1),
                ("scheduler",), "implausible request id", scheduler_value("newest_request", str(2**64 - 1)),
                "every later assignment would take effect at an impossible request"),
        Variant("nan_compute_ms", f"NaN compute time for {idle or 'an idle node (none)'}", True, ic.TELEMETRY_TOPIC,
                telemetry(idle or busy, nxt, compute_ms=math.nan), ("scheduler",), "implausible telemetry",
                speed_not_finite(idle or busy), "the scheduler would estimate a speed from NaN"),
        Variant("request_id_ahead", "a request id half an hour ahead of the clock (plausible)", False,
                ic.TELEMETRY_TOPIC, telemetry(busy, ahead), ("scheduler",), "",
                scheduler_value("newest_request", str(ahead)),
                "the scheduler's assignments take effect half an hour of requests ahead; the coordinator refuses "
                "them as implausible: adaptation stops until the scheduler restarts"),
    ]


def _taken_over(lines: Sequence[str]) -> list[str]:
    """The authorities to restart for ChaosGraph.takeovers() lines (coordinator first)."""
    names = []
    if any(not line.startswith("coordinator follows") for line in lines):
        names.append("coordinator")
    if any(line.startswith("coordinator follows") for line in lines):
        names.append("scheduler")
    return names


def _any_effect(effects: Any) -> bool | None:
    """True if any variant had an effect, None if one could not be observed, else False."""
    effects = list(effects)
    return True if any(e is True for e in effects) else (None if any(e is None for e in effects) else False)


def _with(msg: Any, **fields: Any) -> Any:
    import dataclasses

    return dataclasses.replace(msg, **fields)


def fuzz_topics(g: ChaosGraph) -> dict[str, str]:
    from kaitian_ros.nodes import inference_common as ic

    topics = {CAMERA_TOPIC: "Image", ic.chunk_topic(ic.COORDINATOR): "TensorChunk"}
    topics.update({ic.chunk_topic(n): "TensorChunk" for n in g.compute_names})
    topics.update({ic.PROFILES_TOPIC: "CostProfile", ic.TELEMETRY_TOPIC: "NodeTelemetry",
                   ic.ASSIGNMENT_TOPIC: "LoadAssignment", ic.PLAN_TOPIC: "LoadAssignment"})
    return topics


def fuzz_seeds(g: ChaosGraph) -> dict[str, tuple[str, bytes, tuple[str, ...]]]:
    """Per subscribed topic: (type, a valid message as the graph sends it, its subscribers), in
    the order fuzzed (the plan last: a fuzzed plan can take the compute nodes away from the
    real coordinator)."""
    import numpy as np
    import torch

    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.runtime import interfaces

    p = g.scenario.node("coordinator").parameters
    h, w, slab = int(p["input_height"]), int(p["input_width"]), int(p["slab_rows"])
    plan = g.latest_plan()
    version = int(plan.version) if plan is not None else 1
    # not the camera's frame_id nor a recent stamp: the probe must not take fuzzed frames for real ones
    stamp = interfaces.msg_class("Time")(sec=1, nanosec=0)
    image = interfaces.make("Image", header=interfaces.header("chaos_fuzz", stamp), height=h, width=w, encoding="rgb8",
                            step=w * 3, data=np.zeros(h * w * 3, np.uint8))
    seeds: dict[str, tuple[str, bytes, tuple[str, ...]]] = {
        CAMERA_TOPIC: ("Image", _encode(image, "Image"), ("coordinator",))}
    out_rows = torch.zeros(1, 512, 1, 7)
    seeds[ic.chunk_topic(ic.COORDINATOR)] = ("TensorChunk", _encode(ic.chunk_message(
        request_id=g.latest_request_id() + 1, plan_version=version, producer=g.compute_names[0],
        consumer=ic.COORDINATOR,
        segment=0, role=ic.ROLE_OUTPUT, row_offset=0, total_rows=7, rows=out_rows), "TensorChunk"), ("coordinator",))
    for n in g.compute_names:
        rows = torch.zeros(1, 3, slab, w, dtype=torch.uint8)
        seeds[ic.chunk_topic(n)] = ("TensorChunk", _encode(ic.chunk_message(
            request_id=g.latest_request_id() + 1, plan_version=version, producer=ic.COORDINATOR, consumer=n,
            segment=0, role=ic.ROLE_INPUT, row_offset=0, total_rows=h, rows=rows), "TensorChunk"), (n,))
    with g.rec.lock:
        profile = next(iter(g.rec.profiles.values()), None)
        telemetry = g.rec.telemetry_sample
    if profile is not None:
        seeds[ic.PROFILES_TOPIC] = ("CostProfile", _encode(profile, "CostProfile"), ("coordinator",))
    if telemetry is not None:
        seeds[ic.TELEMETRY_TOPIC] = ("NodeTelemetry", _encode(telemetry, "NodeTelemetry"), ("scheduler", "coordinator"))
    assignment = g.latest_assignment()
    if assignment is not None:
        seeds[ic.ASSIGNMENT_TOPIC] = ("LoadAssignment", _encode(assignment, "LoadAssignment"), ("coordinator",))
    if plan is not None:
        seeds[ic.PLAN_TOPIC] = ("LoadAssignment", _encode(plan, "LoadAssignment"), tuple(g.compute_names))
    return seeds


def _tbf_bytes(links: Any) -> dict[str, int]:
    """Bytes each end of the emulated link's tbf has sent so far (proof that traffic crosses it)."""
    import re

    out = {}
    for dev, text in links.qdisc_stats().items():
        m = re.search(r"Sent (\d+) bytes", text)
        if m:
            out[dev] = int(m.group(1))
    return out


def _plan_text(m: Any) -> str | None:
    if m is None:
        return None
    nodes = "/".join(f"{n} {float(s):.2f}" for n, s in zip(m.node_ids, m.shares))
    return f"v{int(m.version)} {m.strategy or 'stripes'} {nodes}"


def _plans(plans: Sequence[tuple[float, Any]], t0: float, limit: int = 12) -> list[str]:
    return [f"+{t - t0:.2f} s {_plan_text(m)}" for t, m in plans[:limit]]


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


# =========================================================================== the run
METRIC_KEYS = ("lost", "duplicated", "out_of_order", "recover_s", "peak_rss_delta_mb", "settled_rss_delta_mb",
               "forgery_effect")


def skipped(name: str, reason: str) -> dict[str, Any]:
    """A fault that could not run here: every metric null, with the reason."""
    out: dict[str, Any] = dict.fromkeys(METRIC_KEYS)
    out.update({"skipped": True, "reason": reason})
    out["targets"] = [t.__dict__ for t in cm.targets(cm.fault_kind(name), out)]
    return out


def security_status() -> str:
    """'' when this tree has the security option, else why the ``*_secure`` faults are null."""
    from kaitian_ros import cli

    return "" if hasattr(cli, "cmd_certs") else "security option not available"


def run_fault(run: Run, name: str, link_reason: str) -> dict[str, Any]:
    g = run.g
    if name == "kill_compute":
        return run.run(name, run.kill_compute)
    if name in ("kill_scheduler", "kill_coordinator"):
        return run.run(name, lambda: run.kill_authority(name.split("_", 1)[1]))
    if name == "kill_router":
        if g.child("router") is None:
            return skipped(name, "the router runs inside the launcher's own process (no router child to kill)")
        return run.run(name, run.kill_router)
    if name == "flood":
        return run.run(name, run.flood, prepare=run.flood_prepare)
    if name == "link_collapse":
        if g.links is None:
            return skipped(name, link_reason or "no emulated link")
        return run.run(name, run.link_collapse)
    if name.startswith("forge_"):
        kind = name.split("_")[1]
        return run.run(name, lambda: run.forge(kind), prepare=run.attackers)
    if name == "fuzz":
        return run.run(name, run.fuzz, prepare=run.attacker_for)
    raise ValueError(name)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False, text=True,
                              timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _series(g: ChaosGraph) -> dict[str, Any]:
    """Latency and RSS over the run (seconds since the graph started), for the plot and JSON."""
    _, answers = g.rec.snapshot()
    lat = [[round(a.t - g.t0, 2), None if a.latency_ms is None else round(a.latency_ms, 1), a.complete]
           for a in answers]
    rss: dict[str, list[list[float]]] = {}
    for node, samples in g.rss_samples().items():
        last = -math.inf
        for t, mb in samples:  # one a second is plenty for the record
            if t - last >= 1.0:
                rss.setdefault(node, []).append([round(t - g.t0, 1), round(mb, 1)])
                last = t
    return {"answers": lat, "rss_mb": rss}


def plot(summary: dict[str, Any], path: Path) -> None:
    """Latency and RSS over time per graph (the plain one, and the secured one when it ran),
    each fault's window shaded (dark: the fault; light: its observation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(title, series, {n: f for n, f in summary["faults"].items() if (f.get("graph") == "secure") == secure})
             for title, series, secure in (("", summary["series"], False),
                                           ("security option on: ", summary.get("series_secure"), True))
             if series and series["answers"]]
    if not parts:
        return
    fig, axes = plt.subplots(2 * len(parts), 1, figsize=(13, 7.5 * len(parts)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] * len(parts)})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (title, series, faults) in enumerate(parts):
        ax, ax2 = axes[2 * k, 0], axes[2 * k + 1, 0]
        ax2.sharex(ax)
        ok = [(t, ms) for t, ms, complete in series["answers"] if complete and ms is not None]
        bad = [t for t, _, complete in series["answers"] if not complete]
        if ok:
            ts, ms = zip(*ok)
            ax.plot(ts, ms, "k.", ms=2.5, label="complete frame: end-to-end latency")
            top = max(ms) * 1.6  # log scale: a collapsed link's seconds and the usual tens of ms both show
            ax.set_yscale("log")
            ax.set_ylim(min(ms) * 0.8, top)
            for t in bad:
                ax.plot([t], [top / 1.25], "rx", ms=5)
            if bad:
                ax.plot([], [], "rx", label="incomplete (coordinator timeout)")
        for j, (name, f) in enumerate(faults.items()):
            w = f.get("window")
            if not w:
                continue
            c = colours[j % len(colours)]
            for a in (ax, ax2):
                a.axvspan(w["start"], max(w["end"], w["start"] + 0.3), color=c, alpha=0.35)
                a.axvspan(max(w["end"], w["start"] + 0.3), w["until"], color=c, alpha=0.08)
            ax.text(w["start"], ax.get_ylim()[1] / 1.1, name, rotation=90, fontsize=7, va="top", ha="right")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{title}{summary['setup']['graph']}", loc="left", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        for node, pts in sorted(series["rss_mb"].items()):
            ts, mb = zip(*pts)
            ax2.plot(ts, mb, lw=1, label=node)
        ax2.set_ylabel("RSS (MB)")
        ax2.set_xlabel("seconds since the graph started (fault: dark; observation: light)")
        ax2.legend(fontsize=7, loc="upper left", ncol=4)
    setup = summary["setup"]
    fig.suptitle(f"kaitian bench chaos{' --quick' if setup['quick'] else ''}: {setup['graph']} "
                 f"(EMULATED device speeds), "
                 f"commit {setup['commit']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.1f}"
    return str(x)


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nchaos ({summary['setup']['graph']}; EMULATED device speeds)")
    print(f"{'fault':<25}{'lost':>5}{'(drop)':>7}{'dup':>5}{'ooo':>5}{'recover_s':>10}{'peak MB':>9}"
          f"{'settled MB':>11}{'forged':>8}   target: value (met)")
    for name, f in summary["faults"].items():
        dropped = (f.get("frames") or {}).get("dropped_by_design")
        head = (f"{name:<25}{_fmt(f['lost']):>5}{'(' + _fmt(dropped) + ')':>7}{_fmt(f['duplicated']):>5}"
                f"{_fmt(f['out_of_order']):>5}"
                f"{_fmt(f['recover_s']):>10}{_fmt(f['peak_rss_delta_mb']):>9}{_fmt(f['settled_rss_delta_mb']):>11}"
                f"{_fmt(f['forgery_effect']):>8}   ")
        parts = [f"{t['what']}: {_fmt(t['value'])} ({'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'})"
                 for t in f["targets"]]
        print(head + ("; ".join(parts)))


def print_one(name: str, f: dict[str, Any]) -> None:
    if f.get("skipped"):
        print(f"  {name}: null ({f['reason']})", flush=True)
        return
    met = ", ".join(f"{t['what']}: {'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'}"
                    for t in f["targets"])
    print(f"  {name}: lost {f['lost']} ({f['frames']['dropped_by_design']} of them dropped by design), "
          f"duplicated {f['duplicated']}, out of order {f['out_of_order']}, "
          f"recover {_fmt(f['recover_s'])} s (first complete {_fmt(f['first_complete_s'])} s), output gap "
          f"{_fmt(f['output_gap_s'])} s, peak RSS +{_fmt(f['peak_rss_delta_mb'])} MB ({f['peak_rss_node']}), settled "
          f"+{_fmt(f['settled_rss_delta_mb'])} MB, forgery effect {_fmt(f['forgery_effect'])} | {met}", flush=True)


def run_graph(s: Settings, names: Sequence[str], results: dict[str, Any], *, links: Any = None,
              link_text: str = "", secure_dir: str | None = None, echo: bool = False) -> tuple[dict[str, Any], str]:
    """Start a graph (with the security option when ``secure_dir``), run ``names`` on it one
    after another into ``results``; (what to record about the graph, why it failed or "")."""
    g = ChaosGraph(s, links=links, echo=echo,
                   overrides=[f"security:={secure_dir}"] if secure_dir else [])
    if secure_dir:  # the probe joins as a member (role node), like any tool
        g._setenv("KAITIAN_SECURITY", secure_dir)
        g._setenv("KAITIAN_SECURITY_ROLE", "node")
    run = Run(g, s, secure_dir)
    info: dict[str, Any] = {"security": bool(secure_dir), "startup_s": None, "baseline_latency_ms": None,
                            "scenario": g.scenario}
    failure = ""
    try:
        g.start()
        info["startup_s"] = _r(g.wait_serving(180.0))
        time.sleep(s.warmup_s)  # the planner's first rounds: the plan settles
        now = time.monotonic()
        lat = g.latencies(now - s.warmup_s, now)
        run.baseline_ms = statistics.median(lat) if lat else None
        info["baseline_latency_ms"] = _r(run.baseline_ms)
        info["plan_at_start"] = _plan_text(g.latest_plan())
        print(f"  graph{' (security on)' if secure_dir else ''} serving after {info['startup_s']} s; baseline "
              f"end-to-end latency {_fmt(run.baseline_ms)} ms, plan {info['plan_at_start']}", flush=True)
        for name in names:
            print(f"  {name} ...", flush=True)
            try:
                results[name] = run_fault(run, name, link_text)
            except GraphFailed as exc:
                failure = str(exc).splitlines()[0]
                results[name] = skipped(name, failure)
                break
            if secure_dir:
                results[name]["graph"] = "secure"
            print_one(name, results[name])
    except (GraphFailed, RuntimeError) as exc:
        failure = failure or " ".join(str(exc).split())[:400]
    finally:
        info["series"] = _series(g) if g.launcher is not None else {"answers": [], "rss_mb": {}}
        run.close_attackers()
        g.close()
    return info, failure


def main(argv: list[str]) -> int:
    p = BenchArgumentParser(
        prog="kaitian bench chaos",
        description="Kill -9 and respawn, flood, link collapse, forged control messages and fuzz, one after another, "
                    f"on the running {SCENARIO} graph (EMULATED device speeds); JSON + PNG (docs/chaos.md).")
    p.add_argument("--json", default=str(DEFAULT_JSON), help=f"result JSON (default {DEFAULT_JSON}; PNG next to it)")
    p.add_argument("--quick", action="store_true",
                   help="shorter windows, an 8 s flood and collapse, 1000 fuzzed messages per topic (a few minutes)")
    p.add_argument("--faults", default="all", help="comma-separated subset of " + ",".join(FAULTS + SECURE_FAULTS))
    p.add_argument("--settle", type=float, help="seconds observed after each fault; the settled RSS is read then "
                                                "(default 30, quick 10)")
    p.add_argument("--flood-seconds", type=float, help="flood duration (default 20, quick 8)")
    p.add_argument("--flood-rate", type=float, help="unsolicited chunks per second (default 1000)")
    p.add_argument("--fuzz-count", type=int, help="fuzzed messages per subscribed topic (default 10000, quick 1000)")
    p.add_argument("--link-mbit", type=float, help=f"{LINK_NODE}'s emulated link (default 1000 Mbit/s)")
    p.add_argument("--collapse-mbit", type=float, help="the link's rate during the collapse (default 1 Mbit/s)")
    p.add_argument("--collapse-seconds", type=float, help="collapse duration (default 20, quick 8)")
    p.add_argument("--echo", action="store_true", help="print the nodes' output")
    args = p.parse_args(argv)
    names = FAULTS + SECURE_FAULTS if args.faults == "all" else tuple(x for x in args.faults.split(",") if x)
    bad = [x for x in names if x not in FAULTS + SECURE_FAULTS]
    if bad or not names:
        p.error(f"unknown faults {bad}; choose from {','.join(FAULTS + SECURE_FAULTS)}" if bad else "--faults is empty")
    for flag in ("settle", "flood_seconds", "flood_rate", "fuzz_count", "link_mbit", "collapse_mbit",
                 "collapse_seconds"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.settle is not None and args.settle < ANSWER_S + 2:
        p.error(f"--settle must be at least {ANSWER_S + 2:g} s (a frame is unanswered after {ANSWER_S:g} s)")
    s = Settings.make(args.quick, settle_s=args.settle, flood_s=args.flood_seconds, flood_rate=args.flood_rate,
                      fuzz_count=args.fuzz_count, link_mbit=args.link_mbit, collapse_mbit=args.collapse_mbit,
                      collapse_s=args.collapse_seconds)
    json_path = Path(args.json)
    order = [n for n in FAULTS + SECURE_FAULTS if n in names]
    print(f"kaitian bench chaos{' --quick' if s.quick else ''}: {SCENARIO} (EMULATED device speeds), faults "
          f"{', '.join(order)}", flush=True)

    from kaitian_ros.bench import netns

    links, link_text = None, ""
    if "link_collapse" in order:
        ok, why = netns.available()
        if ok:
            links = netns.Links(1, s.link_mbit, **LINK_NAMES)
            try:
                links.open()
                link_text = (f"{LINK_NODE} in network namespace {links.netns(0)}, veth + tbf {s.link_mbit:g} "
                             f"Mbit/s both ways (no shared memory for it); collapse to {s.collapse_mbit:g} Mbit/s")
            except netns.LinkSetupError as exc:
                links, why = None, str(exc)
        if links is None:
            link_text = f"no emulated link: {why}"
    results: dict[str, Any] = {}
    t_all = time.monotonic()
    plain = [n for n in order if n not in SECURE_FAULTS]
    secure_names = [n for n in order if n in SECURE_FAULTS]
    graphs: dict[str, Any] = {}
    failure = ""
    if plain:
        graphs["plain"], failure = run_graph(s, plain, results, links=links, link_text=link_text, echo=args.echo)
    if links is not None:
        links.close()
    secure = security_status() if secure_names else ""
    if secure_names and not secure and not failure:
        with tempfile.TemporaryDirectory(prefix="kaitian_chaos_certs_") as certs:
            made = subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "certs", "create", certs],
                                  capture_output=True, check=False, text=True)
            if made.returncode != 0:
                secure = f"kaitian certs create failed: {(made.stderr or made.stdout).strip()[-300:]}"
            else:
                print("  a second graph with the security option (certificates from kaitian certs create)", flush=True)
                graphs["secure"], failure = run_graph(s, secure_names, results, secure_dir=certs, echo=args.echo)
    for name in order:
        if name not in results:
            results[name] = skipped(name, secure if name in SECURE_FAULTS and secure else failure or "not run")
    scenario = graphs["plain"]["scenario"] if "plain" in graphs else None
    from kaitian_ros.scenario import load_scenario

    scenario = load_scenario(SCENARIO)
    summary = {
        "setup": {
            "graph": SCENARIO, "emulated": True,
            "nodes": {n.name: {"executable": n.executable,
                               **({"emulated_slowdown": n.parameters.get("emulated_slowdown")}
                                  if n.executable == "compute" else {})} for n in scenario.nodes},
            "camera_hz": scenario.node("image_source").parameters.get("rate_hz"),
            "quick": s.quick, "settings": s.__dict__, "answer_s": ANSWER_S, "lead_s": LEAD_S,
            "link": link_text or "not used", "security": secure or "available",
            "graphs": {k: {kk: v for kk, v in g.items() if kk not in ("series", "scenario")}
                       for k, g in graphs.items()},
            "baseline_latency_ms": graphs["plain"]["baseline_latency_ms"] if "plain" in graphs else None,
            "cpus": os.cpu_count(), "commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": round(time.monotonic() - t_all, 1), "failure": failure or None},
        "faults": {n: results[n] for n in order},
        "series": graphs["plain"]["series"] if "plain" in graphs else {"answers": [], "rss_mb": {}},
        "series_secure": graphs["secure"]["series"] if "secure" in graphs else None,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1, default=str))
    png = json_path.with_suffix(".png")
    plot(summary, png)
    print_table(summary)
    print(f"\nwrote {json_path} and {png}")
    return 1 if failure else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
