"""Stripe executor: gathered stripes equal the single-device trunk, for every reference model,
share vector, slab size, cut choice and arrival order; malformed rows are refused."""

from __future__ import annotations

import collections
import random
import time

import pytest
import torch
from plan_checks import assert_close

from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import PlanSpec, build_plan, make_plan
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import Emission, RowPieces, StripeRunner, run_plan_locally

torch.set_num_threads(1)

CASES = [("resnet18", (3, 64, 64)), ("mobilenet_v2", (3, 64, 64)), ("vgg11", (3, 64, 64)),
         ("digits_cnn", (1, 8, 8)), ("digits_cnn", (3, 32, 32)), ("resnet18", (3, 96, 80))]
_GRAPHS: dict = {}


def _graph(name: str, shape: tuple[int, int, int]):
    key = (name, shape)
    if key not in _GRAPHS:
        _GRAPHS[key] = split_model(build_model(name, in_channels=shape[0]), shape)
    return _GRAPHS[key]


SHARES = [[1.0], [0.5, 0.5], [0.67, 0.33], [0.6, 0.001, 0.399], [0.1, 0.2, 0.3, 0.4]]


@pytest.mark.parametrize("name,shape", CASES)
def test_gathered_stripes_equal_trunk(name: str, shape: tuple[int, int, int]) -> None:
    g = _graph(name, shape)
    rng = random.Random(hash((name, shape)) & 0xFFFF)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(rng.randrange(1000)))
    ref = g.run_trunk(x)
    shares_list = SHARES + [[rng.random() for _ in range(rng.randint(2, 4))]]
    cut_choices = [None, g.cut_values, g.cut_values[1::2]]
    for si, shares in enumerate(shares_list):
        ids = [f"n{i}" for i in range(len(shares))]
        plan = make_plan(g, ids, shares, cuts=cut_choices[si % 3])
        whole = max(hi - lo for lo, hi in map(plan.input_rows_for, ids))
        for slab in (1, 3, 8, max(whole, 1)):
            assert_close(run_plan_locally(g, plan, x, slab_rows=slab, seed=rng.randrange(10**6),
                                    min_run_rows=1 + si % 3 * 4), ref)
    # deterministic delivery order and deferred (batched) runs give the same numbers
    plan = make_plan(g, ["a", "b", "c"], [0.3, 0.3, 0.4], cuts=g.cut_values)
    assert_close(run_plan_locally(g, plan, x, slab_rows=3, min_run_rows=1), ref)
    assert_close(run_plan_locally(g, plan, x, slab_rows=2, seed=5, min_run_rows=4), ref)


class _Pools(torch.nn.Module):
    """Max pools with dilation, ceil mode, unequal kernel/stride/padding and an odd floor-mode
    edge: the stripes pool exact row windows (H padding materialised) with F.max_pool2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.dilated = torch.nn.MaxPool2d(3, stride=2, padding=1, dilation=2, ceil_mode=True)
        self.uneven = torch.nn.MaxPool2d((2, 3), stride=(1, 2), padding=(1, 1))
        self.floor = torch.nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.floor(self.uneven(self.dilated(torch.relu(self.conv(x)))))


def _exotic() -> torch.nn.Module:
    from test_core_graph import _Exotic  # shared test model

    return _Exotic()


@pytest.mark.parametrize("make,shape", [(_exotic, (3, 21, 19)), (_Pools, (3, 29, 17))])
def test_local_ops_through_stripes(make, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    g = split_model(make(), shape)
    x = torch.randn(1, *shape)
    ref = g.run_trunk(x)
    for shares in ([0.5, 0.5], [0.2, 0.3, 0.5], [0.05, 0.9, 0.05]):
        ids = [f"n{i}" for i in range(len(shares))]
        for cuts in (None, g.cut_values):
            plan = make_plan(g, ids, shares, cuts=cuts)
            for slab, min_run_rows in ((1, 1), (4, 8)):
                assert_close(run_plan_locally(g, plan, x, slab_rows=slab, seed=slab, min_run_rows=min_run_rows), ref)


def test_batch_of_two() -> None:
    g = _graph("digits_cnn", (3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    plan = make_plan(g, ["a", "b"], [0.4, 0.6], cuts=g.cut_values)
    assert_close(run_plan_locally(g, plan, x, slab_rows=5, seed=1), g.run_trunk(x))


def test_emissions_go_where_the_plan_says() -> None:
    g = _graph("vgg11", (3, 64, 64))
    plan = make_plan(g, ["a", "b", "c"], [0.3, 0.4, 0.3], cuts=g.cut_values)
    x = torch.randn(1, 3, 64, 64)
    r = StripeRunner(g, plan, "b")
    lo, hi = plan.input_rows_for("b")
    ems: list[Emission] = []
    for a in range(lo, hi, 4):
        ems += r.feed(0, a, x[:, :, a:min(a + 4, hi)])
    assert not r.done  # needs halo rows from a and c for later segments
    assert ems and all(e.role == "HALO" for e in ems)
    for e in ems:  # every emitted row is one the plan routes from b to that consumer
        targets = plan.halo_targets("b", e.segment)
        assert any(h.dst == e.consumer and h.lo <= e.row_offset and
                   e.row_offset + e.rows.shape[2] <= h.hi for h in targets)
    sent_1 = sorted((e.consumer, r) for e in ems if e.segment == 1
                    for r in range(e.row_offset, e.row_offset + e.rows.shape[2]))
    assert sent_1 == sorted((h.dst, r) for h in plan.halo_targets("b", 1)
                            for r in range(h.lo, h.hi))
    assert r.stats()["rows_in"] == hi - lo and r.stats()["runs"] > 0


def test_runner_rejects_bad_rows() -> None:
    g = _graph("digits_cnn", (3, 32, 32))
    plan = make_plan(g, ["a", "b"], [0.5, 0.5], cuts=g.cut_values)
    r = StripeRunner(g, plan, "a")
    lo, hi = plan.input_rows_for("a")
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="not expected"):
        r.feed(0, hi, x[:, :, hi:hi + 1])  # rows of the other node
    with pytest.raises(ValueError, match="shape"):
        r.feed(0, lo, x[:, :2, lo:lo + 2])
    with pytest.raises(ValueError, match="shape"):
        r.feed(0, lo, x[:, :, lo:lo + 2, :5])
    with pytest.raises(ValueError, match="segment"):
        r.feed(7, lo, x[:, :, lo:lo + 2])
    with pytest.raises(ValueError, match="4-D"):
        r.feed(0, lo, x[0, :, lo:lo + 2])
    r.feed(0, lo, x[:, :, lo:lo + 2])
    with pytest.raises(ValueError, match="not expected"):
        r.feed(0, lo, x[:, :, lo:lo + 2])  # duplicate
    with pytest.raises(ValueError, match="batch"):
        r.feed(0, lo + 2, torch.randn(2, 3, 1, 32))
    # the runner is still usable after refusals
    r.feed(0, lo + 2, x[:, :, lo + 2:hi])
    assert r.expected_rows(0) == []


def test_emit_hands_on_each_emission_as_its_rows_exist() -> None:
    """With `emit`, a feed publishes its HALO rows the moment they are computed - before the
    same feed goes on to compute the rest - and the emissions are exactly those `feed` returns
    without it."""
    g = _graph("resnet18", (3, 64, 64))
    plan = make_plan(g, ["a", "b"], [0.5, 0.5], cuts=g.cut_values)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    lo, hi = plan.input_rows_for("a")
    returned = StripeRunner(g, plan, "a", min_run_rows=1).feed(0, lo, x[:, :, lo:hi])
    runner = StripeRunner(g, plan, "a", min_run_rows=1)
    handed: list[tuple[Emission, int]] = []
    left = runner.feed(0, lo, x[:, :, lo:hi], emit=lambda e: handed.append((e, runner.stats()["rows_computed"])))
    assert left == [] and handed
    assert [(e.role, e.segment, e.consumer, e.row_offset) for e, _ in handed] == \
        [(e.role, e.segment, e.consumer, e.row_offset) for e in returned]
    for (e, _), r in zip(handed, returned):
        assert torch.equal(e.rows, r.rows)
    total = runner.stats()["rows_computed"]
    assert handed[0][1] < total  # the first HALO left while the feed still had rows to compute
    # time spent in the callback is not the node's compute
    slow = StripeRunner(g, plan, "a", min_run_rows=1)
    slow.feed(0, lo, x[:, :, lo:hi], emit=lambda e: time.sleep(0.05))  # a slow callback is the case under test
    assert slow.stats()["compute_s"] < 0.05 * len(handed)


@pytest.mark.parametrize("name,shape", [("mobilenet_v2", (3, 128, 96)), ("resnet18", (3, 64, 64))])
def test_a_one_segment_plan_with_all_its_input_runs_each_op_once_in_order(
        name: str, shape: tuple[int, int, int]) -> None:
    """A one-segment plan (one device, or stripes without cuts) whose input rows are all here
    computes every op in one run, in topological order, each run reported to `on_run` with
    its rows; its output equals the single-device trunk and the rows fed slab by slab."""
    g = _graph(name, shape)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(4))
    for spec in (PlanSpec.single("a"), PlanSpec.stripes(("a", "b"), (0.5, 0.5), cuts=())):
        plan = build_plan(g, spec, slab_rows=shape[1])
        assert plan.num_segments == 1
        lo, hi = plan.input_rows_for("a")
        runs: list[tuple[int, int]] = []
        runner = StripeRunner(g, plan, "a", min_run_rows=1, on_run=lambda j, r, s, runs=runs: runs.append((j, r)))
        (out,) = runner.feed(0, lo, x[:, :, lo:hi])
        computed = runner._comp  # the rows the plan gives each value, to check the runs against
        expected = [(j, b - a) for j in range(len(g.ops)) for a, b in [computed[j + 1]] if b > a]
        assert runs == expected and runner.stats()["runs"] == len(expected) and runner.done
        streamed = StripeRunner(g, plan, "a", min_run_rows=1)
        slabs = [e for r0 in range(lo, hi, 5) for e in streamed.feed(0, r0, x[:, :, r0:min(r0 + 5, hi)])]
        assert streamed.stats()["runs"] > len(expected)  # slab by slab: ops split into several runs
        assert_close(torch.cat([e.rows for e in slabs], dim=2), out.rows)
        a, b = plan.output_rows_for("a")
        assert (out.role, out.row_offset, out.rows.shape[2]) == ("OUTPUT", a, b - a) and a < b
        assert_close(out.rows, g.run_trunk(x)[:, :, a:b])


def test_a_streamed_one_segment_plan_runs_short_ops_before_the_last_slab() -> None:
    """Slabs of a one-segment plan: an op with fewer rows than `min_run_rows` (ResNet-18's
    deeper layers) still computes half its rows before the last slab, in at most two runs;
    behind a cut `min_run_rows` holds as given (each op once when nothing else comes)."""
    shape = (3, 128, 128)
    g = _graph("resnet18", shape)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(6))
    plan = build_plan(g, PlanSpec.single("a"), slab_rows=32)
    runs: list[tuple[int, int]] = []
    runner = StripeRunner(g, plan, "a", min_run_rows=64, on_run=lambda j, r, s: runs.append((j, r)))
    outs = []
    for r0 in range(0, 96, 32):
        outs += runner.feed(0, r0, x[:, :, r0:r0 + 32])
    early = {j for j, _ in runs}
    rows = {j: g.value_shapes[j + 1][1] for j in range(len(g.ops))}
    assert any(rows[j] < 64 for j in early) and max(rows[j] for j in early) >= 32
    outs += runner.feed(0, 96, x[:, :, 96:])
    per_op = collections.Counter(j for j, _ in runs)
    assert runner.done and set(per_op) == set(range(len(g.ops))) and max(per_op.values()) == 2
    assert_close(torch.cat([e.rows for e in outs], dim=2), g.run_trunk(x))
    cut = build_plan(g, PlanSpec.layerwise("a", "a2", 19), slab_rows=32)
    one_run: list[int] = []
    first = StripeRunner(g, cut, "a", min_run_rows=64, on_run=lambda j, r, s: one_run.append(j))
    for r0 in range(0, 128, 32):
        first.feed(0, r0, x[:, :, r0:r0 + 32])
    assert first.done and len(one_run) == len(set(one_run))  # the deferral as given: one run per op


def test_row_pieces_read_views_one_piece_and_copies_across_pieces_and_padding() -> None:
    """A run's rows stay where the op put them: reading rows of one piece is a view of it (no
    copy), rows of several pieces or with border padding rows come back as one new tensor."""
    full = torch.arange(2 * 3 * 10 * 4, dtype=torch.float32).reshape(2, 3, 10, 4)
    full = full.contiguous(memory_format=torch.channels_last)
    pieces = RowPieces()
    for lo, hi in ((4, 7), (0, 4), (7, 10)):  # added out of order, as halos may arrive
        pieces.add(lo, hi, full[:, :, lo:hi].clone(memory_format=torch.channels_last))
    inside = pieces.read(4, 6)
    assert torch.equal(inside, full[:, :, 4:6])
    assert any(inside.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in pieces)
    across = pieces.read(2, 9)
    assert torch.equal(across, full[:, :, 2:9]) and across.is_contiguous(memory_format=torch.channels_last)
    padded = pieces.read(0, 3, top=1, bottom=2, fill=-1.0)
    assert padded.shape[2] == 6 and torch.equal(padded[:, :, 1:4], full[:, :, 0:3])
    assert bool((padded[:, :, :1] == -1).all()) and bool((padded[:, :, 4:] == -1).all())
    # a strided 1x1 conv's window skips rows the plan never sends: the gap reads as zeros
    gappy = RowPieces()
    gappy.add(0, 3, full[:, :, 0:3].clone(memory_format=torch.channels_last))
    gappy.add(4, 6, full[:, :, 4:6].clone(memory_format=torch.channels_last))
    rows = gappy.read(1, 6)
    assert torch.equal(rows[:, :, 0:2], full[:, :, 1:3]) and torch.equal(rows[:, :, 3:5], full[:, :, 4:6])
    assert bool((rows[:, :, 2] == 0).all())


@pytest.mark.parametrize("cuts", [False, True])
def test_a_runner_holds_only_the_rows_its_ops_still_read(cuts: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values every op of the node has read are released: an unfinished request costs its
    node its live activations (the compute node bounds its request table by these bytes),
    and a finished one nothing."""
    g = _graph("resnet18", (3, 96, 80))
    x = torch.randn(1, 3, 96, 80)
    everything = sum(c * h * w * 4 for c, h, w in g.value_shapes)  # each value's whole map, fp32
    plan = make_plan(g, ["a", "b"], [0.5, 0.5], cuts=g.cut_values if cuts else None)
    runners: dict[str, StripeRunner] = {}
    peaks: dict[str, int] = {}

    class Watched(StripeRunner):
        def _add(self, v: int, lo: int, hi: int, rows: torch.Tensor) -> None:
            super()._add(v, lo, hi, rows)
            peaks[self.node_id] = max(peaks.get(self.node_id, 0), self.held_bytes)

    for n in plan.active_nodes():
        runners[n] = Watched(g, plan, n)
    # feed only node a's first slab: what it computed from it is held until the rest arrives
    lo, _ = plan.input_rows_for("a")
    runners["a"].feed(0, lo, x[:, :, lo:lo + 8])
    assert runners["a"].held_bytes >= x[:, :, lo:lo + 8].numel() * 4
    assert not runners["a"].done
    # the whole exchange, through run_plan_locally's routing, with the watched runners
    out: dict[str, StripeRunner] = {}
    monkeypatch.setattr("kaitian_ros.core.stripe.StripeRunner", Watched)
    peaks.clear()
    assert_close(run_plan_locally(g, plan, x, slab_rows=8, runners_out=out), g.run_trunk(x))
    assert all(r.done and r.held_bytes == 0 for r in out.values())
    assert 0 < max(peaks.values()) < everything / 2
