"""What the stripe executor costs in one process, per way of running a trunk (analysis script,
not a test): `run_ops` (the whole trunk, one call per op), a single-node plan fed the whole
image, streamed single-node plans (slabs of 64 rows with `min_run_rows` 32, also with the
thread idle for 5 ms between slabs as on a link, slabs of 16 with 8) and the two stripes of
a 0.6/0.4 split. CPU time of this thread (one torch thread), median over interleaved rounds,
the first two left out.

With `--against DIR`, the same runs of another checkout's package (DIR/kaitian_ros, imported
under another name) alternate with this one's in every round, so that a slower or faster
machine hits both alike; the last column is this checkout over that one.

    python tools/executor_costs.py [--model mobilenet_v2] [--height 240] [--width 320] [--rounds 12]
    python tools/executor_costs.py --against /tmp/checkout_of_the_previous_commit
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ALIAS = "kaitian_ros_against"


def import_copy(checkout: Path) -> str:
    """Copy `checkout`'s package to a temporary folder as ALIAS, with its own imports renamed,
    and put that folder on sys.path."""
    src = checkout / "kaitian_ros"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--against: {checkout} has no kaitian_ros package")
    root = Path(tempfile.mkdtemp(prefix="kaitian_against_"))
    shutil.copytree(src, root / ALIAS)
    for f in (root / ALIAS).rglob("*.py"):
        text = f.read_text()
        f.write_text(re.sub(r"\bkaitian_ros\b", ALIAS, text))
    sys.path.insert(0, str(root))
    return ALIAS


class Package:
    """One copy of the package with a graph of the model built by it."""

    def __init__(self, name: str, params: dict[str, Any]) -> None:
        ic = importlib.import_module(f"{name}.nodes.inference_common")
        self.plan = importlib.import_module(f"{name}.core.plan")
        self.stripe = importlib.import_module(f"{name}.core.stripe")
        tensors = importlib.import_module(f"{name}.core.tensors")
        self.graph = ic.build_graph(ic.ModelSpec.from_params(params))
        h, w = params["input_height"], params["input_width"]
        pixels = torch.randint(0, 255, (1, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        self.image = tensors.normalise_input(pixels, 3)

    def run_ops(self) -> float:
        g = self.graph
        x = self.image.contiguous(memory_format=g.activation_format)
        t0 = time.thread_time()
        with torch.no_grad():
            g.run_ops(x, 0, g.output_value)
        return time.thread_time() - t0

    def single(self, slab: int, min_run_rows: int, gap_s: float = 0.0) -> float:
        """`gap_s`: the thread sleeps that long between slabs, as a node waits for the next one
        to cross a link (the sleep is not CPU time; what idling does to the caches is)."""
        g, h = self.graph, self.image.shape[2]
        plan = self.plan.build_plan(g, self.plan.PlanSpec.single("a"), slab_rows=slab)
        runner = self.stripe.StripeRunner(g, plan, "a", min_run_rows=min_run_rows)
        slabs = [self.image[:, :, lo:lo + slab].contiguous(memory_format=g.activation_format)
                 for lo in range(0, h, slab)]
        took = 0.0
        with torch.no_grad():
            for k, rows in enumerate(slabs):
                if k and gap_s > 0:
                    time.sleep(gap_s)
                t0 = time.thread_time()
                runner.feed(0, k * slab, rows, emit=lambda e: None)
                took += time.thread_time() - t0
        return took

    def split(self, slab: int, min_run_rows: int) -> float:
        plan = self.plan.make_plan(self.graph, ["a", "b"], [0.6, 0.4], slab_rows=slab)
        t0 = time.thread_time()
        with torch.no_grad():
            self.stripe.run_plan_locally(self.graph, plan, self.image, min_run_rows=min_run_rows)
        return time.thread_time() - t0


RUNS: dict[str, Callable[[Package], float]] = {
    "run_ops": Package.run_ops,
    "single, whole image": lambda p: p.single(4096, 4096),
    "single, slabs 64 / min 32": lambda p: p.single(64, 32),
    "single, slabs 64 / min 32, 5 ms apart": lambda p: p.single(64, 32, gap_s=0.005),
    "single, slabs 16 / min 8": lambda p: p.single(16, 8),
    "0.6/0.4 split, slabs 64 / min 32": lambda p: p.split(64, 32),
    "0.6/0.4 split, slabs 16 / min 8": lambda p: p.split(16, 8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--height", type=int, default=240)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--against", type=Path, help="another checkout (its folder) to compare with")
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = {"model": args.model, "input_height": args.height, "input_width": args.width,
              "input_channels": 3, "num_classes": 1000, "seed": 0, "weights": ""}
    packages = {"this": Package("kaitian_ros", params)}
    if args.against is not None:
        packages["against"] = Package(import_copy(args.against), params)
    times: dict[tuple[str, str], list[float]] = {(r, p): [] for r in RUNS for p in packages}
    for k in range(args.rounds + 2):
        for run, fn in RUNS.items():
            for name in (list(packages) if k % 2 else list(packages)[::-1]):
                took = fn(packages[name])
                if k >= 2:  # kernels built, weights packed
                    times[(run, name)].append(took * 1e3)
    print(f"{args.model} {args.height}x{args.width}, CPU ms (median of {args.rounds})")
    for run in RUNS:
        this = statistics.median(times[(run, "this")])
        line = f"  {run:38s} this {this:7.1f}"
        if "against" in packages:
            other = statistics.median(times[(run, "against")])
            line += f"   against {other:7.1f}   this/against {this / other:.3f}"
        print(line)


if __name__ == "__main__":
    main()
