"""How plans are priced: `PlanCosts`, the per-node costs a planner prices plans with, and
`CostModel`, the flop-based prior used until nodes have published measured costs
(`core.costs` holds the measured ones)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .costs import OpCost
from .graph import ModelGraph


class PlanCosts(Protocol):
    """Per-node costs a planner prices plans with (node = index into the plan's node ids)."""

    def op_ms(self, node: int, op: int, rows: int) -> float:
        """Time node `node` takes for `rows` rows of trunk op `op`, in executor-sized runs."""

    def transfer_ms(self, src: int, dst: int, nbytes: float) -> float:
        """Time `nbytes` take from node `src` to node `dst` (latency included)."""


@dataclass(frozen=True)
class CostModel:
    """Flop-based prior cost model, used until nodes have published measured costs.

    Node i computes at `flops_per_ms * n_active * share_i` (the scheduler sets shares in
    proportion to speed, so the mean node runs at `flops_per_ms`). Each cut adds `exchange_ms`
    plus the halo bytes at `link_bytes_per_ms`. `bind(shares)` gives the `PlanCosts` view.
    Every constant is a prior, replaced by measurements as soon as they exist; where each came
    from is said next to it.
    """

    # one CPU thread of the development VM: ResNet-18 trunk, 3.6 GFLOP, in ~80 ms
    flops_per_ms: float = 4.5e7
    # per cut: message latency + synchronisation with neighbours; 0.5 ms let the planner cut the
    # adaptivity benchmark's 128x128 ResNet-18 at every block instead of not at all (docs)
    exchange_ms: float = 0.5
    link_bytes_per_ms: float = 1.0e5  # 100 MB/s, a gigabit link
    bytes_per_element: int = 4  # float32
    # Per-call costs the flop count misses, measured on the development VM (ResNet-18, one
    # thread): every conv call reads its whole (prepacked) weight tensor at memory speed, and
    # every call has a fixed Python/dispatch cost; runs are about `run_rows` rows.
    call_ms: float = 0.05
    weight_bytes_per_ms: float = 2.0e7  # ~20 GB/s
    run_rows: int = 8

    def bind(self, graph: ModelGraph, shares: Sequence[float]) -> PlanCosts:
        return _PriorCosts(self, graph, tuple(shares))


@dataclass(frozen=True)
class _PriorCosts:
    model: CostModel
    graph: ModelGraph
    shares: tuple[float, ...]

    def op_ms(self, node: int, op: int, rows: int) -> float:
        m, o = self.model, self.graph.ops[op]
        share = self.shares[node]
        if rows <= 0 or share <= 0:
            return 0.0 if rows <= 0 else math.inf
        n_active = sum(1 for s in self.shares if s > 0)
        flops_ms = rows * o.flops_per_row / m.flops_per_ms
        calls = -(-rows // max(1, m.run_rows))
        extra = calls * m.call_ms
        if o.window is not None and m.weight_bytes_per_ms > 0:
            # conv weights ~ flops_per_row / (2 * W_out) elements (tiny for pools)
            wbytes = o.flops_per_row / (2.0 * o.out_shape[2]) * m.bytes_per_element
            extra += max(0.0, calls * wbytes / m.weight_bytes_per_ms - flops_ms)
        return (flops_ms + extra) / (n_active * share)

    def transfer_ms(self, src: int, dst: int, nbytes: float) -> float:
        return self.model.exchange_ms + nbytes / self.model.link_bytes_per_ms


def prior_op_cost(op: Any, prior: CostModel, scale: float) -> OpCost:
    """An op's prior cost before its node measured it: flops at the prior speed, plus the prior
    per-call cost; `scale` > 1 for a slower node."""
    return OpCost(prior.call_ms * scale, op.flops_per_row / prior.flops_per_ms * scale)
