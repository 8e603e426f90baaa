"""The measurement of one ``kaitian bench inference`` scenario: start the graph, tune each
variant (the best single device, the best layer-wise cut, the product's configurations), run
them in interleaved rounds and compute the bound and the result dict."""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.bench.inference_driver import Driver, ProductConfig
from kaitian_ros.bench.inference_graph import Graph
from kaitian_ros.bench.inference_report import VARIANTS, ours_over_best_heldout
from kaitian_ros.bench.inference_scenarios import BenchScenario

WHOLE = 4096  # slab_rows / min_run_rows meaning "whole stripe" / "one run per op"
OURS_WARMUP = 3  # frames after switching to ours before measuring: the plan and shares settle
SCHEDULER_FRAMES = 15  # frames at most for the scheduler's first assignment to be adopted


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
    planning_rounds: int = 0  # ours: rounds the coordinator sent its planner process while measured

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
               # every frame in the order measured (rounds concatenated): spread and drift are visible
               "frames_ms": [round(x, 2) for x in self.samples],
               **self.config}
        if self.plans:
            out["plans_ran"] = dict(collections.Counter(self.plans).most_common())
            out["frames_plan"] = self.plans
            out["planning_rounds"] = self.planning_rounds
        if self.plans and len(self.plans) == len(self.samples):
            # what each plan took while it ran: tells a plan measured slow from a slow switch
            by_plan: dict[str, list[float]] = {}
            for plan, ms in zip(self.plans, self.samples):
                by_plan.setdefault(plan, []).append(ms)
            out["plans_ran_median_ms"] = {plan: round(statistics.median(v), 2) for plan, v in by_plan.items()}
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
    # the same product with every image through the coordinator: what its direct path gains
    cfgs["ours_via_coordinator"] = replace(cfgs["ours"], direct_single=False)
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
        res["coordinator_links_at_end"] = driver.coordinator_links()
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
        _keep_or_remove_logs(tmp, args.logs, sc.name, say)


def _keep_or_remove_logs(tmp: Path, logs: Path | None, scenario: str, say: Any) -> None:
    """The processes' logs go to `logs`/<scenario> when asked for, else away with their folder."""
    if logs is not None:
        dest = logs / scenario
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp), dest)
        say(f"[bench] process logs in {dest}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


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
        for name, cfg in _round_order(cfgs, r):
            driver.configure(cfg)
            if name.startswith("ours"):
                rounds_before = driver.planning_rounds()
                measure(series[name], driver.ours_frame, per_round, warmup=OURS_WARMUP)
                # planning runs in a process of its own on the same cores as the nodes
                series[name].planning_rounds += driver.planning_rounds() - rounds_before
            else:
                measure(series[name], driver.product_frame, per_round, warmup=2 if r == 0 else 1)
        for name, chain in chains.items():
            measure(series[name], functools.partial(_layerwise, driver, chain), per_round)
        say(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {s.median:.1f}" for k, s in series.items()) + " ms")
    return series


def _round_order(cfgs: dict[str, ProductConfig], r: int) -> list[tuple[str, ProductConfig]]:
    """The product variants in round `r`'s order: `ours` and `ours_via_coordinator` swap places
    every other round, so that neither always pays the switch from a fixed variant while the
    other follows its settled plan. With `ours` always first, wide_link (where the direct path
    never applies) measured `ours_via_coordinator` -20 to +10 ms off ours over six runs."""
    items = list(cfgs.items())
    names = [k for k, _ in items]
    if r % 2 and "ours" in names and "ours_via_coordinator" in names:
        i, j = names.index("ours"), names.index("ours_via_coordinator")
        items[i], items[j] = items[j], items[i]
    return items


def _bound(sc: BenchScenario, graph: Any, trunk_ms: list[float]) -> dict:
    c, h, w = graph.input_shape
    # the camera's uint8 image must reach the devices, the float32 trunk output (its
    # per-channel mean for a head that starts with a global average pool) come back
    min_bytes = c * h * w + 4 * graph.output_values_sent
    compute_bound = 1.0 / sum(1.0 / t for t in trunk_ms)
    # with a local device nothing has to cross a link (it could compute everything itself)
    link_bound = 0.0 if sc.local else min_bytes / (sc.n_remote * sc.mbit * 1e6 / 8 / 1e3)
    return {"compute_bound_ms": round(compute_bound, 2), "link_bound_ms": round(link_bound, 2),
            "bound_ms": max(compute_bound, link_bound), "device_trunk_ms": [round(t, 2) for t in trunk_ms],
            "min_bytes": min_bytes, "n_remote": sc.n_remote,
            "formula": "max(1 / sum_i(1 / trunk_ms_i), link bound); link bound = (image uint8 + trunk output "
                       "float32 bytes, its mean over H and W for a pooled head) / (n_remote links * link rate) when no "
                       "device is local, else 0"}


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
    # baselines only: ours_via_coordinator is the product too
    heldout, heldout_best = ours_over_best_heldout({k: s.samples for k, s in series.items()
                                                    if k == "ours" or not k.startswith("ours")})
    return {
        "latency_ms": {k: round(v, 2) for k, v in lat.items()},
        "bound_ms": round(bound_ms, 2),
        "speedup_vs_single": round(lat["single"] / lat["ours"], 3),
        "speedup_vs_best_other": round(best_other / lat["ours"], 3),
        "ours_over_best_heldout": round(heldout, 3),
        "best_heldout": heldout_best,
        "ours_over_bound": round(lat["ours"] / bound_ms, 3),
        # the product with its images through the coordinator minus ours (> 0: the direct path gains)
        "direct_gain_ms": round(series["ours_via_coordinator"].median - lat["ours"], 2),
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
