"""The simulator and the strategy-complete planner, on made-up profiles (no timing: every
prediction is deterministic), plus one structural run of the start-up profiler."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace

import pytest
import torch

from kaitian_ros.core.costs import COORDINATOR, Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import WHOLE_RUNS, PlanSpec, build_plan
from kaitian_ros.core.planner import MeasuredPlan, choose_plan, error_key, predict, spec_key, speed_shares, stripe_specs
from kaitian_ros.core.profiling import MeasuredCosts, measure_profile, probe
from kaitian_ros.core.simulate import simulate
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import StripeRunner, run_plan_locally

torch.set_num_threads(1)

FREE = LinkEstimate(1e18, 0.0)  # a link that takes no time
SLOW = LinkEstimate(1_000.0, 0.0)  # 1 kB/ms
_GRAPHS: dict = {}


def _graph(name: str, shape=(3, 32, 32)):
    key = (name, shape)
    if key not in _GRAPHS:
        _GRAPHS[key] = split_model(build_model(name, in_channels=shape[0]), shape)
    return _GRAPHS[key]


def _profile(g, node: str, ms_per_mflop: float, *, call_ms: float = 0.01, message_ms: float = 0.01,
             min_run_rows: int = 8) -> DeviceProfile:
    """Made-up costs: row time proportional to the op's FLOPs per row."""
    ops = tuple(OpCost(call_ms, op.flops_per_row / 1e6 * ms_per_mflop) for op in g.ops)
    trunk = sum(c.ms(op.out_shape[1]) for c, op in zip(ops, g.ops))
    return DeviceProfile(node, 1, "m", "cpu", 1.0, ops, trunk, message_ms, min_run_rows)


def _bytes(g, v: int, rows: int | None = None, per_element: int = 4) -> int:
    c, h, w = g.value_shapes[v]
    return c * (h if rows is None else rows) * w * per_element


# --------------------------------------------------------------------------- simulate
def _executor_runs(g, plan, slab: int, *, min_run_rows: int) -> tuple[list[tuple[int, int]], int]:
    """The (op, rows) runs node "a"'s real stripe executor makes for `plan`'s input fed in
    `slab`-row slabs, in order, and the number of feeds; the runner must finish."""
    runs: list[tuple[int, int]] = []
    runner = StripeRunner(g, plan, "a", min_run_rows=min_run_rows, on_run=lambda j, rows, s: runs.append((j, rows)))
    x = torch.randn(1, *g.input_shape)
    starts = range(0, g.input_shape[1], slab)
    for a in starts:
        runner.feed(0, a, x[:, :, a:a + slab])
    assert runner.done
    return runs, len(starts)


def test_one_node_prediction_is_the_hand_computation() -> None:
    g = _graph("digits_cnn")
    h = g.input_shape[1]
    p = _profile(g, "a", 0.05, call_ms=0.3, message_ms=0.2, min_run_rows=10**6)
    pre, post, per_mb = 1.5, 2.5, 0.25
    costs = Costs({"a": p}, {}, FREE, pre_ms=pre, post_ms=post, send_ms_per_mb=per_mb)
    ops_ms = sum(c.ms(op.out_shape[1]) for c, op in zip(p.op_costs, g.ops))  # each op once
    in_bytes = _bytes(g, 0, per_element=1)  # uint8 image
    out_bytes = _bytes(g, g.output_value)  # float32 trunk output
    send = (in_bytes + out_bytes) * per_mb / 1e6

    plan = build_plan(g, PlanSpec.single("a"), slab_rows=h)  # the whole image in one slab
    got = simulate(g, plan, costs)
    assert got.outputs_ms == pytest.approx(send + p.message_ms + ops_ms)
    assert got.latency_ms == pytest.approx(pre + send + p.message_ms + ops_ms + post)
    assert got.node_busy_ms == {"a": pytest.approx(p.message_ms + ops_ms)}
    assert set(got.node_done_ms) == {"a"}

    # slabs of 4 rows: one message cost per slab; runs deferred until half of each op's rows
    # can go (the executor's runs: at most two per op)
    slab = 4
    plan4 = build_plan(g, PlanSpec.single("a"), slab_rows=slab)
    n_slabs = h // slab
    runs, _ = _executor_runs(g, plan4, slab, min_run_rows=10**6)
    assert len(g.ops) < len(runs) <= 2 * len(g.ops)
    runs_ms = sum(p.op_costs[j].ms(r) for j, r in runs)
    first_send = _bytes(g, 0, slab, 1) * per_mb / 1e6
    got4 = simulate(g, plan4, costs)
    assert got4.outputs_ms == pytest.approx(first_send + n_slabs * p.message_ms + runs_ms
                                            + out_bytes * per_mb / 1e6)
    assert got4.node_busy_ms["a"] == pytest.approx(n_slabs * p.message_ms + runs_ms)


def test_simulated_runs_are_the_executors_runs() -> None:
    """With eager runs the node's busy time is the message costs plus the cost of exactly the
    runs the real stripe executor makes for the same slabs (in the same order)."""
    g = _graph("digits_cnn")
    p = _profile(g, "a", 0.05, call_ms=0.3, message_ms=0.2, min_run_rows=1)
    costs = Costs({"a": p}, {}, FREE)
    plan = build_plan(g, PlanSpec.single("a"), slab_rows=5)
    runs, n_feeds = _executor_runs(g, plan, 5, min_run_rows=1)
    assert len(runs) > len(g.ops)  # several runs per op
    want = n_feeds * p.message_ms + sum(p.op_costs[j].ms(r) for j, r in runs)
    got = simulate(g, plan, costs)
    assert got.node_busy_ms["a"] == pytest.approx(want)
    # more, smaller calls cost more than one whole call per op
    batched = simulate(g, plan, Costs({"a": _profile(g, "a", 0.05, call_ms=0.3, message_ms=0.2,
                                                     min_run_rows=10**6)}, {}, FREE))
    assert got.node_busy_ms["a"] > batched.node_busy_ms["a"]


def test_a_whole_image_runs_every_op_once_per_stripe_and_the_simulator_knows() -> None:
    """With the whole image at once a node's executor does not split an op around halo rows
    still to come (`Plan.run_rows`): its runs are one per op it computes, in the executor and
    in the simulator alike, and the split result still equals one device's."""
    g = _graph("vgg11", (3, 64, 64))  # two rows at the deepest op: both stripes reach it
    h = g.input_shape[1]
    spec = PlanSpec.stripes(("a", "b"), (0.5, 0.5), cuts=(g.cut_values[3],))
    whole, streamed = build_plan(g, spec, slab_rows=h), build_plan(g, spec, slab_rows=4)
    assert whole.whole_image and not streamed.whole_image
    assert whole.run_rows(1) == WHOLE_RUNS and streamed.run_rows(1) == 1
    x = torch.randn(1, *g.input_shape)
    runners: dict[str, StripeRunner] = {}
    got = run_plan_locally(g, whole, x, min_run_rows=whole.run_rows(1), runners_out=runners)
    torch.testing.assert_close(got, g.run_trunk(x), rtol=1e-4, atol=1e-4)
    profiles = {n: _profile(g, n, 0.05, min_run_rows=1) for n in ("a", "b")}
    predicted = simulate(g, whole, Costs(profiles, {}, FREE))
    # both stripes reach through every op: one run per op on each node
    executed = {n: r.stats()["runs"] for n, r in runners.items()}
    assert predicted.node_runs == executed == dict.fromkeys(runners, len(g.ops))
    eager = simulate(g, replace(whole, slab_rows=h - 1), Costs(profiles, {}, FREE))
    assert all(eager.node_runs[n] > predicted.node_runs[n] for n in runners)  # one row short of whole: split runs


def test_a_slower_link_costs_bytes_over_rate() -> None:
    g = _graph("digits_cnn")
    p = _profile(g, "a", 0.05, min_run_rows=10**6)
    plan = build_plan(g, PlanSpec.single("a"), slab_rows=g.input_shape[1])
    fast = simulate(g, plan, Costs({"a": p}, {}, FREE)).latency_ms
    rate, lat = 1_000.0, 0.7
    link = LinkEstimate(rate, lat)
    slow = simulate(g, plan, Costs({"a": p}, {(COORDINATOR, "a"): link, ("a", COORDINATOR): link},
                                   FREE)).latency_ms
    nbytes = _bytes(g, 0, per_element=1) + _bytes(g, g.output_value)
    assert slow - fast == pytest.approx(nbytes / rate + 2 * lat)
    # the prior stands in for links nobody measured
    assert simulate(g, plan, Costs({"a": p}, {}, link)).latency_ms == pytest.approx(slow)


def test_halos_across_a_slow_link_cost_time() -> None:
    g = _graph("vgg11")
    profiles = {n: _profile(g, n, 0.05, min_run_rows=10**6) for n in ("a", "b")}
    fast = Costs(profiles, {}, FREE)
    rate = 2_000.0
    slow = Costs(profiles, {("a", "b"): LinkEstimate(rate, 0.3), ("b", "a"): LinkEstimate(rate, 0.3)}, FREE)
    # layer-wise: the whole cut activation crosses a -> b in one chunk
    cut = g.cut_values[3]
    plan = build_plan(g, PlanSpec.layerwise("a", "b", cut), slab_rows=g.input_shape[1])
    d = simulate(g, plan, slow).latency_ms - simulate(g, plan, fast).latency_ms
    assert d == pytest.approx(_bytes(g, cut) / rate + 0.3)
    # stripes: halo rows cross both ways at every cut
    plan = build_plan(g, PlanSpec.stripes(["a", "b"], [0.5, 0.5], g.cut_values[::2]), slab_rows=4)
    halos = [h for s in plan.segments for h in s.halos]
    assert {(h.src, h.dst) for h in halos} == {("a", "b"), ("b", "a")}
    t_fast, t_slow = simulate(g, plan, fast).latency_ms, simulate(g, plan, slow).latency_ms
    biggest = max(_bytes(g, plan.segments[h.segment].in_value, h.hi - h.lo) for h in halos)
    assert t_slow > t_fast and t_slow >= biggest / rate
    # unmeasured node -> node links go through the coordinator: slow legs there slow the halos
    legs = {(COORDINATOR, n): LinkEstimate(rate, 0.3) for n in "ab"}
    legs.update({(n, COORDINATOR): LinkEstimate(rate, 0.3) for n in "ab"})
    star = Costs(profiles, legs, FREE)
    direct = Costs(profiles, {**legs, ("a", "b"): FREE, ("b", "a"): FREE}, FREE)
    assert simulate(g, plan, star).latency_ms > simulate(g, plan, direct).latency_ms


def test_prediction_of_an_unprofiled_node_is_infinite() -> None:
    g = _graph("digits_cnn")
    costs = Costs({"a": _profile(g, "a", 0.05)}, {}, FREE)
    assert math.isinf(predict(g, PlanSpec.single("b"), costs, slab_rows=8))
    assert math.isinf(predict(g, PlanSpec.layerwise("a", "b", g.cut_values[0]), costs, slab_rows=8))
    assert math.isfinite(predict(g, PlanSpec.single("a"), costs, slab_rows=8))
    # a node without rows does not need a profile
    assert math.isfinite(predict(g, PlanSpec.stripes(["a", "b"], [1.0, 0.0]), costs, slab_rows=8))


# --------------------------------------------------------------------------- planner
def _two(g, fa: float = 0.02, fb: float = 0.02, links=None, prior=FREE) -> Costs:
    return Costs({"a": _profile(g, "a", fa), "b": _profile(g, "b", fb)}, links or {}, prior)


def _by_strategy(choice, strategy: str):
    return [c for c in choice.candidates if c.spec.strategy == strategy]


def test_two_identical_nodes_on_a_free_link_split_the_rows() -> None:
    g = _graph("resnet18")
    choice = choose_plan(g, ["a", "b"], _two(g), slab_rows=8)
    assert choice.best.spec.strategy == "stripes"
    assert set(build_plan(g, choice.best.spec).active_nodes()) == {"a", "b"}
    single = min(c.predicted_ms for c in _by_strategy(choice, "single"))
    assert choice.best.predicted_ms < 0.9 * single
    # fastest first, the best is the plan it builds, the runner-up is another strategy
    ms = [c.predicted_ms for c in choice.candidates]
    assert ms == sorted(ms) and choice.candidates[0] == choice.best
    assert choice.runner_up is not None and choice.runner_up.spec.strategy != "stripes"
    plan = choice.plan(g)
    assert plan.spec == build_plan(g, choice.best.spec).spec
    # streamed in slabs of 8 or sent whole: whichever the planner predicted faster
    assert plan.estimated_ms == choice.best.predicted_ms and plan.slab_rows == choice.best.slab_rows
    assert plan.slab_rows in (8, g.input_shape[1])
    assert choice.best.label in choice.summary() and choice.runner_up.label in choice.summary()
    # deterministic
    assert choose_plan(g, ["a", "b"], _two(g), slab_rows=8) == choice


def test_a_very_slow_link_to_the_second_node_keeps_everything_on_the_first() -> None:
    g = _graph("resnet18")
    links = dict.fromkeys(((COORDINATOR, "b"), ("b", COORDINATOR), ("a", "b"), ("b", "a")), SLOW)
    choice = choose_plan(g, ["a", "b"], _two(g, links=links), slab_rows=8)
    assert choice.best.spec == PlanSpec.single("a")
    # every candidate in which b computes anything is predicted slower
    for c in choice.candidates:
        if "b" in build_plan(g, c.spec).active_nodes():
            assert c.predicted_ms > choice.best.predicted_ms
    # b alone pays the image's way there and the trunk output's way back
    single_b = next(c for c in choice.candidates if c.spec == PlanSpec.single("b"))
    assert single_b.predicted_ms >= \
        (_bytes(g, 0, per_element=1) + _bytes(g, g.output_value)) / SLOW.bytes_per_ms


def test_a_node_100x_slower_gets_no_work() -> None:
    g = _graph("resnet18", (3, 64, 64))
    for order in (["a", "b"], ["b", "a"]):
        choice = choose_plan(g, order, _two(g, 0.02, 2.0), slab_rows=8)
        assert "b" not in build_plan(g, choice.best.spec).active_nodes()
        assert build_plan(g, choice.best.spec).active_nodes() == ("a",)


def test_forced_strategies() -> None:
    g = _graph("vgg11")
    costs = _two(g)
    single = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="single")
    assert {c.spec for c in single.candidates} == {PlanSpec.single("a"), PlanSpec.single("b")}
    assert single.runner_up is not None and single.runner_up.spec.strategy == "single"
    layer = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="layerwise")
    every = {PlanSpec.layerwise(x, y, cut) for x, y in itertools.permutations("ab") for cut in g.cut_values}
    assert len(layer.candidates) >= 2 and {c.spec for c in layer.candidates} <= every
    assert layer.runner_up.spec.strategy == "layerwise"
    stripes = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="stripes")
    assert all(c.spec.strategy == "stripes" for c in stripes.candidates)
    with pytest.raises(ValueError, match="strategy"):
        choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="diagonal")
    # auto sees all three, and its best is no worse than any forced one
    auto = choose_plan(g, ["a", "b"], costs, slab_rows=8)
    assert {c.spec.strategy for c in auto.candidates} == {"single", "layerwise", "stripes"}
    assert auto.best.predicted_ms <= min(x.best.predicted_ms for x in (single, layer, stripes))


def test_runner_up_is_another_strategy_under_auto() -> None:
    g = _graph("digits_cnn")
    for fb, links in ((0.02, None), (2.0, None), (0.02, {(COORDINATOR, "b"): SLOW})):
        choice = choose_plan(g, ["a", "b"], _two(g, 0.02, fb, links), slab_rows=8)
        assert choice.runner_up is not None
        assert choice.runner_up.spec.strategy != choice.best.spec.strategy
        assert choice.runner_up.predicted_ms >= choice.best.predicted_ms
        others = [c for c in choice.candidates if c.spec.strategy != choice.best.spec.strategy]
        assert choice.runner_up == others[0]


def test_nodes_without_a_profile_are_skipped() -> None:
    g = _graph("digits_cnn")
    costs = _two(g)
    choice = choose_plan(g, ["a", "ghost", "b"], costs, slab_rows=8)
    assert all("ghost" not in c.spec.node_ids for c in choice.candidates)
    assert choice == choose_plan(g, ["a", "b"], costs, slab_rows=8)
    with pytest.raises(ValueError, match="no node"):
        choose_plan(g, ["ghost", "spook"], costs, slab_rows=8)
    for strategy in ("auto", "single", "layerwise", "stripes"):
        with pytest.raises(ValueError, match="cost profile"):
            choose_plan(g, ["x"], Costs({}, {}, FREE), slab_rows=8, strategy=strategy)


@pytest.mark.parametrize("strategy", ["stripes", "layerwise"])
def test_one_node_falls_back_to_single(strategy: str) -> None:
    g = _graph("digits_cnn")
    costs = Costs({"a": _profile(g, "a", 0.02)}, {}, FREE)
    for ids in (["a"], ["a", "ghost"]):
        choice = choose_plan(g, ids, costs, slab_rows=8, strategy=strategy)
        assert choice.best.spec == PlanSpec.single("a")
        assert choice.runner_up is None and len(choice.candidates) == 1


def test_speed_shares_and_stripe_specs() -> None:
    g = _graph("digits_cnn")
    costs = _two(g, 0.02, 0.06)  # b 3x slower (all costs scale but the call costs)
    ta, tb = costs.profiles["a"].trunk_ms, costs.profiles["b"].trunk_ms
    assert speed_shares(["a", "b"], costs) == pytest.approx((tb / (ta + tb), ta / (ta + tb)))
    s2 = speed_shares(["a", "b"], costs, 2.0)
    assert s2[0] == pytest.approx(tb**2 / (ta**2 + tb**2)) and s2[0] > speed_shares(["a", "b"], costs)[0]
    specs = stripe_specs(g, ["a", "b"], [0.7, 0.3], costs)
    assert specs and all(s.strategy == "stripes" and s.node_ids == ("a", "b") for s in specs)
    assert len({(s.cuts, s.segment_shares) for s in specs}) == len(specs)  # no duplicates
    assert any(s.cuts == () for s in specs) and any(s.cuts == g.cut_values for s in specs)
    # a solo tail runs on the fastest node (a)
    tails = [s for s in specs if s.segment_shares[-1] != s.segment_shares[0]]
    assert all(s.segment_shares[-1] == (1.0, 0.0) for s in tails)
    for s in specs:
        build_plan(g, s)  # every candidate is a valid spec
    # a node without a share is left out of the plan; one node left: no stripes
    assert stripe_specs(g, ["a", "b"], [1.0, 0.0], costs) == []
    three = Costs({**costs.profiles, "c": _profile(g, "c", 0.02)}, {}, FREE)
    assert all(s.node_ids == ("a", "c") for s in stripe_specs(g, ["a", "b", "c"], [1, 0, 1], three))
    # the scheduler's shares are among the candidates, even without adapted shares
    choice = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="stripes", shares=[0.7, 0.3],
                         adapt_shares=False)
    assert all(c.spec.segment_shares[0] == pytest.approx((0.7, 0.3)) for c in choice.candidates)
    assert {c.spec for c in choice.candidates} == set(specs)  # every cut variant of them


# --------------------------------------------------------------------------- profiling
class _TickClock:
    """Every reading is `step_s` after the previous one: every timed call takes exactly that."""

    def __init__(self, step_s: float) -> None:
        self.t, self.step = 0.0, step_s

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_measure_profile_applies_the_slowdown() -> None:
    g = _graph("digits_cnn")
    got, inputs = measure_profile(g, _TickClock(1e-3), slowdown=2.0, reps=2, budget_s=30.0)
    assert isinstance(got, MeasuredCosts) and len(got.op_costs) == len(g.ops)
    # every call took 1 ms whatever its rows: a per-call cost, times the slowdown
    for c in got.op_costs:
        assert c.call_ms == pytest.approx(2.0) and c.row_ms == pytest.approx(0.0, abs=1e-9)
    assert got.trunk_ms == pytest.approx(2.0)
    assert got.probe_base_ms == pytest.approx(2.0)  # one pass of the probe ops, 1 ms, times 2
    assert got.probe_ops == (len(g.ops) // 2,)  # 1 ms: one op reaches PROBE_MS
    assert len(inputs) == g.num_values
    assert all((t is not None) == (u in g.ops[got.probe_ops[0]].inputs) for u, t in enumerate(inputs))
    assert probe(g, got, _TickClock(1e-3), 3.0, inputs) == pytest.approx(3.0)


def test_measure_profile_structure_with_a_real_clock() -> None:
    g = _graph("digits_cnn")
    budget = 5.0
    got, inputs = measure_profile(g, time.perf_counter, budget_s=budget)
    assert len(got.op_costs) == len(g.ops)
    for c, op in zip(got.op_costs, g.ops):
        assert c.call_ms >= 0 and c.row_ms >= 0 and c.ms(op.out_shape[1]) > 0
    assert got.trunk_ms > 0 and got.probe_base_ms > 0
    assert got.probe_ops and all(0 <= j < len(g.ops) for j in got.probe_ops)
    assert list(got.probe_ops) == list(range(got.probe_ops[0], got.probe_ops[-1] + 1))
    assert 0 < got.elapsed_s < budget + 30.0  # the budget bounds the op sweep (liveness only)
    assert probe(g, got, time.perf_counter, 1.0, inputs) > 0
    # the profile it makes passes the planner's checks and plans
    p = DeviceProfile("a", 1, "m", "cpu", 1.0, got.op_costs, got.trunk_ms, 0.01)
    choice = choose_plan(g, ["a"], Costs({"a": p}, {}, FREE), slab_rows=8)
    assert choice.best.spec == PlanSpec.single("a") and choice.best.predicted_ms > 0


def test_streaming_is_chosen_only_where_it_pays() -> None:
    """The whole image in one slab, or streamed in slabs: a slow input link is worth streaming
    (transfer overlaps compute); with a free link and a costly executor run it is not."""
    g = _graph("resnet18", (3, 64, 64))
    h = g.input_shape[1]

    def best(link: LinkEstimate, run_ms: float):
        p = replace(_profile(g, "a", 0.05, min_run_rows=1), run_ms=run_ms)
        costs = Costs({"a": p}, {("coordinator", "a"): link, ("a", "coordinator"): link}, FREE)
        return choose_plan(g, ["a"], costs, slab_rows=4, strategy="single")

    free = best(FREE, run_ms=0.5)
    assert free.best.slab_rows == h and "whole image" in free.best.label
    assert {c.slab_rows for c in free.candidates} == {4, h}  # both were predicted
    slow = best(LinkEstimate(20.0, 0.0), run_ms=0.0)  # 20 B/ms: the image takes ~0.6 s
    assert slow.best.slab_rows == 4 and "whole image" not in slow.best.label
    streamed = next(c for c in slow.candidates if c.slab_rows == 4)
    whole = next(c for c in slow.candidates if c.slab_rows == h)
    assert streamed.predicted_ms < whole.predicted_ms


def test_measured_plans_are_candidates_but_fixed_shares_stay_fixed() -> None:
    """A plan that ran lately is compared by what it measured; with fixed shares a stripes plan
    that ran with other shares is not a candidate."""
    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({"a": _profile(g, "a", 0.05), "b": _profile(g, "b", 0.05)}, {}, FREE)
    other = PlanSpec.stripes(["a", "b"], [0.6, 0.4])
    fast = {spec_key(other, 8): MeasuredPlan(other, 8, 0.001)}  # "measured" absurdly fast
    free = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="stripes", measured=fast)
    assert free.best.spec.segment_shares[0] == pytest.approx((0.6, 0.4)) and free.best.measured_ms == 0.001
    fixed = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="stripes", shares=[1.0, 1.0],
                        adapt_shares=False, measured=fast)
    assert all(c.spec.segment_shares[0] == pytest.approx((0.5, 0.5)) for c in fixed.candidates)
    same = PlanSpec.stripes(["a", "b"], [0.5, 0.5], fixed.best.spec.cuts)
    seen = {spec_key(same, 8): MeasuredPlan(same, 8, 0.002)}
    again = choose_plan(g, ["a", "b"], costs, slab_rows=8, strategy="stripes", shares=[1.0, 1.0],
                        adapt_shares=False, measured=seen)
    assert again.best.measured_ms == 0.002  # its own measurement counts


def test_a_measured_plan_of_another_slab_size_is_no_candidate() -> None:
    """The slab size is a parameter: a plan that ran (and measured fast) in slabs of 8 rows is
    no candidate once `slab_rows` is 4, nor with the whole image when that is not allowed; at
    its own slab size, and with the whole image where that may be chosen, it is."""
    g = _graph("resnet18", (3, 64, 64))
    h = g.input_shape[1]
    costs = Costs({"a": _profile(g, "a", 0.05)}, {}, FREE)
    a = PlanSpec.single("a")
    ran = {spec_key(a, 8): MeasuredPlan(a, 8, 0.001), spec_key(a, h): MeasuredPlan(a, h, 0.002)}
    other = choose_plan(g, ["a"], costs, slab_rows=4, strategy="single", measured=ran)
    assert {c.slab_rows for c in other.candidates} == {4, h}
    assert other.best.slab_rows == h and other.best.measured_ms == 0.002  # the whole image's own
    streamed_only = choose_plan(g, ["a"], costs, slab_rows=4, strategy="single", measured=ran,
                                whole_image=False)
    assert {c.slab_rows for c in streamed_only.candidates} == {4}
    assert streamed_only.best.measured_ms is None
    whole = choose_plan(g, ["a"], costs, slab_rows=h, strategy="single", measured=ran)
    assert {c.slab_rows for c in whole.candidates} == {h} and whole.best.measured_ms == 0.002
    same = choose_plan(g, ["a"], costs, slab_rows=8, strategy="single", measured=ran)
    assert same.best.slab_rows == 8 and same.best.measured_ms == 0.001
    # "one slab whatever the height" (the benchmark's 4096) is the whole image
    huge = choose_plan(g, ["a"], costs, slab_rows=4096, strategy="single", measured=ran, whole_image=False)
    assert huge.best.measured_ms == 0.002 and all(c.slab_rows != 8 for c in huge.candidates)


def test_the_running_plan_is_judged_by_its_measured_latency() -> None:
    """The coordinator's planning round reports the running plan as (predicted, measured) ms:
    the measurement itself, not another field of the record (a slab size taken for a latency
    kept any plan running whose alternatives were slower than 64 ms)."""
    from kaitian_ros.nodes.planner_process import PlanRequest, plan_round

    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({"a": _profile(g, "a", 0.05), "b": _profile(g, "b", 0.05)}, {}, FREE)
    running = PlanSpec.single("a")
    seen = {spec_key(running, 8): MeasuredPlan(running, 8, 123.0)}
    request = PlanRequest("test", 0, False, ("a", "b"), ("a", "b"), (1.0, 1.0), "adaptive", True, 0.1, seen,
                          costs, (), 8, "auto", 1, running, 8, True)
    choice, was = plan_round(g, request)
    assert choice is not None and was is not None
    assert was[1] == 123.0
    assert was[0] == pytest.approx(predict(g, running, costs, slab_rows=8))


def test_untried_plans_on_nodes_that_ran_slower_than_predicted_are_expected_slower_too() -> None:
    """A stripes plan measured 2.5x its prediction: the other stripes plans over the same two
    nodes carry that error (contention the model does not see), single-node and layer-wise
    plans (one node computing at a time) do not."""
    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({"a": _profile(g, "a", 0.05), "b": _profile(g, "b", 0.05)}, {}, FREE)
    first = choose_plan(g, ["a", "b"], costs, slab_rows=8)
    ran = next(c for c in first.candidates if c.spec.strategy == "stripes" and len(c.spec.cuts) == 0)
    seen = {spec_key(ran.spec, ran.slab_rows): MeasuredPlan(ran.spec, ran.slab_rows, 2.5 * ran.predicted_ms)}
    again = choose_plan(g, ["a", "b"], costs, slab_rows=8, measured=seen)
    for c in again.candidates:
        both = len(build_plan(g, c.spec, slab_rows=c.slab_rows).active_nodes()) == 2 and c.spec.strategy == "stripes"
        if c.measured_ms is not None:
            assert c.expected_ms == pytest.approx(2.5 * ran.predicted_ms)
        elif both:
            assert c.model_error == pytest.approx(2.5) and c.expected_ms == pytest.approx(2.5 * c.predicted_ms)
            assert "as measured on these nodes" in c.describe_ms()
        else:
            assert c.model_error == 1.0 and c.expected_ms == c.predicted_ms
    # equal nodes: splitting was the best guess; at 2.5x the model's error a single node wins
    assert first.best.spec.strategy == "stripes"
    assert again.best.spec.strategy == "single"
    # a third node: plans over a pair that never ran take the error of the pair that did, and
    # so do plans over all three (more nodes at once miss at least as much)
    costs3 = Costs({n: _profile(g, n, 0.05) for n in "abc"}, {}, FREE)
    three = choose_plan(g, ["a", "b", "c"], costs3, slab_rows=8, measured=seen)
    other_pair = [c for c in three.candidates if c.spec.strategy == "stripes"
                  and set(build_plan(g, c.spec, slab_rows=c.slab_rows).active_nodes()) == {"a", "c"}]
    assert other_pair and all(c.model_error == pytest.approx(2.5) for c in other_pair)
    assert all(c.model_error == pytest.approx(2.5) for c in three.candidates
               if len(build_plan(g, c.spec, slab_rows=c.slab_rows).active_nodes()) == 3)
    assert all(c.model_error == 1.0 for c in three.candidates if c.spec.strategy == "layerwise")
    assert three.best.spec.strategy == "single"


def _active(g, c) -> frozenset:
    return frozenset(build_plan(g, c.spec, slab_rows=c.slab_rows).active_nodes())


def test_an_earlier_error_on_a_set_of_nodes_still_counts_after_its_latency_stopped_counting() -> None:
    """A node changed speed, so what the split over {a, b} measured is no latency any more;
    how far the model was off on those two nodes (2.5x) still prices every untried split over
    them - but a current measurement of that set wins over the earlier ratio."""
    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({"a": _profile(g, "a", 0.05), "b": _profile(g, "b", 0.05)}, {}, FREE)
    assert choose_plan(g, ["a", "b"], costs, slab_rows=8).best.spec.strategy == "stripes"
    earlier = {frozenset({"a", "b"}): 2.5}
    again = choose_plan(g, ["a", "b"], costs, slab_rows=8, earlier_errors=earlier)
    for c in again.candidates:
        split = len(_active(g, c)) == 2 and c.spec.strategy == "stripes"
        assert c.model_error == pytest.approx(2.5 if split else 1.0)
    assert again.best.spec.strategy == "single"
    # a current measurement of a split over the same nodes says more than the earlier ratio
    ran = next(c for c in again.candidates if c.spec.strategy == "stripes")
    seen = {spec_key(ran.spec, ran.slab_rows): MeasuredPlan(ran.spec, ran.slab_rows, 1.2 * ran.predicted_ms)}
    now = choose_plan(g, ["a", "b"], costs, slab_rows=8, measured=seen, earlier_errors=earlier)
    assert all(c.model_error == pytest.approx(1.2) for c in now.candidates
               if c.measured_ms is None and len(_active(g, c)) == 2 and c.spec.strategy == "stripes")
    # nonsense ratios are ignored
    bad = choose_plan(g, ["a", "b"], costs, slab_rows=8,
                      earlier_errors={frozenset({"a", "b"}): float("nan"), frozenset({"a"}): -1.0})
    assert all(c.model_error == 1.0 for c in bad.candidates)


def _after_a_three_node_split(factor: float) -> tuple:
    """Three equal nodes; a three-node split ran `factor` x its prediction: the graph, the
    costs, the planner's choice now and the measurement."""
    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({n: _profile(g, n, 0.05) for n in "abc"}, {}, FREE)
    first = choose_plan(g, ["a", "b", "c"], costs, slab_rows=8, shares=(1.0, 1.0, 1.0))
    ran = next(c for c in first.candidates if len(_active(g, c)) == 3)
    seen = {spec_key(ran.spec, ran.slab_rows): MeasuredPlan(ran.spec, ran.slab_rows, factor * ran.predicted_ms)}
    return g, costs, choose_plan(g, ["a", "b", "c"], costs, slab_rows=8, shares=(1.0, 1.0, 1.0), measured=seen), seen


def test_a_split_over_fewer_nodes_than_any_that_ran_takes_the_nearest_larger_splits_error() -> None:
    """Only a three-node split ran (1.6x its prediction): an untried pair is expected to miss
    like it rather than be believed at face value; single-node plans are not split plans."""
    g, _, again, _ = _after_a_three_node_split(1.6)
    pairs = [c for c in again.candidates if len(_active(g, c)) == 2 and c.spec.strategy == "stripes"]
    assert pairs and all(c.model_error == pytest.approx(1.6) for c in pairs if c.measured_ms is None)
    assert all(c.model_error == 1.0 for c in again.candidates if len(_active(g, c)) == 1)


def test_layer_wise_plans_carry_the_error_of_layer_wise_plans_not_of_splits() -> None:
    """A layer-wise plan computes a request on one node after the other: a split's error
    (nodes contending for shared cores) is not its own. robot_two_edges: after a three-node
    split measured 1.5x its prediction, the untried layer-wise plan edge -> robot was expected
    1.5x too and never tried, while it ran faster than the split. Once a layer-wise plan ran,
    every untried layer-wise plan carries its error, over any pair (a bounded exploration)."""
    g, costs, again, seen = _after_a_three_node_split(1.5)
    layerwise = [c for c in again.candidates if c.spec.strategy == "layerwise"]
    assert layerwise and all(c.model_error == 1.0 and c.expected_ms == c.predicted_ms for c in layerwise)
    assert all(c.model_error == pytest.approx(1.5) for c in again.candidates
               if c.spec.strategy == "stripes" and c.measured_ms is None)
    # a layer-wise plan that ran 1.3x its prediction: the others (any pair) carry 1.3, splits keep 1.5
    ran = layerwise[0]
    seen[spec_key(ran.spec, ran.slab_rows)] = MeasuredPlan(ran.spec, ran.slab_rows, 1.3 * ran.predicted_ms)
    third = choose_plan(g, ["a", "b", "c"], costs, slab_rows=8, shares=(1.0, 1.0, 1.0), measured=seen)
    others = [c for c in third.candidates if c.spec.strategy == "layerwise" and c.measured_ms is None]
    assert others and all(c.model_error == pytest.approx(1.3) for c in others)
    assert all(c.model_error == pytest.approx(1.5) for c in third.candidates
               if c.spec.strategy == "stripes" and c.measured_ms is None)
    # what the coordinator remembers keeps the two apart as well
    earlier = {error_key(ran.spec, ran.spec.node_ids): 1.3, frozenset("abc"): 1.5}
    later = choose_plan(g, ["a", "b", "c"], costs, slab_rows=8, shares=(1.0, 1.0, 1.0), earlier_errors=earlier)
    assert all(c.model_error == pytest.approx(1.3) for c in later.candidates if c.spec.strategy == "layerwise")
    assert all(c.model_error == pytest.approx(1.5) for c in later.candidates
               if c.spec.strategy == "stripes" and len(_active(g, c)) >= 2)


def test_a_quick_round_weighs_single_node_plans_against_the_running_plan_only() -> None:
    """A node of the running split changed speed: the quick round (single-node plans, a few
    ms) still judges the running plan by what it would take now."""
    from kaitian_ros.nodes.planner_process import PlanRequest, plan_round

    g = _graph("resnet18", (3, 64, 64))
    costs = Costs({"a": _profile(g, "a", 0.05), "b": _profile(g, "b", 0.5)}, {}, FREE)  # b is 10x slower now
    running = PlanSpec.stripes(("a", "b"), (0.5, 0.5), ())
    request = PlanRequest("b slowed", 0, False, ("a", "b"), ("a", "b"), (1.0, 1.0), "adaptive", True, 0.1, {},
                          costs, (), 8, "auto", 1, running, 8, True, quick=True)
    choice, was = plan_round(g, request)
    assert choice is not None and {c.spec.strategy for c in choice.candidates} == {"single"}
    assert choice.best.spec == PlanSpec.single("a")
    assert was[0] == pytest.approx(predict(g, running, costs, slab_rows=8)) and was[0] > choice.best.expected_ms


def test_a_kept_plan_that_grew_slower_is_left_for_the_newest_rounds_other_best() -> None:
    """`worth_leaving`: the fastest other candidate of the last round, once the running plan's
    measurement makes it worth switching to (full margin against a prediction, half against
    a measurement)."""
    from kaitian_ros.core.planner import Candidate, Choice, worth_leaving

    single = Candidate(PlanSpec("single", ("a",), (), ((1.0,),)), 73.4, "single a", measured_ms=76.0, slab_rows=64)
    layerwise = Candidate(PlanSpec("layerwise", ("a", "b"), (5,), ((1.0, 0.0), (0.0, 1.0))), 65.2, "a -> b",
                          slab_rows=64, model_error=1.08)  # expected 70.4
    measured_other = Candidate(PlanSpec("single", ("b",), (), ((1.0,),)), 90.0, "single b", measured_ms=72.0,
                               slab_rows=64)
    choice = Choice(single, layerwise, (layerwise, single))
    running = spec_key(single.spec, single.slab_rows)
    assert worth_leaving(choice, running, 76.0, 0.1) is None   # within 1.1 x 70.4
    assert worth_leaving(choice, running, 85.0, 0.1) is layerwise
    assert worth_leaving(None, running, 85.0, 0.1) is None
    # against a measured plan half the margin: 72 x 1.05 = 75.6
    choice = Choice(single, measured_other, (measured_other, single))
    assert worth_leaving(choice, running, 75.0, 0.1) is None
    assert worth_leaving(choice, running, 76.0, 0.1) is measured_other
    # the running plan itself is never its own alternative
    assert worth_leaving(Choice(single, None, (single,)), running, 500.0, 0.1) is None
