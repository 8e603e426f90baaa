"""``kaitian bench inference``: collaborative inference against its baselines, in one run.

Real processes of the product: a Zenoh router and the bench driver in the root network
namespace, the real ``coordinator`` and ``scheduler`` nodes next to them, and one real
``compute`` node per device. A remote device sits in its own network namespace behind a veth
pair rate limited with tbf in both directions; a *local* device (the robot's own processor)
runs in the root namespace with the coordinator, with no link (``bench/netns.py``; needs root,
otherwise loopback and the output says so). Device speeds are EMULATED with
``emulated_slowdown`` (a node sleeps (s-1)x each real compute). What runs where comes from a
scenario (``inference_scenarios.py``: ``--scenario NAME``, ``--matrix`` runs them all).

On the same frames, in interleaved rounds, driver-side end-to-end latency (Image published ->
FusedOutput received) of

* ``single``    best single device, its link included (a local device pays none): the minimum
                over every device of (a) the product forced onto it (``use_scheduler`` false,
                one-hot ``static_shares``, ``strategy: single``) and (b) a bench worker running
                the whole trunk there in one call;
* ``layerwise`` Neurosurgeon-style split: device X runs the trunk up to a cut, sends the
                activation over the link, device Y runs the rest; every cut and every ordered
                pair of devices is tried and the best is measured (bench workers, same links);
* ``equal``     row stripes with equal static shares (``strategy: stripes``);
* ``no_stream`` row stripes by measured device speed, slab = whole stripe, one run per op;
* ``ours``      the product as a user runs it: the scheduler node's shares (adaptive policy,
                as in config/hetero_inference.yaml), ``use_scheduler`` true, ``strategy: auto``
                (the coordinator's planner picks the plan); with its predicted latency;

and the physical bound ``max(compute bound, link bound)``: compute bound = 1 / sum_i(1 /
trunk_ms_i) with each device's trunk time measured in the same run (worker, whole trunk in one
call); link bound = (image bytes + trunk output bytes) / (remote links x link rate) when every
device is remote, else 0 (a local device could do everything without a link).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.inference_graph import DRIVER, LW_TELEMETRY, Graph, lw_topic, worker_main
from kaitian_ros.bench.inference_report import VARIANTS
from kaitian_ros.bench.inference_scenarios import (
    DEFAULT_SCENARIO,
    SCENARIOS,
    BenchScenario,
    scenario_problem,
    with_overrides,
)

RESULTS = Path("bench/results")
WHOLE = 4096  # slab_rows / min_run_rows meaning "whole stripe" / "one run per op"
OURS_WARMUP = 3  # frames after switching to ours before measuring: the plan and shares settle
SCHEDULER_FRAMES = 15  # frames at most for the scheduler's first assignment to be adopted


# =========================================================================== driver
@dataclass(frozen=True)
class ProductConfig:
    """One product variant: the coordinator's and compute nodes' live parameters."""

    strategy: str           # coordinator `strategy`
    use_scheduler: bool     # coordinator `use_scheduler`
    shares: tuple[float, ...]  # coordinator `static_shares` (used when use_scheduler is false)
    slab_rows: int          # coordinator `slab_rows`
    min_run_rows: int       # every compute node's `min_run_rows`

    def summary(self) -> dict:
        return {"strategy": self.strategy, "use_scheduler": self.use_scheduler,
                "shares": [round(x, 4) for x in self.shares], "slab_rows": self.slab_rows,
                "min_run_rows": self.min_run_rows}


COORDINATOR_STATUS = "kaitian: coordinator"


class Driver:
    """The bench's own node: publishes frames, times FusedOutput, collects telemetry, plans,
    profiles and the coordinator's /diagnostics."""

    def __init__(self, graph_proc: Graph, graph: Any) -> None:
        from kaitian_ros.nodes import inference_common as ic
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
        self.lw_pubs = {w: self.rt.create_publisher(lw_topic(w), "TensorChunk") for w in graph_proc.workers}
        self.rt.create_subscription(ic.FUSED_TOPIC, "FusedOutput", lambda m: self.fused.put((time.perf_counter(), m)))
        self.rt.create_subscription(lw_topic(DRIVER), "TensorChunk",
                                    lambda m: self.lw_out.put((time.perf_counter(), m)))
        self.rt.create_subscription(ic.TELEMETRY_TOPIC, "NodeTelemetry", self._on_tele)
        self.rt.create_subscription(LW_TELEMETRY, "NodeTelemetry", self._on_lw_tele)
        self.rt.create_subscription(ic.PLAN_TOPIC, "LoadAssignment", self._on_plan, QoS.LATCHED)
        self.rt.create_subscription(ic.PROFILES_TOPIC, "CostProfile", self._on_profile, QoS.LATCHED)
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
        """Set a variant's parameters; a fixed-share variant waits until its plan is in effect."""
        ok, why = self.client.set_parameters("coordinator", {
            "use_scheduler": cfg.use_scheduler, "strategy": cfg.strategy, "slab_rows": int(cfg.slab_rows),
            "static_shares": [float(s) for s in cfg.shares]})
        if not ok:
            raise RuntimeError(f"coordinator refused parameters: {why}")
        for n in self.gp.compute:
            if self.min_run_rows.get(n) != cfg.min_run_rows:  # a change republishes the node's profile
                ok, why = self.client.set_parameters(n, {"min_run_rows": int(cfg.min_run_rows)})
                if not ok:
                    raise RuntimeError(f"{n} refused min_run_rows: {why}")
                self.min_run_rows[n] = cfg.min_run_rows
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
            return self.ic.spec_from_msg(msg).describe(self.graph)
        except ValueError as exc:
            return f"unreadable plan v{msg.version}: {exc}"

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

        ic, g = self.ic, self.graph
        self.request += 1
        rid = self.request
        t0 = time.perf_counter()
        # the same uint8 pixel rows the product sends: every variant moves the same input bytes
        c, h, w = g.input_shape
        x = resize_pixels(image, h, w, c)
        first_worker, first, last = chain[0]
        nxt = chain[1][0] if len(chain) > 1 else DRIVER
        self.lw_pubs[first_worker].publish(ic.chunk_message(
            request_id=rid, plan_version=last, producer=DRIVER, consumer=first_worker, segment=first,
            role=ic.ROLE_INPUT, row_offset=0, total_rows=x.shape[2], rows=x, frame_id=nxt))
        got = _wait_for(self.lw_out, lambda m: int(m.request_id) == rid, t0 + timeout_s)
        if got is None:
            return {"ok": False, "status": "no layer-wise result (timeout)"}
        _, m = got
        with torch.no_grad():
            y = g.run_head(ic.chunk_rows(m).clone())
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


# =========================================================================== measurement
@dataclass
class Series:
    name: str
    config: dict
    samples: list[float] = field(default_factory=list)
    coord: list[float] = field(default_factory=list)
    compute: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # ours: the coordinator's prediction per frame
    plans: list[str] = field(default_factory=list)        # ours: the plan that ran each frame

    def add(self, r: dict) -> None:
        if not r["ok"]:
            self.failures.append(r["status"])
            return
        self.samples.append(r["ms"])
        if "coord_ms" in r:
            self.coord.append(r["coord_ms"])
        if "predicted_ms" in r:
            self.predicted.append(r["predicted_ms"])
            self.plans.append(r["plan"])
        for n, c in r.get("node_compute_ms", {}).items():
            if c is not None:
                self.compute.setdefault(n, []).append(c)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def summary(self) -> dict:
        s = sorted(self.samples)
        q = (lambda f: s[min(len(s) - 1, int(f * len(s)))]) if s else (lambda f: float("nan"))
        out = {"median_ms": self.median, "p10_ms": q(0.1), "p90_ms": q(0.9), "frames": len(s),
               "failures": len(self.failures), "failure_reasons": sorted(set(self.failures))[:3],
               "coordinator_latency_median_ms": statistics.median(self.coord) if self.coord else None,
               "node_compute_median_ms": {n: statistics.median(v) for n, v in self.compute.items()},
               **self.config}
        if self.plans:
            out["plans_ran"] = dict(collections.Counter(self.plans).most_common())
        return out


def _frames(n: int, height: int, width: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    cols = np.linspace(0, 255, width, dtype=np.float32)
    rows = np.linspace(0, 255, height, dtype=np.float32)
    out = []
    for k in range(n):  # smooth-ish synthetic scenes with noise (content does not change the cost)
        img = (cols[None, :, None] * (0.5 + 0.1 * k) + rows[:, None, None] * 0.3) % 256
        img = img + rng.normal(0, 20, (height, width, 3))
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


@dataclass
class Measurer:
    """Runs frames of one variant into its Series, checking that every process is still up."""

    frames: list[np.ndarray]
    gp: Graph

    def __call__(self, series: Series, fn: Callable[[np.ndarray], dict], count: int, warmup: int = 1) -> None:
        for k in range(warmup):
            fn(self.frames[k % len(self.frames)])
        for k in range(count):
            series.add(fn(self.frames[k % len(self.frames)]))
            self.gp.check_alive()


def build_model_graph(sc: BenchScenario) -> Any:
    """The scenario's model split into trunk and head (ValueError, one line, when it cannot be
    built: an unknown model, an input too small for it): checked before any process starts."""
    from kaitian_ros.nodes import inference_common as ic

    spec = ic.ModelSpec(sc.model, (3, sc.height, sc.width), 1000, 0, "")
    try:
        return ic.build_graph(spec)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(" ".join(f"scenario {sc.name}: {exc}".split())) from None


def _open_links(args: argparse.Namespace, sc: BenchScenario) -> tuple[Any, str]:
    """Links for the remote devices, or None and why the run is on loopback."""
    from kaitian_ros.bench import netns

    if args.loopback:
        return None, "loopback (--loopback): no rate limit, link_mbit is only used for the bound"
    if sc.n_remote == 0:
        return None, "every device is local: no link"
    ok, why = netns.available()
    if not ok:
        return None, f"loopback ({why}): no rate limit, link_mbit is only used for the bound"
    return netns.Links(len(sc.devices), sc.mbit, sc.local), ""


def _start_driver(gp: Graph, graph: Any) -> Driver:
    """The driver's sessions listen where the namespaces reach them (when links are emulated)."""
    listen_before = os.environ.get("KAITIAN_LISTEN")
    if gp.links is not None:
        os.environ["KAITIAN_LISTEN"] = f"tcp/{gp.host}:0"
    try:
        return Driver(gp, graph)
    finally:
        if listen_before is None:
            os.environ.pop("KAITIAN_LISTEN", None)
        else:
            os.environ["KAITIAN_LISTEN"] = listen_before


def _trunk_alone(driver: Driver, gp: Graph, frames: list[np.ndarray], count: int) -> list[float]:
    """Each device's whole trunk in one call (worker), best of `count`: speeds for the bound
    and the no_stream shares. The least disturbed sample: other work shares these cores."""
    out_value = driver.graph.output_value
    solo = {w: Series(f"solo_{w}", {}) for w in gp.workers}
    for k in range(count + 1):  # devices alternate: load bursts hit all alike; the first is a warm-up
        for w in gp.workers:
            r = driver.layerwise_frame(frames[k % len(frames)], [(w, 0, out_value)])
            if k:
                solo[w].add(r)
    return [min(solo[w].compute[w]) for w in gp.workers]


def _layerwise(driver: Driver, chain: list[tuple[str, int, int]], image: np.ndarray) -> dict:
    return driver.layerwise_frame(image, chain)


def _layerwise_search(driver: Driver, gp: Graph, measure: Measurer, frames_each: int) -> list[dict]:
    """Every cut, every ordered pair of devices (local ones too), coarse: the best is measured
    with the other variants."""
    g = driver.graph
    search = []
    for a, b in ((a, b) for a in range(len(gp.workers)) for b in range(len(gp.workers)) if a != b):
        for cut in g.cut_values:
            chain = [(gp.workers[a], 0, cut), (gp.workers[b], cut, g.output_value)]
            s = Series("lw", {})
            measure(s, functools.partial(_layerwise, driver, chain), frames_each, warmup=0)
            search.append({"first": a, "second": b, "cut_value": cut, "cut_shape": list(g.value_shapes[cut]),
                           "median_ms": s.median})
    return search


def _product_configs(sc: BenchScenario, args: argparse.Namespace, trunk_ms: list[float]) -> dict[str, ProductConfig]:
    n = len(sc.devices)
    by_speed = tuple((1.0 / t) / sum(1.0 / u for u in trunk_ms) for t in trunk_ms)
    cfgs = {f"single_product_{i}": ProductConfig("single", False, tuple(float(i == j) for j in range(n)),
                                                  args.slab_rows, args.min_run_rows) for i in range(n)}
    cfgs["equal"] = ProductConfig("stripes", False, (1.0,) * n, args.slab_rows, args.min_run_rows)
    cfgs["no_stream"] = ProductConfig("stripes", False, by_speed, WHOLE, WHOLE)
    # ours: the scheduler's shares and the planner's choice; static_shares only matter until
    # the scheduler's first assignment (as in config/hetero_inference.yaml: equal)
    cfgs["ours"] = ProductConfig("auto", True, (1.0,) * n, args.slab_rows, args.min_run_rows)
    return cfgs


def _adopt_scheduler(driver: Driver, cfg: ProductConfig, frames: list[np.ndarray], say: Any) -> str:
    """Run ours until the coordinator runs the scheduler's (adaptive) shares; the policy seen."""
    driver.configure(cfg)
    policy = ""
    for k in range(SCHEDULER_FRAMES):
        driver.product_frame(frames[k % len(frames)])
        p = driver.latest_plan()
        policy = p.policy if p is not None else ""
        if policy == "adaptive":
            break
    say(f"[bench] ours: coordinator policy '{policy}' after the scheduler warm-up"
        + ("" if policy == "adaptive" else " (WARNING: the scheduler's assignment was not adopted)"))
    return policy


def run(args: argparse.Namespace, sc: BenchScenario, say: Any) -> dict:
    """One scenario end to end: start the graph, measure every variant, the result dict."""
    graph = build_model_graph(sc)  # before any namespace or process: a bad model fails at once
    links, link_note = _open_links(args, sc)
    tmp = Path(tempfile.mkdtemp(prefix="kaitian_bench_inf_"))
    gp: Graph | None = None
    driver: Driver | None = None
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    try:
        if links is not None:
            links.open()
            link_note = links.describe()
        say(f"[bench] scenario {sc.describe()}")
        say(f"[bench] link: {link_note}")
        gp = Graph(args, sc, links, tmp)
        gp.start()
        driver = _start_driver(gp, graph)
        driver.wait_ready(args.startup_timeout)
        if load_start > (os.cpu_count() or 1):
            say(f"[bench] WARNING: load average {load_start:.1f} > {os.cpu_count()} CPUs: other work shares "
                f"these cores, latencies are inflated and noisy")
        say(f"[bench] {len(gp.procs)} processes ready after {time.monotonic() - t_start:.1f} s")
        frames = _frames(args.frames, sc.height, sc.width)
        measure = Measurer(frames, gp)
        trunk_ms = _trunk_alone(driver, gp, frames, args.solo_frames)
        say("[bench] trunk alone (worker, EMULATED speeds): " + ", ".join(
            f"device {i} {t:.1f} ms" for i, t in enumerate(trunk_ms)))
        search = _layerwise_search(driver, gp, measure, args.search_frames)
        best_lw = min(search, key=lambda r: r["median_ms"])
        say(f"[bench] layer-wise search: {len(search)} (order, cut) pairs; best device {best_lw['first']} "
            f"-> cut value {best_lw['cut_value']} {tuple(best_lw['cut_shape'])} -> device "
            f"{best_lw['second']} ({best_lw['median_ms']:.1f} ms)")
        cfgs = _product_configs(sc, args, trunk_ms)
        policy = _adopt_scheduler(driver, cfgs["ours"], frames, say)
        series = _measure_rounds(driver, gp, measure, cfgs, best_lw, args, say)
        sent = {k: _sent_bytes(v) for k, v in links.qdisc_stats().items()} if links is not None else {}
        res = _result(sc, args, driver, series, cfgs, trunk_ms, search, link_note, links is not None)
        res["ours_policy"] = policy
        res["profiles_at_end"] = driver.profile_summary()
        res["tbf_bytes_sent"] = sent
        res["scenario"] |= {"load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()[0]}
        res["wall_s"] = round(time.monotonic() - t_start, 1)
        return res
    finally:
        if driver is not None:
            driver.close()
        if gp is not None:
            gp.stop()
        if links is not None:
            links.close()


def _measure_rounds(driver: Driver, gp: Graph, measure: Measurer, cfgs: dict[str, ProductConfig],
                    best_lw: dict, args: argparse.Namespace, say: Any) -> dict[str, Series]:
    """Every variant, interleaved in rounds: slow drift of the machine's load hits all alike."""
    out_value = driver.graph.output_value
    chains = {f"single_whole_{i}": [(w, 0, out_value)] for i, w in enumerate(gp.workers)}
    chains["layerwise"] = [(gp.workers[best_lw["first"]], 0, best_lw["cut_value"]),
                           (gp.workers[best_lw["second"]], best_lw["cut_value"], out_value)]
    series = {k: Series(k, c.summary()) for k, c in cfgs.items()}
    series |= {f"single_whole_{i}": Series(f"single_whole_{i}", {"device": i, "one call, whole trunk": True})
               for i in range(len(gp.workers))}
    series["layerwise"] = Series("layerwise", {k: best_lw[k] for k in ("first", "second", "cut_value")})
    per_round = max(1, args.frames // args.rounds)
    for r in range(args.rounds):
        for name, cfg in cfgs.items():
            driver.configure(cfg)
            if name == "ours":
                measure(series[name], driver.ours_frame, per_round, warmup=OURS_WARMUP)
            else:
                measure(series[name], driver.product_frame, per_round, warmup=2 if r == 0 else 1)
        for name, chain in chains.items():
            measure(series[name], functools.partial(_layerwise, driver, chain), per_round)
        say(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {s.median:.1f}" for k, s in series.items()) + " ms")
    return series


def _bound(sc: BenchScenario, graph: Any, trunk_ms: list[float]) -> dict:
    c, h, w = graph.input_shape
    oc, oh, ow = graph.trunk_output_shape
    # the camera's uint8 image must reach the devices, the float32 trunk output come back
    min_bytes = c * h * w + 4 * oc * oh * ow
    compute_bound = 1.0 / sum(1.0 / t for t in trunk_ms)
    # with a local device nothing has to cross a link (it could compute everything itself)
    link_bound = 0.0 if sc.local else min_bytes / (sc.n_remote * sc.mbit * 1e6 / 8 / 1e3)
    return {"compute_bound_ms": round(compute_bound, 2), "link_bound_ms": round(link_bound, 2),
            "bound_ms": max(compute_bound, link_bound), "device_trunk_ms": [round(t, 2) for t in trunk_ms],
            "min_bytes": min_bytes, "n_remote": sc.n_remote,
            "formula": "max(1 / sum_i(1 / trunk_ms_i), link bound); link bound = (image uint8 + trunk output "
                       "float32 bytes) / (n_remote links * link rate) when no device is local, else 0"}


def _ours_choice(driver: Driver, ours: Series) -> dict:
    """What the product chose: the plan that ran most of the measured ours frames, its
    prediction (median over the frames of the coordinator's current prediction) and error."""
    if not ours.plans:
        return {"chosen_strategy": "", "chosen_plan": "", "predicted_ms": None, "prediction_error": None,
                "runner_up": "", "runner_up_ms": None}
    chosen = collections.Counter(ours.plans).most_common(1)[0][0]
    with driver.lock:
        msgs = [m for _, m in sorted(driver.plans.items()) if driver.describe_plan(m) == chosen]
    msg = msgs[-1] if msgs else None
    predicted = statistics.median(ours.predicted)
    measured = ours.median
    coord = statistics.median(ours.coord) if ours.coord else float("nan")
    return {"chosen_strategy": (msg.strategy or "stripes") if msg is not None else "",
            "chosen_plan": chosen,
            "chosen_plan_frames": f"{collections.Counter(ours.plans)[chosen]}/{len(ours.plans)}",
            "predicted_ms": round(predicted, 2),
            "prediction_error": round(abs(predicted - measured) / measured, 3),
            # the coordinator predicts image received -> result published; the driver also
            # counts the image's and the result's way between it and the coordinator
            "prediction_error_vs_coordinator": round(abs(predicted - coord) / coord, 3),
            "runner_up": msg.runner_up if msg is not None else "",
            "runner_up_ms": round(float(msg.runner_up_ms), 2) if msg is not None else None}


def _result(sc: BenchScenario, args: argparse.Namespace, driver: Driver, series: dict[str, Series],
            cfgs: dict[str, ProductConfig], trunk_ms: list[float], search: list[dict], link_note: str,
            link_emulated: bool) -> dict:
    singles = [k for k in series if k.startswith("single_")]
    single_name = min(singles, key=lambda k: series[k].median)
    lat = {"single": series[single_name].median} | {k: series[k].median for k in VARIANTS[1:]}
    bound = _bound(sc, driver.graph, trunk_ms)
    bound_ms = bound.pop("bound_ms")
    # for comparison only: the product's own whole-trunk compute on each device (telemetry of
    # the single_product runs); where it is faster than the worker's, the bound is not tight
    product = [series[f"single_product_{i}"].compute.get(n) for i, n in enumerate(driver.gp.compute)]
    bound["device_trunk_ms_product"] = [round(statistics.median(c), 2) if c else None for c in product]
    best_other = min(v for k, v in lat.items() if k != "ours")
    per_round = max(1, args.frames // args.rounds)
    return {
        "latency_ms": {k: round(v, 2) for k, v in lat.items()},
        "bound_ms": round(bound_ms, 2),
        "speedup_vs_single": round(lat["single"] / lat["ours"], 3),
        "speedup_vs_best_other": round(best_other / lat["ours"], 3),
        "ours_over_bound": round(lat["ours"] / bound_ms, 3),
        **_ours_choice(driver, series["ours"]),
        "emulated": any(s != 1.0 for s in sc.slowdowns),
        "link_mbit": sc.mbit,
        "link_emulated": link_emulated,
        "link": link_note,
        "scenario": {"name": sc.name, "about": sc.about, "model": sc.model,
                     "input_size": sc.height if sc.height == sc.width else [sc.height, sc.width],
                     "input_height": sc.height, "input_width": sc.width, "slowdowns": list(sc.slowdowns),
                     "local_devices": list(sc.local),
                     "devices": [{"node": f"compute_{i}", "slowdown": d.slowdown, "local": d.local,
                                  "emulated": d.slowdown != 1.0} for i, d in enumerate(sc.devices)],
                     "frames_per_variant": per_round * args.rounds, "rounds": args.rounds, "quick": args.quick,
                     "cpu_count": os.cpu_count()},
        "bound": bound,
        "single_is": single_name,
        "shares": {"by_trunk_speed": list(cfgs["no_stream"].summary()["shares"]),
                   "equal": list(cfgs["equal"].summary()["shares"])},
        "variants": {k: s.summary() for k, s in series.items()},
        "layerwise_search": search,
    }


def _sent_bytes(text: str) -> int:
    parts = text.split()
    for i, p in enumerate(parts):
        if p == "Sent" and i + 1 < len(parts):
            return int(parts[i + 1])
    return 0


# =========================================================================== command line
OVERRIDES = ("slowdowns", "mbit", "model", "size", "height", "width", "local")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = BenchArgumentParser(prog="kaitian bench inference",
                            description="collaborative inference vs baselines (see module docstring)")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help=f"what runs where (default {DEFAULT_SCENARIO}; see kaitian_ros/bench/inference_scenarios.py)")
    p.add_argument("--matrix", action="store_true",
                   help="every scenario in turn: one JSON + PNG each (<stem>_<scenario>) and a summary JSON")
    p.add_argument("--json", type=Path, default=None,
                   help=f"output JSON (PNG next to it); default {RESULTS}/inference[_<scenario>].json, "
                        f"with --matrix the summary ({RESULTS}/inference_matrix.json)")
    p.add_argument("--quick", action="store_true", help="few frames (a few minutes per scenario)")
    p.add_argument("--slowdowns", type=str, default=None,
                   help="override: EMULATED slowdown per compute node, comma separated (positions keep "
                        "the scenario's local/remote; extra devices are remote)")
    p.add_argument("--local", type=int, default=None, help="override: the first N devices are local (no link)")
    p.add_argument("--mbit", type=float, default=None, help="override: link rate per remote device, Mbit/s")
    p.add_argument("--loopback", action="store_true", help="no namespaces/tbf even when root")
    p.add_argument("--model", default=None, help="override: the model")
    p.add_argument("--size", type=int, default=None, help="override: input height = width")
    p.add_argument("--height", type=int, default=None, help="override: input height (rows)")
    p.add_argument("--width", type=int, default=None, help="override: input width")
    p.add_argument("--frames", type=int, default=None, help="measured frames per variant (default 30, quick 6)")
    p.add_argument("--rounds", type=int, default=None, help="variants interleaved in this many rounds")
    p.add_argument("--slab-rows", type=int, default=64,
                   help="streamed slab rows (ours, equal, single); default 64 as in hetero_inference.yaml")
    p.add_argument("--min-run-rows", type=int, default=32,
                   help="compute nodes' min_run_rows for the streamed variants (hetero_inference.yaml: 32)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    a = p.parse_args(argv)
    if a.matrix:
        given = [f"--{k}" for k in ("scenario", *OVERRIDES) if getattr(a, k) is not None]
        if given:
            p.error(f"--matrix runs the scenarios as defined; it takes no {', '.join(given)}")
    if a.slowdowns is not None:
        try:
            a.slowdowns = tuple(float(s) for s in a.slowdowns.split(","))
        except ValueError:
            p.error(f"--slowdowns must be numbers separated by commas, got {a.slowdowns!r}")
    if a.size is not None and (a.height is not None or a.width is not None):
        p.error("--size sets both height and width; give either --size or --height/--width")
    for name in ("frames", "rounds", "slab_rows", "min_run_rows"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    n_devices = len(a.slowdowns or SCENARIOS[a.scenario or DEFAULT_SCENARIO].devices)
    if a.local is not None and not 0 <= a.local <= n_devices:
        p.error(f"--local must be between 0 and the number of devices ({n_devices}), got {a.local}")
    a.scenarios = list(SCENARIOS.values()) if a.matrix else [_chosen_scenario(a)]
    for sc in a.scenarios:
        if problem := scenario_problem(sc):
            p.error(problem)
    a.frames = a.frames or (6 if a.quick else 30)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.solo_frames = 3 if a.quick else 8
    a.search_frames = 1 if a.quick else 2
    return a


def _chosen_scenario(a: argparse.Namespace) -> BenchScenario:
    base = SCENARIOS[a.scenario or DEFAULT_SCENARIO]
    height = a.size if a.size is not None else a.height
    width = a.size if a.size is not None else a.width
    return with_overrides(base, slowdowns=a.slowdowns, mbit=a.mbit, model=a.model, height=height, width=width,
                          local=a.local)


def _one_line(message: str, code: int) -> int:
    print(f"kaitian bench inference: {message}", file=sys.stderr)
    return code


def _json_path(a: argparse.Namespace) -> Path:
    if a.json is not None:
        return a.json
    if a.matrix:
        return RESULTS / "inference_matrix.json"
    name = a.scenarios[0].name
    return RESULTS / ("inference.json" if name == DEFAULT_SCENARIO else f"inference_{name}.json")


def _write(res: dict, path: Path) -> Path:
    from kaitian_ros.bench import inference_report as report

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    png = path.with_suffix(".png")
    report.plot(res, png)
    return png


def _run_one(args: argparse.Namespace, sc: BenchScenario, path: Path, say: Any) -> dict:
    from kaitian_ros.bench import inference_report as report

    res = run(args, sc, say)
    png = _write(res, path)
    print(report.table(res))
    print(f"[bench] wrote {path} and {png} ({res['wall_s']} s)", flush=True)
    return res


def _run_matrix(args: argparse.Namespace, path: Path, say: Any) -> int:
    """Every scenario in turn; a failed one is reported in the summary and the others still run."""
    from kaitian_ros.bench import inference_report as report

    t0 = time.monotonic()
    results: dict[str, dict] = {}
    failed = 0
    for sc in args.scenarios:
        one = path.with_name(f"{path.stem}_{sc.name}.json")
        try:
            results[sc.name] = _run_one(args, sc, one, say) | {"file": str(one)}
        except (RuntimeError, ValueError) as exc:
            failed += 1
            results[sc.name] = {"error": " ".join(str(exc).split())[:500]}
            say(f"[bench] scenario {sc.name} FAILED: {results[sc.name]['error']}")
    summary = report.summary(results, quick=args.quick, wall_s=round(time.monotonic() - t0, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(report.summary_table(summary))
    print(f"[bench] wrote {path} ({summary['wall_s']} s)", flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    args = parse_args(argv)
    path = _json_path(args)

    def say(line: str) -> None:
        print(line, flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    prev_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    try:
        if args.matrix:
            return _run_matrix(args, path, say)
        _run_one(args, args.scenarios[0], path, say)
        return 0
    except KeyboardInterrupt:
        return _one_line("interrupted (namespaces, qdiscs and processes cleaned up)", 130)
    except ValueError as exc:  # the scenario cannot run here (model, input size): before anything started
        return _one_line(str(exc), 2)
    except RuntimeError as exc:
        return _one_line(str(exc), 1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, prev_int)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
