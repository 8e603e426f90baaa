"""How fast can any row split of the trunk be on this CPU? (analysis script, not a test)

Runs each plan in one process with no messages (``run_plan_locally``, whole stripes, best of
``--reps``) and prints every node's stripe compute time. With node b EMULATED ``--slow`` times
slower, no collaborative run of that plan can beat max(a, slow x b), whatever the transport;
trunk / max(a, slow x b) is the most speed-up the plan allows (docs/benchmarks-history.md, "An upper bound without
messages").

    python tools/split_bound.py [--model resnet18] [--size 224] [--slow 2.0]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kaitian_ros.core.cost_model import CostModel
from kaitian_ros.core.plan import Plan, make_plan
from kaitian_ros.core.stripe import run_plan_locally
from kaitian_ros.nodes import inference_common as ic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--slow", type=float, default=2.0, help="EMULATED slowdown of node b")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--link-mbit", type=float, default=200.0, help="link rate the planner assumes")
    p.add_argument("--shares", default="0.78,0.67,0.6",
                   help="node a's shares to try, comma-separated (node b gets the rest)")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = ic.build_graph(ic.ModelSpec(args.model, (3, args.size, args.size), 1000, 0, ""))
    x = torch.randn(1, 3, args.size, args.size)
    cost = CostModel(link_bytes_per_ms=args.link_mbit * 1e6 / 8 / 1e3)  # Mbit/s -> bytes/ms

    def per_node(plan: Plan) -> tuple[dict[str, float], float]:
        """Best stripe times per node, and the best whole-trunk time measured between them
        (this box's speed drifts by 10-30 % within minutes: compare only interleaved times).
        The trunk runs the same fused, prepacked ops as the stripes (``run_ops``), as the
        benchmark's single-device baseline does."""
        best: dict[str, float] = {}
        trunk = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            g.run_ops(x)
            trunk = min(trunk, (time.perf_counter() - t0) * 1e3)
            runners: dict = {}
            run_plan_locally(g, plan, x, slab_rows=4096, min_run_rows=4096, runners_out=runners)
            for n, r in runners.items():
                best[n] = min(best.get(n, float("inf")), r.stats()["compute_s"] * 1e3)
        return best, trunk

    with torch.no_grad():
        g.run_ops(x)
        print(f"{args.model} {args.size}x{args.size}: cut values {g.cut_values}; node b EMULATED "
              f"{args.slow}x slower; trunk = whole trunk in one call, interleaved with the plan's runs")
        cuts = g.cut_values
        best_plan = (0.0, "")  # (at most x, which plan)
        for share_a in (float(v) for v in args.shares.split(",")):
            shares = (share_a, round(1.0 - share_a, 6))
            variants: dict[str, dict[str, Any]] = {"planner": {"cost": cost},
                        "no solo tail": {"cost": cost, "solo_tail": False},
                        "every cut": {"cuts": cuts, "solo_tail": False},
                        "every cut + solo tail": {"cuts": cuts, "solo_tail": True}}
            for name, kw in variants.items():
                plan = make_plan(g, ["a", "b"], shares, slab_rows=32, **kw)
                t, trunk = per_node(plan)
                fa, fb = (sum(s.flops[i] for s in plan.segments) / 1e6 for i in (0, 1))
                worst = max(t.get("a", 0.0), args.slow * t.get("b", 0.0))
                best_plan = max(best_plan, (trunk / worst, f"{shares} {name}"))
                print(f"  {shares} {name:22s} cuts {plan.cut_values}  flops a {fa:.0f}M b {fb:.0f}M  "
                      f"a {t.get('a', 0.0):.1f} ms  {args.slow:g} x b {args.slow * t.get('b', 0.0):.1f} ms  "
                      f"trunk {trunk:.1f} ms -> at most {trunk / worst:.2f}x")
        print(f"best: at most {best_plan[0]:.2f}x ({best_plan[1]})")


if __name__ == "__main__":
    main()
