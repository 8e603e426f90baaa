"""What the coordinator does with the measured latency of its running plan and of a streaming
twin's trial (`nodes.coordinator_measured`), on real planner choices and a real `PlanMemory`.

The coordinator itself needs a middleware and a planner process; `CoordinatorDouble` below is a
test double holding only the state `observe_latency` reads and a plan switch that records the
new plan as running (what `Coordinator.apply_plan` does once it has decided)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kaitian_ros.core.costs import Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan_memory import PlanMemory
from kaitian_ros.core.planner import Choice, choose_plan, spec_key
from kaitian_ros.core.split import split_model
from kaitian_ros.nodes.coordinator_measured import observe_latency

SLAB = 8
LINK = LinkEstimate(2_000.0, 0.0)  # streaming the input and not are predicted close


@pytest.fixture(scope="module")
def graph():
    return split_model(build_model("resnet18", in_channels=3), (3, 64, 64))


@pytest.fixture(scope="module")
def setting(graph) -> tuple[Costs, Choice]:
    ops = tuple(OpCost(0.01, op.flops_per_row / 1e6 * 0.05) for op in graph.ops)
    trunk = sum(c.ms(op.out_shape[1]) for c, op in zip(ops, graph.ops))
    profile = DeviceProfile("a", 1, "m", "cpu", 1.0, ops, trunk, 0.01, 8)
    costs = Costs({"a": profile}, {("coordinator", "a"): LINK, ("a", "coordinator"): LINK}, LinkEstimate(1e18, 0.0))
    return costs, choose_plan(graph, ["a"], costs, slab_rows=SLAB, strategy="single")


class CoordinatorDouble:
    """Test double of `nodes.coordinator.Coordinator` for `observe_latency`: its plan state,
    measurements and parameters; a switch runs the chosen plan at once as the next version."""

    def __init__(self, graph: Any, costs: Costs, choice: Choice, running: Any) -> None:
        self.graph, self.profiles = graph, costs.profiles
        self.nodes, self.alive = ("a",), {"a"}
        self.params = {"min_plan_gain": 0.1, "strategy": "auto", "input_pacing_ms": 0.0, "slab_rows": SLAB}
        self.spec = SimpleNamespace(input_shape=graph.input_shape)
        self.memory = PlanMemory()
        self.planner = SimpleNamespace(busy=None)
        self.plans: dict[int, Any] = {}
        self.current: Any = None
        self.pending = None
        self.measure_replanned = 0
        self.twin_trial = None
        self.replans: list[str] = []
        self.choice = choice
        self._run(choice.switched_to(running))

    def _run(self, choice: Choice) -> None:
        version = (self.current.version if self.current else 0) + 1
        self.plans[version] = choice.plan(self.graph)
        self.current = SimpleNamespace(version=version)
        self.choice, self.predicted_ms = choice, choice.best.predicted_ms

    def running_plan(self) -> Any:
        return self.plans[self.current.version]

    def shares_for(self, alive: tuple[str, ...]) -> tuple[tuple[float, ...], str]:
        return (1.0,), "adaptive"

    def plan_request(self, reason: str, effective: int, force: bool) -> Any:
        return SimpleNamespace(nodes=self.nodes, reason=reason)

    def apply_plan(self, request: Any, choice: Choice, was: Any) -> None:
        self._run(choice)

    def replan_soon(self, reason: str, **_: Any) -> None:
        self.replans.append(reason)

    def running_key(self) -> tuple:
        plan = self.running_plan()
        return spec_key(plan.spec, plan.slab_rows)

    def serve(self, *latencies: float) -> None:
        for ms in latencies:
            observe_latency(self, self.running_plan(), ms)


def _plans(choice: Choice) -> tuple[Any, Any]:
    """The two single-device plans (whole image, streamed): the one predicted faster and its twin."""
    singles = sorted((c for c in choice.candidates if c.spec.strategy == "single"), key=lambda c: c.predicted_ms)
    assert len(singles) == 2 and singles[0].slab_rows != singles[1].slab_rows
    return singles[0], singles[1]


def _key(candidate: Any) -> tuple:
    return spec_key(candidate.spec, candidate.slab_rows)


def _spike_trial(graph: Any, setting: tuple[Costs, Choice]) -> tuple[CoordinatorDouble, Any, Any, float]:
    """A plan runs at its usual latency, far under its twin's prediction, then three slow
    requests make its median of five look like that prediction: the twin goes on trial."""
    costs, choice = setting
    origin, twin = _plans(choice)
    c = CoordinatorDouble(graph, costs, choice, origin)
    spike = twin.predicted_ms  # within min_plan_gain of the origin's prediction too: no planning round
    assert spike <= origin.predicted_ms * 1.1
    c.serve(*[0.7 * spike] * 6)
    assert c.running_key() == _key(origin)
    c.serve(spike, spike, spike)
    assert c.running_key() == _key(twin)  # the trial started
    return c, origin, twin, spike


def test_after_its_streaming_twin_measured_the_plan_it_was_tried_from_runs_again_measured_afresh(
        graph, setting) -> None:
    c, origin, twin, spike = _spike_trial(graph, setting)
    c.serve(spike * 0.97, spike * 0.97, spike * 0.97)  # the twin: a little under the spike, far over usual
    assert c.running_key() == _key(origin)
    assert _key(origin) not in c.memory.observed  # measured again from scratch
    assert c.memory.observed[_key(twin)].n == 3  # the twin's measurement is kept
    c.serve(*[0.7 * spike] * 6)  # measured again at its usual latency: it stays, no second trial
    assert c.running_key() == _key(origin)
    assert c.twin_trial is None


def test_a_twin_faster_than_the_plan_measured_again_is_gone_back_to(graph, setting) -> None:
    c, origin, twin, spike = _spike_trial(graph, setting)
    fast = spike * 0.9
    c.serve(fast, fast, fast)
    assert c.running_key() == _key(origin)  # measured again first
    c.serve(spike, spike, spike)  # the spike was the plan's latency now: the twin measured faster
    assert c.running_key() == _key(twin)
    c.serve(*[fast] * 6)  # and it stays: the plan it left has a measurement, no second trial
    assert c.running_key() == _key(twin)


def test_no_twin_trial_while_a_planning_round_runs(graph, setting) -> None:
    costs, choice = setting
    origin, twin = _plans(choice)
    c = CoordinatorDouble(graph, costs, choice, origin)
    c.planner.busy = object()  # a round in flight: it may be the one the measurement asked for
    spike = twin.predicted_ms
    c.serve(*[0.7 * spike] * 6, spike, spike, spike, spike)
    assert c.running_key() == _key(origin)
    c.planner.busy = None
    c.serve(spike)
    assert c.running_key() == _key(twin)  # once the round is over, the trial
