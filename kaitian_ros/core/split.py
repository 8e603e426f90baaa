"""Trunk/head split of a CNN (docs/architecture-core.md).

`split_model` traces a model with torch.fx, keeps the longest prefix of spatially local ops as
the *trunk* and everything after the first global op (adaptive pool, flatten, linear, ...) as the
*head*. The trunk is compiled into a list of `TrunkOp`s - conv/pool "window" ops and row-wise
"pointwise" ops (activations, BN, residual add, channel cat) - with chains of single-consumer
pointwise ops fused into the op before them (conv+BN folded, ReLU as an in-place epilogue): fewer
ops means fewer buffers and fewer Python round trips per row run in the stripe executor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from .fx_ops import (
    RawOp,
    avg_divisor,
    bn_affine,
    caller,
    conv_params,
    describe,
    is_global_average_pool,
    is_head_start,
    model_device,
    module_of,
    op_kind,
    pair,
    pool_module,
    shape_of,
)
from .graph import ModelGraph, TrunkOp, UnsplittableModelError, Window
from .prepack import prepacked_conv


def _compile(raw: RawOp, epilogue: list[Callable[[Tensor], Tensor]], gm: fx.GraphModule,
             trunk: set[fx.Node], value_of: dict[fx.Node, int], name: str,
             out_node: fx.Node, fold: tuple[Tensor, Tensor] | None) -> TrunkOp:
    node = raw.node
    in_shape = shape_of(raw.inputs[0])
    out_shape = shape_of(out_node)
    cin, hin, win = in_shape[1], in_shape[2], in_shape[3]
    cout, hout, wout = out_shape[1], out_shape[2], out_shape[3]

    def finish(y: Tensor) -> Tensor:
        for f in epilogue:
            y = f(y)
        return y

    epi_flops = float(cout * wout * len(epilogue))
    if raw.kind == "conv":
        m = module_of(node, gm, nn.Conv2d)
        if m.padding_mode != "zeros":
            raise UnsplittableModelError(
                f"op {describe(node, gm)} uses padding_mode={m.padding_mode!r}; only zero "
                "padding is split by rows")
        kh, sh, dh, ptop, pl, pr = conv_params(m)
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

        def conv(x: Tensor, pad_h: int) -> Tensor:
            if not sym:
                x = F.pad(x, (pl, pr, 0, 0))
            if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
                return finish(packed(x, pad_h))
            return finish(F.conv2d(x, weight, bias, stride, (pad_h, padding[1]), dil, groups))

        def run_conv(xs: list[Tensor], lo: int, hi: int) -> Tensor:
            return conv(xs[0], 0)

        flops = 2.0 * cout * wout * (cin // groups) * kh * m.kernel_size[1]
        window = Window(kh, sh, ptop, dh, hin, hout)
        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), window, 0.0, run_conv,
                       flops + epi_flops, run_padded=conv)
    if raw.kind in ("maxpool", "avgpool"):
        pool = pool_module(node, gm)
        k, s, p = pair(pool.kernel_size), pair(pool.stride or pool.kernel_size), pair(pool.padding)
        if raw.kind == "maxpool":
            assert isinstance(pool, nn.MaxPool2d)
            if pool.return_indices:
                raise UnsplittableModelError(f"op {describe(node, gm)} returns indices")
            d = pair(pool.dilation)
            pad_w, ceil = (0, p[1]), pool.ceil_mode

            def max_pool(x: Tensor, pad_h: int) -> Tensor:
                # The rows hold the H padding already (`border_rows`) or the pool adds pad_h
                # (implicit -inf, as the model's own pool); an exact row window gives hi - lo
                # rows in floor and ceil mode alike. On channels-last rows 3-4x faster than a
                # max over k*k strided views (ResNet-18's maxpool over the whole map at 224:
                # 0.40 ms instead of 1.18).
                return finish(F.max_pool2d(x, k, s, (pad_h, pad_w[1]), d, ceil))

            def run(xs: list[Tensor], lo: int, hi: int) -> Tensor:
                return max_pool(xs[0], 0)

            run_padded = max_pool
            window = Window(k[0], s[0], p[0], d[0], hin, hout)
            pad_value = float("-inf")
        else:
            assert isinstance(pool, nn.AvgPool2d)
            div = avg_divisor(pool, (hin, win), (hout, wout), model_device(gm))
            ceil = pool.ceil_mode

            def run(xs: list[Tensor], lo: int, hi: int) -> Tensor:
                # Sum pool (explicit zero rows) / exact torch divisor of these output rows.
                y = F.avg_pool2d(xs[0], k, s, (0, p[1]), ceil, True, 1)
                return finish(y / div[:, :, lo:hi])

            window = Window(k[0], s[0], p[0], 1, hin, hout)
            pad_value = 0.0
            run_padded = None  # the divisor of border rows depends on the padding mode: rows copied
        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), window, pad_value,
                       run, float(cout * wout * k[0] * k[1]) + epi_flops, run_padded=run_padded)
    if raw.kind == "bn":
        scale, shift = bn_affine(module_of(node, gm, nn.BatchNorm2d))
        sc, sh_ = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)

        def run_bn(xs: list[Tensor], lo: int, hi: int) -> Tensor:
            return finish(torch.addcmul(sh_, xs[0], sc))

        return TrunkOp(name, (value_of[raw.inputs[0]],), (cout, hout, wout), None, 0.0, run_bn,
                       2.0 * cout * wout + epi_flops)
    call, ins = caller(node, gm, trunk, inplace_ok=False)

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


def _epilogue(raw: RawOp, gm: fx.GraphModule, trunk: set[fx.Node]
              ) -> Callable[[Tensor], Tensor]:
    """Pointwise unary op applied in place to a freshly computed run."""
    if raw.kind == "bn":
        scale, shift = bn_affine(module_of(raw.node, gm, nn.BatchNorm2d))
        sc, sh = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)
        return lambda y: y.mul_(sc).add_(sh)
    call, _ = caller(raw.node, gm, trunk, inplace_ok=True)
    return lambda y: call([y])


# --------------------------------------------------------------------------- split_model
def split_model(model: nn.Module, input_shape: tuple[int, int, int]) -> ModelGraph:
    """Trace `model` (put in eval mode) and split it into a row-splittable trunk and a head.

    The ops compute on the model's device (move the model first: ``model.to("cuda:0")``)."""
    model.eval()
    device = model_device(model)
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
        kind = op_kind(node, gm)
        shp = shape_of(node)
        if kind is not None and len(shp) == 4 and all(len(shape_of(a)) == 4 for a in tensor_ins):
            if kind == "pointwise" and any(shape_of(a)[2] != shp[2] for a in tensor_ins):
                raise UnsplittableModelError(
                    f"op {describe(node, gm)} broadcasts along rows; cannot split rows")
            if node.op == "call_module" and kind == "bn":
                bn = gm.get_submodule(str(node.target))
                if bn.running_mean is None:
                    raise UnsplittableModelError(
                        f"op {describe(node, gm)} uses batch statistics (no running stats)")
            kinds[node] = kind
            trunk.add(node)
        elif not is_head_start(node, gm):
            raise UnsplittableModelError(
                f"op {describe(node, gm)} mixes rows inside the spatial trunk; "
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
    raws = {n: RawOp(n, kinds[n], [a for a in n.all_input_nodes if a in trunk]) for n in order}
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
                g["fold"] = bn_affine(module_of(n, gm, nn.BatchNorm2d))
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
    # 5. a head that reads the trunk output only through a global average pool needs only its
    # per-channel mean: a node can send its rows' sum instead of the rows (ModelGraph.pooled_head)
    pooled = bool(trunk_out.users) and all(is_global_average_pool(u, gm) for u in trunk_out.users)
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
        pooled_head=pooled,
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
