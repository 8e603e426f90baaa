"""The harness of ``kaitian bench adaptivity`` (also used by ``test/test_scheduler_e2e.py``): the
graph of the product on one host with the bench as its camera, a steady closed-loop stream of
frames and a record of every answer, plan and assignment."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.runtime.interfaces import stamp_key

CAMERA_TOPIC = "/camera/image_raw"
PLAN_WAIT_S = 5.0  # drive(): how long it waits for the plans of the answers it got
UNTIL_POLL_S = 0.05  # drive(until=...): how often the predicate is asked while no answer arrives


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
                 frames: Callable[[int], Any] | None = None, fork: Any = True) -> None:
        """``frames(i)``: the i-th camera Image to publish, with a stamp of its own (default:
        random rgb8 pixels of the model's input size). ``fork``: as `Launcher` takes it (a
        running fork server to fork the nodes from, kept running)."""
        from kaitian_ros.launcher import start_on_free_port
        from kaitian_ros.nodes import protocol as proto
        from kaitian_ros.processes import CapturedOutput
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
        self.launcher = start_on_free_port(self.scenario, out=self.out, fork=fork)
        self.endpoint = self.launcher.router_endpoint
        try:
            self.rt = EmbeddedRuntime(NodeArgs("adaptivity_driver"), router=self.endpoint)
            self.fused, self.plans, self.assignments, self.telemetry = _Log(), _Log(), _Log(), _Log()
            self.rt.create_subscription(proto.FUSED_TOPIC, "FusedOutput", self.fused)
            self.rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", self.plans, QoS.LATCHED)
            self.rt.create_subscription(proto.ASSIGNMENT_TOPIC, "LoadAssignment", self.assignments, QoS.LATCHED)
            self.rt.create_subscription(proto.TELEMETRY_TOPIC, "NodeTelemetry", self.telemetry)
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

    def story(self) -> str:
        """What happened, on one line (a failure's last line is what a CI log keeps): each plan
        version's nodes and the head of its reason, and the coordinator's counters."""
        from kaitian_ros.nodes import protocol as proto

        plans = "; ".join(f"v{v} {'+'.join(sorted(proto.members(m)))}: {m.reason[:48]}"
                          for v, m in sorted(self.plan_table().items()))
        keys = ("completed", "timeouts", "late_drops", "redispatched", "departures", "dropped_busy")
        counts = ", ".join(f"{k} {self.coordinator_values[k]}" for k in keys if k in self.coordinator_values)
        return f"{plans} | {counts}"

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
        until_seen, until_at = -1, 0.0
        while True:
            now = time.monotonic()
            snap = self.fused.snapshot()
            for _, f in snap[seen:]:
                answered_stamps.add(stamp_key(f.header.stamp))
            seen = len(snap)
            done = len(snap) - start
            while pending and pending[0][0] <= done:
                _, fn = pending.pop(0)
                t = threading.Thread(target=fn, daemon=True)
                t.start()
                threads.append(t)
            if answers is not None and done >= answers:
                break
            # until() on a new answer, else every UNTIL_POLL_S: this loop wakes every few ms, and a
            # predicate that scans every answer would otherwise take CPU from the graph it measures
            if until is not None and (len(snap) != until_seen or now - until_at >= UNTIL_POLL_S):
                until_seen, until_at = len(snap), now
                if until():
                    break
            if now > deadline:
                raise TimeoutError(f"{done} answers ({answers} wanted) after {timeout_s:.0f} s:\n{self.out.text(40)}")
            for key in [k for k, t in outstanding.items() if k in answered_stamps or now - t > resend_after_s]:
                del outstanding[key]
            if len(outstanding) < window and now - last_send >= period_s:
                msg = self._frame()
                key = stamp_key(msg.header.stamp)
                self.camera.publish(msg)
                last_send = now
                outstanding[key] = now
                self.sent[key] = now
                continue
            with self.fused.changed:
                self.fused.changed.wait(timeout=0.005)
        for t in threads:
            t.join(timeout=30.0)
        self._wait_for_plans(PLAN_WAIT_S)

    def _wait_for_plans(self, timeout_s: float) -> None:
        """Until the plan of every answer so far has arrived, at most `timeout_s`: a plan and the
        answers computed under it come on different topics, and an answer whose plan was not
        here yet read as a plan without any node (a test of a rejoined node saw its share 0)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            known = self.plan_table()
            if all(int(f.plan_version) in known for _, f in self.fused.snapshot()):
                return
            with self.plans.changed:
                self.plans.changed.wait(timeout=0.01)

    # --- results -------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """One dict per FusedOutput (arrival order): request id, plan version, latency, shares,
        and each node's time on the request from its telemetry (`node_ms`: node -> [compute,
        wait] ms; compute is the device's time, CPU time on a CPU, so a node that waited for a
        core shows it as wait, not compute)."""
        plans = self.plan_table()
        node_ms: dict[int, dict[str, list[float]]] = {}
        for _, m in self.telemetry.snapshot():
            if int(m.request_id):  # 0: a heartbeat
                node_ms.setdefault(int(m.request_id), {})[m.node_id] = [round(float(m.compute_ms), 2),
                                                                        round(float(m.wait_ms), 2)]
        out = []
        for t, f in self.fused.snapshot():
            plan = plans.get(int(f.plan_version))
            shares = dict(zip(plan.node_ids, (float(s) for s in plan.shares))) if plan is not None else {}
            out.append({"request_id": int(f.request_id), "plan_version": int(f.plan_version),
                        "complete": bool(f.complete), "status": f.status, "latency_ms": float(f.latency_ms),
                        "node_ids": list(f.node_ids), "node_rows": [int(r) for r in f.node_rows],
                        "shares": shares, "arrived_s": t, "node_ms": node_ms.get(int(f.request_id), {}),
                        "sent_s": self.sent.get(stamp_key(f.header.stamp))})
        return out

    def first_request_sent_after(self, t: float) -> int | None:
        """The first request id whose frame was sent at or after ``t`` (time.monotonic())."""
        ids = [int(f.request_id) for _, f in self.fused.snapshot()
               if (sent := self.sent.get(stamp_key(f.header.stamp))) is not None and sent >= t]
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
