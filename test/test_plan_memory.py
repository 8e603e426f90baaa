"""core.plan_memory: what the coordinator remembers about plans that ran (pure, no graph)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kaitian_ros.core.plan import PlanSpec
from kaitian_ros.core.plan_memory import (
    MEASURED_MIN,
    OBSERVED_TTL_S,
    SPEED_CHANGE,
    PlanMemory,
    same_speed,
)
from kaitian_ros.core.planner import spec_key


@dataclass
class _Plan:  # what PlanMemory reads of a Plan
    spec: PlanSpec
    slab_rows: int = 8
    estimated_ms: float = 50.0
    whole_image: bool = False

    def active_nodes(self) -> tuple[str, ...]:
        return tuple(self.spec.node_ids)


@dataclass
class _Profile:  # what PlanMemory reads of a DeviceProfile
    trunk_ms: float
    min_run_rows: int = 8


def _run(memory: PlanMemory, plan: _Plan, samples: list[float], t0: float = 0.0, profiles=None,
         alive=("a", "b")):
    profiles = profiles or {"a": _Profile(10.0), "b": _Profile(20.0)}
    seen = None
    for i, ms in enumerate(samples):
        seen = memory.observe(plan, ms, 40.0, t0 + i, profiles, alive)
    return seen


def test_a_plan_counts_as_measured_after_measured_min_requests_and_while_valid() -> None:
    memory, plan = PlanMemory(), _Plan(PlanSpec.single("a"))
    profiles = {"a": _Profile(10.0)}
    _run(memory, plan, [50.0] * (MEASURED_MIN - 1), profiles=profiles)
    assert memory.measured(MEASURED_MIN, profiles, ("a",)) == {}
    seen = _run(memory, plan, [80.0, 52.0, 90.0], t0=2.0, profiles=profiles)
    assert seen is not None and seen.n == MEASURED_MIN + 2 and seen.ms == 52.0  # median of the window
    key = spec_key(plan.spec, plan.slab_rows)
    assert memory.measured(4.0, profiles, ("a",))[key].ms == 52.0
    # forgotten once it is old, once a node of it is gone, once its node changed speed
    assert memory.measured(4.0 + OBSERVED_TTL_S + 1, profiles, ("a",)) == {}
    assert memory.measured(4.0, profiles, ()) == {}
    assert memory.measured(4.0, {"a": _Profile(10.0 * SPEED_CHANGE * 1.01)}, ("a",)) == {}
    # ... and once its node groups rows differently (another min_run_rows: another computation)
    assert memory.measured(4.0, {"a": _Profile(10.0, min_run_rows=4096)}, ("a",)) == {}
    # a new measurement starts when the old one is no longer valid
    seen = memory.observe(plan, 70.0, 40.0, 5.0, {"a": _Profile(30.0)}, ("a",))
    assert seen is not None and seen.n == 1 and seen.trunks == {"a": 30.0}


def test_a_whole_image_plan_keeps_its_measurement_when_min_run_rows_changes() -> None:
    """Its executor runs every op once per stripe whatever the node's min_run_rows (Plan.run_rows):
    the benchmark's no_stream variant sets 4096 and measures the same computation."""
    memory, plan = PlanMemory(), _Plan(PlanSpec.single("a"), slab_rows=4096, whole_image=True)
    _run(memory, plan, [50.0] * MEASURED_MIN, profiles={"a": _Profile(10.0, min_run_rows=4096)})
    key = spec_key(plan.spec, plan.slab_rows)
    assert memory.measured(MEASURED_MIN, {"a": _Profile(10.0, min_run_rows=32)}, ("a",))[key].ms == 50.0
    assert memory.measured(MEASURED_MIN, {"a": _Profile(20.0, min_run_rows=32)}, ("a",)) == {}  # speed still counts


def test_earlier_errors_keep_the_models_error_on_a_set_of_nodes_across_a_speed_change() -> None:
    memory, plan = PlanMemory(), _Plan(PlanSpec.stripes(("a", "b"), (1.0, 1.0)))
    _run(memory, plan, [80.0] * MEASURED_MIN)
    errors = memory.earlier_errors(float(MEASURED_MIN))
    assert errors == {frozenset(("a", "b")): 2.0}  # 80 ms measured, 40 ms predicted
    assert memory.earlier_errors(OBSERVED_TTL_S + MEASURED_MIN) == {}


def test_a_node_that_left_gets_back_the_plan_it_left_only_while_the_others_keep_their_speed() -> None:
    profiles = {"a": _Profile(10.0), "b": _Profile(20.0)}
    plan = _Plan(PlanSpec.stripes(("a", "b"), (1.0, 1.0)))
    memory = PlanMemory()
    _run(memory, plan, [60.0] * MEASURED_MIN, profiles=profiles)
    memory.record_departure(plan, ["b"], 45.0, 10.0, profiles)
    d, why = memory.take_departure("b", 11.0, "auto", ("a", "b"), profiles)
    assert d is not None and why == "" and d.measured_ms == 60.0 and d.predicted_ms == 45.0
    assert memory.take_departure("b", 11.0, "auto", ("a", "b"), profiles) == (None, "")  # taken once

    memory.record_departure(plan, ["b"], 45.0, 10.0, profiles)
    d, why = memory.take_departure("b", 11.0, "auto", ("a", "b"), {"a": _Profile(20.0), "b": _Profile(20.0)})
    assert d is None and why == "b joined again, a at another speed (trunk 10.0 -> 20.0 ms): planning anew"
    # the returning node's own start-up profile is not held against it (measured otherwise)
    memory.record_departure(plan, ["b"], 45.0, 10.0, profiles)
    d, why = memory.take_departure("b", 11.0, "auto", ("a", "b"), {"a": _Profile(10.0), "b": _Profile(40.0)})
    assert d is not None and why == ""

    memory.record_departure(plan, ["b"], 45.0, 10.0, profiles)
    assert memory.take_departure("b", 11.0, "single", ("a", "b"), profiles) == (None, "")  # another strategy
    memory.record_departure(plan, ["b"], 45.0, 10.0, profiles)
    assert memory.take_departure("b", 11.0 + OBSERVED_TTL_S, "auto", ("a", "b"), profiles) == (None, "")
    # no departure is remembered without every node's profile
    memory.record_departure(plan, ["b"], 45.0, 10.0, {"a": _Profile(10.0)})
    assert memory.left_from == {}


def test_same_speed_is_within_speed_change_either_way() -> None:
    assert same_speed(10.0, 10.0 * SPEED_CHANGE) and same_speed(10.0, 10.0 / SPEED_CHANGE)
    assert not same_speed(10.0, 10.0 * SPEED_CHANGE * 1.01)


def test_beaten_means_another_valid_measurement_faster_by_more_than_the_gain() -> None:
    memory = PlanMemory()
    single, split = _Plan(PlanSpec.single("a")), _Plan(PlanSpec.stripes(("a", "b"), (1.0, 1.0)))
    _run(memory, single, [60.0] * MEASURED_MIN)
    _run(memory, split, [64.0] * MEASURED_MIN, t0=10.0)
    profiles, now = {"a": _Profile(10.0), "b": _Profile(20.0)}, 20.0
    assert memory.beaten(split, 64.0, 0.05, now, profiles, ("a", "b"))  # 60 * 1.05 < 64
    assert not memory.beaten(split, 62.0, 0.05, now, profiles, ("a", "b"))  # within the gain
    assert not memory.beaten(single, 60.0, 0.0, now, profiles, ("a", "b"))  # its own measurement is not another
    # a measurement that no longer counts beats nothing: old, or its node changed speed
    assert not memory.beaten(split, 64.0, 0.05, 3.0 + OBSERVED_TTL_S, profiles, ("a", "b"))
    assert not memory.beaten(split, 64.0, 0.05, now, {"a": _Profile(10.0 * SPEED_CHANGE * 1.01),
                                                      "b": _Profile(20.0)}, ("a", "b"))


def test_a_running_plan_keeps_its_measurement_through_a_slow_drift_but_not_a_jump() -> None:
    """Validity is judged against the speeds at the plan's latest request: a profile refined
    step by step (each step within SPEED_CHANGE) is the speed the plan ran at; a jump since the
    latest request starts the measurement again."""
    memory, plan = PlanMemory(), _Plan(PlanSpec.single("a"))
    trunk, seen = 10.0, None
    for i in range(8):  # 10 % slower each request: 1.9x over the run
        seen = memory.observe(plan, 50.0 + i, 40.0, float(i), {"a": _Profile(trunk)}, ("a",))
        trunk *= 1.1
    assert seen is not None and seen.n == 8 and seen.trunks == {"a": pytest.approx(10.0 * 1.1 ** 7)}
    key = spec_key(plan.spec, plan.slab_rows)
    assert key in memory.measured(8.0, {"a": _Profile(10.0 * 1.1 ** 7)}, ("a",))
    # not run since, its node now SPEED_CHANGE faster than at its latest request: no longer counts
    assert memory.measured(8.0, {"a": _Profile(10.0 * 1.1 ** 7 / SPEED_CHANGE / 1.01)}, ("a",)) == {}
    jumped = memory.observe(plan, 90.0, 40.0, 9.0, {"a": _Profile(10.0 * 1.1 ** 7 * SPEED_CHANGE * 1.01)}, ("a",))
    assert jumped is not None and jumped.n == 1 and jumped.samples == (90.0,)


def test_the_plan_that_ran_under_settings_resumes_while_its_measurement_is_valid() -> None:
    memory = PlanMemory()
    single, split = _Plan(PlanSpec.single("a")), _Plan(PlanSpec.stripes(("a", "b"), (1.0, 1.0)))
    profiles = {"a": _Profile(10.0), "b": _Profile(20.0)}
    auto, forced = ("auto", True), ("stripes", True)
    memory.ran_with(auto, single)
    assert memory.resumable(auto, 0.0, profiles, ("a", "b")) is None  # not measured yet
    _run(memory, single, [50.0] * MEASURED_MIN, profiles=profiles)
    memory.ran_with(forced, split)  # the user forced stripes a while
    got = memory.resumable(auto, MEASURED_MIN, profiles, ("a", "b"))
    assert got is not None and got.spec == single.spec and got.ms == 50.0
    assert memory.resumable(forced, MEASURED_MIN, profiles, ("a", "b")) is None  # never measured
    # a later plan under the same settings replaces it; stale or sped-up measurements do not resume
    memory.ran_with(auto, split)
    assert memory.resumable(auto, MEASURED_MIN, profiles, ("a", "b")) is None
    memory.ran_with(auto, single)
    assert memory.resumable(auto, MEASURED_MIN + OBSERVED_TTL_S + 1, profiles, ("a", "b")) is None
    assert memory.resumable(auto, MEASURED_MIN, {"a": _Profile(5.0), "b": _Profile(20.0)}, ("a", "b")) is None
