"""Classification of torch.fx nodes for the trunk/head split: which ops are row-wise
(pointwise), which read a window of rows (conv, pool), which start the head (global ops), and
the parameters of each (conv and pool geometry, folded BN, average-pool divisors)."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from .graph import UnsplittableModelError

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


def describe(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"{node.name} ({type(gm.get_submodule(str(node.target))).__name__} '{node.target}')"
    if node.op == "call_function":
        return f"{node.name} ({getattr(node.target, '__name__', str(node.target))})"
    return f"{node.name} (.{node.target}())"


def shape_of(node: fx.Node) -> tuple[int, ...]:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()


# --------------------------------------------------------------------------- compiling ops
@dataclass
class RawOp:
    """One fx node of the trunk before fusion."""

    node: fx.Node
    kind: str  # "conv" | "maxpool" | "avgpool" | "bn" | "pointwise"
    inputs: list[fx.Node]  # trunk-tensor args in call order


def conv_params(m: nn.Conv2d) -> tuple[int, int, int, int, int, int]:
    """(kernel_h, stride_h, dilation_h, pad_top, pad_left, pad_right) of a conv module."""
    rp = m._reversed_padding_repeated_twice  # [left, right, top, bottom]
    return (m.kernel_size[0], m.stride[0], m.dilation[0], int(rp[2]), int(rp[0]), int(rp[1]))


def bn_affine(bn: nn.modules.batchnorm._BatchNorm) -> tuple[Tensor, Tensor]:
    assert bn.running_var is not None and bn.running_mean is not None, (
        "BatchNorm without running statistics normalises by the batch; it cannot be folded")
    scale = torch.rsqrt(bn.running_var + bn.eps)
    if bn.affine:
        scale = scale * bn.weight
    shift = -bn.running_mean * scale
    if bn.affine:
        shift = shift + bn.bias
    return scale.detach().clone(), shift.detach().clone()


def pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


_M = TypeVar("_M", bound=nn.Module)


def module_of(node: fx.Node, gm: fx.GraphModule, cls: type[_M]) -> _M:
    """The module a call_module node calls, which `_classify` found to be a `cls`."""
    m = gm.get_submodule(str(node.target))
    assert isinstance(m, cls), (node.name, type(m))
    return m


def pool_module(node: fx.Node, gm: fx.GraphModule) -> nn.MaxPool2d | nn.AvgPool2d:
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


def op_kind(node: fx.Node, gm: fx.GraphModule) -> str | None:
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


def is_head_start(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _HEAD_MODULES)
    if node.op == "call_function":
        return node.target in _HEAD_FUNCTIONS
    return node.op == "call_method" and node.target in _HEAD_METHODS


def _is_one(size: Any) -> bool:
    return size == 1 or (isinstance(size, (tuple, list)) and len(size) == 2 and all(v == 1 for v in size))


def is_global_average_pool(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether `node` averages its input over height and width to one value per channel, so
    that it gives the same result for the (N, C, 1, 1) mean of its input: an
    ``AdaptiveAvgPool2d(1)`` (module or function) or a ``mean`` over dims (2, 3)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return isinstance(mod, nn.AdaptiveAvgPool2d) and _is_one(mod.output_size)
    args = list(node.args[1:]) + [node.kwargs.get(k) for k in ("output_size", "dim") if k in node.kwargs]
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        return len(args) == 1 and _is_one(args[0])
    if (node.op == "call_function" and node.target is torch.mean) or \
            (node.op == "call_method" and node.target == "mean"):
        dims = args[0] if args else None
        return isinstance(dims, (tuple, list)) and sorted(int(d) % 4 for d in dims) == [2, 3]
    return False


def caller(node: fx.Node, gm: fx.GraphModule, trunk: set[fx.Node], inplace_ok: bool
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
            f"op {describe(node, gm)} reads non-trunk value {n.name}; cannot split rows")

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


def model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def avg_divisor(m: nn.AvgPool2d, in_hw: tuple[int, int], out_hw: tuple[int, int],
                 device: torch.device) -> Tensor:
    """Per-output divisor of an average pool (torch semantics incl. ceil_mode clipping)."""
    k, s, p = pair(m.kernel_size), pair(m.stride or m.kernel_size), pair(m.padding)
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
