"""Where the CPU goes while the inference graph serves requests (analysis script, not a test).

Starts the graph of `kaitian bench adaptivity` (coordinator, scheduler, compute nodes as real
processes, no links; by default three at EMULATED slowdown 1 and ResNet-18 at 128x128), answers
`--warmup` requests, then `--requests` more one at a time, and prints for those: the latency
median and p10/p90, the planning rounds the coordinator sent to its planner process, which
nodes computed, and the CPU time (user + system, from /proc) each process used per request.

`--policy static` forces the whole trunk onto the fastest node (strategy single, fixed shares,
no scheduler), as the adaptivity reference measures a plan; `--policy adaptive` is the product's
default (the scheduler's shares, strategy auto). `--no-probes` turns off the idle probes of the
compute nodes (`probe_period_s` 0). Run it on an otherwise idle machine; each run starts a
fresh graph, so running it twice shows how much the same configuration moves from launch to
launch.

    python tools/cpu_per_request.py --policy static
    python tools/cpu_per_request.py --policy adaptive --requests 200
    python tools/cpu_per_request.py --model resnet18 --size 224 --slowdowns 4,1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph, scenario_config

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds_by_process() -> dict[str, float]:
    """User + system CPU seconds of every running kaitian process, by node name (`__node:=`),
    the planner child by its process name, anything else of ours by its command name."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        proc = Path("/proc", pid)
        try:
            comm = (proc / "comm").read_text().strip()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        node = next((t.removeprefix("__node:=") for t in cmd.split() if t.startswith("__node:=")), None)
        if node is None and comm != "planner" and "kaitian" not in cmd:
            continue
        name = node or comm
        # fields after the command name: utime and stime are the 12th and 13th
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def config(policy: str, model: str, size: int, slowdowns: list[float], probes: bool) -> dict[str, Any]:
    equal = [1.0] * len(slowdowns)
    if policy == "static":
        cfg = scenario_config(model=model, height=size, width=size, slowdowns=slowdowns, policy="static",
                              static_shares=equal, coordinator={"use_scheduler": False, "static_shares": equal,
                                                                "strategy": "stripes"})
    else:
        cfg = scenario_config(model=model, height=size, width=size, slowdowns=slowdowns)
    if not probes:
        for name, section in cfg.items():
            if name.startswith("compute_"):
                section["ros__parameters"]["probe_period_s"] = 0.0
    return cfg


def measure(args: argparse.Namespace) -> None:
    slowdowns = args.slowdowns
    cfg = config(args.policy, args.model, args.size, slowdowns, not args.no_probes)
    with AdaptivityGraph(cfg) as g:
        g.wait_ready(timeout_s=120.0)
        if args.policy == "static":  # as the adaptivity reference sets a fixed plan
            fastest = slowdowns.index(min(slowdowns))
            g.set_param("/coordinator", "strategy", "single")
            g.set_param("/coordinator", "static_shares", [float(i == fastest) for i in range(len(slowdowns))])
        g.drive(args.warmup, window=1, timeout_s=300.0)
        first = len(g.fused)
        rounds_before = g.coordinator_values.get("plan_rounds", "?")
        cpu_before, t0 = cpu_seconds_by_process(), time.monotonic()
        g.drive(args.requests, window=1, timeout_s=600.0)
        wall, cpu_after = time.monotonic() - t0, cpu_seconds_by_process()
        rounds_after = g.coordinator_values.get("plan_rounds", "?")
        records = g.records()[first:]
    latencies = [r["latency_ms"] for r in records if r["complete"]]
    deciles = statistics.quantiles(latencies, n=10)
    computed: dict[str, int] = {}
    for r in records:
        key = "+".join(n for n, rows in zip(r["node_ids"], r["node_rows"]) if rows)
        computed[key] = computed.get(key, 0) + 1
    per_request = {name: (cpu_after[name] - cpu_before.get(name, 0.0)) / len(records) * 1e3 for name in cpu_after}
    print(f"{args.policy}{' (no idle probes)' if args.no_probes else ''}, {args.model} {args.size}x{args.size}, "
          f"compute nodes at EMULATED slowdowns {slowdowns}: {len(records)} requests in {wall:.1f} s")
    print(f"  latency median {statistics.median(latencies):.1f} ms, p10 {deciles[0]:.1f}, p90 {deciles[-1]:.1f}")
    print(f"  planning rounds sent to the planner process: {rounds_before} -> {rounds_after}")
    print("  computed by: " + ", ".join(f"{k} {v}" for k, v in sorted(computed.items())))
    print("  CPU ms per request: " + ", ".join(
        f"{name} {ms:.2f}" for name, ms in sorted(per_request.items(), key=lambda kv: -kv[1]) if ms > 0.005))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=("static", "adaptive"), default="adaptive")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--warmup", type=int, default=30, help="requests answered before measuring")
    p.add_argument("--requests", type=int, default=120, help="requests measured")
    p.add_argument("--slowdowns", default="1,1,1", help="EMULATED slowdown per compute node, comma separated")
    p.add_argument("--no-probes", action="store_true", help="compute nodes' probe_period_s 0")
    args = p.parse_args()
    if args.requests < 10 or args.warmup < 0:
        p.error("--requests must be >= 10 and --warmup >= 0")
    try:
        args.slowdowns = [float(x) for x in args.slowdowns.split(",")]
    except ValueError:
        p.error(f"--slowdowns: numbers separated by commas, got {args.slowdowns!r}")
    if len(args.slowdowns) < 2 or min(args.slowdowns) < 1.0:
        p.error("--slowdowns: at least two, each >= 1")
    measure(args)


if __name__ == "__main__":
    main()
