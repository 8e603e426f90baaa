"""The driver of ``kaitian bench inference``: the bench's own node, which publishes the frames,
times each FusedOutput and sets the product's live parameters for each variant
(:class:`ProductConfig`)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kaitian_ros.bench.inference_graph import DRIVER, LW_TELEMETRY, Graph, bench_chunk, bench_tensor, lw_topic


@dataclass(frozen=True)
class ProductConfig:
    """One product variant: the coordinator's and compute nodes' live parameters."""

    strategy: str           # coordinator `strategy`
    use_scheduler: bool     # coordinator `use_scheduler`
    shares: tuple[float, ...]  # coordinator `static_shares` (used when use_scheduler is false)
    slab_rows: int          # coordinator `slab_rows`
    min_run_rows: int       # every compute node's `min_run_rows`
    direct_single: bool = True  # coordinator `direct_single` (the product's default)

    def summary(self) -> dict:
        return {"strategy": self.strategy, "use_scheduler": self.use_scheduler,
                "shares": [round(x, 4) for x in self.shares], "slab_rows": self.slab_rows,
                "min_run_rows": self.min_run_rows, "direct_single": self.direct_single}


COORDINATOR_STATUS = "kaitian: coordinator"


class Driver:
    """The bench's own node: publishes frames, times FusedOutput, collects telemetry, plans,
    profiles and the coordinator's /diagnostics."""

    def __init__(self, graph_proc: Graph, graph: Any) -> None:
        from kaitian_ros.nodes import inference_common as ic
        from kaitian_ros.nodes import protocol as proto
        from kaitian_ros.runtime import interfaces
        from kaitian_ros.runtime.api import QoS
        from kaitian_ros.runtime.diagnostics import DIAGNOSTICS_TOPIC
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.graph_client import GraphClient
        from kaitian_ros.runtime.node_args import parse_node_args

        self.ic, self.interfaces, self.gp = ic, interfaces, graph_proc
        self.rt = EmbeddedRuntime(parse_node_args([], DRIVER), router=graph_proc.router_ep)
        self.client = GraphClient(router=graph_proc.router_ep)
        self.graph = graph
        self.fused: queue.Queue = queue.Queue()
        self.lw_out: queue.Queue = queue.Queue()
        self.telemetry: dict[tuple[str, int], Any] = {}
        self.lw_tele: dict[tuple[str, int], Any] = {}
        self.lock = threading.Lock()
        self.plans: dict[int, Any] = {}  # /kaitian/plan messages by version
        self.profiles_seen: set[str] = set()
        self.profiles: dict[str, Any] = {}  # newest CostProfile message per compute node
        self.workers_seen: set[str] = set()
        self.status: dict[str, str] = {}  # the coordinator's newest /diagnostics values
        self.min_run_rows: dict[str, int] = {}  # what the driver last set on each compute node
        self.image_pub = self.rt.create_publisher("/camera/image_raw", "Image")
        self.lw_pubs = {w: self.rt.create_publisher(lw_topic(w), "BenchChunk") for w in graph_proc.workers}
        self.rt.create_subscription(proto.FUSED_TOPIC, "FusedOutput",
                                    lambda m: self.fused.put((time.perf_counter(), m)))
        self.rt.create_subscription(lw_topic(DRIVER), "BenchChunk",
                                    lambda m: self.lw_out.put((time.perf_counter(), m)))
        self.rt.create_subscription(proto.TELEMETRY_TOPIC, "NodeTelemetry", self._on_tele)
        self.rt.create_subscription(LW_TELEMETRY, "NodeTelemetry", self._on_lw_tele)
        self.rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", self._on_plan, QoS.LATCHED)
        self.rt.create_subscription(proto.PROFILES_TOPIC, "CostProfile", self._on_profile, QoS.LATCHED)
        self.rt.create_subscription(DIAGNOSTICS_TOPIC, "DiagnosticArray", self._on_diagnostics)
        self.thread = threading.Thread(target=self.rt.spin, daemon=True)
        self.thread.start()
        self.request = 0

    # --- subscriptions (middleware thread) ----------------------------------------------
    def _on_tele(self, m: Any) -> None:
        if m.request_id:
            self.telemetry[(m.node_id, int(m.request_id))] = m

    def _on_lw_tele(self, m: Any) -> None:
        self.workers_seen.add(m.node_id)
        if m.request_id:
            self.lw_tele[(m.node_id, int(m.request_id))] = m

    def _on_plan(self, m: Any) -> None:
        with self.lock:
            self.plans[int(m.version)] = m

    def _on_profile(self, m: Any) -> None:
        self.profiles_seen.add(m.node_id)
        with self.lock:
            self.profiles[m.node_id] = m

    def profile_summary(self) -> dict:
        """What each compute node last published about its costs: trunk time and the rates of
        its incoming links (what the planner predicts with; for checking predictions)."""
        with self.lock:
            msgs = dict(self.profiles)
        return {n: {"version": int(m.version), "trunk_ms": round(float(m.trunk_ms), 2),
                    "link_mbit": {src: round(float(r) * 8e3 / 1e6, 2) for src, r in zip(m.link_sources,
                                                                                      m.link_bytes_per_ms)}}
                for n, m in sorted(msgs.items())}

    def coordinator_links(self) -> str:
        """The coordinator's estimates of its incoming links (``node:rate/latency,...``), as its
        /diagnostics last reported them: with `profile_summary`, every link the planner uses."""
        with self.lock:
            return self.status.get("links_in", "")

    def _on_diagnostics(self, m: Any) -> None:
        for st in m.status:
            if st.name == COORDINATOR_STATUS:
                with self.lock:
                    self.status = {kv.key: kv.value for kv in st.values}

    def latest_plan(self) -> Any:
        with self.lock:
            return self.plans[max(self.plans)] if self.plans else None

    def plan(self, version: int) -> Any:
        with self.lock:
            return self.plans.get(version)

    def close(self) -> None:
        self.rt.shutdown()
        self.thread.join(timeout=2.0)
        self.client.close()
        self.rt.close()

    # --- setup ------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:
        """Every compute node alive in the coordinator and profiled, every worker up."""
        deadline = time.monotonic() + timeout_s
        want = set(self.gp.compute)
        while time.monotonic() < deadline:
            self.gp.check_alive()
            with self.lock:
                alive = set(filter(None, self.status.get("alive", "").split(",")))
            if (want <= alive and want <= self.profiles_seen and set(self.gp.workers) <= self.workers_seen
                    and self.latest_plan() is not None):
                return
            time.sleep(0.2)
        with self.lock:
            alive_text = self.status.get("alive", "?")
        raise RuntimeError(f"nodes not ready after {timeout_s:.0f} s (alive in the coordinator: {alive_text}; "
                           f"profiles from {sorted(self.profiles_seen)}; workers seen: "
                           f"{sorted(self.workers_seen)}); logs in {self.gp.tmp}")

    def configure(self, cfg: ProductConfig) -> None:
        """Set a variant's parameters; a fixed-share variant waits until its plan is in effect.

        The compute nodes first, then the coordinator: a node's `min_run_rows` is part of its
        cost profile, and the coordinator re-plans inside its parameter call. Set the other way
        round, it planned every variant against the previous variant's executor settings (after
        `no_stream`, `ours` started each round without the measurements of its own plans)."""
        for n in self.gp.compute:
            if self.min_run_rows.get(n) != cfg.min_run_rows:  # a change republishes the node's profile
                ok, why = self.client.set_parameters(n, {"min_run_rows": int(cfg.min_run_rows)})
                if not ok:
                    raise RuntimeError(f"{n} refused min_run_rows: {why}")
                self.min_run_rows[n] = cfg.min_run_rows
                self._wait_profile_rows(n, cfg.min_run_rows)
        ok, why = self.client.set_parameters("coordinator", {
            "use_scheduler": cfg.use_scheduler, "strategy": cfg.strategy, "slab_rows": int(cfg.slab_rows),
            "static_shares": [float(s) for s in cfg.shares], "direct_single": cfg.direct_single})
        if not ok:
            raise RuntimeError(f"coordinator refused parameters: {why}")
        if cfg.use_scheduler:
            # the coordinator replanned inside the parameter call; warm-up frames follow
            time.sleep(0.1)
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            p = self.latest_plan()
            if p is not None and self._plan_matches(p, cfg):
                return
            time.sleep(0.05)
        raise RuntimeError(f"coordinator did not adopt {cfg.summary()} (newest plan: "
                           f"{self.describe_plan(self.latest_plan())})")

    def _wait_profile_rows(self, node: str, rows: int, timeout_s: float = 3.0) -> None:
        """Until `node`'s newest cost profile (as this driver, a subscriber like the coordinator,
        received it) carries `rows` as its min_run_rows; on timeout the variant goes on."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                m = self.profiles.get(node)
            if m is not None and int(m.min_run_rows) == rows:
                return
            time.sleep(0.01)

    def _plan_matches(self, msg: Any, cfg: ProductConfig) -> bool:
        spec = self.ic.spec_from_msg(msg)
        nodes = tuple(n for n, s in zip(self.gp.compute, cfg.shares) if s > 0)
        if spec.strategy != cfg.strategy or tuple(spec.node_ids) != nodes:
            return False
        if cfg.strategy != "stripes":
            return True
        first, want = spec.segment_shares[0], [s for s in cfg.shares if s > 0]
        return all(abs(a / sum(first) - b / sum(want)) < 1e-6 for a, b in zip(first, want))

    def describe_plan(self, msg: Any) -> str:
        if msg is None:
            return "none"
        try:
            text = self.ic.spec_from_msg(msg).describe(self.graph)
        except ValueError as exc:
            return f"unreadable plan v{msg.version}: {exc}"
        return text + (", whole image" if msg.slab_rows >= self.graph.input_shape[1] else "")

    def planning_rounds(self) -> int:
        """Planning rounds the coordinator has sent its planner process so far (its newest
        /diagnostics; they come once a second, so a count may lag by that much)."""
        with self.lock:
            return int(self.status.get("plan_rounds", "0") or 0)

    def prediction(self, version: int) -> float:
        """The coordinator's current prediction of plan `version`: its /diagnostics value when
        that reports this version (re-predicted every replan_period_s with the newest
        measurements), else the prediction the plan was published with."""
        with self.lock:
            st = dict(self.status)
        if st.get("plan_version") == str(version) and st.get("predicted_ms"):
            return float(st["predicted_ms"])
        msg = self.plan(version)
        return float(msg.predicted_makespan_ms) if msg is not None else float("nan")

    # --- one frame ----------------------------------------------------------------------
    def product_frame(self, image: np.ndarray, timeout_s: float = 30.0) -> dict:
        self.request += 1
        fid = f"bench{self.request}"
        h, w, _ = image.shape
        msg = self.interfaces.make("Image", header=self.interfaces.header(fid), height=h, width=w,
                                   encoding="rgb8", is_bigendian=0, step=w * 3, data=image.reshape(-1))
        t0 = time.perf_counter()
        self.image_pub.publish(msg)
        got = _wait_for(self.fused, lambda m: m.header.frame_id == fid, t0 + timeout_s)
        if got is None:
            return {"ok": False, "status": "no FusedOutput (timeout)"}
        t1, m = got
        if not m.complete:
            return {"ok": False, "status": m.status}
        rid = int(m.request_id)
        time.sleep(0.005)  # telemetry follows the last OUTPUT chunk
        nodes = {n: self.telemetry.pop((n, rid), None) for n in m.node_ids}
        return {"ok": True, "ms": (t1 - t0) * 1e3, "coord_ms": float(m.latency_ms),
                "plan_version": int(m.plan_version),
                "node_compute_ms": {n: (t.compute_ms if t is not None else None) for n, t in nodes.items()},
                "node_rows": dict(zip(m.node_ids, (int(r) for r in m.node_rows)))}

    def ours_frame(self, image: np.ndarray) -> dict:
        """A product frame with the coordinator's prediction of the plan that ran it."""
        r = self.product_frame(image)
        if r["ok"]:
            r["predicted_ms"] = self.prediction(r["plan_version"])
            r["plan"] = self.describe_plan(self.plan(r["plan_version"]))
        return r

    def layerwise_frame(self, image: np.ndarray, chain: list[tuple[str, int, int]],
                        timeout_s: float = 30.0) -> dict:
        """chain: [(worker, first value, last value), ...] covering the whole trunk."""
        import torch

        from kaitian_ros.core.tensors import resize_pixels

        g = self.graph
        if any(a[2] != b[1] for a, b in itertools.pairwise(chain)):
            raise ValueError(f"chain {chain} is not contiguous")
        self.request += 1
        rid = self.request
        t0 = time.perf_counter()
        # the same uint8 pixel rows the product sends: every variant moves the same input bytes
        c, h, w = g.input_shape
        x = resize_pixels(image, h, w, c)
        self.lw_pubs[chain[0][0]].publish(bench_chunk(
            request_id=rid, sender=DRIVER, value=chain[0][1], route=[n for n, _, _ in chain],
            stop_values=[last for _, _, last in chain], reply_to=DRIVER, tensor=x))
        got = _wait_for(self.lw_out, lambda m: int(m.request_id) == rid, t0 + timeout_s)
        if got is None:
            return {"ok": False, "status": "no layer-wise result (timeout)"}
        _, m = got
        with torch.no_grad():
            y = g.run_head(bench_tensor(m).clone())
        t1 = time.perf_counter()
        assert y.shape[0] == 1
        time.sleep(0.005)
        comp = {w: self.lw_tele.pop((w, rid), None) for w, _, _ in chain}
        return {"ok": True, "ms": (t1 - t0) * 1e3,
                "node_compute_ms": {w: (t.compute_ms if t is not None else None) for w, t in comp.items()}}


def _wait_for(replies: queue.Queue, wanted: Callable[[Any], bool], deadline: float) -> tuple[float, Any] | None:
    """The first (arrival time, message) from ``replies`` that ``wanted`` accepts, None at
    ``deadline`` (perf_counter); older replies (earlier, timed-out frames) are skipped."""
    while True:
        try:
            arrived, msg = replies.get(timeout=max(0.01, deadline - time.perf_counter()))
        except queue.Empty:
            return None
        if wanted(msg):
            return arrived, msg
