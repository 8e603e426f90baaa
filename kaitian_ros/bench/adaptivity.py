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

The harness is :mod:`kaitian_ros.bench.adaptivity_graph`, the metrics
:mod:`kaitian_ros.bench.adaptivity_metrics`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph, check_requests, scenario_config
from kaitian_ros.bench.adaptivity_metrics import (
    EVENT_PHASES,
    RECONVERGE_FACTOR,
    ROLLING,
    PolicyRun,
    Timeline,
    combine_rounds,
)

DEFAULT_JSON = Path("bench/results/adaptivity.json")
POLICIES = ("adaptive", "static", "profile_once")
REFERENCE_ANSWERS = 10  # answers per fixed plan in the reference run (after two warm-up answers)


def run_policy(policy: str, timeline: Timeline, *, model: str, size: int, slowdowns: Sequence[float],
               dead_after_s: float, window: int, echo: bool = False) -> PolicyRun:
    """One launch, one policy: warm-up and calibration on equal static shares with the scheduler
    ignored, then the policy's start phase, then slow / recover / kill, each phase
    ``timeline.phase`` answers long counted from its first request; then, in the same launch,
    the reference of every event phase (`measure_references`)."""
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
                # drive() asks this on every answer: once the phase's first request is known it is
                # kept (a search over every answer each time took a good part of a core from the
                # graph, in the event phases only - the reference runs never paid it)
                r = bounds.get(name)
                if r is None:
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
        records = g.records()  # the policy's answers: the reference's come after them
        # every plan version the policy's answers ran under, with why the coordinator chose it
        last_version = max((r["plan_version"] for r in records), default=0)
        plans = [{"version": v, "nodes": list(m.node_ids), "shares": [round(float(x), 3) for x in m.shares],
                  "predicted_ms": round(float(m.predicted_makespan_ms), 2), "strategy": str(m.strategy),
                  "slab_rows": int(m.slab_rows), "direct": bool(m.image_topic), "reason": str(m.reason)}
                 for v, m in sorted(g.plan_table().items()) if v <= last_version]
        reference = measure_references(g, timeline, slowdowns, per_plan=REFERENCE_ANSWERS, window=window)
        return PolicyRun(policy, records, bounds, kill_detect, startup, check_requests(records), g.out.text(30),
                         extra={"reference": reference, "plans": plans}, reference_ms=reference["best_ms"])


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


def _measure_plan(g: AdaptivityGraph, strategy: str, shares: list[float], per_plan: int, window: int) -> float:
    """One fixed plan (coordinator with fixed shares and a forced strategy, as `kaitian param set`
    does): two warm-up answers, then the median of `per_plan` complete answers (ms)."""
    g.set_param("/coordinator", "strategy", strategy)
    g.set_param("/coordinator", "static_shares", shares)
    g.drive(2, window=window, timeout_s=300.0)  # the plan's first requests: new shapes
    before = len(g.fused)
    g.drive(per_plan, window=window, timeout_s=300.0)
    got = [float(m.latency_ms) for _, m in g.fused.snapshot()[before:] if m.complete]
    return round(statistics.median(got), 2) if got else math.inf


def _measure_phase(g: AdaptivityGraph, speeds: Sequence[float], per_plan: int, window: int
                   ) -> tuple[dict[str, float], str, float, float | None]:
    """Every `reference_plans` plan for `speeds` (a dead node: inf) once, then the fastest once
    more: (every plan's first-pass median, the best plan, its second measurement, the
    equal-plans spread). The fastest of several noisy measurements is biased low by the
    selection itself (the same plan on equal devices measured 17-24 ms one after the other
    here); a second measurement of the chosen plan is not."""
    candidates = reference_plans(g.compute_names, speeds)
    plans = {label: _measure_plan(g, strategy, shares, per_plan, window) for label, strategy, shares in candidates}
    label, strategy, shares = min(candidates, key=lambda c: plans[c[0]])
    return plans, label, _measure_plan(g, strategy, shares, per_plan, window), \
        equal_plans_spread(plans, g.compute_names, speeds)


def _reference_record(measured: Mapping[str, tuple[dict[str, float], str, float, float | None]]) -> dict[str, Any]:
    return {"best_ms": {p: m[2] for p, m in measured.items()},
            "best_plan": {p: m[1] for p, m in measured.items()},
            "first_pass_best_ms": {p: min(m[0].values()) for p, m in measured.items()},
            "plans": {p: m[0] for p, m in measured.items()},
            "equal_plans_spread": {p: m[3] for p, m in measured.items()}}


def measure_references(g: AdaptivityGraph, timeline: Timeline, slowdowns: Sequence[float], *, per_plan: int,
                       window: int) -> dict[str, Any]:
    """The reference of every event phase, measured in the launch whose policy it judges, after
    the policy's timeline (so that no phase the policy is judged in runs after a fixed plan
    the coordinator would remember): the scheduler ignored, every `reference_plans` plan for
    the killed phase's speeds as the timeline left them, then the killed node started again and
    the slowed and the recovered speeds set in turn. Machine speed differs between launches
    here (the same fixed plan measured up to 1.15x apart in two launches minutes apart); in
    the same launch the policy and its reference share the processes, their placement on the
    cores and the minutes they ran in."""
    names = g.compute_names
    slow, kill = names.index(timeline.slow_node), names.index(timeline.kill_node)
    speeds = list(slowdowns)
    speeds[kill] = math.inf
    g.set_param("/coordinator", "use_scheduler", False)
    measured = {"killed": _measure_phase(g, speeds, per_plan, window)}
    g.set_param("/coordinator", "strategy", "stripes")
    g.set_param("/coordinator", "static_shares", [1.0] * len(names))
    g.restart(timeline.kill_node)
    g.wait_ready(timeout_s=120.0)

    def back_in_plan() -> bool:
        plan = g.latest_plan()
        return plan is not None and timeline.kill_node in plan.node_ids

    g.drive(until=back_in_plan, window=window, timeout_s=120.0)
    speeds[kill] = slowdowns[kill]
    for phase, value in (("slowed", slowdowns[slow] * timeline.slow_factor), ("recovered", slowdowns[slow])):
        speeds[slow] = value
        g.set_param(f"/{timeline.slow_node}", "emulated_slowdown", value)
        measured[phase] = _measure_phase(g, speeds, per_plan, window)
    return _reference_record({p: measured[p] for p in EVENT_PHASES})


def run_reference(timeline: Timeline, *, model: str, size: int, slowdowns: Sequence[float], dead_after_s: float,
                  window: int, per_plan: int, echo: bool = False) -> dict[str, Any]:
    """The reference measured in a launch of its own (`--separate-reference`, the method until
    the same-launch one): for each event phase's device speeds in timeline order, every
    `reference_plans` plan once and the fastest once more (`_measure_phase`)."""
    cfg = scenario_config(model=model, height=size, width=size, slowdowns=slowdowns, policy="static",
                          static_shares=[1.0] * len(slowdowns), dead_after_s=dead_after_s,
                          coordinator={"use_scheduler": False, "static_shares": [1.0] * len(slowdowns),
                                       "strategy": "stripes"})
    measured = {}
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
            measured[phase] = _measure_phase(g, speeds, per_plan, window)
    return _reference_record(measured)


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


def _describe_reference(ref: Mapping[str, Any]) -> str:
    """Each phase's best fixed plan and its ms, and the same plan on equal nodes (slowest / fastest)."""
    best = ", ".join(f"{p} {ref['best_plan'][p]} {ms:.1f} ms (first pass {ref['first_pass_best_ms'][p]:.1f})"
                     for p, ms in ref["best_ms"].items())
    spread = ", ".join(f"{p} {x:.2f}" for p, x in ref["equal_plans_spread"].items() if x is not None)
    return f"{best}; the same plan on equal nodes, slowest / fastest: {spread or '-'}"


def print_table(summary: dict[str, Any], speeds: str) -> None:
    print(f"\nadaptivity ({speeds}; EMULATED speeds)")
    print(f"{'policy':<13}{'reconverge':>11}{'lost':>6}{'p50 ms':>9}{'p95 ms':>9}   per round  "
          f"per phase of the median round (slowed/recovered/killed)")
    for name, m in summary["policies"].items():
        per = " / ".join(f"{ph['requests_to_reconverge']}{'' if ph['reconverged'] else '(never)'}"
                         for ph in m["phases"].values())
        rounds = ",".join(map(str, m["requests_to_reconverge_per_round"]))
        cal = ",".join(map(str, m["requests_to_reconverge_calibrated_per_round"]))
        other = m.get("requests_to_reconverge_per_round_vs_separate_launch")
        also = f"; against the separate reference launch: {','.join(map(str, other))}" if other else ""
        print(f"{name:<13}{m['requests_to_reconverge']:>11}{m['lost_requests']:>6}{m['p50_ms']:>9}{m['p95_ms']:>9}"
              f"   {rounds:<10} {per:<28} (worst round {m['worst_round']}; calibration-normalised per round: "
              f"{cal}{also})")


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
    p.add_argument("--separate-reference", action="store_true",
                   help="also measure each round's reference in a launch of its own (the method before "
                        "the same-launch reference) and report re-convergence against it beside")
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
    separate: list[dict[str, Any]] = []
    t_all = time.monotonic()
    for k in range(rounds):
        order = policies[k % len(policies):] + policies[:k % len(policies)]  # drift hits all alike
        # said before the round's first run: each run takes minutes, its line comes after it
        print(f"  round {k + 1}/{rounds}: {'a reference launch, then ' if args.separate_reference else ''}"
              f"{', '.join(order)}, each with its reference in its launch", flush=True)
        if args.separate_reference:
            t = time.monotonic()
            ref = run_reference(timeline, model=args.model, size=args.size, slowdowns=slowdowns,
                                dead_after_s=args.dead_after, window=args.window, per_plan=REFERENCE_ANSWERS,
                                echo=args.echo)
            separate.append(ref)
            print(f"  round {k + 1}/{rounds} separate reference launch: {_describe_reference(ref)} "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
        runs = []
        for policy in order:
            t = time.monotonic()
            run = run_policy(policy, timeline, model=args.model, size=args.size, slowdowns=slowdowns,
                             dead_after_s=args.dead_after, window=args.window, echo=args.echo)
            runs.append(run)
            print(f"  round {k + 1}/{rounds} {policy}: {len(run.records)} answers in {time.monotonic() - t:.0f} s "
                  f"(startup {run.startup_s:.0f} s), phases from request {run.boundaries}, "
                  f"lost {run.lost['lost']}, kill detected after "
                  f"{run.kill_detect_s if run.kill_detect_s is None else round(run.kill_detect_s, 2)} s; "
                  f"reference in its launch: {_describe_reference(run.extra['reference'])}", flush=True)
        all_rounds.append(sorted(runs, key=lambda r: policies.index(r.policy)))
    summary = combine_rounds(all_rounds)
    summary["references"] = [{r.policy: r.extra["reference"] for r in runs} for runs in all_rounds]
    if separate:
        # the same answers judged against the other launch's reference (the method before)
        other = combine_rounds([[dataclasses.replace(r, reference_ms=None) for r in runs] for runs in all_rounds],
                               [ref["best_ms"] for ref in separate])["policies"]
        for name, m in summary["policies"].items():
            m["requests_to_reconverge_per_round_vs_separate_launch"] = other[name]["requests_to_reconverge_per_round"]
        summary["separate_references"] = separate
    summary["setup"] = {"model": args.model, "input": [3, args.size, args.size], "compute_nodes": 3,
                        "start_slowdowns": slowdowns, "emulated": True, "timeline": speeds,
                        "answers_per_phase": n, "warmup_answers": warm, "window": args.window,
                        "dead_after_s": args.dead_after, "reconverge_factor": RECONVERGE_FACTOR,
                        "rolling_median": ROLLING, "quick": args.quick, "rounds": rounds, "cpus": os.cpu_count(),
                        "wall_s": round(time.monotonic() - t_all, 1)}
    summary["timelines"] = [{r.policy: [{k: x[k] for k in ("request_id", "plan_version", "complete", "latency_ms",
                                                            "shares", "node_ms")} for x in r.records] for r in runs}
                            for runs in all_rounds]
    summary["plans"] = [{r.policy: r.extra["plans"] for r in runs} for runs in all_rounds]
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
