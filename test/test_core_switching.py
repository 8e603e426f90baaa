"""When the planner leaves a plan: `planner.worth_switching` (the running plan against the best
candidate) and `planner.simpler_margin` (a simpler strategy against the fastest), with
predictions and with measurements."""

from __future__ import annotations

import torch

from kaitian_ros.core.costs import Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import PlanSpec
from kaitian_ros.core.planner import (
    Candidate,
    Choice,
    MeasuredPlan,
    choose_plan,
    resuming,
    simpler_margin,
    spec_key,
    worth_switching,
)
from kaitian_ros.core.split import split_model

torch.set_num_threads(1)
FREE = LinkEstimate(1e18, 0.0)


def _costs(g, trunk_ms: float) -> Costs:
    """Made-up costs: row time proportional to the op's FLOPs, the trunk `trunk_ms` on a node."""
    per_flop = trunk_ms / g.trunk_flops()

    def profile(node: str) -> DeviceProfile:
        ops = tuple(OpCost(0.0, op.flops_per_row * per_flop) for op in g.ops)
        return DeviceProfile(node, 1, "m", "cpu", 1.0, ops, sum(c.ms(op.out_shape[1]) for c, op in zip(ops, g.ops)),
                             0.01, 8)

    return Costs({"a": profile("a"), "b": profile("b")}, {}, FREE)


def test_worth_switching_asks_half_the_gain_between_two_measurements() -> None:
    spec = PlanSpec.single("a")
    measured, predicted = Candidate(spec, 70.0, "a", measured_ms=60.0), Candidate(spec, 60.0, "a")
    # a prediction must promise the full gain (10 %): 64 ms running stays against 60 expected
    assert not worth_switching(64.0, True, predicted, 0.1)
    assert worth_switching(67.0, True, predicted, 0.1)
    # a plan that measured 64 ms goes back to one that measured 60 ms (half the gain: 5 %)
    assert worth_switching(64.0, True, measured, 0.1)
    assert not worth_switching(62.0, True, measured, 0.1)
    # the running plan only predicted: the full gain again, whatever the other measured
    assert not worth_switching(64.0, False, measured, 0.1)


def test_simpler_margin_shrinks_once_the_faster_plan_measured() -> None:
    single, split = PlanSpec.single("a"), PlanSpec.stripes(("a", "b"), (1.0, 1.0))
    predicted_split, measured_split = Candidate(split, 50.0, "s"), Candidate(split, 50.0, "s", measured_ms=50.0)
    predicted_single, measured_single = Candidate(single, 54.0, "a"), Candidate(single, 54.0, "a", measured_ms=54.0)
    assert simpler_margin(predicted_single, predicted_split, 0.1) == 0.1
    assert simpler_margin(measured_single, predicted_split, 0.1) == 0.1
    assert simpler_margin(measured_single, measured_split, 0.1) == 0.05
    assert simpler_margin(predicted_single, measured_split, 0.1) == 0.0


def test_a_measured_split_wins_over_a_simpler_plan_that_measured_slower() -> None:
    """Both plans ran: the layer-wise one measured 8 % faster than the single device. With the
    full simplicity margin the single device won; between two measurements it must not. (The
    model predicts 300 ms for the trunk, and the measurements carry a model error of 1/3 to the
    plans that did not run: they are expected at 100 ms; no stripes: one node has no share.)"""
    g = split_model(build_model("resnet18", in_channels=3), (3, 32, 32))
    costs = _costs(g, 300.0)
    single, layerwise = PlanSpec.single("a"), PlanSpec.layerwise("a", "b", g.cut_values[len(g.cut_values) // 2])
    measured = {spec_key(single, 8): MeasuredPlan(single, 8, 86.0),
                spec_key(layerwise, 8): MeasuredPlan(layerwise, 8, 79.6)}
    choice = choose_plan(g, ["a", "b"], costs, slab_rows=8, margin=0.1, measured=measured, whole_image=False,
                         shares=[1.0, 0.0], adapt_shares=False)
    assert choice.best.spec == layerwise and choice.best.measured_ms == 79.6
    # within half the margin the simpler measured plan still wins (no switching on noise)
    measured[spec_key(single, 8)] = MeasuredPlan(single, 8, 82.0)
    choice = choose_plan(g, ["a", "b"], costs, slab_rows=8, margin=0.1, measured=measured, whole_image=False,
                         shares=[1.0, 0.0], adapt_shares=False)
    assert choice.best.spec == single


def test_parameters_set_again_resume_the_measured_plan_unless_it_is_clearly_beaten() -> None:
    """The layer-wise plan ran under these parameters and measured 79.6 ms. A search after the
    parameters return predicts the single device at 60 ms (model error: nothing measured on
    it): that promises the full gain, so it is tried. Predicted at 75 ms it is not: the
    measured plan resumes. Measured at 78 ms (within half the margin) it is not either."""
    single, layerwise = PlanSpec.single("a"), PlanSpec.layerwise("a", "b", 5)
    ran = MeasuredPlan(layerwise, 8, 79.6)

    def choice_with(single_ms: float, single_measured: bool):
        best = Candidate(single, single_ms, "single a", measured_ms=single_ms if single_measured else None)
        return Choice(best, None, (best, Candidate(layerwise, 90.0, "layerwise", measured_ms=79.6)))

    tried = resuming(choice_with(60.0, False), ran, 0.1)
    assert tried.best.spec == single
    for single_ms, single_measured in ((75.0, False), (78.0, True)):
        kept = resuming(choice_with(single_ms, single_measured), ran, 0.1)
        assert kept.best.spec == layerwise and kept.best.measured_ms == 79.6
        assert kept.runner_up is not None and kept.runner_up.spec == single
    # measured clearly faster (more than half the margin): the search's choice stands
    assert resuming(choice_with(70.0, True), ran, 0.1).best.spec == single
    # nothing to resume, or the plan that ran is no candidate now (a node of it gone)
    assert resuming(choice_with(75.0, False), None, 0.1).best.spec == single
    gone = Choice(Candidate(single, 75.0, "single a"), None, (Candidate(single, 75.0, "single a"),))
    assert resuming(gone, ran, 0.1).best.spec == single


def test_switching_to_a_plan_names_another_plan_as_runner_up() -> None:
    single_a = Candidate(PlanSpec.single("a"), 60.0, "single a")
    single_b = Candidate(PlanSpec.single("b"), 62.0, "single b")
    layerwise = Candidate(PlanSpec.layerwise("a", "b", 3), 70.0, "layerwise a->b")
    choice = Choice(single_a, layerwise, (single_a, single_b, layerwise))
    assert choice.switched_to(single_b).runner_up is single_a  # the round's best, now passed over
    # a measured return to the round's own best: the runner-up stays another plan, not itself
    measured_a = Candidate(PlanSpec.single("a"), 60.0, "single a", measured_ms=58.0)
    again = choice.switched_to(measured_a)
    assert again.best is measured_a and again.runner_up is layerwise
