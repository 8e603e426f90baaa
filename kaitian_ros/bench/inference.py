"""``kaitian bench inference``: collaborative inference against its baselines, in one run.

Real processes of the product: a Zenoh router and the bench driver in the root network
namespace, the real ``coordinator`` node next to them, and one real ``compute`` node per device,
each device in its own network namespace behind a veth pair rate limited with tbf in both
directions (``bench/netns.py``; needs root, otherwise loopback and the output says so). Device
speeds are EMULATED with ``emulated_slowdown`` (a node sleeps (s-1)x each real compute).

On the same frames, driver-side end-to-end latency (Image published -> FusedOutput received) of

* ``single``    best single device: min of (a) the product with every row on the fastest node
                (streamed) and (b) a dedicated worker running the whole trunk there in one call;
* ``layerwise`` Neurosurgeon-style split: device X runs the trunk up to a cut, sends the
                activation over the link, device Y runs the rest; every cut candidate and both
                orders are tried and the best is measured (bench workers, same links);
* ``equal``     operator (row-stripe) split with equal shares;
* ``no_stream`` our split by device speed with slab = whole stripe and one run per op;
* ``ours``      our split by device speed, streamed in slabs;

and the physical bound ``max(total compute / sum of device speeds, minimum bytes / link rate)``
where each device's trunk time is measured in the same run (worker, whole trunk in one call).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
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

DEFAULT_JSON = Path("bench/results/inference.json")
LW_TOPIC_PREFIX = "/kaitian/bench/lw/"
LW_TELEMETRY = "/kaitian/bench/lw_telemetry"
DRIVER = "bench"
VARIANTS = ("single", "layerwise", "equal", "no_stream", "ours")
WHOLE = 4096  # slab_rows / min_run_rows meaning "whole stripe" / "one run per op"


def lw_topic(name: str) -> str:
    return LW_TOPIC_PREFIX + name


# =========================================================================== layer-wise worker
def _worker_parameters() -> tuple:
    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.runtime.api import ParameterDescriptor as P
    from kaitian_ros.runtime.api import ParameterType as T

    return ic.MODEL_PARAMETERS + (
        P("threads", T.INTEGER, 1, "torch CPU threads", 1, 256),
        P("emulated_slowdown", T.DOUBLE, 1.0, "EMULATED slower device: sleep (s-1)x each compute",
          1.0, 100.0),
    )


class LayerwiseWorker:
    """Bench-only node: runs trunk values [segment, plan_version) of a chunk's tensor in one call
    (fused ops, whole rows) and sends the result to ``header.frame_id`` (next device or the bench
    driver). Two of them chained are the Neurosurgeon-style layer-wise split; one alone is a
    single device running the whole trunk."""

    def __init__(self, rt: Any) -> None:
        import torch

        from kaitian_ros.nodes import inference_common as ic

        self.rt, self.ic, self.torch = rt, ic, torch
        self.params = rt.declare_parameters(_worker_parameters())
        torch.set_num_threads(self.params["threads"])
        self.graph = ic.build_graph(ic.ModelSpec.from_params(self.params))
        self.pubs: dict[str, Any] = {}
        self.telemetry = rt.create_publisher(LW_TELEMETRY, "NodeTelemetry")
        rt.create_subscription(lw_topic(rt.node_name), "TensorChunk", self._on_chunk)
        rt.create_timer(0.5, self._heartbeat)

    def _heartbeat(self) -> None:
        from kaitian_ros.runtime import interfaces

        self.telemetry.publish(interfaces.make("NodeTelemetry", node_id=self.rt.node_name, request_id=0))

    def _on_chunk(self, msg: Any) -> None:
        from kaitian_ros.runtime import interfaces

        ic, g = self.ic, self.graph
        try:
            x = ic.chunk_rows(msg)
            if x.dtype == self.torch.uint8:  # pixels, like the product's INPUT chunks
                from kaitian_ros.core.tensors import normalise_input

                x = normalise_input(x, g.input_shape[0])
            first, last, nxt = int(msg.segment), int(msg.plan_version), msg.header.frame_id
            if not (0 <= first < last <= g.output_value) or (first and first not in g.cut_values):
                raise ValueError(f"bad range [{first},{last})")
        except (ValueError, interfaces.DecodeError) as exc:
            self.rt.rejected.count(f"bad chunk: {exc}")
            return
        t0 = time.perf_counter()
        with self.torch.no_grad():
            y = g.run_ops(x, first, last)
        spent = time.perf_counter() - t0
        s = self.params["emulated_slowdown"]
        if s > 1.0:
            time.sleep((s - 1.0) * spent)
            spent *= s
        pub = self.pubs.get(nxt)
        if pub is None:
            pub = self.pubs[nxt] = self.rt.create_publisher(lw_topic(nxt), "TensorChunk")
        pub.publish(ic.chunk_message(
            request_id=int(msg.request_id), plan_version=g.output_value, producer=self.rt.node_name,
            consumer=nxt, segment=last, role=ic.ROLE_HALO if last < g.output_value else ic.ROLE_OUTPUT,
            row_offset=0, total_rows=y.shape[2], rows=y, frame_id=DRIVER))
        self.telemetry.publish(interfaces.make(
            "NodeTelemetry", node_id=self.rt.node_name, request_id=int(msg.request_id),
            plan_version=first * 1000 + last, compute_ms=spent * 1e3, emulated=s != 1.0,
            emulated_slowdown=s, bytes_in=len(msg.data), bytes_out=y.numel() * 4))


def worker_main(argv: list[str]) -> int:
    from kaitian_ros.runtime import run_node

    return run_node(LayerwiseWorker, "lw_worker", argv)


# =========================================================================== processes
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


class Graph:
    """Router + node processes (in namespaces when links are emulated); stop() cleans up."""

    def __init__(self, args: argparse.Namespace, links: Any, tmp: Path) -> None:
        self.args, self.links, self.tmp = args, links, tmp
        self.procs: list[Proc] = []
        self.router: Any = None
        n = len(args.slowdowns)
        self.compute = [f"compute_{i}" for i in range(n)]
        self.workers = [f"lw_{i}" for i in range(n)]
        port = _free_port()
        if links is not None:
            self.host = links.host_ip(0)
            self.router_ep = f"tcp/{self.host}:{port}"
        else:
            self.host = "127.0.0.1"
            self.router_ep = f"tcp/127.0.0.1:{port}"

    def params_file(self) -> Path:
        import yaml

        a = self.args
        model = {"model": a.model, "input_height": a.size, "input_width": a.size, "num_classes": 1000,
                 "seed": 0, "slab_rows": a.slab_rows, "plan_link_mbit": float(a.mbit)}
        doc: dict[str, Any] = {"coordinator": {"ros__parameters": model | {
            "compute_nodes": self.compute, "static_shares": [1.0] * len(self.compute),
            "use_scheduler": False, "max_in_flight": 1, "request_timeout_s": 30.0,
            "dead_after_s": 10.0, "threads": 1}}}
        for i, s in enumerate(a.slowdowns):
            doc[self.compute[i]] = {"ros__parameters": model | {
                "device": "cpu", "threads": 1, "emulated_slowdown": float(s), "request_timeout_s": 60.0}}
            doc[self.workers[i]] = {"ros__parameters": model | {"threads": 1, "emulated_slowdown": float(s)}}
        path = self.tmp / "bench_inference.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def start(self) -> None:
        from kaitian_ros.launcher import _die_with_parent
        from kaitian_ros.runtime import zenoh_session as zs

        if self.links is not None:
            os.environ["KAITIAN_SHM"] = "0"  # this process's sessions too (router, driver)
        self.router = zs.open_session("router", listen=self.router_ep)
        pf = self.params_file()
        base = dict(os.environ, KAITIAN_ROUTER=self.router_ep, KAITIAN_RUNTIME="embedded",
                    PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        base.pop("KAITIAN_LISTEN", None)
        if self.links is not None:  # zenoh's shared-memory transport would bypass the links
            base["KAITIAN_SHM"] = "0"
        jobs: list[tuple[str, list[str], dict[str, str]]] = []
        root_env = dict(base)
        if self.links is not None:
            root_env["KAITIAN_LISTEN"] = f"tcp/{self.host}:0"
        jobs.append(("coordinator", self._cmd("kaitian_ros.nodes.coordinator", "coordinator", pf), root_env))
        for i in range(len(self.compute)):
            env, prefix = dict(base), []
            if self.links is not None:
                env["KAITIAN_LISTEN"] = f"tcp/{self.links.device_ip(i)}:0"
                prefix = self.links.exec_prefix(i)
            jobs.append((self.compute[i], prefix + self._cmd("kaitian_ros.nodes.compute", self.compute[i], pf), env))
            jobs.append((self.workers[i], prefix + self._cmd("kaitian_ros.bench.inference", self.workers[i], pf,
                                                              worker=True), env))
        for name, cmd, env in jobs:
            log = self.tmp / f"{name}.log"
            fh = open(log, "w")
            p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent)
            fh.close()
            self.procs.append(Proc(name, p, log))

    @staticmethod
    def _cmd(module: str, name: str, pf: Path, worker: bool = False) -> list[str]:
        return [sys.executable, "-u", "-m", module, *(["--worker"] if worker else []), "--ros-args",
                "-r", f"__node:={name}", "--params-file", str(pf)]

    def check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text()[-1500:] if p.log.exists() else ""
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}:\n{tail}")

    def stop(self) -> None:
        from kaitian_ros.launcher import stop_process_groups

        stop_process_groups([p.popen for p in self.procs], ((signal.SIGINT, 4.0), (signal.SIGKILL, 2.0)))
        for p in self.procs:
            try:
                p.popen.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if self.router is not None:
            try:
                self.router.close()
            except Exception:
                pass
            self.router = None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =========================================================================== driver
class Driver:
    """The bench's own node: publishes frames, times FusedOutput, collects telemetry."""

    def __init__(self, graph_proc: Graph, spec: Any) -> None:
        from kaitian_ros.nodes import inference_common as ic
        from kaitian_ros.runtime import interfaces
        from kaitian_ros.runtime.api import QoS
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.graph_client import GraphClient
        from kaitian_ros.runtime.node_args import parse_node_args

        self.ic, self.interfaces, self.gp = ic, interfaces, graph_proc
        self.rt = EmbeddedRuntime(parse_node_args([], DRIVER), router=graph_proc.router_ep)
        self.client = GraphClient(router=graph_proc.router_ep)
        self.graph = ic.build_graph(spec)
        self.spec = spec
        self.fused: queue.Queue = queue.Queue()
        self.lw_out: queue.Queue = queue.Queue()
        self.telemetry: dict[tuple[str, int], Any] = {}
        self.lw_tele: dict[tuple[str, int], Any] = {}
        self.plan: Any = None
        self.plan_lock = threading.Lock()
        self.image_pub = self.rt.create_publisher("/camera/image_raw", "Image")
        self.lw_pubs = {w: self.rt.create_publisher(lw_topic(w), "TensorChunk") for w in graph_proc.workers}
        self.rt.create_subscription(ic.FUSED_TOPIC, "FusedOutput", lambda m: self.fused.put((time.perf_counter(), m)))
        self.rt.create_subscription(lw_topic(DRIVER), "TensorChunk", lambda m: self.lw_out.put((time.perf_counter(), m)))
        self.rt.create_subscription(ic.TELEMETRY_TOPIC, "NodeTelemetry", self._on_tele)
        self.rt.create_subscription(LW_TELEMETRY, "NodeTelemetry", self._on_lw_tele)
        self.rt.create_subscription(ic.PLAN_TOPIC, "LoadAssignment", self._on_plan, QoS.LATCHED)
        self.workers_seen: set[str] = set()
        self.thread = threading.Thread(target=self.rt.spin, daemon=True)
        self.thread.start()
        self.request = 0

    def _on_tele(self, m: Any) -> None:
        if m.request_id:
            self.telemetry[(m.node_id, int(m.request_id))] = m

    def _on_lw_tele(self, m: Any) -> None:
        self.workers_seen.add(m.node_id)
        if m.request_id:
            self.lw_tele[(m.node_id, int(m.request_id))] = m

    def _on_plan(self, m: Any) -> None:
        with self.plan_lock:
            if self.plan is None or m.version >= self.plan.version:
                self.plan = m

    def close(self) -> None:
        self.rt.shutdown()
        self.thread.join(timeout=2.0)
        self.client.close()
        self.rt.close()

    # --- setup ------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = set(self.gp.compute)
        while time.monotonic() < deadline:
            self.gp.check_alive()
            with self.plan_lock:
                p = self.plan
            if p is not None and set(p.node_ids) == want and set(self.gp.workers) <= self.workers_seen:
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not ready after {timeout_s:.0f} s (plan: "
                           f"{None if self.plan is None else list(self.plan.node_ids)}, workers seen: "
                           f"{sorted(self.workers_seen)}); logs in {self.gp.tmp}")

    def configure(self, shares: list[float], slab_rows: int, min_run_rows: int) -> None:
        ok, why = self.client.set_parameters("coordinator", {"slab_rows": int(slab_rows),
                                                             "static_shares": [float(s) for s in shares]})
        if not ok:
            raise RuntimeError(f"coordinator refused parameters: {why}")
        for n in self.gp.compute:
            ok, why = self.client.set_parameters(n, {"min_run_rows": int(min_run_rows)})
            if not ok:
                raise RuntimeError(f"{n} refused min_run_rows: {why}")
        total = sum(shares)
        want = {n: s / total for n, s in zip(self.gp.compute, shares) if s > 0}
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with self.plan_lock:
                p = self.plan
            got = dict(zip(p.node_ids, (float(s) for s in p.shares)))
            if set(got) == set(want) and all(abs(got[k] - want[k]) < 1e-6 for k in want):
                return
            time.sleep(0.05)
        raise RuntimeError(f"coordinator did not adopt shares {want}")

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
                "node_compute_ms": {n: (t.compute_ms if t is not None else None) for n, t in nodes.items()},
                "node_rows": dict(zip(m.node_ids, (int(r) for r in m.node_rows)))}

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
        x = resize_pixels(image, self.spec.input_shape[1], self.spec.input_shape[2], self.spec.input_shape[0])
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

    def add(self, r: dict) -> None:
        if not r["ok"]:
            self.failures.append(r["status"])
            return
        self.samples.append(r["ms"])
        if "coord_ms" in r:
            self.coord.append(r["coord_ms"])
        for n, c in r.get("node_compute_ms", {}).items():
            if c is not None:
                self.compute.setdefault(n, []).append(c)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def summary(self) -> dict:
        s = sorted(self.samples)
        q = (lambda f: s[min(len(s) - 1, int(f * len(s)))]) if s else (lambda f: float("nan"))
        return {"median_ms": self.median, "p10_ms": q(0.1), "p90_ms": q(0.9), "frames": len(s),
                "failures": len(self.failures), "failure_reasons": sorted(set(self.failures))[:3],
                "coordinator_latency_median_ms": statistics.median(self.coord) if self.coord else None,
                "node_compute_median_ms": {n: statistics.median(v) for n, v in self.compute.items()},
                **self.config}


def _frames(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, size, dtype=np.float32)
    out = []
    for k in range(n):  # smooth-ish synthetic scenes with noise (content does not change the cost)
        img = (base[None, :, None] * (0.5 + 0.1 * k) + base[:, None, None] * 0.3) % 256
        img = img + rng.normal(0, 20, (size, size, 3))
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def run(args: argparse.Namespace, say: Any) -> dict:
    from kaitian_ros.bench import netns
    from kaitian_ros.nodes import inference_common as ic

    n = len(args.slowdowns)
    links, link_note = None, ""
    if args.loopback:
        link_note = "loopback (--loopback): no rate limit, link_mbit is only used for the bound"
    else:
        ok, why = netns.available()
        if ok:
            links = netns.Links(n, args.mbit)
        else:
            link_note = f"loopback ({why}): no rate limit, link_mbit is only used for the bound"
    tmp = Path(tempfile.mkdtemp(prefix="kaitian_bench_inf_"))
    gp: Graph | None = None
    driver: Driver | None = None
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    listen_before = os.environ.get("KAITIAN_LISTEN")
    try:
        if links is not None:
            links.open()
            link_note = links.describe()
        say(f"[bench] link: {link_note}")
        say(f"[bench] devices: {n} compute nodes on this CPU, slowdowns {list(args.slowdowns)} "
            f"(EMULATED: a node sleeps (s-1)x its compute)")
        gp = Graph(args, links, tmp)
        gp.start()
        spec = ic.ModelSpec(args.model, (3, args.size, args.size), 1000, 0, "")
        if links is not None:  # the driver's sessions must be reachable from the namespaces too
            os.environ["KAITIAN_LISTEN"] = f"tcp/{gp.host}:0"
        try:
            driver = Driver(gp, spec)
        finally:
            if listen_before is None:
                os.environ.pop("KAITIAN_LISTEN", None)
            else:
                os.environ["KAITIAN_LISTEN"] = listen_before
        driver.wait_ready(args.startup_timeout)
        if load_start > (os.cpu_count() or 1):
            say(f"[bench] WARNING: load average {load_start:.1f} > {os.cpu_count()} CPUs: other work shares "
                f"these cores, latencies are inflated and noisy")
        say(f"[bench] {len(gp.procs)} processes ready after {time.monotonic() - t_start:.1f} s")
        frames = _frames(args.frames, args.size)
        g = driver.graph
        out_value = g.output_value

        def measure(series: Series, fn: Any, count: int, warmup: int = 1) -> None:
            for k in range(warmup):
                fn(frames[k % len(frames)])
            for k in range(count):
                series.add(fn(frames[k % len(frames)]))
                gp.check_alive()

        # 1. each device's trunk alone, whole trunk in one call (speeds for the bound and shares)
        solo = {i: Series(f"solo_{w}", {"device": i, "slowdown": args.slowdowns[i]})
                for i, w in enumerate(gp.workers)}
        for k in range(args.solo_frames + 1):  # devices alternate: load bursts hit all alike
            for i, w in enumerate(gp.workers):
                r = driver.layerwise_frame(frames[k % len(frames)], [(w, 0, out_value)])
                if k:  # first one is a warm-up
                    solo[i].add(r)
        # best of the samples: the least disturbed by other work on these shared cores
        trunk_ms = [min(solo[i].compute[gp.workers[i]]) for i in range(n)]
        speeds = [1.0 / t for t in trunk_ms]
        fastest = int(np.argmin(trunk_ms))
        say("[bench] trunk alone: " + ", ".join(f"device {i} {t:.1f} ms" for i, t in enumerate(trunk_ms)))

        # 2. layer-wise: every cut, both orders (ordered pairs of devices), coarse, then the best
        search = []
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                for cut in g.cut_values:
                    chain = [(gp.workers[a], 0, cut), (gp.workers[b], cut, out_value)]
                    s = Series("lw", {})
                    measure(s, lambda im, c=chain: driver.layerwise_frame(im, c), args.search_frames, warmup=0)
                    search.append({"first": a, "second": b, "cut_value": cut,
                                   "cut_shape": list(g.value_shapes[cut]), "median_ms": s.median})
        best_lw = min(search, key=lambda r: r["median_ms"])
        say(f"[bench] layer-wise search: {len(search)} (order, cut) pairs; best device {best_lw['first']} "
            f"-> cut value {best_lw['cut_value']} {tuple(best_lw['cut_shape'])} -> device "
            f"{best_lw['second']} ({best_lw['median_ms']:.1f} ms)")
        lw_chain = [(gp.workers[best_lw["first"]], 0, best_lw["cut_value"]),
                    (gp.workers[best_lw["second"]], best_lw["cut_value"], out_value)]

        # 3. our shares: trunk-alone speeds are not stripe speeds (a thin stripe pays per-call
        # and weight-read costs a whole trunk amortises; the plan's solo tail runs on the
        # fastest node), so pick the best of a one-parameter family by measured latency
        by_speed = [s / sum(speeds) for s in speeds]
        balanced, calibration = _tune_shares(driver, gp, measure, speeds, args)
        say("[bench] share tuning (median ms): " + ", ".join(
            f"gamma {c['gamma']} [{', '.join(f'{x:.3f}' for x in c['shares'])}] {c['median_ms']:.1f} "
            f"(compute {'/'.join(f'{v:.0f}' for v in c['node_compute_median_ms'].values())})"
            for c in calibration) + f" -> [{', '.join(f'{x:.3f}' for x in balanced)}]")
        one_hot = [1.0 if i == fastest else 0.0 for i in range(n)]
        cfgs = {
            "single_stream": (one_hot, args.slab_rows, args.min_run_rows),
            "equal": ([1.0] * n, args.slab_rows, args.min_run_rows),
            "no_stream": (balanced, WHOLE, WHOLE),
            "ours": (balanced, args.slab_rows, args.min_run_rows),
        }
        series = {k: Series(k, {"shares": [round(x, 4) for x in v[0]], "slab_rows": v[1], "min_run_rows": v[2]})
                  for k, v in cfgs.items()}
        for k, (shares, slab, _) in cfgs.items():  # the plan the nodes derive (deterministic)
            nodes = [gp.compute[i] for i in range(n) if shares[i] > 0]
            pl = ic.plan_for(g, tuple(nodes), tuple(shares[i] for i in range(n) if shares[i] > 0), slab,
                             args.mbit)
            series[k].config["plan"] = {
                "cut_values": list(pl.cut_values), "estimated_ms": round(pl.estimated_ms, 1),
                "segment_rows": [[list(r) for r in seg.out_rows] for seg in pl.segments],
                "flops_g": [round(pl.flops_for(nd) / 1e9, 3) for nd in nodes]}
        series["single_whole"] = Series("single_whole", {"device": fastest, "one call, whole trunk": True})
        series["layerwise"] = Series("layerwise", {"first": best_lw["first"], "second": best_lw["second"],
                                                   "cut_value": best_lw["cut_value"]})
        per_round = max(1, args.frames // args.rounds)
        for r in range(args.rounds):
            for name, (shares, slab, mrr) in cfgs.items():
                driver.configure(shares, slab, mrr)
                measure(series[name], driver.product_frame, per_round, warmup=2 if r == 0 else 1)
            measure(series["single_whole"],
                    lambda im: driver.layerwise_frame(im, [(gp.workers[fastest], 0, out_value)]), per_round)
            measure(series["layerwise"], lambda im: driver.layerwise_frame(im, lw_chain), per_round)
            say(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {s.median:.1f}" for k, s in series.items()) + " ms")
        if links is not None:
            stats = links.qdisc_stats()
            sent = {k: _sent_bytes(v) for k, v in stats.items()}
        else:
            sent = {}

        single_name = min(("single_stream", "single_whole"), key=lambda k: series[k].median)
        lat = {"single": series[single_name].median, "layerwise": series["layerwise"].median,
               "equal": series["equal"].median, "no_stream": series["no_stream"].median,
               "ours": series["ours"].median}
        c, h, w = g.input_shape
        oc, oh, ow = g.trunk_output_shape
        # the camera's uint8 image must reach the devices, the float32 trunk output come back
        min_bytes = c * h * w + 4 * oc * oh * ow
        link_bytes_per_ms = args.mbit * 1e6 / 8 / 1e3
        compute_bound = 1.0 / sum(speeds)
        link_bound = min_bytes / (n * link_bytes_per_ms)  # n links in parallel
        bound = max(compute_bound, link_bound)
        best_other = min(v for k, v in lat.items() if k != "ours")
        result = {
            "latency_ms": {k: round(v, 2) for k, v in lat.items()},
            "bound_ms": round(bound, 2),
            "speedup_vs_single": round(lat["single"] / lat["ours"], 3),
            "speedup_vs_best_other": round(best_other / lat["ours"], 3),
            "ours_over_bound": round(lat["ours"] / bound, 3),
            "emulated": any(s != 1.0 for s in args.slowdowns),
            "link_mbit": args.mbit,
            "link_emulated": links is not None,
            "link": link_note,
            "scenario": {"model": args.model, "input_size": args.size, "slowdowns": list(args.slowdowns),
                         "frames_per_variant": per_round * args.rounds, "rounds": args.rounds,
                         "quick": args.quick, "cpu_count": os.cpu_count(),
                         "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()[0]},
            "bound": {"compute_bound_ms": round(compute_bound, 2), "link_bound_ms": round(link_bound, 2),
                      "device_trunk_ms": [round(t, 2) for t in trunk_ms],
                      "min_bytes": min_bytes, "formula": "max(1 / sum_i(1 / trunk_ms_i), "
                      "(image + trunk output bytes) / (n_links * link rate))"},
            "single_is": single_name,
            "shares": {"by_trunk_speed": [round(x, 4) for x in by_speed],
                       "ours": [round(x, 4) for x in balanced], "candidates": calibration},
            "variants": {k: s.summary() for k, s in series.items()},
            "layerwise_search": search,
            "tbf_bytes_sent": sent,
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        return result
    finally:
        if driver is not None:
            driver.close()
        if gp is not None:
            gp.stop()
        if links is not None:
            links.close()


GAMMAS = (1.0, 1.5, 2.0, 3.0)  # share_i ~ speed_i ** gamma candidates (see _tune_shares)


def _tune_shares(driver: Driver, gp: Graph, measure: Any, speeds: list[float],
                 args: argparse.Namespace) -> tuple[list[float], list[dict]]:
    """The lowest-latency shares of the family share_i ~ speed_i ** gamma (gamma 1 = by trunk
    speed; larger gammas tilt work to the faster devices, whose thicker stripes pay less
    per-call and weight-read overhead and who run the plan's solo tail), measured on the
    product in interleaved passes; returns them and every candidate's latency."""
    floor = 0.4 * min(speeds) / sum(speeds)  # a stripe this thin rounds away at the trunk end
    cands = []
    for gamma in GAMMAS:
        w = [s ** gamma for s in speeds]
        shares = [x / sum(w) for x in w]
        if gamma == 1.0 or min(shares) >= floor:
            cands.append((gamma, shares))
    samples: dict[float, Series] = {g: Series(f"gamma {g}", {}) for g, _ in cands}
    for _ in range(args.balance_passes):
        for gamma, shares in cands:
            driver.configure(shares, args.slab_rows, args.min_run_rows)
            measure(samples[gamma], driver.product_frame, args.balance_frames, warmup=1)
    steps = [{"gamma": g, "shares": [round(x, 4) for x in sh], "median_ms": round(samples[g].median, 2),
              "node_compute_median_ms": {n: round(v, 1) for n, v in
                                         samples[g].summary()["node_compute_median_ms"].items()}}
             for g, sh in cands]
    best = min(steps, key=lambda r: r["median_ms"])
    return dict(cands)[best["gamma"]], steps


def _sent_bytes(text: str) -> int:
    parts = text.split()
    for i, p in enumerate(parts):
        if p == "Sent" and i + 1 < len(parts):
            return int(parts[i + 1])
    return 0


# =========================================================================== output
def table(res: dict) -> str:
    lat, bound = res["latency_ms"], res["bound_ms"]
    ours = lat["ours"]
    v = res["variants"]
    src = {"single": res["single_is"], "layerwise": "layerwise", "equal": "equal", "no_stream": "no_stream",
           "ours": "ours"}
    lines = [f"{'variant':<11} {'median ms':>9} {'p90 ms':>8} {'x ours':>7} {'x bound':>8}  notes",
             "-" * 78]
    for k in VARIANTS:
        s = v[src[k]]
        if k == "single":
            note = res["single_is"] + (f", shares {s['shares']}" if "shares" in s else ", whole trunk in one call")
        elif k == "layerwise":
            note = f"device {s['first']} -> cut value {s['cut_value']} -> device {s['second']}"
        else:
            note = f"shares {s['shares']}, slab_rows {s['slab_rows']}, min_run_rows {s['min_run_rows']}"
        lines.append(f"{k:<11} {lat[k]:>9.1f} {s['p90_ms']:>8.1f} {lat[k] / ours:>7.2f} {lat[k] / bound:>8.2f}  {note}")
    lines.append(f"{'bound':<11} {bound:>9.1f} {'':>8} {bound / ours:>7.2f} {1.0:>8.2f}  "
                 f"compute {res['bound']['compute_bound_ms']} ms, link {res['bound']['link_bound_ms']} ms")
    lines.append("-" * 78)
    lines.append(f"speedup_vs_single {res['speedup_vs_single']:.2f} (target >= 1.40)   speedup_vs_best_other "
                 f"{res['speedup_vs_best_other']:.2f} (>= 1.25)   ours_over_bound {res['ours_over_bound']:.2f} (<= 1.10)")
    lines.append(f"device speeds EMULATED (slowdowns {res['scenario']['slowdowns']}); link: {res['link']}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = res["latency_ms"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(VARIANTS)
    colors = ["#999999"] * 4 + ["#2a7ab0"]
    ax.bar(names, [lat[k] for k in names], color=colors)
    ax.axhline(res["bound_ms"], color="#c0392b", linestyle="--", label=f"bound {res['bound_ms']:.1f} ms")
    for i, k in enumerate(names):
        ax.text(i, lat[k], f"{lat[k]:.1f}", ha="center", va="bottom", fontsize=9)
    sc = res["scenario"]
    ax.set_ylabel("median end-to-end latency (ms)")
    link = f"{res['link_mbit']:g} Mbit/s tbf" if res["link_emulated"] else "loopback (no rate limit)"
    ax.set_title(f"{sc['model']} {sc['input_size']}px, slowdowns {sc['slowdowns']} (EMULATED), {link}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = BenchArgumentParser(prog="kaitian bench inference",
                                description="collaborative inference vs baselines (see module docstring)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (PNG next to it); {DEFAULT_JSON}")
    p.add_argument("--quick", action="store_true", help="few frames (under a minute)")
    p.add_argument("--slowdowns", type=str, default="1.0,2.0",
                   help="EMULATED slowdown per compute node, comma separated (default 1.0,2.0)")
    p.add_argument("--mbit", type=float, default=200.0, help="link rate per device, Mbit/s (default 200)")
    p.add_argument("--loopback", action="store_true", help="no namespaces/tbf even when root")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=224, help="input height = width")
    p.add_argument("--frames", type=int, default=None, help="measured frames per variant (default 30, quick 6)")
    p.add_argument("--rounds", type=int, default=None, help="variants interleaved in this many rounds")
    p.add_argument("--slab-rows", type=int, default=64,
                   help="streamed slab rows (ours, equal, single); default 64 as in hetero_inference.yaml")
    p.add_argument("--min-run-rows", type=int, default=32,
                   help="compute nodes' min_run_rows for the streamed variants (hetero_inference.yaml: 32)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--balance-passes", type=int, default=None,
                   help="passes over the share candidates before measuring (default 2, quick 1)")
    a = p.parse_args(argv)
    try:
        a.slowdowns = tuple(float(s) for s in a.slowdowns.split(","))
    except ValueError:
        p.error(f"--slowdowns must be numbers separated by commas, got {a.slowdowns!r}")
    if len(a.slowdowns) < 2 or any(s < 1.0 for s in a.slowdowns):
        p.error("--slowdowns needs at least 2 values, each >= 1.0")
    if a.mbit <= 0:
        p.error("--mbit must be > 0")
    a.frames = a.frames or (6 if a.quick else 30)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.solo_frames = 3 if a.quick else 8
    a.search_frames = 1 if a.quick else 2
    a.balance_passes = a.balance_passes if a.balance_passes is not None else (1 if a.quick else 2)
    if a.balance_passes < 1:
        p.error("--balance-passes must be >= 1")
    a.balance_frames = 3
    return a


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    args = parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    prev_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    try:
        res = run(args, say)
    except KeyboardInterrupt:
        print("kaitian bench inference: interrupted (namespaces, qdiscs and processes cleaned up)",
              file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"kaitian bench inference: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, prev_int)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    png = args.json.with_suffix(".png")
    plot(res, png)
    print(table(res))
    print(f"[bench] wrote {args.json} and {png} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
