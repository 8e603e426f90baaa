"""The adaptivity benchmark's metric (pure functions over recorded answers): a run is
normalised by its calibration phase - the same equal-share plan in every run - so a policy
that did well in its own start phase is not judged against a lower baseline, and a machine
that was slower during one run does not count against that run's policy."""

from __future__ import annotations

from kaitian_ros.bench.adaptivity_metrics import PHASES, PolicyRun, combine_rounds, summarise

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


def test_with_a_reference_a_phase_is_judged_in_ms_against_the_best_fixed_plan() -> None:
    """Same round, two runs whose calibrations differ 1.6x (this machine's noise, not the
    policies): by the calibration both re-converge or not depending on that noise; against the
    round's measured best fixed plan (ms) the one that is fastest in ms re-converges and the one
    that stays 1.3x slower does not."""
    fast = _timeline(calibration=_flat(50.0), killed=_recovering(900.0, 56.0, 1))
    slow = _timeline(calibration=_flat(80.0), killed=_flat(72.0))
    reference = {"slowed": 66.0, "recovered": 66.0, "killed": 55.0}
    out = summarise([_run("fast", fast), _run("slow", slow)], reference)["policies"]
    assert out["fast"]["phases"]["killed"]["requests_to_reconverge"] == 0  # rolling median of 3 from the start
    assert out["fast"]["phases"]["killed"]["reference_ms"] == 55.0
    assert out["slow"]["phases"]["killed"]["reconverged"] is False
    assert out["slow"]["requests_to_reconverge"] == PHASE_LEN
    # the calibration-normalised verdict is kept beside it, and here it is the other way round
    assert out["fast"]["requests_to_reconverge_calibrated"] == PHASE_LEN
    assert out["slow"]["phases"]["killed"]["requests_to_reconverge_calibrated"] == 0
    rounds = combine_rounds([[_run("fast", fast)], [_run("fast", fast)]], [reference, None])["policies"]["fast"]
    assert rounds["requests_to_reconverge_per_round"] == [2, 2]
    assert rounds["requests_to_reconverge_calibrated_per_round"] == [2, 2]
    assert rounds["worst_round"] == 2 and rounds["reconverged_every_phase_every_round"] is True


def test_reference_plans_are_every_alive_single_node_and_stripes_by_speed() -> None:
    import math

    from kaitian_ros.bench.adaptivity import reference_plans

    names = ["compute_0", "compute_1", "compute_2"]
    plans = reference_plans(names, [1.0, 3.0, 1.0])
    assert [p[0] for p in plans] == ["single compute_0", "single compute_1", "single compute_2", "stripes by speed"]
    assert plans[1][1:] == ("single", [0.0, 1.0, 0.0])
    assert plans[3][1] == "stripes" and plans[3][2] == [1.0, 1 / 3, 1.0]
    dead = reference_plans(names, [1.0, 1.0, math.inf])
    assert [p[0] for p in dead] == ["single compute_0", "single compute_1", "stripes by speed"]
    assert dead[-1][2] == [1.0, 1.0, 0.0]
    assert [p[0] for p in reference_plans(names, [1.0, math.inf, math.inf])] == ["single compute_0"]


def test_equal_plans_spread_compares_single_plans_of_nodes_at_the_same_speed_only() -> None:
    import math

    from kaitian_ros.bench.adaptivity import equal_plans_spread

    names = ["compute_0", "compute_1", "compute_2"]
    plans = {"single compute_0": 20.0, "single compute_1": 60.0, "single compute_2": 25.0, "stripes by speed": 10.0}
    # compute_1 is slowed 3x: only compute_0 and compute_2 run at the same speed
    assert equal_plans_spread(plans, names, [1.0, 3.0, 1.0]) == 1.25
    assert equal_plans_spread(plans, names, [1.0, 1.0, 1.0]) == 3.0
    assert equal_plans_spread(plans, names, [1.0, 3.0, math.inf]) is None  # no two alive at one speed
    assert equal_plans_spread({"single compute_0": 20.0}, names, [1.0, 1.0, 1.0]) is None


def test_a_run_is_judged_against_the_reference_measured_in_its_own_launch() -> None:
    """Two launches of one round ran at different machine speeds (the same answers 1.3x apart):
    each is judged against the reference measured in its own launch, so the slower launch is
    not a miss merely for being slower; the round's common reference applies only to a run
    without its own."""
    fast = _timeline(slowed=_flat(50.0))
    slow = _timeline(slowed=_flat(65.0))
    own_fast = _run("fast", fast)
    own_fast.reference_ms = {"slowed": 50.0, "recovered": 66.0, "killed": 55.0}
    own_slow = _run("slow", slow)
    own_slow.reference_ms = {"slowed": 64.0, "recovered": 66.0, "killed": 55.0}
    round_reference = {"slowed": 50.0, "recovered": 66.0, "killed": 55.0}
    out = summarise([own_fast, own_slow], round_reference)["policies"]
    assert out["slow"]["phases"]["slowed"]["reference_ms"] == 64.0
    assert out["slow"]["phases"]["slowed"]["reconverged"] is True
    assert out["fast"]["phases"]["slowed"]["reference_ms"] == 50.0
    # without its own, the slow launch is judged against the round's: never within 1.10x
    out = summarise([_run("fast", fast), _run("slow", slow)], round_reference)["policies"]
    assert out["slow"]["phases"]["slowed"]["reconverged"] is False
    assert out["slow"]["phases"]["slowed"]["reference_ms"] == 50.0
