"""Pure metrics of ``kaitian bench adaptivity`` (no clock, no I/O): the timeline of a run, its
phases, steady-state latency, requests to re-converge after each change, and the summary of
several rounds (definitions in ``docs/benchmarks-adaptivity.md``)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RECONVERGE_FACTOR = 1.10


ROLLING = 3  # requests in the rolling median that decides "reconverged"


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
    # event phase -> ms: the best fixed plan for that phase's speeds, measured in this run's own
    # launch after its timeline (`adaptivity.measure_references`); None: the round's is used
    reference_ms: dict[str, float] | None = None


PHASES = ("calibration", "start", "slowed", "recovered", "killed")
EVENT_PHASES = PHASES[2:]  # the phases that start with an event to reconverge from


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

    With a reference (event phase -> ms: the best fixed plan for that phase's device speeds), a
    phase has re-converged once the rolling median of its latencies is within RECONVERGE_FACTOR
    of it. A run's own reference (`PolicyRun.reference_ms`, measured in its launch) comes first;
    else `reference`, one for every run of the round.

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
        ref = r.reference_ms if r.reference_ms is not None else reference
        for p in EVENT_PHASES:
            xs = rel[r.policy][p]
            best_p = best[p]
            k_cal = requests_to_reconverge(xs, best_p) if best_p is not None else None
            k_cal_count = len(xs) if k_cal is None else k_cal  # never: censored at the whole phase
            if ref is not None and ref.get(p) is not None:
                k = requests_to_reconverge(slices[r.policy][p], ref[p])
            else:
                k = k_cal
            k_count = len(xs) if k is None else k
            never = never or k is None
            worst, worst_cal = max(worst, k_count), max(worst_cal, k_cal_count)
            phases[p] = {"first_request": r.boundaries[p], "requests": len(xs),
                         "requests_to_reconverge": k_count, "reconverged": k is not None,
                         "reference_ms": round_or_none(ref.get(p)) if ref is not None else None,
                         "requests_to_reconverge_calibrated": k_cal_count,
                         "steady_ms": round_or_none(steady_state(slices[r.policy][p])),
                         "steady_rel": round_or_none(steady_state(xs), 3), "best_steady_rel": round_or_none(best[p], 3),
                         "p50_ms": round_or_none(statistics.median(slices[r.policy][p]) if xs else None)}
        policies[r.policy] = {
            "requests_to_reconverge": worst, "reconverged_every_phase": not never,
            "requests_to_reconverge_calibrated": worst_cal,
            "lost_requests": r.lost["lost"], "missing_ids": r.lost["missing"], "incomplete_ids": r.lost["incomplete"],
            "duplicate_ids": r.lost["duplicates"], "requests": len(r.records),
            "p50_ms": round_or_none(float(np.percentile(lat, 50)) if lat else None),
            "p95_ms": round_or_none(float(np.percentile(lat, 95)) if lat else None),
            "calibration_ms": round_or_none(norm[r.policy]),
            "start_steady_ms": round_or_none(steady_state(slices[r.policy]["start"])),
            "kill_detected_after_s": round_or_none(r.kill_detect_s, 3), "startup_s": round_or_none(r.startup_s, 1),
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
            "p50_ms": round_or_none(float(np.percentile(lat, 50)) if lat else None),
            "p95_ms": round_or_none(float(np.percentile(lat, 95)) if lat else None),
            "reconverged_every_phase": median_round["reconverged_every_phase"],
            "phases": median_round["phases"], "rounds": [r[name] for r in per_round]}
    return {"policies": out}


def round_or_none(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)
