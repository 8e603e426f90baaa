"""``kaitian bench chaos``: faults injected one after another into the running default graph
(``config/hetero_inference.yaml``: camera, coordinator, scheduler, compute_0..2 with EMULATED
speeds), each measured for lost, duplicated and out-of-order frames, time to recover, the
nodes' memory and, for forgeries, whether they had an effect.

Real processes: the graph is started by the embedded launcher, which respawns what is killed;
the bench's own probe node subscribes to the camera topic, ``/kaitian/fused``, the plans,
assignments, profiles, telemetry and ``/diagnostics``; an attacker process of its own
(``chaos_attack``) sends the floods, forgeries and fuzz. Faults, in order:

* ``kill_compute``: SIGKILL of the compute node with the largest share of the running plan;
* ``kill_scheduler``, ``kill_coordinator``: SIGKILL of the authority; the launcher respawns it;
* ``kill_router``: SIGKILL of the router when the launcher runs it as a child (else null, with
  the reason);
* ``flood``: unsolicited valid-looking INPUT chunks at the busiest compute node's chunk topic
  (20 s at 1000 chunks/s by default);
* ``link_collapse``: one compute node (``compute_0``) runs inside a network namespace behind a
  veth pair with a tbf rate limit for the whole run (1000 Mbit/s); the fault drops the rate
  to 1 Mbit/s both ways for 20 s, then restores it (root only; else null);
* ``forge_plan``, ``forge_assignment``, ``forge_telemetry``: forged control messages, first the
  implausible ones (which must be rejected and counted), then one plausible one (which nothing
  can tell from a restart without the security option); ``*_secure``: the same with the
  security option on (null until it exists);
* ``fuzz``: fuzzed messages on every topic a node of the graph subscribes to.

Every fault is preceded by a wait for a healthy graph and a pre-fault window (reference latency
and RSS) and followed by an observation of ``settle_s``. Frames are matched by header stamp;
definitions of every number are in :mod:`kaitian_ros.bench.chaos_metrics` and docs/chaos.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.chaos_faults import FaultRun, run_fault
from kaitian_ros.bench.chaos_graph import ChaosGraph
from kaitian_ros.bench.chaos_report import cell, plan_text, plot, print_one, print_table, rounded, run_series, skipped
from kaitian_ros.bench.chaos_settings import (
    ANSWER_S,
    DEFAULT_JSON,
    FAULTS,
    LEAD_S,
    LINK_NAMES,
    LINK_NODE,
    SCENARIO,
    SECURE_FAULTS,
    GraphFailed,
    Settings,
)


def security_status() -> str:
    """'' when this tree has the security option, else why the ``*_secure`` faults are null."""
    from kaitian_ros import cli

    return "" if hasattr(cli, "cmd_certs") else "security option not available"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False, text=True,
                              timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_graph(s: Settings, names: Sequence[str], results: dict[str, Any], *, links: Any = None,
              link_text: str = "", secure_dir: str | None = None, echo: bool = False) -> tuple[dict[str, Any], str]:
    """Start a graph (with the security option when ``secure_dir``), run ``names`` on it one
    after another into ``results``; (what to record about the graph, why it failed or "")."""
    g = ChaosGraph(s, links=links, echo=echo,
                   overrides=[f"security:={secure_dir}"] if secure_dir else [])
    if secure_dir:  # the probe joins as a member (role node), like any tool
        g.setenv("KAITIAN_SECURITY", secure_dir)
        g.setenv("KAITIAN_SECURITY_ROLE", "node")
    run = FaultRun(g, s, secure_dir)
    info: dict[str, Any] = {"security": bool(secure_dir), "startup_s": None, "baseline_latency_ms": None,
                            "scenario": g.scenario}
    failure = ""
    try:
        g.start()
        info["startup_s"] = rounded(g.wait_serving(180.0))
        time.sleep(s.warmup_s)  # the planner's first rounds: the plan settles
        now = time.monotonic()
        lat = g.latencies(now - s.warmup_s, now)
        run.baseline_ms = statistics.median(lat) if lat else None
        info["baseline_latency_ms"] = rounded(run.baseline_ms)
        info["plan_at_start"] = plan_text(g.latest_plan())
        print(f"  graph{' (security on)' if secure_dir else ''} serving after {info['startup_s']} s; baseline "
              f"end-to-end latency {cell(run.baseline_ms)} ms, plan {info['plan_at_start']}", flush=True)
        for name in names:
            print(f"  {name} ...", flush=True)
            try:
                results[name] = run_fault(run, name, link_text)
            except GraphFailed as exc:
                failure = str(exc).splitlines()[0]
                results[name] = skipped(name, failure)
                break
            if secure_dir:
                results[name]["graph"] = "secure"
            print_one(name, results[name])
    except (GraphFailed, RuntimeError) as exc:
        failure = failure or " ".join(str(exc).split())[:400]
    finally:
        info["series"] = run_series(g) if g.launcher is not None else {"answers": [], "rss_mb": {}}
        run.close_attackers()
        g.close()
    return info, failure


def main(argv: list[str]) -> int:
    p = BenchArgumentParser(
        prog="kaitian bench chaos",
        description="Kill -9 and respawn, flood, link collapse, forged control messages and fuzz, one after another, "
                    f"on the running {SCENARIO} graph (EMULATED device speeds); JSON + PNG (docs/chaos.md).")
    p.add_argument("--json", default=str(DEFAULT_JSON), help=f"result JSON (default {DEFAULT_JSON}; PNG next to it)")
    p.add_argument("--quick", action="store_true",
                   help="shorter windows, an 8 s flood and collapse, 1000 fuzzed messages per topic (a few minutes)")
    p.add_argument("--faults", default="all", help="comma-separated subset of " + ",".join(FAULTS + SECURE_FAULTS))
    p.add_argument("--settle", type=float, help="seconds observed after each fault; the settled RSS is read then "
                                                "(default 30, quick 10)")
    p.add_argument("--flood-seconds", type=float, help="flood duration (default 20, quick 8)")
    p.add_argument("--flood-rate", type=float, help="unsolicited chunks per second (default 1000)")
    p.add_argument("--flood-whole-stripes", action="store_true",
                   help="each flood chunk the node's whole input stripe, a request it computes (default: 64-row slabs)")
    p.add_argument("--fuzz-count", type=int, help="fuzzed messages per subscribed topic (default 10000, quick 1000)")
    p.add_argument("--link-mbit", type=float, help=f"{LINK_NODE}'s emulated link (default 1000 Mbit/s)")
    p.add_argument("--collapse-mbit", type=float, help="the link's rate during the collapse (default 1 Mbit/s)")
    p.add_argument("--collapse-seconds", type=float, help="collapse duration (default 20, quick 8)")
    p.add_argument("--echo", action="store_true", help="print the nodes' output")
    args = p.parse_args(argv)
    names = FAULTS + SECURE_FAULTS if args.faults == "all" else tuple(x for x in args.faults.split(",") if x)
    bad = [x for x in names if x not in FAULTS + SECURE_FAULTS]
    if bad or not names:
        p.error(f"unknown faults {bad}; choose from {','.join(FAULTS + SECURE_FAULTS)}" if bad else "--faults is empty")
    for flag in ("settle", "flood_seconds", "flood_rate", "fuzz_count", "link_mbit", "collapse_mbit",
                 "collapse_seconds"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.settle is not None and args.settle < ANSWER_S + 2:
        p.error(f"--settle must be at least {ANSWER_S + 2:g} s (a frame is unanswered after {ANSWER_S:g} s)")
    s = Settings.make(args.quick, settle_s=args.settle, flood_s=args.flood_seconds, flood_rate=args.flood_rate,
                      flood_whole_stripes=args.flood_whole_stripes or None,
                      fuzz_count=args.fuzz_count, link_mbit=args.link_mbit, collapse_mbit=args.collapse_mbit,
                      collapse_s=args.collapse_seconds)
    json_path = Path(args.json)
    order = [n for n in FAULTS + SECURE_FAULTS if n in names]
    print(f"kaitian bench chaos{' --quick' if s.quick else ''}: {SCENARIO} (EMULATED device speeds), faults "
          f"{', '.join(order)}", flush=True)

    from kaitian_ros.bench import netns

    links, link_text = None, ""
    if "link_collapse" in order:
        ok, why = netns.available()
        if ok:
            links = netns.Links(1, s.link_mbit, **LINK_NAMES)
            try:
                links.open()
                link_text = (f"{LINK_NODE} in network namespace {links.netns(0)}, veth + tbf {s.link_mbit:g} "
                             f"Mbit/s both ways (no shared memory for it); collapse to {s.collapse_mbit:g} Mbit/s")
            except netns.LinkSetupError as exc:
                links, why = None, str(exc)
        if links is None:
            link_text = f"no emulated link: {why}"
    results: dict[str, Any] = {}
    t_all = time.monotonic()
    plain = [n for n in order if n not in SECURE_FAULTS]
    secure_names = [n for n in order if n in SECURE_FAULTS]
    graphs: dict[str, Any] = {}
    failure = ""
    if plain:
        graphs["plain"], failure = run_graph(s, plain, results, links=links, link_text=link_text, echo=args.echo)
    if links is not None:
        links.close()
    secure = security_status() if secure_names else ""
    if secure_names and not secure and not failure:
        with tempfile.TemporaryDirectory(prefix="kaitian_chaos_certs_") as certs:
            made = subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "certs", "create", certs],
                                  capture_output=True, check=False, text=True)
            if made.returncode != 0:
                secure = f"kaitian certs create failed: {(made.stderr or made.stdout).strip()[-300:]}"
            else:
                print("  a second graph with the security option (certificates from kaitian certs create)", flush=True)
                graphs["secure"], failure = run_graph(s, secure_names, results, secure_dir=certs, echo=args.echo)
    for name in order:
        if name not in results:
            results[name] = skipped(name, secure if name in SECURE_FAULTS and secure else failure or "not run")
    scenario = graphs["plain"]["scenario"] if "plain" in graphs else None
    from kaitian_ros.scenario import load_scenario

    scenario = load_scenario(SCENARIO)
    summary = {
        "setup": {
            "graph": SCENARIO, "emulated": True,
            "nodes": {n.name: {"executable": n.executable,
                               **({"emulated_slowdown": n.parameters.get("emulated_slowdown")}
                                  if n.executable == "compute" else {})} for n in scenario.nodes},
            "camera_hz": scenario.node("image_source").parameters.get("rate_hz"),
            "quick": s.quick, "settings": s.__dict__, "answer_s": ANSWER_S, "lead_s": LEAD_S,
            "link": link_text or "not used", "security": secure or "available",
            "graphs": {k: {kk: v for kk, v in g.items() if kk not in ("series", "scenario")}
                       for k, g in graphs.items()},
            "baseline_latency_ms": graphs["plain"]["baseline_latency_ms"] if "plain" in graphs else None,
            "cpus": os.cpu_count(), "commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": round(time.monotonic() - t_all, 1), "failure": failure or None},
        "faults": {n: results[n] for n in order},
        "series": graphs["plain"]["series"] if "plain" in graphs else {"answers": [], "rss_mb": {}},
        "series_secure": graphs["secure"]["series"] if "secure" in graphs else None,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1, default=str))
    png = json_path.with_suffix(".png")
    plot(summary, png)
    print_table(summary)
    print(f"\nwrote {json_path} and {png}")
    return 1 if failure else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
