"""Planner invariants: ownership, exact receptive fields, halos, determinism, errors, cost."""

from __future__ import annotations

import math
import random

import pytest
import torch
from plan_checks import assert_plan_invariants

from kaitian_ros.core.cost_model import CostModel
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import make_plan, split_rows
from kaitian_ros.core.split import split_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def graphs() -> dict:
    return {n: split_model(build_model(n, in_channels=s[0]), s) for n, s in
            [("resnet18", (3, 32, 32)), ("mobilenet_v2", (3, 32, 32)), ("vgg11", (3, 32, 32)),
             ("digits_cnn", (1, 8, 8))]}


def _share_vectors(seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    vecs = [[1.0], [0.5, 0.5], [0.67, 0.33], [0.6, 0.001, 0.399], [0.0, 1.0, 2.0, 0.5]]
    vecs += [[rng.random() for _ in range(rng.randint(1, 4))] for _ in range(4)]
    return vecs


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "vgg11", "digits_cnn"])
def test_rows_owned_once_and_halo_is_exactly_missing(graphs, name: str) -> None:
    g = graphs[name]
    for shares in _share_vectors(1):
        ids = [f"n{i}" for i in range(len(shares))]
        for cuts in (None, g.cut_values, g.cut_values[::2]):
            assert_plan_invariants(g, make_plan(g, ids, shares, cuts=cuts))


def _nan_receptive_rows(g, in_value: int, out_value: int, x: torch.Tensor) -> list[set[int]]:
    """For every output row: the input rows that influence it (NaN probing, one row at a time)."""
    h_in = x.shape[2]
    h_out = g.value_shapes[out_value][1]
    deps: list[set[int]] = [set() for _ in range(h_out)]
    for r in range(h_in):
        xr = x.clone()
        xr[:, :, r] = float("nan")
        y = g.run_ops(xr, in_value, out_value)
        for o in torch.isnan(y).flatten(start_dim=3).any(dim=3).any(dim=1)[0].nonzero().flatten():
            deps[int(o)].add(r)
    return deps


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "vgg11"])
def test_input_rows_are_exactly_the_receptive_field(graphs, name: str) -> None:
    g = graphs[name]
    cuts = g.cut_values[::3]
    p = make_plan(g, ["a", "b", "c"], [0.3, 0.45, 0.25], cuts=cuts)
    x = torch.randn(1, *g.input_shape, generator=torch.Generator().manual_seed(0))
    for seg in p.segments:
        xin = g.run_ops(x, 0, seg.in_value) if seg.in_value else x
        deps = _nan_receptive_rows(g, seg.in_value, seg.out_value, xin)
        for i, (lo, hi) in enumerate(seg.out_rows):
            if lo >= hi:
                assert seg.in_rows[i] == (0, 0)
                continue
            field = set().union(*deps[lo:hi])
            assert seg.in_rows[i] == (min(field), max(field) + 1)
            assert field == set(range(min(field), max(field) + 1))


def test_deterministic(graphs) -> None:
    g = graphs["resnet18"]
    a = make_plan(g, ["x", "y", "z"], [0.2, 0.5, 0.3])
    b = make_plan(g, ["x", "y", "z"], [2.0, 5.0, 3.0])  # normalised: same plan
    assert a == b and hash(a) == hash(b)
    assert a != make_plan(g, ["x", "y", "z"], [0.3, 0.5, 0.2])


def test_zero_share_node_drops_out(graphs) -> None:
    g = graphs["vgg11"]
    p = make_plan(g, ["a", "b", "c"], [0.5, 0.0, 0.5], cuts=g.cut_values)
    assert p.active_nodes() == ("a", "c")
    assert p.input_rows_for("b") == (0, 0) and p.output_rows_for("b") == (0, 0)
    assert p.flops_for("b") == 0.0
    assert all(h.src != "b" and h.dst != "b" for s in p.segments for h in s.halos)
    assert p.input_rows_for("a")[0] == 0 and p.input_rows_for("c")[1] == g.input_shape[1]


def test_tiny_share_rounds_to_zero_rows(graphs) -> None:
    g = graphs["digits_cnn"]  # 4 output rows
    p = make_plan(g, ["a", "b", "c"], [0.5, 0.01, 0.49])
    assert "b" not in p.active_nodes() and p.output_rows_for("b") == (0, 0)


@pytest.mark.parametrize("shares,msg", [
    ([0.5, -0.1], "negative"), ([0.0, 0.0], "zero"), ([1.0], "2 nodes"),
    ([math.nan, 1.0], "finite"), ([math.inf, 1.0], "finite"), (["x", 1.0], "number"),
])
def test_bad_shares(graphs, shares, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        make_plan(graphs["digits_cnn"], ["a", "b"], shares)


def test_bad_arguments(graphs) -> None:
    g = graphs["digits_cnn"]
    with pytest.raises(ValueError, match="duplicate"):
        make_plan(g, ["a", "a"], [1, 1])
    with pytest.raises(ValueError, match="cut"):
        make_plan(g, ["a"], [1], cuts=[999])
    with pytest.raises(ValueError, match="slab_rows"):
        make_plan(g, ["a"], [1], slab_rows=0)
    with pytest.raises(ValueError, match="not in the plan"):
        make_plan(g, ["a"], [1]).input_rows_for("zz")


def test_cost_model_trades_exchanges_for_redundancy(graphs) -> None:
    g = split_model(build_model("resnet18"), (3, 224, 224))
    ids, shares = ["a", "b"], [0.5, 0.5]
    one = make_plan(g, ids, shares, cuts=())
    chosen = make_plan(g, ids, shares)
    assert chosen.num_segments > 1  # the measured fact: one-segment halos are mostly waste
    assert sum(chosen.flops_for(n) for n in ids) < 0.8 * sum(one.flops_for(n) for n in ids)
    assert chosen.estimated_ms <= one.estimated_ms
    costly = make_plan(g, ids, shares, cost=CostModel(exchange_ms=1e6))
    assert costly.num_segments == 1
    free = make_plan(g, ids, shares, cost=CostModel(exchange_ms=0.0, link_bytes_per_ms=1e12))
    assert free.num_segments >= chosen.num_segments
    assert make_plan(g, ids, shares, max_segments=2).num_segments <= 2
    assert make_plan(g, ["solo"], [1.0]).num_segments == 1  # nothing to exchange with


def test_split_rows() -> None:
    assert split_rows(7, [0.5, 0.5]) == ((0, 4), (4, 7))
    assert split_rows(4, [0.0, 1.0]) == ((0, 0), (0, 4))
    assert split_rows(3, [0.1, 0.1, 0.8]) == ((0, 0), (0, 1), (1, 3))
