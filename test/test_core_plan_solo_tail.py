"""Solo tail (layer-wise split after the row stripes): the late segments run whole on the
fastest node. Ownership/halo invariants and exactness through the stripe executor."""

from __future__ import annotations

import pytest
import torch

from kaitian_ros.core.cost_model import CostModel
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import make_plan
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import run_plan_locally

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def graphs() -> dict:
    return {n: split_model(build_model(n), (3, 64, 64)) for n in ("resnet18", "mobilenet_v2")}


def _solo_plans(g, shares):
    ids = [f"n{i}" for i in range(len(shares))]
    fastest = max(range(len(shares)), key=lambda i: (shares[i], -i))
    # a huge per-call weight cost makes every split of the tail expensive: solo tail chosen
    heavy = CostModel(weight_bytes_per_ms=1.0)
    for cuts in (g.cut_values, g.cut_values[::2]):
        p = make_plan(g, ids, shares, cuts=cuts, solo_tail=True, cost=heavy)
        yield ids, fastest, p


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_solo_tail_invariants_and_exactness(graphs, name: str) -> None:
    g = graphs[name]
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    ref = g.run_trunk(x)
    for shares in ([0.67, 0.33], [0.2, 0.5, 0.3]):
        for ids, fastest, p in _solo_plans(g, shares):
            last = p.segments[-1]
            assert last.out_rows[fastest] == (0, g.value_shapes[last.out_value][1])  # solo tail
            assert all(r == (0, 0) for i, r in enumerate(last.out_rows) if i != fastest)
            # the nodes before the tail own no output rows: they only feed it
            assert p.feeder_nodes() == tuple(n for i, n in enumerate(ids) if i != fastest
                                             and n in p.active_nodes())
            assert p.num_segments >= 2 and any(  # the front is still split
                sum(1 for r in s.out_rows if r[0] < r[1]) > 1 for s in p.segments)
            for k, seg in enumerate(p.segments):
                owned = [r for lo, hi in seg.out_rows for r in range(lo, hi)]
                assert owned == list(range(g.value_shapes[seg.out_value][1]))
                if k:
                    prev = p.segments[k - 1].out_rows
                    for i, n in enumerate(ids):
                        lo, hi = seg.in_rows[i]
                        missing = {r for r in range(lo, hi) if not prev[i][0] <= r < prev[i][1]}
                        got = [r for h in p.halo_sources(n, k) for r in range(h.lo, h.hi)]
                        assert sorted(got) == sorted(missing)
            for slab, seed in ((4, None), (64, 1), (3, 7)):
                out = run_plan_locally(g, p, x, slab_rows=slab, seed=seed)
                assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_solo_tail_off_and_single_node(graphs) -> None:
    g = graphs["resnet18"]
    heavy = CostModel(weight_bytes_per_ms=1.0)
    p = make_plan(g, ["a", "b"], [0.6, 0.4], cuts=g.cut_values, solo_tail=False, cost=heavy)
    assert all(sum(1 for r in s.out_rows if r[0] < r[1]) == 2 for s in p.segments)
    assert make_plan(g, ["a"], [1.0], solo_tail=True, cost=heavy).num_segments == 1
    # deterministic
    assert make_plan(g, ["a", "b"], [0.6, 0.4], cost=heavy) == make_plan(g, ["a", "b"], [6, 4], cost=heavy)
