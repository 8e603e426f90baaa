"""The split model and its per-op row-interval maps (docs/architecture-core.md): a `ModelGraph`
holds the trunk as a list of `TrunkOp`s and the head; :mod:`kaitian_ros.core.split` builds it.

Row algebra: value 0 is the image, op j produces value j + 1; every op maps a range of output
rows to the (clipped) range of input rows it reads (`Window.needs`) and, inversely, a range of
available input rows to the output rows it can compute (`Window.covered`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx

from .intervals import EMPTY, Interval, hull, intersect
from .intervals import iv_sub as iv_sub  # plan.py imports the interval names it uses from here
from .prepack import CPU_ACTIVATION_FORMAT


class UnsplittableModelError(ValueError):
    """The model has an op in its spatial trunk that mixes rows (or cannot be traced)."""


# --------------------------------------------------------------------------- row windows
@dataclass(frozen=True)
class Window:
    """Row (H) geometry of a conv/pool: output row r reads raw input rows
    [r*stride - pad_top, r*stride - pad_top + dilation*(kernel-1) + 1); rows outside
    [0, in_h) are padding."""

    kernel: int
    stride: int
    pad_top: int
    dilation: int
    in_h: int
    out_h: int

    def raw(self, lo: int, hi: int) -> Interval:
        return (lo * self.stride - self.pad_top,
                (hi - 1) * self.stride - self.pad_top + self.dilation * (self.kernel - 1) + 1)

    def input_rows(self, lo: int, hi: int) -> tuple[int, int, int, int]:
        """For output rows [lo, hi): the input rows [first, stop) that exist, and the padding
        rows above and below them that lie outside the image."""
        ra, rb = self.raw(lo, hi)
        first, stop = max(ra, 0), min(rb, self.in_h)
        return first, stop, first - ra, rb - stop

    def needs(self, rng: Interval) -> Interval:
        if rng[0] >= rng[1]:
            return EMPTY
        lo, hi = self.raw(*rng)
        return intersect((lo, hi), (0, self.in_h))

    def covered(self, avail: Interval) -> Interval:
        lo, hi = avail
        if lo >= hi:
            return EMPTY
        s, p, ext = self.stride, self.pad_top, self.dilation * (self.kernel - 1)
        a = 0 if lo <= 0 else -((-(lo + p)) // s)
        b = self.out_h if hi >= self.in_h else (hi - 1 + p - ext) // s + 1
        return intersect((a, b), (0, self.out_h))


# --------------------------------------------------------------------------- trunk ops
RunFn = Callable[[list[Tensor], int, int], Tensor]  # (inputs, out_lo, out_hi) -> rows
PaddedRunFn = Callable[[Tensor, int], Tensor]  # (input rows, H padding each side) -> output rows


@dataclass(frozen=True, eq=False)
class TrunkOp:
    name: str  # fx node names fused into this op, joined by "+"
    inputs: tuple[int, ...]  # value indices read
    out_shape: tuple[int, int, int]  # (C, H, W) of the produced value
    window: Window | None  # None: output row r reads row r of every input
    pad_value: float  # fill of H padding rows materialised at the true image border
    run: RunFn  # rows of each input (H padding included), output rows [lo, hi) -> those rows
    flops_per_row: float
    # a window op that can add its H padding itself (the conv's or pool's own padding
    # argument) instead of reading rows copied in between padding rows; None: it cannot
    run_padded: PaddedRunFn | None = None

    def needs(self, rng: Interval) -> Interval:
        return rng if self.window is None else self.window.needs(rng)

    def pads_itself(self, top: int, bottom: int) -> bool:
        """Whether `run_border` computes rows with `top`/`bottom` border padding rows without a
        copy of its input: symmetric padding of max(top, bottom) rows gives the wanted rows when
        the extra rows it adds at the top are a whole number of strides."""
        w = self.window
        return (self.run_padded is not None and w is not None and (top > 0 or bottom > 0)
                and (max(top, bottom) - top) % w.stride == 0)

    def run_border(self, x: Tensor, top: int, bottom: int, lo: int, hi: int) -> Tensor:
        """Output rows [lo, hi) from input rows `x` that lack `top`/`bottom` padding rows at the
        image border: the op pads where `pads_itself`, else the rows are copied between padding
        rows (`border_rows`)."""
        if top <= 0 and bottom <= 0:
            return self.run([x], lo, hi)
        if not self.pads_itself(top, bottom):
            return self.run([border_rows(x, top, bottom, self.pad_value)], lo, hi)
        assert self.run_padded is not None and self.window is not None
        pad = max(top, bottom)
        first = (pad - top) // self.window.stride  # output rows of padding above the wanted ones
        return self.run_padded(x, pad)[:, :, first:first + hi - lo]

    def covered(self, avail: Interval) -> Interval:
        return avail if self.window is None else self.window.covered(avail)


@dataclass(frozen=True, eq=False)
class ModelGraph:
    input_shape: tuple[int, int, int]
    trunk_output_shape: tuple[int, int, int]
    ops: tuple[TrunkOp, ...]
    value_shapes: tuple[tuple[int, int, int], ...]  # index 0 = image, j + 1 = output of op j
    cut_values: tuple[int, ...]  # values where exactly one tensor crosses (segment boundaries)
    consumers: tuple[tuple[int, ...], ...]  # per value: indices of the ops reading it
    trunk_module: fx.GraphModule = field(repr=False)
    head_module: fx.GraphModule = field(repr=False)
    device: torch.device = torch.device("cpu")  # where the ops' weights live (the model's)
    # the head reads the trunk output only through a global average pool: it gives the same
    # result for the output's per-channel mean, (N, C, 1, 1) (`run_head_on_sums`)
    pooled_head: bool = False

    @property
    def activation_format(self) -> torch.memory_format:
        """Memory format of activations between ops: channels-last (NHWC) on a CPU, where a
        block of rows is then one contiguous slice - a stripe's input window is a view, not a
        copy - and oneDNN's convolutions run without reordering their input; NCHW elsewhere."""
        return CPU_ACTIVATION_FORMAT if self.device.type == "cpu" else torch.contiguous_format

    @property
    def output_values_sent(self) -> int:
        """Values of the whole trunk output that cross a link back to the coordinator: its
        per-channel sum for a `pooled_head`, else every value."""
        c, h, w = self.trunk_output_shape
        return c if self.pooled_head else c * h * w

    @property
    def num_values(self) -> int:
        return len(self.value_shapes)

    @property
    def output_value(self) -> int:
        return len(self.value_shapes) - 1

    @torch.no_grad()
    def run_trunk(self, x: Tensor) -> Tensor:
        """Single-device reference trunk on the original (unfused) modules, (N,C,H,W)."""
        return self.trunk_module(x)

    @torch.no_grad()
    def run_head(self, trunk_out: Tensor) -> Tensor:
        return self.head_module(trunk_out)

    @torch.no_grad()
    def run_head_on_sums(self, sums: Sequence[Tensor]) -> Tensor:
        """The head on the trunk output given as the sums over height and width of its row
        stripes, (N, C, 1, 1) each (only for a `pooled_head`). Summed in the order given: the
        caller passes them in row order, so that a plan always adds them alike."""
        if not self.pooled_head:
            raise ValueError("the head does not start with a global average pool: it needs the rows")
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        _, h, w = self.trunk_output_shape
        return self.head_module(total / (h * w))

    @torch.no_grad()
    def run_ops(self, x: Tensor, first_value: int = 0, last_value: int | None = None) -> Tensor:
        """Run the fused trunk ops on whole tensors from `first_value` (a cut) to `last_value`."""
        last = self.output_value if last_value is None else last_value
        fmt = self.activation_format
        vals: dict[int, Tensor] = {first_value: x.contiguous(memory_format=fmt)}
        for j in range(first_value, last):
            op = self.ops[j]
            ins = [vals[u] for u in op.inputs]
            if op.window is not None:
                y = window_rows(op, ins[0], 0, op.window.out_h)
            else:
                y = op.run(ins, 0, op.out_shape[1])
            vals[j + 1] = y.contiguous(memory_format=fmt)
            for u in op.inputs:  # read for the last time: its memory is reused by the next ops
                if self.consumers[u][-1] == j:
                    vals.pop(u, None)
        return vals[last]

    def trunk_flops(self) -> float:
        return float(sum(op.flops_per_row * op.out_shape[1] for op in self.ops))

    def required_rows(
        self, in_value: int, out_value: int, out_rows: Interval
    ) -> tuple[dict[int, Interval], Interval]:
        """Rows of every value in (in_value, out_value] needed to compute `out_rows` of
        `out_value` from `in_value` (a cut), and the rows of `in_value` read.

        Propagates backwards through the DAG; a value read by several ops needs the hull of
        their windows (for the reference nets the union is already contiguous).
        """
        need: dict[int, Interval] = {out_value: out_rows if out_rows[0] < out_rows[1] else EMPTY}
        comp: dict[int, Interval] = {}
        for j in range(out_value - 1, in_value - 1, -1):
            rng = need.get(j + 1, EMPTY)
            comp[j + 1] = rng
            if rng[0] >= rng[1]:
                continue
            op = self.ops[j]
            for u in op.inputs:
                need[u] = hull(need.get(u, EMPTY), op.needs(rng))
        return comp, need.get(in_value, EMPTY)


def window_rows(op: TrunkOp, x: Tensor, lo: int, hi: int) -> Tensor:
    """Output rows [lo, hi) of window op `op`, given `x` = its whole input."""
    assert op.window is not None
    first, stop, top, bottom = op.window.input_rows(lo, hi)
    return op.run_border(x[:, :, first:stop], top, bottom, lo, hi)


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last for an NHWC-strided 4-D tensor, else contiguous (NCHW)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def border_rows(x: Tensor, top: int, bottom: int, fill: float) -> Tensor:
    """Add `top`/`bottom` rows of `fill` (padding only exists at the true image border)."""
    if top <= 0 and bottom <= 0:
        return x
    n, c, h, w = x.shape
    out = torch.empty((n, c, top + h + bottom, w), dtype=x.dtype, device=x.device,
                      memory_format=memory_format_of(x))
    if top > 0:
        out[:, :, :top].fill_(fill)
    out[:, :, top:top + h].copy_(x)
    if bottom > 0:
        out[:, :, top + h:].fill_(fill)
    return out
