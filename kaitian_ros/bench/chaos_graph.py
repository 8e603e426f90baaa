"""The graph under test of ``kaitian bench chaos``: the launcher with its output timed, the probe
node's recording of frames, answers, plans and ``/diagnostics``, the nodes' memory, and the
queries the faults ask of them."""

from __future__ import annotations

import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kaitian_ros.bench import chaos_metrics as cm
from kaitian_ros.bench.chaos_settings import (
    CAMERA_TOPIC,
    LINK_NODE,
    MEM_FLOOR_MB,
    READY_MARK,
    RSS_PERIOD_S,
    SCENARIO,
    GraphFailed,
    Settings,
)
from kaitian_ros.processes import CapturedOutput
from kaitian_ros.runtime import interfaces


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

    def on_camera(self, msg: Any) -> None:
        t = time.monotonic()
        if msg.header.frame_id != self.frame_id:
            return
        stamp = interfaces.stamp_key(msg.header.stamp)
        with self.lock:
            if stamp not in self.frame_t:
                self.frame_t[stamp] = t
                self.frames.append(cm.Frame(stamp, t))

    def on_fused(self, msg: Any) -> None:
        t = time.monotonic()
        if msg.header.frame_id != self.frame_id:
            return
        stamp = interfaces.stamp_key(msg.header.stamp)
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
        from kaitian_ros.nodes import protocol as proto
        from kaitian_ros.runtime.api import QoS
        from kaitian_ros.runtime.diagnostics import DIAGNOSTICS_TOPIC
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.node_args import NodeArgs

        host, prefix, env = "127.0.0.1", {}, {}
        if self.links is not None:
            # everyone listens where the namespace reaches it; the node inside without shared
            # memory, so that its bytes really cross the emulated link
            host = self.links.root_ip()
            self.setenv("KAITIAN_LISTEN", f"tcp/{host}:0")  # this process's sessions and every child's
            prefix[LINK_NODE] = self.links.exec_prefix(0)
            env[LINK_NODE] = {"KAITIAN_LISTEN": f"tcp/{self.links.device_ip(0)}:0", "KAITIAN_SHM": "0"}
        self.launcher = start_on_free_port(self.scenario, out=self.out, host=host, node_prefix=prefix, node_env=env)
        self.endpoint = self.launcher.router_endpoint
        threading.Thread(target=self._supervise, daemon=True).start()
        self.rt = EmbeddedRuntime(NodeArgs("chaos_probe"), router=self.endpoint)
        r = self.rec
        self.rt.create_subscription(CAMERA_TOPIC, "Image", r.on_camera, QoS.BEST_EFFORT)
        self.rt.create_subscription(proto.FUSED_TOPIC, "FusedOutput", r.on_fused)
        self.rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", r.on_plan, QoS.LATCHED)
        self.rt.create_subscription(proto.ASSIGNMENT_TOPIC, "LoadAssignment", r.on_assignment, QoS.LATCHED)
        self.rt.create_subscription(proto.PROFILES_TOPIC, "CostProfile", r.on_profile, QoS.LATCHED)
        self.rt.create_subscription(proto.TELEMETRY_TOPIC, "NodeTelemetry", r.on_telemetry)
        self.rt.create_subscription(DIAGNOSTICS_TOPIC, "DiagnosticArray", r.on_diag)
        self._spin = threading.Thread(target=self.rt.spin, daemon=True)
        self._spin.start()
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def setenv(self, key: str, value: str) -> None:
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
        return [(t, m) for t, m in msgs if not real or incarnation_hex(m.incarnation) in real]

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


def diag_float(text: str) -> float:
    """A /diagnostics value as a float ("nan" is NaN; unreadable text is 0, not an effect)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return 0.0


def incarnation_hex(incarnation: int) -> str:
    return f"{int(incarnation):016x}"
