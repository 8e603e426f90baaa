"""Does any conv of a model cost far more on a stripe than its rows' share? (analysis script, not a test)

For every windowed conv of the trunk, times the op (as the stripe executor calls it) on each
possible number of output rows and compares that with the rows' share of the whole-map call.
A row count over 4x its share (+2 ms) is listed as slow. oneDNN chooses its blocked weight
layout by input shape, and for a few shapes (ResNet-18 at 448, MobileNetV2 and VGG-11 at 224)
it converts layouts on every call, 4-40x slower; `graph.PrepackedConv` packs such a shape's
weights for itself after its first calls, so this should list nothing (a listed row count is a
shape it misses).

    python tools/conv_row_costs.py [--model resnet18] [--size 224] [--max-counts 40]
"""

from __future__ import annotations

import argparse
import time

import torch

from kaitian_ros.core.graph import TrunkOp
from kaitian_ros.nodes import inference_common as ic


def best_ms(op: TrunkOp, in_shape: tuple[int, int, int], rows: int, fmt: torch.memory_format) -> float:
    """Best of two timed calls of `op` computing `rows` output rows (after two untimed ones:
    the first calls at a shape build kernels, and may repack the weights)."""
    assert op.window is not None  # only windowed convs are timed
    lo, hi = op.window.raw(0, rows)
    x = torch.randn(1, in_shape[0], hi - lo, in_shape[2]).contiguous(memory_format=fmt)
    for _ in range(2):
        op.run([x], 0, rows)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        op.run([x], 0, rows)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--max-counts", type=int, default=40, help="row counts tried per op, evenly spaced")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = ic.build_graph(ic.ModelSpec(args.model, (3, args.size, args.size), 1000, 0, ""))
    slow_total = 0
    with torch.no_grad():
        for j, op in enumerate(g.ops):
            if op.window is None or op.pad_value != 0.0:
                continue  # pointwise ops and max pools (avg pools are timed too: cheap)
            c, _, w = in_shape = g.value_shapes[op.inputs[0]]
            rows = op.out_shape[1]
            whole = best_ms(op, in_shape, rows, g.activation_format)
            slow = []
            for r in range(1, rows + 1, max(1, rows // args.max_counts)):
                t = best_ms(op, in_shape, r, g.activation_format)
                if t > 4 * whole * r / rows + 2.0:
                    slow.append(f"{r} rows {t:.1f} ms")
            slow_total += len(slow)
            print(f"{j:3d} {op.name[:36]:36s} {c}x{w} -> {rows} rows: whole map {whole:.2f} ms; "
                  f"slow: {', '.join(slow) or 'none'}", flush=True)
    print(f"{args.model} {args.size}x{args.size}: {slow_total} slow (op, row count) cases")


if __name__ == "__main__":
    main()
