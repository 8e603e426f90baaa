"""The adaptivity benchmark's metric (pure functions over recorded answers): a run is
normalised by its calibration phase - the same equal-share plan in every run - so a policy
that did well in its own start phase is not judged against a lower baseline, and a machine
that was slower during one run does not count against that run's policy."""

from __future__ import annotations

from kaitian_ros.bench.adaptivity import PHASES, PolicyRun, combine_rounds, summarise

PHASE_LEN = 12


def _run(policy: str, levels: dict[str, list[float]]) -> PolicyRun:
    """A run whose phase p answers with the latencies levels[p] (ms), requests numbered 1.."""
    records, bounds, rid = [], {}, 1
    for p in PHASES:
        bounds[p] = rid
        for ms in levels[p]:
            records.append({"request_id": rid, "plan_version": 1, "complete": True, "latency_ms": ms,
                            "shares": {}})
            rid += 1
    return PolicyRun(policy, records, bounds, 1.0, 10.0,
                     {"lost": 0, "missing": [], "incomplete": [], "duplicates": []})


def _flat(ms: float) -> list[float]:
    return [ms] * PHASE_LEN


def _recovering(spike: float, settle: float, after: int) -> list[float]:
    return [spike] * after + [settle] * (PHASE_LEN - after)


def _timeline(**phases: list[float]) -> dict[str, list[float]]:
    """A policy that re-converges 2 requests after the slowdown and at once after the
    recovery and the kill (whose first request waits out dead_after_s); `phases` replace."""
    return {"calibration": _flat(80.0), "start": _flat(70.0), "slowed": _recovering(150.0, 70.0, 3),
            "recovered": _flat(70.0), "killed": _recovering(900.0, 55.0, 1)} | phases


def test_a_good_start_phase_is_not_a_handicap() -> None:
    # both policies end every phase at the same absolute latency on an equally fast machine;
    # "fast_start" also had a better start phase. Neither may look worse for it.
    out = summarise([_run("fast_start", _timeline(start=_flat(60.0), recovered=_flat(75.0))),
                     _run("slow_start", _timeline(start=_flat(80.0), recovered=_flat(75.0)))])["policies"]
    for name in ("fast_start", "slow_start"):
        phases = out[name]["phases"]
        assert out[name]["calibration_ms"] == 80.0
        assert [phases[p]["requests_to_reconverge"] for p in ("slowed", "recovered", "killed")] == [2, 0, 0]
        assert all(phases[p]["reconverged"] for p in phases)


def test_a_slower_machine_during_one_run_is_normalised_away() -> None:
    # the second run ran on a machine 1.5x slower throughout (calibration included)
    fast = _timeline()
    slow = {p: [1.5 * x for x in xs] for p, xs in fast.items()}
    out = summarise([_run("a", fast), _run("b", slow)])["policies"]
    assert out["a"]["requests_to_reconverge"] == out["b"]["requests_to_reconverge"] == 2
    assert out["b"]["phases"]["slowed"]["steady_rel"] == out["a"]["phases"]["slowed"]["steady_rel"]


def test_a_policy_that_stays_slow_never_reconverges() -> None:
    out = summarise([_run("adaptive", _timeline()), _run("static", _timeline(slowed=_flat(130.0)))])["policies"]
    assert out["adaptive"]["requests_to_reconverge"] == 2
    assert out["static"]["phases"]["slowed"]["reconverged"] is False
    assert out["static"]["requests_to_reconverge"] == PHASE_LEN  # censored: the whole phase


def test_rounds_report_the_median_and_every_round() -> None:
    good = _timeline()
    late = _timeline(killed=_recovering(900.0, 55.0, 9))  # one round where the machine lagged
    lost = _run("a", good)
    lost.lost = {"lost": 1, "missing": [5], "incomplete": [], "duplicates": []}
    out = combine_rounds([[_run("a", good)], [_run("a", late)], [lost]])["policies"]["a"]
    assert out["requests_to_reconverge_per_round"] == [2, 8, 2]
    assert out["requests_to_reconverge"] == 2
    assert out["lost_requests"] == 1  # a lost request in any round counts
    assert len(out["rounds"]) == 3
    two = combine_rounds([[_run("a", good)], [_run("a", late)]])["policies"]["a"]
    assert two["requests_to_reconverge"] == 8  # even count: the upper median, never the kinder one
