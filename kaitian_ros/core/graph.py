"""Trunk/head split of a CNN and per-op row-interval maps (docs/architecture-core.md).

`split_model` traces a model with torch.fx, keeps the longest prefix of spatially local ops as
the *trunk* and everything after the first global op (adaptive pool, flatten, linear, ...) as the
*head*. The trunk is compiled into a list of `TrunkOp`s - conv/pool "window" ops and row-wise
"pointwise" ops (activations, BN, residual add, channel cat) - with chains of single-consumer
pointwise ops fused into the op before them (conv+BN folded, ReLU as an in-place epilogue): fewer
ops means fewer buffers and fewer Python round trips per row run in the stripe executor.

Row algebra: value 0 is the image, op j produces value j + 1; every op maps a range of output
rows to the (clipped) range of input rows it reads (`Window.needs`) and, inversely, a range of
available input rows to the output rows it can compute (`Window.covered`).
"""

from __future__ import annotations

import copy
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp

Interval = tuple[int, int]  # [lo, hi); empty when lo >= hi, canonical empty = (0, 0)
EMPTY: Interval = (0, 0)


class UnsplittableModelError(ValueError):
    """The model has an op in its spatial trunk that mixes rows (or cannot be traced)."""


# --------------------------------------------------------------------------- intervals
def hull(a: Interval, b: Interval) -> Interval:
    if a[0] >= a[1]:
        return b if b[0] < b[1] else EMPTY
    if b[0] >= b[1]:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]))


def intersect(a: Interval, b: Interval) -> Interval:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else EMPTY


def iv_add(ivs: list[Interval], new: Interval) -> list[Interval]:
    """Union of a sorted disjoint interval list with one interval (adjacent ones merge)."""
    lo, hi = new
    if lo >= hi:
        return ivs
    out: list[Interval] = []
    for a, b in ivs:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    out.sort()
    return out


def iv_intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if lo < hi:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def iv_sub(xs: list[Interval], cut: Interval) -> list[Interval]:
    out: list[Interval] = []
    for a, b in xs:
        if cut[1] <= a or cut[0] >= b or cut[0] >= cut[1]:
            out.append((a, b))
            continue
        if a < cut[0]:
            out.append((a, cut[0]))
        if cut[1] < b:
            out.append((cut[1], b))
    return out


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


@dataclass(frozen=True, eq=False)
class TrunkOp:
    name: str  # fx node names fused into this op, joined by "+"
    inputs: tuple[int, ...]  # value indices read
    out_shape: tuple[int, int, int]  # (C, H, W) of the produced value
    window: Window | None  # None: output row r reads row r of every input
    pad_value: float  # fill of H padding rows materialised at the true image border
    run: RunFn  # rows of each input (H padding included), output rows [lo, hi) -> those rows
    flops_per_row: float

    def needs(self, rng: Interval) -> Interval:
        return rng if self.window is None else self.window.needs(rng)

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

    @property
    def activation_format(self) -> torch.memory_format:
        """Memory format of activations between ops: channels-last (NHWC) on a CPU, where a
        block of rows is then one contiguous slice - a stripe's input window is a view, not a
        copy - and oneDNN's convolutions run without reordering their input; NCHW elsewhere."""
        return CPU_ACTIVATION_FORMAT if self.device.type == "cpu" else torch.contiguous_format

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
    def run_ops(self, x: Tensor, first_value: int = 0, last_value: int | None = None) -> Tensor:
        """Run the fused trunk ops on whole tensors from `first_value` (a cut) to `last_value`."""
        last = self.output_value if last_value is None else last_value
        fmt = self.activation_format
        vals: dict[int, Tensor] = {first_value: x.contiguous(memory_format=fmt)}
        for j in range(first_value, last):
            op = self.ops[j]
            ins = [vals[u] for u in op.inputs]
            if op.window is not None:
                ins = [_pad_rows(ins[0], op.window, 0, op.window.out_h, op.pad_value)]
            vals[j + 1] = op.run(ins, 0, op.out_shape[1]).contiguous(memory_format=fmt)
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


def _pad_rows(x: Tensor, w: Window, lo: int, hi: int, fill: float) -> Tensor:
    """Input rows for output rows [lo, hi) of window op `w`, given `x` = whole input."""
    ra, rb = w.raw(lo, hi)
    ca, cb = max(ra, 0), min(rb, w.in_h)
    return border_rows(x[:, :, ca:cb], ca - ra, rb - cb, fill)


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


# --------------------------------------------------------------------------- op tables
_POINTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.SiLU, nn.GELU,
    nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.PReLU,
    nn.Identity, nn.Dropout, nn.Dropout2d, nn.AlphaDropout,
)
_POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.relu, torch.sigmoid, torch.tanh,
    torch.clamp, torch.cat, torch.abs, torch.exp, torch.maximum, torch.minimum,
    F.relu, F.relu6, F.hardtanh, F.leaky_relu, F.elu, F.selu, F.silu, F.gelu, F.sigmoid,
    F.hardswish, F.hardsigmoid, F.mish, F.softplus, F.dropout, F.dropout2d, F.tanh,
}
_POINTWISE_METHODS = {
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp", "clamp_", "add", "add_",
    "sub", "sub_", "mul", "mul_", "div", "div_", "contiguous", "clone", "abs", "neg", "exp",
}
_HEAD_MODULES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear)
_HEAD_FUNCTIONS = {
    torch.flatten, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.linear, torch.mean,
    torch.amax, torch.sum, torch.squeeze, getattr,
}
_HEAD_METHODS = {"flatten", "view", "reshape", "mean", "amax", "sum", "size", "squeeze", "dim"}


class _Slot:
    """Placeholder for the i-th trunk-tensor argument of a node call."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _subst(obj: object, xs: Sequence[Tensor]) -> Any:  # the args of whatever op was traced
    if isinstance(obj, _Slot):
        return xs[obj.i]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_subst(o, xs) for o in obj)
    if isinstance(obj, dict):
        return {k: _subst(v, xs) for k, v in obj.items()}
    return obj


def _describe(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"{node.name} ({type(gm.get_submodule(str(node.target))).__name__} '{node.target}')"
    if node.op == "call_function":
        return f"{node.name} ({getattr(node.target, '__name__', str(node.target))})"
    return f"{node.name} (.{node.target}())"


def _shape(node: fx.Node) -> tuple[int, ...]:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()


# --------------------------------------------------------------------------- compiling ops
@dataclass
class _Raw:
    """One fx node of the trunk before fusion."""

    node: fx.Node
    kind: str  # "conv" | "maxpool" | "avgpool" | "bn" | "pointwise"
    inputs: list[fx.Node]  # trunk-tensor args in call order


def _conv_params(m: nn.Conv2d) -> tuple[int, int, int, int, int, int]:
    """(kernel_h, stride_h, dilation_h, pad_top, pad_left, pad_right) of a conv module."""
    rp = m._reversed_padding_repeated_twice  # [left, right, top, bottom]
    return (m.kernel_size[0], m.stride[0], m.dilation[0], int(rp[2]), int(rp[0]), int(rp[1]))


def _bn_affine(bn: nn.modules.batchnorm._BatchNorm) -> tuple[Tensor, Tensor]:
    assert bn.running_var is not None and bn.running_mean is not None, (
        "BatchNorm without running statistics normalises by the batch; it cannot be folded")
    scale = torch.rsqrt(bn.running_var + bn.eps)
    if bn.affine:
        scale = scale * bn.weight
    shift = -bn.running_mean * scale
    if bn.affine:
        shift = shift + bn.bias
    return scale.detach().clone(), shift.detach().clone()


def _pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


_M = TypeVar("_M", bound=nn.Module)


def _module_of(node: fx.Node, gm: fx.GraphModule, cls: type[_M]) -> _M:
    """The module a call_module node calls, which `_classify` found to be a `cls`."""
    m = gm.get_submodule(str(node.target))
    assert isinstance(m, cls), (node.name, type(m))
    return m


def _pool_module(node: fx.Node, gm: fx.GraphModule) -> nn.MaxPool2d | nn.AvgPool2d:
    """MaxPool2d/AvgPool2d module for a module call or a F.max_pool2d/F.avg_pool2d call."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        assert isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)), (node.name, type(m))
        return m
    names = (["kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"]
             if node.target is F.max_pool2d else
             ["kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
              "divisor_override"])
    kw: dict[str, Any] = dict(zip(names, node.args[1:]))  # values as traced
    kw.update(node.kwargs)
    return (nn.MaxPool2d if node.target is F.max_pool2d else nn.AvgPool2d)(**kw)


def _classify(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """Kind of a spatially local op, or None when the op is not row-local."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, nn.Conv2d):
            return "conv"
        if isinstance(m, nn.MaxPool2d):
            return "maxpool"
        if isinstance(m, nn.AvgPool2d):
            return "avgpool"
        if isinstance(m, nn.BatchNorm2d):
            return "bn"
        if isinstance(m, _POINTWISE_MODULES):
            return "pointwise"
        return None
    if node.op == "call_function":
        if node.target is F.max_pool2d:
            return "maxpool"
        if node.target is F.avg_pool2d:
            return "avgpool"
        return "pointwise" if node.target in _POINTWISE_FUNCTIONS else None
    if node.op == "call_method":
        return "pointwise" if node.target in _POINTWISE_METHODS else None
    return None


def _is_head_start(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _HEAD_MODULES)
    if node.op == "call_function":
        return node.target in _HEAD_FUNCTIONS
    return node.op == "call_method" and node.target in _HEAD_METHODS


def _caller(node: fx.Node, gm: fx.GraphModule, trunk: set[fx.Node], inplace_ok: bool
            ) -> tuple[Callable[[Sequence[Tensor]], Tensor], list[fx.Node]]:
    """A function of the node's trunk-tensor args (in order) that replays the node."""
    ins: list[fx.Node] = []

    def slot(n: fx.Node) -> Any:  # a _Slot, which map_arg's Argument type does not admit
        if n in trunk:
            if n not in ins:
                ins.append(n)
            return _Slot(ins.index(n))
        if n.op == "get_attr":
            return _fetch_attr(gm, str(n.target))
        raise UnsplittableModelError(
            f"op {_describe(node, gm)} reads non-trunk value {n.name}; cannot split rows")

    args = fx.node.map_arg(node.args, slot)
    kwargs = dict(fx.node.map_arg(node.kwargs, slot))
    if not inplace_ok and "inplace" in kwargs:
        kwargs["inplace"] = False
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if not inplace_ok and getattr(mod, "inplace", False):
            mod = copy.copy(mod)
            mod.inplace = False  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
        return (lambda xs: mod(*_subst(args, xs), **_subst(kwargs, xs))), ins
    if node.op == "call_function":
        fn = node.target
        assert callable(fn), node.name
        return (lambda xs: fn(*_subst(args, xs), **_subst(kwargs, xs))), ins
    name = str(node.target)
    if not inplace_ok and name.endswith("_"):
        name = name[:-1]  # in-place method on a buffer view would corrupt the buffer
    return (lambda xs: getattr(_subst(args, xs)[0], name)(*_subst(args, xs)[1:],
                                                          **_subst(kwargs, xs))), ins


def _fetch_attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, Tensor) and obj.dim() >= 2 and obj.shape[-2] != 1:
        raise UnsplittableModelError(f"constant '{target}' varies along rows; cannot split rows")
    return obj


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _avg_divisor(m: nn.AvgPool2d, in_hw: tuple[int, int], out_hw: tuple[int, int],
                 device: torch.device) -> Tensor:
    """Per-output divisor of an average pool (torch semantics incl. ceil_mode clipping)."""
    k, s, p = _pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding)
    if m.divisor_override:
        return torch.full((1, 1, *out_hw), float(m.divisor_override), device=device)
    sizes = []
    for d in range(2):
        col = []
        for o in range(out_hw[d]):
            start = o * s[d] - p[d]
            end = min(start + k[d], in_hw[d] + p[d])
            if m.count_include_pad:
                col.append(end - start)
            else:
                col.append(min(end, in_hw[d]) - max(start, 0))
        sizes.append(torch.tensor(col, dtype=torch.float32))
    return (sizes[0][:, None] * sizes[1][None, :]).view(1, 1, *out_hw).to(device)


# Activations between trunk ops on a CPU (`ModelGraph.activation_format`). Measured on this CPU
# (ResNet-18 224, one thread, interleaved medians): channels-last with every conv
# prepacked made the whole trunk 10 % faster than NCHW (53.9 -> 48.4 ms), a streamed
# single-node stripe 10 % and the two stripes of a 0.7/0.3 split 11-12 %.
CPU_ACTIVATION_FORMAT = torch.channels_last


# A first call at an input shape that stays this many times slower than its share of the
# whole-map call (plus the slack) gets weights packed for that shape (see `PrepackedConv`).
SLOW_PACK_FACTOR = 3.0
SLOW_PACK_SLACK_S = 0.5e-3
REPACK_MIN_SPEEDUP = 2.0  # ... and keeps them only if they are at least this much faster


class PrepackedConv:
    """A CPU float32 conv with its weights reordered into oneDNN's blocked layout once, not
    on every call.

    Why: the default CPU conv reorders the whole weight tensor on every call. For a stripe of
    a few rows of a weight-heavy layer that reorder is most of the cost - a 1-row call of a
    512-channel 3x3 conv (9.4 MB of weights) took 7.1 ms, as long as all 7 rows (7.3 ms);
    prepacked it takes 0.26 ms and 4.6 ms (docs/architecture-core.md). Row splits pay that
    fixed cost once per node and per run, so it decides whether splitting pays at all.

    oneDNN chooses the blocked layout by input shape. The one packed for the whole map suits
    nearly every row count, but for a few shapes oneDNN wants another and converts between
    the two on every call, 4-150x slower (ResNet-18 at 448: a layer4 conv on 12 of
    its 14 rows took 155 ms instead of 9; MobileNetV2 at 224, 1x1 convs on 2-3 of 7 rows took
    10-25 ms instead of 0.1-0.3). So the first call at each (batch, rows) shape is timed
    against the whole-map call; a shape that is still far slower on a second call gets weights
    packed for itself, kept if they give the same result at least twice as fast.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, padding: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int], groups: int,
                 input_shape: tuple[int, int, int, int]) -> None:
        """Packs for `input_shape` (the whole map), checks the packed op against ``F.conv2d``
        on channels-last input, as the trunk runs it (ValueError on a mismatch), and times it.
        """
        self._weight, self._bias = weight, bias
        self._args = (list(padding), list(stride), list(dilation), groups)
        with torch.no_grad():
            self._default = self._pack(input_shape)
            probe = torch.randn(input_shape, generator=torch.Generator().manual_seed(0))
            probe = probe.contiguous(memory_format=torch.channels_last)
            want = F.conv2d(probe, weight, bias, stride, padding, dilation, groups)
            got = self._run(probe, self._default)
            if got.shape != want.shape or not _close(got, want):
                raise ValueError("packed conv differs from F.conv2d")
            t0 = time.perf_counter()
            self._run(probe, self._default)  # the first call built oneDNN's kernel: time the second
            self._s_per_row = (time.perf_counter() - t0) / got.shape[2]  # per output row, one image
        self._by_shape: dict[tuple[int, int], Tensor] = {(input_shape[0], input_shape[2]): self._default}

    def __call__(self, x: Tensor) -> Tensor:
        key = (x.shape[0], x.shape[2])
        packed = self._by_shape.get(key)
        if packed is not None:
            return self._run(x, packed)
        self._by_shape[key] = self._default
        y, took = self._timed(x, self._default)
        if not self._slow(y, took):
            return y
        y, took = self._timed(x, self._default)  # the first call at a shape also builds a kernel
        if not self._slow(y, took):
            return y
        try:
            own = self._pack(tuple(x.shape))
            self._run(x, own)  # builds the kernel for this layout
            mine, took_own = self._timed(x, own)
        except RuntimeError:  # refused for this shape: keep the (slow but right) layout
            return y
        # kept only where it is right and clearly faster: a call that was merely descheduled
        # must not leave a second copy of the weights behind
        if mine.shape == y.shape and _close(mine, y) and took_own * REPACK_MIN_SPEEDUP < took:
            self._by_shape[key] = own
        return y

    @property
    def repacked_shapes(self) -> tuple[tuple[int, int], ...]:
        """(batch, input rows) shapes that got weights packed for themselves."""
        return tuple(k for k, p in self._by_shape.items() if p is not self._default)

    def _timed(self, x: Tensor, packed: Tensor) -> tuple[Tensor, float]:
        t0 = time.perf_counter()
        y = self._run(x, packed)
        return y, time.perf_counter() - t0

    def _slow(self, y: Tensor, took: float) -> bool:
        """Far slower than this many output rows' share of the whole-map call."""
        return took > SLOW_PACK_FACTOR * self._s_per_row * y.shape[0] * y.shape[2] + SLOW_PACK_SLACK_S

    def _pack(self, input_shape: Sequence[int]) -> Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(self._weight, *self._args, list(input_shape))

    def _run(self, x: Tensor, packed: Tensor) -> Tensor:
        return torch.ops.mkldnn._convolution_pointwise(x, packed, self._bias, *self._args, "none", [], "")


def _close(got: Tensor, want: Tensor) -> bool:
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def prepacked_conv(weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                   stride: Sequence[int], dilation: Sequence[int], groups: int,
                   input_shape: tuple[int, int, int, int]) -> PrepackedConv | None:
    """The conv with prepacked weights (`PrepackedConv`), or None where that path does not
    apply, is unavailable in this torch build, or differs from ``F.conv2d``."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or groups != 1
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return PrepackedConv(weight, bias, padding, stride, dilation, groups, input_shape)
    except (RuntimeError, AttributeError, TypeError, ValueError):  # op missing, refused or wrong
        return None


def _compile(raw: _Raw, epilogue: list[Callable[[Tensor], Tensor]], gm: fx.GraphModule,
             trunk: set[fx.Node], value_of: dict[fx.Node, int], name: str,
             out_node: fx.Node, fold: tuple[Tensor, Tensor] | None) -> TrunkOp:
    node = raw.node
    in_shape = _shape(raw.inputs[0])
    out_shape = _shape(out_node)
    cin, hin, win = in_shape[1], in_shape[2], in_shape[3]
    cout, hout, wout = out_shape[1], out_shape[2], out_shape[3]

    def finish(y: Tensor) -> Tensor:
        for f in epilogue:
            y = f(y)
        return y

    epi_flops = float(cout * wout * len(epilogue))
    if raw.kind == "conv":
        m = _module_of(node, gm, nn.Conv2d)
        if m.padding_mode != "zeros":
            raise UnsplittableModelError(
                f"op {_describe(node, gm)} uses padding_mode={m.padding_mode!r}; only zero "
                "padding is split by rows")
        kh, sh, dh, ptop, pl, pr = _conv_params(m)
        weight = m.weight.detach()
        bias = None if m.bias is None else m.bias.detach()
        if fold is not None:  # conv -> BN (eval): fold the affine map into the weights
            scale, shift = fold
            weight = weight * scale.view(-1, 1, 1, 1)
            bias = shift if bias is None else bias * scale + shift
        weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()
        stride, dil, groups = m.stride, m.dilation, m.groups
        sym = pl == pr
        padding = (0, pl if sym else 0)
        packed = prepacked_conv(weight, bias, padding, stride, dil, groups,
                                (1, cin, (hout - 1) * sh + dh * (kh - 1) + 1, win + (0 if sym else pl + pr)))

        def run_conv(xs: list[Tensor], lo: int, hi: int) -> Tensor:
            x = xs[0] if sym else F.pad(xs[0], (pl, pr, 0, 0))
            if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
                return finish(packed(x))
            return finish(F.conv2d(x, weight, bias, stride, padding, dil, groups))

        flops = 2.0 * cout * wout * (cin // groups) * kh * m.kernel_size[1]
        window = Window(kh, sh, ptop, dh, hin, hout)
        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), window, 0.0, run_conv,
                       flops + epi_flops)
    if raw.kind in ("maxpool", "avgpool"):
        pool = _pool_module(node, gm)
        k, s, p = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size), _pair(pool.padding)
        if raw.kind == "maxpool":
            assert isinstance(pool, nn.MaxPool2d)
            if pool.return_indices:
                raise UnsplittableModelError(f"op {_describe(node, gm)} returns indices")
            d = _pair(pool.dilation)
            pad_w, ceil = (0, p[1]), pool.ceil_mode

            def run(xs: list[Tensor], lo: int, hi: int) -> Tensor:
                # The rows hold the H padding already (`border_rows`), so the pool pads only W;
                # an exact row window gives hi - lo rows in floor and ceil mode alike. On
                # channels-last rows 3-4x faster than a max over k*k strided views
                # (ResNet-18's maxpool over the whole map at 224: 0.40 ms instead of 1.18).
                return finish(F.max_pool2d(xs[0], k, s, pad_w, d, ceil))

            window = Window(k[0], s[0], p[0], d[0], hin, hout)
            pad_value = float("-inf")
        else:
            assert isinstance(pool, nn.AvgPool2d)
            div = _avg_divisor(pool, (hin, win), (hout, wout), _model_device(gm))
            ceil = pool.ceil_mode

            def run(xs: list[Tensor], lo: int, hi: int) -> Tensor:
                # Sum pool (explicit zero rows) / exact torch divisor of these output rows.
                y = F.avg_pool2d(xs[0], k, s, (0, p[1]), ceil, True, 1)
                return finish(y / div[:, :, lo:hi])

            window = Window(k[0], s[0], p[0], 1, hin, hout)
            pad_value = 0.0
        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), window, pad_value,
                       run, float(cout * wout * k[0] * k[1]) + epi_flops)
    if raw.kind == "bn":
        scale, shift = _bn_affine(_module_of(node, gm, nn.BatchNorm2d))
        sc, sh_ = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)

        def run_bn(xs: list[Tensor], lo: int, hi: int) -> Tensor:
            return finish(torch.addcmul(sh_, xs[0], sc))

        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), None, 0.0, run_bn,
                       2.0 * cout * wout + epi_flops)
    call, ins = _caller(node, gm, trunk, inplace_ok=False)

    def run_call(xs: list[Tensor], lo: int, hi: int) -> Tensor:
        y = call(xs)
        # Identity-like ops return their input (a view of a row buffer): the in-place
        # epilogue must not write through it.
        if epilogue and any(y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                            for x in xs):
            y = y.clone()
        return finish(y)

    return TrunkOp(name, tuple(value_of[i] for i in ins), (cout, hout, wout), None, 0.0, run_call,
                   float(cout * wout * max(1, len(ins))) + epi_flops)


def _epilogue(raw: _Raw, gm: fx.GraphModule, trunk: set[fx.Node]
              ) -> Callable[[Tensor], Tensor]:
    """Pointwise unary op applied in place to a freshly computed run."""
    if raw.kind == "bn":
        scale, shift = _bn_affine(_module_of(raw.node, gm, nn.BatchNorm2d))
        sc, sh = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)
        return lambda y: y.mul_(sc).add_(sh)
    call, _ = _caller(raw.node, gm, trunk, inplace_ok=True)
    return lambda y: call([y])


# --------------------------------------------------------------------------- split_model
def split_model(model: nn.Module, input_shape: tuple[int, int, int]) -> ModelGraph:
    """Trace `model` (put in eval mode) and split it into a row-splittable trunk and a head.

    The ops compute on the model's device (move the model first: ``model.to("cuda:0")``)."""
    model.eval()
    device = _model_device(model)
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # any tracing failure means we cannot split
        raise UnsplittableModelError(f"torch.fx cannot trace the model: {e}") from e
    gm.graph.eliminate_dead_code()
    gm.recompile()
    c, h, w = (int(v) for v in input_shape)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.randn(1, c, h, w, generator=gen).to(device))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsplittableModelError(f"model must take one tensor input, got {len(placeholders)}")
    image = placeholders[0]

    # 1. classify: trunk = local ops whose tensor inputs are all trunk values.
    trunk: set[fx.Node] = {image}
    kinds: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        tensor_ins = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if not tensor_ins or not all(a in trunk for a in tensor_ins):
            continue  # head (or constant) computation
        kind = _classify(node, gm)
        shp = _shape(node)
        if kind is not None and len(shp) == 4 and all(len(_shape(a)) == 4 for a in tensor_ins):
            if kind == "pointwise" and any(_shape(a)[2] != shp[2] for a in tensor_ins):
                raise UnsplittableModelError(
                    f"op {_describe(node, gm)} broadcasts along rows; cannot split rows")
            if node.op == "call_module" and kind == "bn":
                bn = gm.get_submodule(str(node.target))
                if bn.running_mean is None:
                    raise UnsplittableModelError(
                        f"op {_describe(node, gm)} uses batch statistics (no running stats)")
            kinds[node] = kind
            trunk.add(node)
        elif not _is_head_start(node, gm):
            raise UnsplittableModelError(
                f"op {_describe(node, gm)} mixes rows inside the spatial trunk; "
                "it is neither row-local (conv, pool, BN, activation, add, cat) nor a head op "
                "(global pool, flatten, linear)")

    # 2. the trunk output: the one trunk value the head (or the model output) reads.
    crossing = []
    for node in gm.graph.nodes:
        if node in trunk:
            continue
        for a in node.all_input_nodes:
            if a in trunk and a not in crossing:
                crossing.append(a)
    if len(crossing) != 1:
        names = ", ".join(n.name for n in crossing)
        raise UnsplittableModelError(
            f"the head reads {len(crossing)} trunk tensors ({names}); need exactly one")
    trunk_out = crossing[0]
    if trunk_out is image:
        raise UnsplittableModelError("the model has no spatially local trunk")
    # keep only ancestors of the trunk output
    alive: set[fx.Node] = set()
    stack = [trunk_out]
    while stack:
        n = stack.pop()
        if n in alive or n not in trunk:
            continue
        alive.add(n)
        stack.extend(n.all_input_nodes)
    order = [n for n in gm.graph.nodes if n in alive and n is not image]

    # 3. fuse: conv -> BN folding; single-consumer pointwise unary ops become epilogues.
    raws = {n: _Raw(n, kinds[n], [a for a in n.all_input_nodes if a in trunk]) for n in order}
    users = {n: [u for u in n.users if u in alive] for n in alive}
    groups: list[dict] = []  # {"raw", "epi", "fold", "names", "out"}
    group_of: dict[fx.Node, int] = {}
    for n in order:
        r = raws[n]
        prev = r.inputs[0] if len(r.inputs) == 1 else None
        fusible = (
            prev is not None and prev is not image and prev is not trunk_out
            and len(users[prev]) == 1 and len(set(n.all_input_nodes) - {prev}) == 0
            and (r.kind == "bn" or (r.kind == "pointwise" and len(n.all_input_nodes) == 1))
        )
        if fusible:
            assert prev is not None
            g = groups[group_of[prev]]
            if r.kind == "bn" and g["raw"].kind == "conv" and not g["epi"] and g["fold"] is None:
                g["fold"] = _bn_affine(_module_of(n, gm, nn.BatchNorm2d))
            else:
                g["epi"].append(_epilogue(r, gm, trunk))
            g["names"].append(n.name)
            g["out"] = n
            group_of[n] = group_of[prev]
            continue
        group_of[n] = len(groups)
        groups.append({"raw": r, "epi": [], "fold": None, "names": [n.name], "out": n})

    value_of: dict[fx.Node, int] = {image: 0}
    ops: list[TrunkOp] = []
    for gi, g in enumerate(groups):
        ops.append(_compile(g["raw"], g["epi"], gm, trunk, value_of, "+".join(g["names"]),
                            g["out"], g["fold"]))
        value_of[g["out"]] = gi + 1
    value_shapes = [(c, h, w)] + [op.out_shape for op in ops]  # the image was propagated at (c, h, w)

    # 4. cut candidates: after op j only value j+1 is read by later ops.
    m = len(ops)
    last_use = [-1] * (m + 1)
    consumers: list[list[int]] = [[] for _ in range(m + 1)]
    for j, op in enumerate(ops):
        for u in op.inputs:
            last_use[u] = max(last_use[u], j)
            consumers[u].append(j)
    cuts = []
    prefix = -1
    for v in range(1, m):
        prefix = max(prefix, last_use[v - 1])
        if prefix <= v - 1:
            cuts.append(v)

    trunk_module, head_module = _sub_modules(gm, image, order, trunk_out)
    return ModelGraph(
        input_shape=(c, h, w),
        trunk_output_shape=value_shapes[-1],
        ops=tuple(ops),
        value_shapes=tuple(value_shapes),
        cut_values=tuple(cuts),
        consumers=tuple(tuple(x) for x in consumers),
        trunk_module=trunk_module,
        head_module=head_module,
        device=device,
    )


def _sub_modules(gm: fx.GraphModule, image: fx.Node, order: list[fx.Node], trunk_out: fx.Node
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
    tg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {image: tg.placeholder("x")}
    trunk_set = set(order)
    for n in gm.graph.nodes:
        if n in trunk_set or (n.op == "get_attr"):
            env[n] = tg.node_copy(n, lambda a: env[a])
    tg.output(env[trunk_out])
    hg = fx.Graph()
    henv: dict[fx.Node, fx.Node] = {trunk_out: hg.placeholder("trunk_out")}
    for n in gm.graph.nodes:
        if n in trunk_set or n is image:
            continue
        henv[n] = hg.node_copy(n, lambda a: henv[a])
    mods = []
    for g in (tg, hg):
        sub = fx.GraphModule(gm, g)
        sub.graph.eliminate_dead_code()
        sub.recompile()
        mods.append(sub)
    return mods[0], mods[1]
