"""`planner.streaming_twin`: the running plan with its input sent the other way (whole image or
streamed) is tried when the model cannot tell the two apart and it has no measurement; and
`planner.measured_return`: a plan that measured faster lately is gone back to without a search."""

from __future__ import annotations

import pytest

from kaitian_ros.core.costs import Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.models import build_model
from kaitian_ros.core.planner import Choice, MeasuredPlan, choose_plan, measured_return, spec_key, streaming_twin
from kaitian_ros.core.split import split_model

SLAB = 8
LINK = LinkEstimate(2_000.0, 0.0)  # 2 kB/ms: streaming the input and not are predicted close


@pytest.fixture(scope="module")
def graph():
    return split_model(build_model("resnet18", in_channels=3), (3, 64, 64))


@pytest.fixture(scope="module")
def choice(graph) -> Choice:
    ops = tuple(OpCost(0.01, op.flops_per_row / 1e6 * 0.05) for op in graph.ops)
    trunk = sum(c.ms(op.out_shape[1]) for c, op in zip(ops, graph.ops))
    profile = DeviceProfile("a", 1, "m", "cpu", 1.0, ops, trunk, 0.01, 8)
    costs = Costs({"a": profile}, {("coordinator", "a"): LINK, ("a", "coordinator"): LINK}, LinkEstimate(1e18, 0.0))
    return choose_plan(graph, ["a"], costs, slab_rows=SLAB, strategy="single")


def _with_slab(choice: Choice, slab: int):
    return next(c for c in choice.candidates if c.spec.strategy == "single" and c.slab_rows == slab)


def test_a_streamed_plan_tries_the_whole_image_and_back(graph, choice) -> None:
    whole = graph.input_shape[1]
    streamed, one_slab = _with_slab(choice, SLAB), _with_slab(choice, whole)
    worst = max(one_slab.predicted_ms, one_slab.expected_ms)
    twin = streaming_twin(choice, streamed.spec, SLAB, worst / 1.05, whole=whole, streamed=SLAB, measured=(),
                          min_gain=0.1)
    assert twin is not None and twin.slab_rows == whole and twin.spec == streamed.spec
    # and the whole image's twin is the streamed plan
    back = streaming_twin(choice, one_slab.spec, whole, max(streamed.predicted_ms, streamed.expected_ms),
                          whole=whole, streamed=SLAB, measured=(), min_gain=0.1)
    assert back is not None and back.slab_rows == SLAB


def test_no_trial_when_the_twin_is_measured_predicted_slower_or_there_is_no_choice(graph, choice) -> None:
    whole = graph.input_shape[1]
    streamed, one_slab = _with_slab(choice, SLAB), _with_slab(choice, whole)
    worst = max(one_slab.predicted_ms, one_slab.expected_ms)
    measured = {spec_key(one_slab.spec, whole): MeasuredPlan(one_slab.spec, whole, worst)}
    assert streaming_twin(choice, streamed.spec, SLAB, worst, whole=whole, streamed=SLAB, measured=measured,
                          min_gain=0.1) is None  # measured: the planner compares the two itself
    assert streaming_twin(choice, streamed.spec, SLAB, worst / 1.2, whole=whole, streamed=SLAB, measured=(),
                          min_gain=0.1) is None  # predicted more than min_gain slower than the running plan
    assert streaming_twin(None, streamed.spec, SLAB, worst, whole=whole, streamed=SLAB, measured=(),
                          min_gain=0.1) is None
    assert streaming_twin(choice, streamed.spec, whole, worst, whole=whole, streamed=whole, measured=(),
                          min_gain=0.1) is None  # slabs of the whole image: there is no other way to send it


def test_a_twin_the_round_did_not_predict_is_not_tried(graph, choice) -> None:
    """Only candidates of the newest round: a prediction the coordinator does not have is not guessed."""
    whole = graph.input_shape[1]
    streamed = _with_slab(choice, SLAB)
    only_streamed = Choice(streamed, None, (streamed,))
    assert streaming_twin(only_streamed, streamed.spec, SLAB, 1e9, whole=whole, streamed=SLAB, measured=(),
                          min_gain=0.1) is None


def test_a_plan_that_measured_faster_lately_is_returned_to_without_a_search(graph, choice) -> None:
    """`measured_return`: the fastest measured candidate, when the running plan is worth leaving for it."""
    whole = graph.input_shape[1]
    streamed, one_slab = _with_slab(choice, SLAB), _with_slab(choice, whole)
    running = spec_key(streamed.spec, SLAB)
    measured = {spec_key(one_slab.spec, whole): MeasuredPlan(one_slab.spec, whole, 50.0),
                running: MeasuredPlan(streamed.spec, SLAB, 60.0)}
    back = measured_return(choice, measured, running, 60.0, 0.1)
    assert back is not None and back.slab_rows == whole and back.measured_ms == 50.0
    assert back.predicted_ms == one_slab.predicted_ms  # the round's prediction, not the measurement
    assert measured_return(choice, measured, running, 52.0, 0.1) is None  # within half of min_gain: noise
    assert measured_return(choice, {running: measured[running]}, running, 60.0, 0.1) is None  # nothing else ran
    assert measured_return(None, measured, running, 60.0, 0.1) is None
