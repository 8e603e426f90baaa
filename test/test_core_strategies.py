"""Every plan strategy is exact: single, layer-wise (every cut, both orders) and stripes with a
solo tail on either node gather to the single-device trunk through the stripe executor, for any
slab size and delivery order. `build_plan` invariants (rows owned once, halos = the missing
input rows), `Plan.shares`, `describe()`, and the refusals of malformed specs."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from plan_checks import assert_close, assert_plan_invariants

from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import PlanSpec, build_plan
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import run_plan_locally

torch.set_num_threads(1)

NAMES = ["resnet18", "mobilenet_v2", "vgg11", "digits_cnn"]
SHAPE = (3, 32, 32)
_GRAPHS: dict = {}


def _graph(name: str):
    if name not in _GRAPHS:
        torch.manual_seed(0)
        _GRAPHS[name] = split_model(build_model(name, in_channels=SHAPE[0]), SHAPE)
    return _GRAPHS[name]


def _input(seed: int) -> torch.Tensor:
    return torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(seed))


def _seg_flops(g, cuts) -> list[float]:
    bounds = [0, *cuts, g.output_value]
    return [sum(g.ops[j].flops_per_row * g.ops[j].out_shape[1] for j in range(a, b))
            for a, b in itertools.pairwise(bounds)]


def _run_all_ways(g, plan, x, ref, rng: random.Random) -> None:
    whole = max(hi - lo for lo, hi in map(plan.input_rows_for, plan.active_nodes()))
    for min_run_rows in (1, 8):
        slab = rng.choice([1, 2, 3, 5, 8, max(1, whole)])
        assert_close(run_plan_locally(g, plan, x, slab_rows=slab, seed=rng.randrange(10**6),
                                min_run_rows=min_run_rows), ref)


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", NAMES)
def test_single_plans_are_exact(name: str) -> None:
    g = _graph(name)
    x = _input(1)
    ref = g.run_trunk(x)
    rng = random.Random(11)
    for node in ("a", "b"):
        plan = build_plan(g, PlanSpec.single(node), slab_rows=4)
        assert_plan_invariants(g, plan)
        assert plan.strategy == "single" and plan.active_nodes() == (node,) and plan.feeder_nodes() == ()
        assert plan.input_rows_for(node) == (0, SHAPE[1])
        assert plan.output_rows_for(node) == (0, g.trunk_output_shape[1])
        assert plan.shares == (1.0,) and plan.num_segments == 1
        _run_all_ways(g, plan, x, ref, rng)
    # the deterministic round-robin delivery too
    assert_close(run_plan_locally(g, build_plan(g, PlanSpec.single("a")), x, min_run_rows=8), ref)


@pytest.mark.parametrize("name", NAMES)
def test_layerwise_plans_are_exact_at_every_cut_in_both_orders(name: str) -> None:
    g = _graph(name)
    x = _input(2)
    ref = g.run_trunk(x)
    rng = random.Random(hash(name) & 0xFFFF)
    assert g.cut_values  # every reference net has somewhere to hand on
    for cut in g.cut_values:
        for first, second in (("a", "b"), ("b", "a")):
            plan = build_plan(g, PlanSpec.layerwise(first, second, cut), slab_rows=4)
            assert_plan_invariants(g, plan)
            assert plan.strategy == "layerwise" and plan.cut_values == (cut,)
            assert plan.node_ids == (first, second) and plan.active_nodes() == (first, second)
            assert plan.feeder_nodes() == (first,)  # it owns no output rows
            # the first runs the whole first segment and reads the whole image, the second
            # reads nothing from the coordinator and receives the whole cut activation
            assert plan.input_rows_for(first) == (0, SHAPE[1])
            assert plan.input_rows_for(second) == (0, 0)
            assert plan.segment_rows_for(first, 0) == (0, g.value_shapes[cut][1])
            assert plan.output_rows_for(second) == (0, g.trunk_output_shape[1])
            assert plan.output_rows_for(first) == (0, 0)
            halos = plan.segments[1].halos
            assert [(h.src, h.dst, h.lo, h.hi) for h in halos] == \
                [(first, second, 0, g.value_shapes[cut][1])]
            _run_all_ways(g, plan, x, ref, rng)


def _solo_specs(g):
    cuts = g.cut_values
    picks = sorted({cuts[0], cuts[len(cuts) // 2], cuts[-1]})
    for solo_node in (0, 1):
        for t in range(1, len(picks) + 1):
            yield PlanSpec.stripes(["a", "b"], [0.6, 0.4], picks, solo_from=t, solo_node=solo_node)
    yield PlanSpec.stripes(["a", "b"], [0.3, 0.7], picks)  # no solo tail
    yield PlanSpec.stripes(["a", "b", "c"], [0.2, 0.5, 0.3], picks[:2], solo_from=1, solo_node=2)
    yield PlanSpec.stripes(["a", "b", "c"], [0.2, 0.5, 0.3], picks[:2], solo_from=1)  # largest: b


@pytest.mark.parametrize("name", NAMES)
def test_stripes_with_solo_tails_are_exact(name: str) -> None:
    g = _graph(name)
    x = _input(3)
    ref = g.run_trunk(x)
    rng = random.Random(7)
    for spec in _solo_specs(g):
        plan = build_plan(g, spec, slab_rows=4)
        assert_plan_invariants(g, plan)
        if spec.segment_shares[-1] != spec.segment_shares[0]:  # a solo tail
            who = max(range(len(spec.node_ids)), key=lambda i: spec.segment_shares[-1][i])
            last = plan.segments[-1]
            assert last.out_rows[who] == (0, g.trunk_output_shape[1])
            assert all(r == (0, 0) for i, r in enumerate(last.out_rows) if i != who)
        _run_all_ways(g, plan, x, ref, rng)


def test_solo_tail_default_node_is_the_largest_share() -> None:
    spec = PlanSpec.stripes(["a", "b", "c"], [1, 3, 2], [1, 2], solo_from=1)
    assert spec.segment_shares[0] == pytest.approx((1 / 6, 3 / 6, 2 / 6))
    assert spec.segment_shares[1] == spec.segment_shares[2] == (0.0, 1.0, 0.0)
    # equal largest shares: the first of them
    assert PlanSpec.stripes(["a", "b"], [1, 1], [1], solo_from=1).segment_shares[1] == (1.0, 0.0)
    # solo_from beyond the last segment: no solo tail
    spec = PlanSpec.stripes(["a", "b"], [1, 3], [1], solo_from=2)
    assert spec.segment_shares == ((0.25, 0.75), (0.25, 0.75))


def test_three_node_layerwise_chain_is_exact() -> None:
    """A hand-made layer-wise spec over three nodes (a -> c -> b) runs exactly too."""
    g = _graph("vgg11")
    c1, c2 = g.cut_values[2], g.cut_values[7]
    spec = PlanSpec("layerwise", ("a", "b", "c"), (c1, c2),
                    ((1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.0, 1.0, 0.0)))
    plan = build_plan(g, spec)
    assert_plan_invariants(g, plan)
    assert [(h.src, h.dst) for s in plan.segments for h in s.halos] == [("a", "c"), ("c", "b")]
    x = _input(4)
    ref = g.run_trunk(x)
    _run_all_ways(g, plan, x, ref, random.Random(3))
    assert spec.describe().startswith("a [value") and spec.describe().endswith("-> b")


# --------------------------------------------------------------------------- shares, describe
@pytest.mark.parametrize("name", NAMES)
def test_plan_shares(name: str) -> None:
    g = _graph(name)
    cuts = g.cut_values
    # uniform stripes: the (normalised) stripe shares, for any cuts
    for shares in ([0.5, 0.5], [1.0, 3.0], [0.2, 0.0, 0.8], [0.1, 0.2, 0.3, 0.4]):
        ids = [f"n{i}" for i in range(len(shares))]
        for c in ((), cuts, cuts[::2]):
            plan = build_plan(g, PlanSpec.stripes(ids, shares, c))
            assert math.fsum(plan.shares) == pytest.approx(1.0, abs=1e-12)
            assert plan.shares == pytest.approx([s / sum(shares) for s in shares], abs=1e-12)
    # layer-wise: each node's share is its segment's fraction of the trunk FLOPs
    for cut in cuts:
        f0, f1 = _seg_flops(g, (cut,))
        plan = build_plan(g, PlanSpec.layerwise("x", "y", cut))
        assert plan.shares == pytest.approx((f0 / (f0 + f1), f1 / (f0 + f1)), abs=1e-12)
        assert math.fsum(plan.shares) == pytest.approx(1.0, abs=1e-12)
    # solo tail: stripe shares over the front, all of the tail on the solo node
    picks = (cuts[0], cuts[-1])
    flops = _seg_flops(g, picks)
    plan = build_plan(g, PlanSpec.stripes(["a", "b"], [0.25, 0.75], picks, solo_from=1, solo_node=0))
    total = sum(flops)
    want_a = (0.25 * flops[0] + flops[1] + flops[2]) / total
    assert plan.shares == pytest.approx((want_a, 1 - want_a), abs=1e-12)
    assert plan.strategy == "stripes" and plan.spec.cuts == picks


def test_plan_spec_is_normalised_and_kept() -> None:
    g = _graph("digits_cnn")
    plan = build_plan(g, PlanSpec("stripes", ("a", "b"), (1,), ((2.0, 6.0), (1.0, 1.0))),
                      slab_rows=3, estimated_ms=12.5)
    assert plan.spec == PlanSpec("stripes", ("a", "b"), (1,), ((0.25, 0.75), (0.5, 0.5)))
    assert plan.slab_rows == 3 and plan.estimated_ms == 12.5
    # pure: the same spec builds an equal plan
    assert plan == build_plan(g, plan.spec, slab_rows=3, estimated_ms=12.5)


def test_describe_names_the_nodes() -> None:
    g = _graph("resnet18")
    assert PlanSpec.single("gpu0").describe() == "single gpu0"
    cut = g.cut_values[3]
    text = PlanSpec.layerwise("npu", "edge", cut).describe(g)
    assert text.index("npu") < text.index("edge")
    assert str(cut) in text and str(g.value_shapes[cut]) in text
    text = PlanSpec.stripes(["n0", "n1"], [0.6, 0.4], g.cut_values[:2]).describe()
    assert "n0 0.60" in text and "n1 0.40" in text and "solo" not in text
    assert f"cuts {g.cut_values[0]},{g.cut_values[1]}" in text
    text = PlanSpec.stripes(["n0", "n1"], [0.6, 0.4], g.cut_values[:2], solo_from=1,
                            solo_node=1).describe()
    assert "solo tail on n1 from segment 1" in text
    # the plan's spec describes the same
    plan = build_plan(g, PlanSpec.stripes(["p", "q", "r"], [1, 1, 2]))
    assert all(n in plan.spec.describe(g) for n in ("p", "q", "r"))


# --------------------------------------------------------------------------- refusals
def _bad_specs(g):
    c = g.cut_values
    two = ((0.5, 0.5),)
    return [
        (PlanSpec("diagonal", ("a", "b"), (), two), "unknown strategy"),
        (PlanSpec("stripes", ("a", "b"), (c[-1] + 1000,), two * 2), "not cut points"),
        (PlanSpec("stripes", ("a", "b"), (0,), two * 2), "not cut points"),  # the image
        (PlanSpec("stripes", ("a", "b"), (g.output_value,), two * 2), "not cut points"),
        (PlanSpec("stripes", ("a", "b"), (c[1], c[0]), two * 3), "strictly increasing"),
        (PlanSpec("stripes", ("a", "b"), (c[0], c[0]), two * 3), "strictly increasing"),
        (PlanSpec("stripes", ("a", "b"), (c[0],), two), "2 segments"),
        (PlanSpec("stripes", ("a", "b"), (), two * 2), "1 segments"),
        (PlanSpec("stripes", ("a", "b"), (), ((1.0,),)), "1 shares for 2 nodes"),
        (PlanSpec("stripes", ("a", "b"), (), ((0.2, 0.3, 0.5),)), "3 shares for 2 nodes"),
        (PlanSpec("stripes", ("a", "b"), (c[0],), ((0.5, 0.5), (0.5,))), "1 shares for 2 nodes"),
        (PlanSpec("stripes", ("a", "b"), (), ((1.2, -0.2),)), "negative"),
        (PlanSpec("stripes", ("a", "b"), (), ((math.nan, 1.0),)), "not finite"),
        (PlanSpec("stripes", ("a", "b"), (), ((math.inf, 1.0),)), "not finite"),
        (PlanSpec("stripes", ("a", "b"), (c[0],), ((0.5, 0.5), (0.0, 0.0))), "all shares are zero"),
        (PlanSpec("layerwise", ("a", "b"), (c[0],), ((1.0, 0.0), (0.0, -1.0))), "negative"),
        (PlanSpec("stripes", ("a", "a"), (), two), "duplicate"),
        (PlanSpec("single", ("coordinator",), (), ((1.0,),)), "coordinator"),
        (PlanSpec.layerwise("a", "coordinator", c[0]), "coordinator"),
        (PlanSpec("single", (), (), ((),)), "non-empty node ids"),
        (PlanSpec("stripes", ("a", ""), (), two), "non-empty node ids"),
        (PlanSpec.layerwise("a", "b", c[-1] + 1000), "not cut points"),
        # the strategy names the plan's shape: a spec off the wire may not claim another one
        (PlanSpec("single", ("a", "b"), (), two), "one segment on one node"),
        (PlanSpec("single", ("a",), (c[0],), ((1.0,), (1.0,))), "one segment on one node"),
        (PlanSpec("layerwise", ("a", "b"), (c[0],), ((0.5, 0.5), (0.0, 1.0))), "whole on one node"),
        (PlanSpec("layerwise", ("a", "b"), (c[0],), ((1.0, 0.0), (1.0, 0.0))), "another than the previous"),
    ]


@pytest.mark.parametrize("name", ["resnet18", "digits_cnn"])
def test_build_plan_refuses_bad_specs(name: str) -> None:
    g = _graph(name)
    for spec, msg in _bad_specs(g):
        with pytest.raises(ValueError, match=msg):
            build_plan(g, spec)
    with pytest.raises(ValueError, match="slab_rows"):
        build_plan(g, PlanSpec.single("a"), slab_rows=0)
    with pytest.raises(ValueError, match="solo_node"):
        PlanSpec.stripes(["a", "b"], [0.5, 0.5], g.cut_values[:1], solo_from=1, solo_node=2)
    with pytest.raises(ValueError, match="solo_from"):
        PlanSpec.stripes(["a", "b"], [0.5, 0.5], g.cut_values[:1], solo_from=-1)
    # the good neighbours of the bad specs build
    c = g.cut_values
    build_plan(g, PlanSpec("stripes", ("a", "b"), (c[0], c[-1]), ((0.5, 0.5),) * 3))
    build_plan(g, PlanSpec("stripes", ("a", "b"), (c[0],), ((0.5, 0.5), (0.0, 1.0))))
