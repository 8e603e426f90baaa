"""How much this machine's own compute speed moves (analysis script, not a test).

Runs one model's forward pass in a loop on one thread, nothing else of the product involved,
and prints the latency median, p10 and p90 and the median of each window of `--window`
passes: what the same fixed work takes from one moment to the next. Every benchmark's
tolerance is judged against that spread: a re-convergence tolerance of 1.10 means little on a
machine whose windows of the same loop move by more. `--cpu N` pins the loop to core N.

    python tools/compute_noise.py
    python tools/compute_noise.py --cpu 1 --passes 400
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kaitian_ros.core.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--size", type=int, default=128, help="input height = width")
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    model = build_model(args.model, num_classes=10).eval()
    x = torch.randn(1, 3, args.size, args.size)
    times = []
    with torch.no_grad():
        for _ in range(args.warmup + args.passes):
            t0 = time.perf_counter()
            model(x)
            times.append((time.perf_counter() - t0) * 1e3)
    times = times[args.warmup:]
    deciles = statistics.quantiles(times, n=10)
    windows = [statistics.median(times[i:i + args.window]) for i in range(0, len(times), args.window)]
    print(f"{args.model} {args.size}x{args.size}, one thread, core {args.cpu if args.cpu is not None else 'any'}: "
          f"median {statistics.median(times):.1f} ms (p10 {deciles[0]:.1f}, p90 {deciles[8]:.1f}); "
          f"medians of {args.window}: {' '.join(f'{w:.1f}' for w in windows)} "
          f"(slowest / fastest {max(windows) / min(windows):.2f})")


if __name__ == "__main__":
    main()
