"""A node's share of the trunk output, sent as its sum over height and width.

When the head reads the trunk output only through a global average pool
(`ModelGraph.pooled_head`: ResNet, MobileNetV2 and VGG here), the coordinator needs nothing of
the output but its per-channel mean. Each node then sends, instead of its output rows
(C x rows x W floats: 100 kB for ResNet-18 at 224 x 224), their sum over height and width (C
floats, 2 kB) once its last output row exists. The coordinator adds the nodes' sums in row
order and runs the head on their mean (`ModelGraph.run_head_on_sums`): the same logits as the
head on the assembled rows up to float32 rounding of the summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .stripe import Emission


class RowSum:
    """Collects the output rows [lo, hi) one node computes for one request, in any order and
    pieces; `add` returns their sum over height and width, (N, C, 1, 1), when the last arrives.
    The sum is taken over all rows at once in row order, so it does not depend on how the
    executor happened to cut them into runs."""

    def __init__(self, lo: int, hi: int) -> None:
        if hi <= lo:
            raise ValueError(f"no output rows to sum: [{lo}, {hi})")
        self.lo, self.hi = lo, hi
        self._pieces: dict[int, Tensor] = {}
        self._rows = 0

    @property
    def complete(self) -> bool:
        return self._rows == self.hi - self.lo

    def add(self, row_offset: int, rows: Tensor) -> Tensor | None:
        a, b = row_offset, row_offset + rows.shape[2]
        if a < self.lo or b > self.hi or a >= b or any(a < k + p.shape[2] and k < b for k, p in self._pieces.items()):
            raise ValueError(f"output rows [{a}, {b}) outside [{self.lo}, {self.hi}) or given before")
        r = b - a
        self._pieces[row_offset] = rows
        self._rows += r
        if not self.complete:
            return None
        whole = torch.cat([self._pieces[k] for k in sorted(self._pieces)], dim=2)
        return whole.sum(dim=(2, 3), keepdim=True)


def sum_outputs(emissions: list[Emission], row_sum: RowSum) -> list[Emission]:
    """`emissions` with their OUTPUT rows folded into `row_sum`, and one ``OUTPUT_SUM``
    emission (at the first row) once it holds them all; HALO emissions unchanged."""
    out = []
    for e in emissions:
        if e.role != "OUTPUT":
            out.append(e)
            continue
        summed = row_sum.add(e.row_offset, e.rows)
        if summed is not None:
            out.append(Emission("OUTPUT_SUM", e.segment, e.consumer, row_sum.lo, summed))
    return out
