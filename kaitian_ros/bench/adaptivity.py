"""``kaitian bench adaptivity``: how fast each share policy follows a changing device, in one run
per policy.

Real processes of the product on one host (a Zenoh router in this process, ``coordinator``,
``scheduler`` and three ``compute`` nodes started by the embedded launcher); the bench driver
is the camera: it publishes frames as a steady closed-loop stream (the next frame as soon as
fewer than ``window`` are unanswered) and records every ``FusedOutput``. Device speeds are
EMULATED (``emulated_slowdown``: a node sleeps (s-1)x each real compute). The timeline, the
same for every policy, after a calibration phase on equal static shares that normalises the run
(the coordinator ignores the scheduler until the policy's ``start`` phase):

* ``R1``  ``compute_1`` slows 3x (``emulated_slowdown`` set live, as ``kaitian param set`` does),
* ``R2``  it recovers (back to its start slowdown),
* ``R3``  ``compute_2`` is killed (SIGKILL): the coordinator drops it after ``dead_after_s``.

Phases are bounded by the first request sent after the change took effect (the parameter set
returned; for the kill, the first request answered after it). A slowed node that was not doing
work at the time changes nothing, and the phase then re-converges at once. Metrics are defined
in ``docs/benchmarks-adaptivity.md``.

:class:`AdaptivityGraph` is the harness (also used by ``test/test_scheduler_e2e.py``).
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.bench import BenchArgumentParser

DEFAULT_JSON = Path("bench/results/adaptivity.json")
CAMERA_TOPIC = "/camera/image_raw"
POLICIES = ("adaptive", "static", "profile_once")
RECONVERGE_FACTOR = 1.10
REFERENCE_ANSWERS = 10  # answers per fixed plan in the reference run (after two warm-up answers)
ROLLING = 3  # requests in the rolling median that decides "reconverged"


class _Log:
    """(monotonic time, message) pairs in arrival order."""

    def __init__(self) -> None:
        self.items: list[tuple[float, Any]] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def __call__(self, msg: Any) -> None:
        with self.changed:
            self.items.append((time.monotonic(), msg))
            self.changed.notify_all()

    def snapshot(self) -> list[tuple[float, Any]]:
        with self.lock:
            return list(self.items)

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)


def scenario_config(*, model: str = "resnet18", height: int = 128, width: int = 128,
                    num_classes: int = 10, slowdowns: Sequence[float] = (1.0, 1.0, 1.0),
                    policy: str = "adaptive", static_shares: Sequence[float] | None = None,
                    slab_rows: int = 8, dead_after_s: float = 1.0, max_in_flight: int = 2,
                    scheduler: dict[str, Any] | None = None,
                    coordinator: dict[str, Any] | None = None) -> dict[str, Any]:
    """hetero_inference without image_source (the driver is the camera), in parameter-file form."""
    model_params = {"model": model, "input_height": height, "input_width": width, "input_channels": 3,
                    "num_classes": num_classes, "seed": 0, "weights": "", "slab_rows": slab_rows}
    names = [f"compute_{i}" for i in range(len(slowdowns))]
    shares = [float(s) for s in (static_shares or [1.0] * len(names))]
    cfg: dict[str, Any] = {
        "coordinator": {"ros__parameters": {
            "executable": "coordinator", "input_topic": CAMERA_TOPIC, "compute_nodes": names,
            "static_shares": shares, "use_scheduler": True, "max_in_flight": max_in_flight,
            "request_timeout_s": 30.0, "dead_after_s": dead_after_s, **model_params, **(coordinator or {})}},
        "scheduler": {"ros__parameters": {
            "executable": "scheduler", "compute_nodes": names, "policy": policy, "static_shares": shares,
            "ewma_alpha": 0.3, "min_gain": 0.1, "min_interval_s": 0.5, "dead_after_s": dead_after_s,
            "change_ratio": 1.6, "change_samples": 2, "warmup_requests": 3, "decide_period_s": 0.1,
            "lead_requests": 2, **(scheduler or {})}},
    }
    for name, slowdown in zip(names, slowdowns):
        cfg[name] = {"ros__parameters": {"executable": "compute", "device": "cpu", "threads": 1,
                                         "emulated_slowdown": float(slowdown), **model_params}}
    return cfg


class AdaptivityGraph:
    """coordinator + scheduler + compute nodes as real processes, the driver in this process."""

    def __init__(self, config: dict[str, Any], *, echo: bool = False,
                 frames: Callable[[int], Any] | None = None) -> None:
        """``frames(i)``: the i-th camera Image to publish, with a stamp of its own (default:
        random rgb8 pixels of the model's input size)."""
        from kaitian_ros.launcher import CapturedOutput, start_on_free_port
        from kaitian_ros.nodes import inference_common as ic
        from kaitian_ros.runtime.api import QoS
        from kaitian_ros.runtime.diagnostics import DIAGNOSTICS_TOPIC
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.node_args import NodeArgs
        from kaitian_ros.scenario import load_scenario

        self.config = config
        self.compute_names = [n for n in config if n.startswith("compute_")]
        p = config["coordinator"]["ros__parameters"]
        self.input_shape = (p["input_channels"], p["input_height"], p["input_width"])
        self._tmp = tempfile.TemporaryDirectory(prefix="kaitian_adaptivity_")
        path = Path(self._tmp.name) / "adaptivity.yaml"
        import yaml

        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.scenario = load_scenario(str(path))
        self.out = CapturedOutput(echo)
        self.launcher: Any = None
        self.rt: Any = None
        self.extra: list[subprocess.Popen] = []
        self.launcher = start_on_free_port(self.scenario, out=self.out)
        self.endpoint = self.launcher.router_endpoint
        try:
            self.rt = EmbeddedRuntime(NodeArgs("adaptivity_driver"), router=self.endpoint)
            self.fused, self.plans, self.assignments, self.telemetry = _Log(), _Log(), _Log(), _Log()
            self.rt.create_subscription(ic.FUSED_TOPIC, "FusedOutput", self.fused)
            self.rt.create_subscription(ic.PLAN_TOPIC, "LoadAssignment", self.plans, QoS.LATCHED)
            self.rt.create_subscription(ic.ASSIGNMENT_TOPIC, "LoadAssignment", self.assignments, QoS.LATCHED)
            self.rt.create_subscription(ic.TELEMETRY_TOPIC, "NodeTelemetry", self.telemetry)
            self.coordinator_values: dict[str, str] = {}  # the coordinator's latest /diagnostics values
            self.rt.create_subscription(DIAGNOSTICS_TOPIC, "DiagnosticArray", self._on_diagnostics)
            self.camera = self.rt.create_publisher(CAMERA_TOPIC, "Image", QoS.BEST_EFFORT)
            self._spin = threading.Thread(target=self.rt.spin, daemon=True)
            self._spin.start()
        except BaseException:
            self.close()
            raise
        self.sent: dict[tuple[int, int], float] = {}  # image stamp -> publish time (monotonic)
        self._frame_index = 0
        self._frames = frames or self._random_frame
        self._lock = threading.Lock()

    def _on_diagnostics(self, array: Any) -> None:
        for status in array.status:
            if status.name.removeprefix("kaitian: ") == "coordinator":
                self.coordinator_values = {kv.key: kv.value for kv in status.values}

    @property
    def planner_state(self) -> str:
        """The coordinator's planner process: starting, ready or lost (its /diagnostics)."""
        return self.coordinator_values.get("planner", "")

    # --- lifecycle -----------------------------------------------------------------------
    def pid(self, name: str) -> int:
        for child in reversed(self.launcher.children):
            if child.spec.name == name:
                return child.process.pid
        raise KeyError(name)

    def dead_children(self) -> list[str]:
        names = {c.spec.name: c.process.poll() for c in self.launcher.children}  # latest per name
        return [n for n, code in names.items() if code is not None]

    def kill(self, name: str) -> float:
        """SIGKILL a node's process (no goodbye); returns the monotonic time of the kill."""
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        for child in self.launcher.children:
            if child.process.pid == pid:
                child.process.wait(timeout=10)
        return t

    def restart(self, name: str) -> int:
        """Start a node again with the scenario's parameters (as the launcher did); returns its pid."""
        from kaitian_ros.launcher import Child

        spec = self.scenario.node(name)
        process, reader = self.launcher.spawn(spec)
        self.launcher.children.append(Child(spec, process, reader))  # stop() ends it with the rest
        return process.pid

    def set_param(self, node: str, name: str, value: Any) -> None:
        from kaitian_ros.runtime.graph_client import GraphClient

        with GraphClient(self.endpoint) as client:
            ok, reason = client.set_parameters(node, {name: value})
        if not ok:
            raise RuntimeError(f"param set {node} {name}={value} refused: {reason}")

    def close(self) -> None:
        if self.rt is not None:
            self.rt.shutdown()
            self._spin.join(timeout=5.0) if hasattr(self, "_spin") else None
            self.rt.close()
            self.rt = None
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
        self._tmp.cleanup()

    def __enter__(self) -> AdaptivityGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- observation ---------------------------------------------------------------------
    def latest_plan(self) -> Any:
        plans = [m for _, m in self.plans.snapshot()]
        return max(plans, key=lambda m: m.version) if plans else None

    def plan_table(self) -> dict[int, Any]:
        return {int(m.version): m for _, m in self.plans.snapshot()}

    def latest_assignment(self) -> Any:
        msgs = [m for _, m in self.assignments.snapshot()]
        return max(msgs, key=lambda m: m.version) if msgs else None

    def wait_ready(self, timeout_s: float = 60.0, nodes: Sequence[str] | None = None) -> Any:
        """Until every compute node has sent a heartbeat, the coordinator has a plan and its
        planner process is ready, and the scheduler's latest proposal names every node. (The
        coordinator adopts a proposal only at its ``effective_from_request``, so before the first
        frame its plan may still lack nodes that joined late. Until its planner process has built
        its model graph - seconds of CPU on this machine - the coordinator plans on its executor
        while that build competes with the compute nodes for the cores: the benchmark measures
        the running product, not its start-up.)"""
        want = tuple(nodes if nodes is not None else self.compute_names)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead_children()
            if dead:
                raise RuntimeError(f"node(s) {dead} exited during startup:\n{self.out.text(60)}")
            plan, proposal = self.latest_plan(), self.latest_assignment()
            beats = {m.node_id for _, m in self.telemetry.snapshot()}
            if self.planner_state == "lost":
                raise RuntimeError(f"the coordinator's planner process died during startup:\n{self.out.text(60)}")
            if plan is not None and proposal is not None and tuple(proposal.node_ids) == want \
                    and set(want) <= beats and self.planner_state == "ready":
                return proposal
            time.sleep(0.1)
        raise RuntimeError(f"no proposal naming {list(want)} within {timeout_s:.0f} s:\n{self.out.text(60)}")

    # --- driving -------------------------------------------------------------------------
    def _frame(self) -> Any:
        i = self._frame_index
        self._frame_index += 1
        return self._frames(i)

    def _random_frame(self, i: int) -> Any:
        from kaitian_ros.runtime import interfaces

        _, h, w = self.input_shape
        rng = np.random.default_rng(i)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        stamp = interfaces.msg_class("Time")(sec=1_000 + i, nanosec=7)
        return interfaces.make("Image", header=interfaces.header(f"frame{i}", stamp), height=h, width=w,
                               encoding="rgb8", is_bigendian=0, step=w * 3, data=pixels.reshape(-1))

    def answered(self) -> int:
        return len(self.fused)

    def drive(self, answers: int | None = None, *, until: Callable[[], bool] | None = None, window: int = 1,
              period_s: float = 0.0, timeout_s: float = 120.0,
              events: Sequence[tuple[int, Callable[[], None]]] = (), resend_after_s: float = 10.0) -> None:
        """Publish frames until ``answers`` more FusedOutputs arrived (or ``until()`` is true): one
        every ``period_s`` at most, never more than ``window`` unanswered (so the coordinator never
        drops one as busy). ``events`` (k, fn): run fn on a thread once k answers have arrived
        (counted from now).

        A frame lost before the coordinator (best-effort camera topic) gets no request id, so it
        cannot cause a missing id; after ``resend_after_s`` without its answer it stops counting."""
        start = self.answered()
        pending = sorted(events, key=lambda e: e[0])
        threads: list[threading.Thread] = []
        deadline = time.monotonic() + timeout_s
        outstanding: dict[tuple[int, int], float] = {}
        answered_stamps: set[tuple[int, int]] = set()
        seen = 0
        last_send = 0.0
        while True:
            now = time.monotonic()
            snap = self.fused.snapshot()
            for _, f in snap[seen:]:
                answered_stamps.add((int(f.header.stamp.sec), int(f.header.stamp.nanosec)))
            seen = len(snap)
            done = len(snap) - start
            while pending and pending[0][0] <= done:
                _, fn = pending.pop(0)
                t = threading.Thread(target=fn, daemon=True)
                t.start()
                threads.append(t)
            if (answers is not None and done >= answers) or (until is not None and until()):
                break
            if now > deadline:
                raise TimeoutError(f"{done} answers ({answers} wanted) after {timeout_s:.0f} s:\n{self.out.text(40)}")
            for key in [k for k, t in outstanding.items() if k in answered_stamps or now - t > resend_after_s]:
                del outstanding[key]
            if len(outstanding) < window and now - last_send >= period_s:
                msg = self._frame()
                key = (int(msg.header.stamp.sec), int(msg.header.stamp.nanosec))
                self.camera.publish(msg)
                last_send = now
                outstanding[key] = now
                self.sent[key] = now
                continue
            with self.fused.changed:
                self.fused.changed.wait(timeout=0.005)
        for t in threads:
            t.join(timeout=30.0)

    # --- results -------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """One dict per FusedOutput (arrival order): request id, plan version, latency, shares."""
        plans = self.plan_table()
        out = []
        for t, f in self.fused.snapshot():
            plan = plans.get(int(f.plan_version))
            shares = dict(zip(plan.node_ids, (float(s) for s in plan.shares))) if plan is not None else {}
            out.append({"request_id": int(f.request_id), "plan_version": int(f.plan_version),
                        "complete": bool(f.complete), "status": f.status, "latency_ms": float(f.latency_ms),
                        "node_ids": list(f.node_ids), "node_rows": [int(r) for r in f.node_rows],
                        "shares": shares, "arrived_s": t,
                        "sent_s": self.sent.get((int(f.header.stamp.sec), int(f.header.stamp.nanosec)))})
        return out

    def first_request_sent_after(self, t: float) -> int | None:
        """The first request id whose frame was sent at or after ``t`` (time.monotonic())."""
        ids = [r["request_id"] for r in self.records() if r["sent_s"] is not None and r["sent_s"] >= t]
        return min(ids) if ids else None

    def first_request_with_slowdown(self, node: str, slowdown: float, after_request: int = 0) -> int | None:
        """The first request id that ``node`` served with ``emulated_slowdown == slowdown``."""
        ids = [int(m.request_id) for _, m in self.telemetry.snapshot()
               if m.node_id == node and int(m.request_id) > after_request
               and abs(float(m.emulated_slowdown) - slowdown) < 1e-9]
        return min(ids) if ids else None


def check_requests(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every request id from the first observed to the last has exactly one complete answer."""
    ids = [r["request_id"] for r in records]
    if not ids:
        return {"first": None, "last": None, "missing": [], "duplicates": [], "incomplete": [], "lost": 0}
    first, last = min(ids), max(ids)
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    missing = [i for i in range(first, last + 1) if i not in counts]
    duplicates = sorted(i for i, c in counts.items() if c > 1)
    incomplete = sorted({r["request_id"] for r in records if not r["complete"]})
    return {"first": first, "last": last, "missing": missing, "duplicates": duplicates,
            "incomplete": incomplete, "lost": len(missing) + len(incomplete)}


# =========================================================================== the benchmark
@dataclass
class Timeline:
    phase: int   # answers per phase, counted from the phase's first request
    warm: int    # answers before calibration (every node has computed a few requests)
    calibration: int  # answers with equal static shares, the same for every policy
    slow_node: str = "compute_1"
    kill_node: str = "compute_2"
    slow_factor: float = 3.0


@dataclass
class PolicyRun:
    policy: str
    records: list[dict[str, Any]]
    boundaries: dict[str, int]  # phase name -> first request id of the phase
    kill_detect_s: float | None
    startup_s: float
    lost: dict[str, Any]
    log_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


PHASES = ("calibration", "start", "slowed", "recovered", "killed")
EVENT_PHASES = PHASES[2:]  # the phases that start with an event to reconverge from


def run_policy(policy: str, timeline: Timeline, *, model: str, size: int, slowdowns: Sequence[float],
               dead_after_s: float, window: int, echo: bool = False) -> PolicyRun:
    """One launch, one policy: warm-up and calibration on equal static shares with the scheduler
    ignored, then the policy's start phase, then slow / recover / kill, each phase
    ``timeline.phase`` answers long counted from its first request."""
    static = [1.0 / s for s in slowdowns]  # static baseline: shares tuned to the START speeds
    # The coordinator starts on equal static shares, scheduler ignored: the calibration phase
    # measures this run's machine speed with the same plan for every policy (the normaliser).
    # Calibration runs row stripes for every policy; at the start phase ``adaptive`` becomes
    # the product as a user runs it (the planner free to choose any strategy and shares), the
    # baselines stay share policies over row stripes.
    cfg = scenario_config(model=model, height=size, width=size, slowdowns=slowdowns, policy=policy,
                          static_shares=static, dead_after_s=dead_after_s,
                          coordinator={"use_scheduler": False, "static_shares": [1.0] * len(slowdowns),
                                       "strategy": "stripes"})
    t0 = time.monotonic()
    with AdaptivityGraph(cfg, echo=echo) as g:
        g.wait_ready(timeout_s=120.0)
        startup = time.monotonic() - t0
        base = slowdowns[g.compute_names.index(timeline.slow_node)]
        slowed = base * timeline.slow_factor
        kill_at: list[float] = []
        bounds: dict[str, int] = {}

        def newest() -> int:
            snap = g.fused.snapshot()
            return max((int(m.request_id) for _, m in snap), default=0)

        def after_kill() -> int | None:
            # the first request answered after the kill: the one in flight at the kill belongs to it
            ids = [int(m.request_id) for t, m in g.fused.snapshot() if kill_at and t >= kill_at[0]]
            return min(ids) if ids else None

        def phase(name: str, fire: Callable[[], None], first: Callable[[], int | None]) -> None:
            def done() -> bool:
                r = first()
                if r is None:
                    return False
                bounds[name] = r
                return newest() >= r + timeline.phase - 1
            g.drive(until=done, window=window, timeout_s=300.0, events=[(0, fire)])

        g.drive(timeline.warm, window=window, timeout_s=300.0)
        bounds["calibration"] = newest() + 1
        g.drive(timeline.calibration, window=window, timeout_s=300.0)
        bounds["start"] = newest() + 1
        if policy == "adaptive":
            g.set_param("/coordinator", "strategy", "auto")
        g.set_param("/coordinator", "use_scheduler", True)
        g.drive(timeline.phase, window=window, timeout_s=300.0)
        changed: dict[str, float] = {}

        def set_slowdown(name: str, value: float) -> None:
            g.set_param(f"/{timeline.slow_node}", "emulated_slowdown", value)
            changed[name] = time.monotonic()  # in effect: the node applied it before answering

        def sent_after(name: str) -> int | None:
            return g.first_request_sent_after(changed[name]) if name in changed else None

        phase("slowed", lambda: set_slowdown("slowed", slowed), lambda: sent_after("slowed"))
        phase("recovered", lambda: set_slowdown("recovered", base), lambda: sent_after("recovered"))
        phase("killed", lambda: kill_at.append(g.kill(timeline.kill_node)), after_kill)
        kill_detect = None
        for t, m in g.plans.snapshot():
            if t >= kill_at[0] and timeline.kill_node not in m.node_ids:
                kill_detect = t - kill_at[0]
                break
        records = g.records()
        return PolicyRun(policy, records, bounds, kill_detect, startup, check_requests(records), g.out.text(30))


def reference_plans(names: Sequence[str], slowdowns: Sequence[float]) -> list[tuple[str, str, list[float]]]:
    """The fixed plans a user who knows the device speeds could pick: the whole trunk on each
    alive node, and row stripes with shares by speed (1/slowdown) over the alive nodes. A dead
    node has slowdown inf. (label, coordinator strategy, static_shares)"""
    out = []
    for i, n in enumerate(names):
        if math.isfinite(slowdowns[i]):
            out.append((f"single {n}", "single", [1.0 if j == i else 0.0 for j in range(len(names))]))
    speeds = [1.0 / s if math.isfinite(s) else 0.0 for s in slowdowns]
    if sum(1 for x in speeds if x > 0) >= 2:
        out.append(("stripes by speed", "stripes", speeds))
    return out


def run_reference(timeline: Timeline, *, model: str, size: int, slowdowns: Sequence[float], dead_after_s: float,
                  window: int, per_plan: int, echo: bool = False) -> dict[str, Any]:
    """One launch that measures, for each event phase's device speeds, every `reference_plans`
    plan (coordinator with fixed shares and a forced strategy, as `kaitian param set` does):
    two warm-up answers, then the median of `per_plan` answers. Returns the best per phase
    (``best_ms``) and every plan's median (``plans``)."""
    cfg = scenario_config(model=model, height=size, width=size, slowdowns=slowdowns, policy="static",
                          static_shares=[1.0] * len(slowdowns), dead_after_s=dead_after_s,
                          coordinator={"use_scheduler": False, "static_shares": [1.0] * len(slowdowns),
                                       "strategy": "stripes"})
    plans: dict[str, dict[str, float]] = {}
    spreads: dict[str, float | None] = {}
    with AdaptivityGraph(cfg, echo=echo) as g:
        g.wait_ready(timeout_s=120.0)
        g.drive(timeline.warm, window=window, timeout_s=300.0)
        names = g.compute_names
        slow = names.index(timeline.slow_node)
        speeds = list(slowdowns)
        for phase in EVENT_PHASES:
            if phase == "slowed":
                speeds[slow] = slowdowns[slow] * timeline.slow_factor
                g.set_param(f"/{timeline.slow_node}", "emulated_slowdown", speeds[slow])
            elif phase == "recovered":
                speeds[slow] = slowdowns[slow]
                g.set_param(f"/{timeline.slow_node}", "emulated_slowdown", speeds[slow])
            else:
                g.kill(timeline.kill_node)
                speeds[names.index(timeline.kill_node)] = math.inf
            plans[phase] = {}
            for label, strategy, shares in reference_plans(names, speeds):
                g.set_param("/coordinator", "strategy", strategy)
                g.set_param("/coordinator", "static_shares", shares)
                g.drive(2, window=window, timeout_s=300.0)  # the plan's first requests: new shapes
                before = len(g.fused)
                g.drive(per_plan, window=window, timeout_s=300.0)
                got = [float(m.latency_ms) for _, m in g.fused.snapshot()[before:] if m.complete]
                plans[phase][label] = round(statistics.median(got), 2) if got else math.inf
            spreads[phase] = equal_plans_spread(plans[phase], names, speeds)
    return {"best_ms": {p: min(v.values()) for p, v in plans.items()}, "plans": plans,
            "equal_plans_spread": spreads}


def equal_plans_spread(plans: Mapping[str, float], names: Sequence[str], speeds: Sequence[float]) -> float | None:
    """The reference's own repeatability: slowest / fastest measured single-node plan among nodes
    at the same emulated speed (the same plan on equal devices, measured one after the other).
    A reconvergence tolerance below it is below what this machine can tell apart. None when no
    two alive nodes run at the same speed."""
    groups: dict[float, list[float]] = {}
    for n, s in zip(names, speeds):
        ms = plans.get(f"single {n}")
        if math.isfinite(s) and ms is not None and math.isfinite(ms):
            groups.setdefault(s, []).append(ms)
    ratios = [max(v) / min(v) for v in groups.values() if len(v) >= 2 and min(v) > 0]
    return round(max(ratios), 3) if ratios else None


def phase_slices(run: PolicyRun) -> dict[str, list[float]]:
    """Latencies (ms) of each phase's requests, in request-id order."""
    by_id = {r["request_id"]: r for r in run.records if r["complete"]}
    bounds = [run.boundaries[p] for p in PHASES] + [max(by_id) + 1]
    out = {}
    for k, p in enumerate(PHASES):
        out[p] = [by_id[i]["latency_ms"] for i in range(bounds[k], bounds[k + 1]) if i in by_id]
    return out


def _rolling_median(xs: Sequence[float], w: int) -> list[float]:
    return [statistics.median(xs[i:i + w]) for i in range(max(0, len(xs) - w + 1))]


def steady_state(latencies: Sequence[float]) -> float | None:
    """A phase's steady state: the median of its second half (at least ROLLING requests)."""
    if len(latencies) < ROLLING:
        return None
    return statistics.median(latencies[len(latencies) // 2:])


def requests_to_reconverge(latencies: Sequence[float], best: float) -> int | None:
    """Requests from the phase's first until a rolling median of ROLLING requests is within
    RECONVERGE_FACTOR x ``best`` (None: never within the phase)."""
    for k, m in enumerate(_rolling_median(latencies, ROLLING)):
        if m <= RECONVERGE_FACTOR * best:
            return k
    return None


def summarise(runs: Sequence[PolicyRun], reference: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Metrics per policy (definitions: docs/benchmarks-adaptivity.md).

    With `reference` (event phase -> ms: the best fixed plan for that phase's device speeds,
    measured in the same round, `run_reference`), a phase has re-converged once the rolling
    median of its latencies is within RECONVERGE_FACTOR of that reference.

    Without it, and always as ``requests_to_reconverge_calibrated``: each run's latencies are
    normalised by the median of its calibration phase (equal static shares on the equal start
    devices, the same plan in every run), and a phase's reference is the lowest normalised
    steady state any policy reached in it. That normaliser is the run's noisiest number on this
    machine (the same plan's calibration took 23-48 ms in runs of one round), so a policy could
    be the fastest in ms and still count as never re-converged."""
    slices = {r.policy: phase_slices(r) for r in runs}
    norm: dict[str, float] = {}
    for r in runs:
        cal = slices[r.policy]["calibration"]
        norm[r.policy] = statistics.median(cal) if cal else 1.0
    rel = {r.policy: {p: [x / norm[r.policy] for x in xs] for p, xs in slices[r.policy].items()} for r in runs}
    best: dict[str, float | None] = {}
    for p in PHASES:
        states = [s for s in (steady_state(rel[r.policy][p]) for r in runs) if s is not None]
        best[p] = min(states) if states else None
    policies: dict[str, Any] = {}
    for r in runs:
        lat = [x["latency_ms"] for x in r.records if x["complete"]]
        phases: dict[str, Any] = {}
        worst = 0
        never = False
        worst_cal = 0
        for p in EVENT_PHASES:
            xs = rel[r.policy][p]
            best_p = best[p]
            k_cal = requests_to_reconverge(xs, best_p) if best_p is not None else None
            k_cal_count = len(xs) if k_cal is None else k_cal  # never: censored at the whole phase
            if reference is not None and reference.get(p) is not None:
                k = requests_to_reconverge(slices[r.policy][p], reference[p])
            else:
                k = k_cal
            k_count = len(xs) if k is None else k
            never = never or k is None
            worst, worst_cal = max(worst, k_count), max(worst_cal, k_cal_count)
            phases[p] = {"first_request": r.boundaries[p], "requests": len(xs),
                         "requests_to_reconverge": k_count, "reconverged": k is not None,
                         "reference_ms": _round(reference.get(p)) if reference is not None else None,
                         "requests_to_reconverge_calibrated": k_cal_count,
                         "steady_ms": _round(steady_state(slices[r.policy][p])),
                         "steady_rel": _round(steady_state(xs), 3), "best_steady_rel": _round(best[p], 3),
                         "p50_ms": _round(statistics.median(slices[r.policy][p]) if xs else None)}
        policies[r.policy] = {
            "requests_to_reconverge": worst, "reconverged_every_phase": not never,
            "requests_to_reconverge_calibrated": worst_cal,
            "lost_requests": r.lost["lost"], "missing_ids": r.lost["missing"], "incomplete_ids": r.lost["incomplete"],
            "duplicate_ids": r.lost["duplicates"], "requests": len(r.records),
            "p50_ms": _round(float(np.percentile(lat, 50)) if lat else None),
            "p95_ms": _round(float(np.percentile(lat, 95)) if lat else None),
            "calibration_ms": _round(norm[r.policy]),
            "start_steady_ms": _round(steady_state(slices[r.policy]["start"])),
            "kill_detected_after_s": _round(r.kill_detect_s, 3), "startup_s": _round(r.startup_s, 1),
            "phases": phases}
    return {"policies": policies}


def combine_rounds(rounds: Sequence[Sequence[PolicyRun]],
                   references: Sequence[Mapping[str, float] | None] | None = None) -> dict[str, Any]:
    """Metrics over repeated rounds (each round: one run per policy, summarised on its own, so a
    phase's best steady state comes from runs minutes apart, not a quarter of an hour).

    Per policy: ``requests_to_reconverge`` is the median over rounds (the upper median for an
    even count), ``lost_requests`` the sum, p50/p95 over every answer of every round; the
    round whose value is that median supplies ``phases``; every round's summary is kept under
    ``rounds``. `references`: one per round (see `summarise`)."""
    refs = list(references) if references is not None else [None] * len(rounds)
    per_round = [summarise(runs, ref)["policies"] for runs, ref in zip(rounds, refs)]
    out: dict[str, Any] = {}
    for name in per_round[0]:
        values = [r[name]["requests_to_reconverge"] for r in per_round]
        med = statistics.median_high(values)
        median_round = per_round[values.index(med)][name]
        lat = [x["latency_ms"] for runs in rounds for run in runs if run.policy == name
               for x in run.records if x["complete"]]
        out[name] = {
            "requests_to_reconverge": med, "requests_to_reconverge_per_round": values,
            "worst_round": max(values),
            "requests_to_reconverge_calibrated_per_round": [r[name]["requests_to_reconverge_calibrated"]
                                                            for r in per_round],
            "reconverged_every_phase_every_round": all(r[name]["reconverged_every_phase"] for r in per_round),
            "lost_requests": sum(r[name]["lost_requests"] for r in per_round),
            "p50_ms": _round(float(np.percentile(lat, 50)) if lat else None),
            "p95_ms": _round(float(np.percentile(lat, 95)) if lat else None),
            "reconverged_every_phase": median_round["reconverged_every_phase"],
            "phases": median_round["phases"], "rounds": [r[name] for r in per_round]}
    return {"policies": out}


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def plot(runs: Sequence[PolicyRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False, sharex=False)
    colours: dict[str, Any] = {}
    for ax, run in zip(axes[:, 0], runs):
        recs = sorted((r for r in run.records), key=lambda r: r["request_id"])
        ids = [r["request_id"] for r in recs]
        lat = [r["latency_ms"] for r in recs]
        ax.plot(ids, lat, "k.-", lw=0.8, ms=3, label="latency (ms)")
        ax.set_ylabel("latency (ms)")
        if lat:  # the request in flight at the kill waits dead_after_s: keep the rest readable
            top = max(3.0 * statistics.median(lat), float(np.percentile(lat, 90)) * 1.5)
            ax.set_ylim(0, top)
            for i, x in zip(ids, lat):
                if x > top:
                    ax.annotate(f"{x:.0f} ms", (i, top), xytext=(3, -10), textcoords="offset points", fontsize=7)
        ax.set_title(f"{run.policy}", loc="left", fontsize=10)
        for name, colour in (("start", "tab:blue"), ("slowed", "tab:red"), ("recovered", "tab:green"),
                             ("killed", "tab:purple")):
            ax.axvline(run.boundaries[name], color=colour, ls="--", lw=1, label=name)
        ax2 = ax.twinx()
        nodes = sorted({n for r in recs for n in r["shares"]})
        bottom = np.zeros(len(recs))
        for n in nodes:
            vals = np.array([r["shares"].get(n, 0.0) for r in recs])
            colour = colours.setdefault(n, f"C{len(colours)}")
            ax2.fill_between(ids, bottom, bottom + vals, step="mid", alpha=0.18, color=colour, label=f"share {n}")
            bottom = bottom + vals
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("shares (stacked)")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("request id")
    import textwrap

    fig.suptitle("\n".join(textwrap.fill(line, 120) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(summary: dict[str, Any], speeds: str) -> None:
    print(f"\nadaptivity ({speeds}; EMULATED speeds)")
    print(f"{'policy':<13}{'reconverge':>11}{'lost':>6}{'p50 ms':>9}{'p95 ms':>9}   per round  "
          f"per phase of the median round (slowed/recovered/killed)")
    for name, m in summary["policies"].items():
        per = " / ".join(f"{ph['requests_to_reconverge']}{'' if ph['reconverged'] else '(never)'}"
                         for ph in m["phases"].values())
        rounds = ",".join(map(str, m["requests_to_reconverge_per_round"]))
        cal = ",".join(map(str, m["requests_to_reconverge_calibrated_per_round"]))
        print(f"{name:<13}{m['requests_to_reconverge']:>11}{m['lost_requests']:>6}{m['p50_ms']:>9}{m['p95_ms']:>9}"
              f"   {rounds:<10} {per:<28} (calibration-normalised per round: {cal})")


def main(argv: list[str]) -> int:
    p = BenchArgumentParser(prog="kaitian bench adaptivity")
    p.add_argument("--json", default=str(DEFAULT_JSON), help=f"result JSON (default {DEFAULT_JSON}; PNG next to it)")
    p.add_argument("--quick", action="store_true", help="short phases (about 2 min on 2 busy cores)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=128, help="input height = width")
    p.add_argument("--slowdowns", default="1.0,1.0,1.0", help="start emulated slowdown of compute_0..2")
    p.add_argument("--phase", type=int, help="requests per phase (default 30, quick 14)")
    p.add_argument("--window", type=int, default=1, help="frames unanswered at once (1 = one request at a time)")
    p.add_argument("--dead-after", type=float, default=1.0, help="dead_after_s of coordinator and scheduler")
    p.add_argument("--rounds", type=int, help="rounds of one run per policy, reported as medians "
                   "(default 3, quick 1; the policy order rotates between rounds)")
    p.add_argument("--echo", action="store_true", help="print the nodes' output")
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        p.error("--rounds must be >= 1")
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {POLICIES}")
    slowdowns = [float(x) for x in args.slowdowns.split(",")]
    if len(slowdowns) != 3:
        p.error("--slowdowns needs 3 values (compute_0, compute_1 slows, compute_2 is killed)")
    n = args.phase or (14 if args.quick else 30)
    warm = 6 if args.quick else 8  # the nodes' first requests pay for lazy torch initialisation
    calibration = 8 if args.quick else 12
    timeline = Timeline(phase=n, warm=warm, calibration=calibration)
    json_path = Path(args.json)
    png_path = json_path.with_suffix(".png")
    speeds = (f"compute_0..2 slowdown {'/'.join(f'{s:g}' for s in slowdowns)}; {warm} warm-up + {calibration} "
              f"calibration answers on equal shares, then the policy: {n} answers, compute_1 x3, {n} later "
              f"back, {n} later compute_2 SIGKILL, {n} more")
    print(f"kaitian bench adaptivity: {args.model} {args.size}x{args.size}, {speeds}; EMULATED speeds; "
          f"window {args.window}, dead_after_s {args.dead_after}", flush=True)
    all_rounds: list[list[PolicyRun]] = []
    references: list[dict[str, Any]] = []
    t_all = time.monotonic()
    for k in range(rounds):
        order = policies[k % len(policies):] + policies[:k % len(policies)]  # drift hits all alike
        # said before the round's first run: each run takes minutes, its line comes after it
        print(f"  round {k + 1}/{rounds}: reference, then {', '.join(order)}", flush=True)
        t = time.monotonic()
        ref = run_reference(timeline, model=args.model, size=args.size, slowdowns=slowdowns,
                            dead_after_s=args.dead_after, window=args.window, per_plan=REFERENCE_ANSWERS,
                            echo=args.echo)
        references.append(ref)
        print(f"  round {k + 1}/{rounds} reference (best fixed plan per phase): "
              + ", ".join(f"{p} {ms:.1f} ms" for p, ms in ref["best_ms"].items())
              + f" ({time.monotonic() - t:.0f} s); the same plan on equal nodes, slowest / fastest: "
              + ", ".join(f"{p} {x:.2f}" for p, x in ref["equal_plans_spread"].items() if x is not None),
              flush=True)
        runs = []
        for policy in order:
            t = time.monotonic()
            run = run_policy(policy, timeline, model=args.model, size=args.size, slowdowns=slowdowns,
                             dead_after_s=args.dead_after, window=args.window, echo=args.echo)
            runs.append(run)
            print(f"  round {k + 1}/{rounds} {policy}: {len(run.records)} answers in {time.monotonic() - t:.0f} s "
                  f"(startup {run.startup_s:.0f} s), phases from request {run.boundaries}, "
                  f"lost {run.lost['lost']}, kill detected after "
                  f"{run.kill_detect_s if run.kill_detect_s is None else round(run.kill_detect_s, 2)} s", flush=True)
        all_rounds.append(sorted(runs, key=lambda r: policies.index(r.policy)))
    summary = combine_rounds(all_rounds, [r["best_ms"] for r in references])
    summary["references"] = references
    summary["setup"] = {"model": args.model, "input": [3, args.size, args.size], "compute_nodes": 3,
                        "start_slowdowns": slowdowns, "emulated": True, "timeline": speeds,
                        "answers_per_phase": n, "warmup_answers": warm, "window": args.window,
                        "dead_after_s": args.dead_after, "reconverge_factor": RECONVERGE_FACTOR,
                        "rolling_median": ROLLING, "quick": args.quick, "rounds": rounds, "cpus": os.cpu_count(),
                        "wall_s": round(time.monotonic() - t_all, 1)}
    summary["timelines"] = [{r.policy: [{k: x[k] for k in ("request_id", "plan_version", "complete", "latency_ms",
                                                            "shares")} for x in r.records] for r in runs}
                            for runs in all_rounds]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1))
    pngs = []
    for k, runs in enumerate(all_rounds):
        path = png_path if k == 0 else png_path.with_name(f"{png_path.stem}_round{k + 1}.png")
        plot(runs, path, f"kaitian bench adaptivity, round {k + 1}/{rounds}: {args.model} {args.size}x{args.size} "
                         f"(EMULATED speeds)\n{speeds}")
        pngs.append(str(path))
    print_table(summary, speeds)
    print(f"\nwrote {json_path} and {', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
