"""A head that starts with a global average pool gets the nodes' sums of their output rows
instead of the rows (core/pooled.py, ModelGraph.pooled_head): which models qualify, the sum of
rows given in pieces, the head on the sums against the head on the rows, and what the
simulator charges for the smaller output."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn

from kaitian_ros.core.costs import COORDINATOR, Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import PlanSpec, build_plan, make_plan
from kaitian_ros.core.pooled import RowSum, sum_outputs
from kaitian_ros.core.simulate import simulate
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import Emission, run_plan_locally


class _Head(nn.Module):
    """conv trunk, then a head given as a function of the trunk output."""

    def __init__(self, head) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self, self.conv(x))


@pytest.mark.parametrize(("head", "pooled"), [
    (lambda m, y: m.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1)), True),
    (lambda m, y: m.fc(y.mean((2, 3))), True),
    (lambda m, y: m.fc(y.mean(dim=(-1, -2))), True),
    (lambda m, y: m.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 2), 1)[:, :8]), False),
    (lambda m, y: m.fc(y.amax((2, 3))), False),
    (lambda m, y: m.fc(y.mean((2, 3)) + y.amax((2, 3))), False),  # reads the rows themselves too
])
def test_pooled_head_only_when_the_output_is_read_through_a_global_mean(head, pooled) -> None:
    graph = split_model(_Head(head), (3, 16, 16))
    assert graph.pooled_head is pooled
    x = torch.randn(1, 3, 16, 16)
    if pooled:  # the head on the output's sum gives the model's logits
        y = graph.run_ops(x)
        assert torch.allclose(graph.run_head_on_sums([y.sum(dim=(2, 3), keepdim=True)]),
                              graph.run_head(y), atol=1e-6)
    else:
        with pytest.raises(ValueError, match="global average pool"):
            graph.run_head_on_sums([x])


def test_the_models_heads() -> None:
    pooled = {name: split_model(build_model(name, num_classes=10, in_channels=c), (c, h, h)).pooled_head
              for name, c, h in (("resnet18", 3, 64), ("mobilenet_v2", 3, 64), ("vgg11", 3, 64),
                                 ("digits_cnn", 1, 8))}
    assert pooled == {"resnet18": True, "mobilenet_v2": True, "vgg11": True, "digits_cnn": False}


def test_row_sum_in_any_pieces_and_order_is_the_sum_of_the_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(1, 5, 12, 7, generator=gen)
    want = rows[:, :, 2:12].sum(dim=(2, 3), keepdim=True)
    for seed in range(5):
        cuts = sorted(random.Random(seed).sample(range(3, 12), 3))
        pieces = list(zip([2, *cuts], [*cuts, 12]))
        random.Random(seed).shuffle(pieces)
        acc = RowSum(2, 12)
        got = [acc.add(a, rows[:, :, a:b]) for a, b in pieces]
        assert all(g is None for g in got[:-1]) and acc.complete
        assert torch.equal(got[-1], want)  # summed at once in row order: independent of the pieces


def test_a_nodes_output_emissions_become_one_sum_when_all_exist() -> None:
    rows = torch.randn(1, 3, 6, 4)
    halo = Emission("HALO", 0, "b", 2, torch.zeros(1, 3, 1, 4))
    acc = RowSum(0, 6)
    first = sum_outputs([Emission("OUTPUT", 1, "coordinator", 0, rows[:, :, :4]), halo], acc)
    assert first == [halo]  # rows kept back, the halo goes on
    (done,) = sum_outputs([Emission("OUTPUT", 1, "coordinator", 4, rows[:, :, 4:])], acc)
    assert (done.role, done.segment, done.consumer, done.row_offset) == ("OUTPUT_SUM", 1, "coordinator", 0)
    assert torch.equal(done.rows, rows.sum(dim=(2, 3), keepdim=True))


def test_row_sum_refuses_rows_outside_or_twice() -> None:
    acc = RowSum(4, 10)
    with pytest.raises(ValueError):
        acc.add(2, torch.zeros(1, 2, 3, 3))  # starts above its rows
    with pytest.raises(ValueError):
        acc.add(8, torch.zeros(1, 2, 3, 3))  # ends below them
    acc.add(4, torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError):
        acc.add(4, torch.zeros(1, 2, 3, 3))  # given twice
    with pytest.raises(ValueError):
        acc.add(6, torch.zeros(1, 2, 3, 3))  # overlaps
    with pytest.raises(ValueError):
        RowSum(5, 5)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_split_plans_through_node_sums_equal_the_single_device_logits(name) -> None:
    torch.manual_seed(0)
    graph = split_model(build_model(name, num_classes=10), (3, 96, 64))
    x = torch.randn(1, 3, 96, 64)
    ref = graph.run_head(graph.run_trunk(x))
    for nodes, shares in ((["a", "b"], [0.7, 0.3]), (["a", "b", "c"], [0.2, 0.5, 0.3])):
        plan = make_plan(graph, nodes, shares, slab_rows=16)
        with torch.no_grad():
            out = run_plan_locally(graph, plan, x)
        ranges = sorted(plan.output_rows_for(n) for n in plan.active_nodes())
        sums = [out[:, :, lo:hi].sum(dim=(2, 3), keepdim=True) for lo, hi in ranges if hi > lo]
        got = graph.run_head_on_sums(sums)
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), (nodes, shares)


def test_the_simulator_charges_a_pooled_output_its_sum_not_its_rows() -> None:
    graph = split_model(build_model("resnet18", num_classes=10), (3, 64, 64))
    ops = tuple(OpCost(0.01, 0.001) for _ in graph.ops)
    profile = DeviceProfile("a", 1, "m", "cpu", 1.0, ops, sum(c.ms(op.out_shape[1]) for c, op in zip(ops, graph.ops)),
                            0.01)
    slow = LinkEstimate(100.0, 0.5)  # 100 bytes/ms: the 32 kB trunk output alone would take 330 ms
    costs = Costs({"a": profile}, {("a", COORDINATOR): slow, (COORDINATOR, "a"): slow}, slow)
    plan = build_plan(graph, PlanSpec.single("a"), slab_rows=16)
    pooled = simulate(graph, plan, costs).outputs_ms
    rows = simulate(dataclasses.replace(graph, pooled_head=False), plan, costs).outputs_ms
    c, h, w = graph.trunk_output_shape
    assert rows - pooled == pytest.approx((c * h * w * 4 - c * 4) / slow.bytes_per_ms, rel=0.02)
    assert graph.output_values_sent == c
    assert dataclasses.replace(graph, pooled_head=False).output_values_sent == c * h * w
