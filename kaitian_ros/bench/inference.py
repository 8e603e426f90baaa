"""``kaitian bench inference``: collaborative inference against its baselines, in one run.

Real processes of the product: a Zenoh router and the bench driver in the root network
namespace, the real ``coordinator`` and ``scheduler`` nodes next to them, and one real
``compute`` node per device. A remote device sits in its own network namespace behind a veth
pair rate limited with tbf in both directions; a *local* device (the robot's own processor)
runs in the root namespace with the coordinator, with no link (``bench/netns.py``; needs root,
otherwise loopback and the output says so). Device speeds are EMULATED with
``emulated_slowdown`` (a node sleeps (s-1)x each real compute). What runs where comes from a
scenario (``inference_scenarios.py``: ``--scenario NAME``, ``--matrix`` runs them all).

On the same frames, in interleaved rounds, driver-side end-to-end latency (Image published ->
FusedOutput received) of

* ``single``    best single device, its link included (a local device pays none): the minimum
                over every device of (a) the product forced onto it (``use_scheduler`` false,
                one-hot ``static_shares``, ``strategy: single``) and (b) a bench worker running
                the whole trunk there in one call;
* ``layerwise`` Neurosurgeon-style split: device X runs the trunk up to a cut, sends the
                activation over the link, device Y runs the rest; every cut and every ordered
                pair of devices is tried and the best is measured (bench workers, same links);
* ``equal``     row stripes with equal static shares (``strategy: stripes``);
* ``no_stream`` row stripes by measured device speed, slab = whole stripe, one run per op;
* ``ours``      the product as a user runs it: the scheduler node's shares (adaptive policy,
                as in config/hetero_inference.yaml), ``use_scheduler`` true, ``strategy: auto``
                (the coordinator's planner picks the plan); with its predicted latency;

and the physical bound ``max(compute bound, link bound)``: compute bound = 1 / sum_i(1 /
trunk_ms_i) with each device's trunk time measured in the same run (worker, whole trunk in one
call); link bound = (image bytes + trunk output bytes) / (remote links x link rate) when every
device is remote, else 0 (a local device could do everything without a link).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.inference_graph import worker_main
from kaitian_ros.bench.inference_harness import run
from kaitian_ros.bench.inference_scenarios import (
    DEFAULT_SCENARIO,
    SCENARIOS,
    BenchScenario,
    scenario_problem,
    with_overrides,
)

RESULTS = Path("bench/results")


# =========================================================================== command line
OVERRIDES = ("slowdowns", "mbit", "model", "size", "height", "width", "local")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = BenchArgumentParser(prog="kaitian bench inference",
                            description="collaborative inference vs baselines (see module docstring)")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help=f"what runs where (default {DEFAULT_SCENARIO}; see kaitian_ros/bench/inference_scenarios.py)")
    p.add_argument("--matrix", action="store_true",
                   help="every scenario in turn: one JSON + PNG each (<stem>_<scenario>) and a summary JSON")
    p.add_argument("--json", type=Path, default=None,
                   help=f"output JSON (PNG next to it); default {RESULTS}/inference[_<scenario>].json, "
                        f"with --matrix the summary ({RESULTS}/inference_matrix.json)")
    p.add_argument("--quick", action="store_true", help="few frames (a few minutes per scenario)")
    p.add_argument("--slowdowns", type=str, default=None,
                   help="override: EMULATED slowdown per compute node, comma separated (positions keep "
                        "the scenario's local/remote; extra devices are remote)")
    p.add_argument("--local", type=int, default=None, help="override: the first N devices are local (no link)")
    p.add_argument("--mbit", type=float, default=None, help="override: link rate per remote device, Mbit/s")
    p.add_argument("--loopback", action="store_true", help="no namespaces/tbf even when root")
    p.add_argument("--model", default=None, help="override: the model")
    p.add_argument("--size", type=int, default=None, help="override: input height = width")
    p.add_argument("--height", type=int, default=None, help="override: input height (rows)")
    p.add_argument("--width", type=int, default=None, help="override: input width")
    p.add_argument("--frames", type=int, default=None, help="measured frames per variant (default 30, quick 6)")
    p.add_argument("--rounds", type=int, default=None, help="variants interleaved in this many rounds")
    p.add_argument("--slab-rows", type=int, default=64,
                   help="streamed slab rows (ours, equal, single); default 64 as in hetero_inference.yaml")
    p.add_argument("--min-run-rows", type=int, default=32,
                   help="compute nodes' min_run_rows for the streamed variants (hetero_inference.yaml: 32)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--logs", type=Path, default=None,
                   help="keep every process's log in DIR/<scenario>/ (by default they are removed at the end)")
    a = p.parse_args(argv)
    if a.matrix:
        given = [f"--{k}" for k in ("scenario", *OVERRIDES) if getattr(a, k) is not None]
        if given:
            p.error(f"--matrix runs the scenarios as defined; it takes no {', '.join(given)}")
    if a.slowdowns is not None:
        try:
            a.slowdowns = tuple(float(s) for s in a.slowdowns.split(","))
        except ValueError:
            p.error(f"--slowdowns must be numbers separated by commas, got {a.slowdowns!r}")
    if a.size is not None and (a.height is not None or a.width is not None):
        p.error("--size sets both height and width; give either --size or --height/--width")
    for name in ("frames", "rounds", "slab_rows", "min_run_rows"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    n_devices = len(a.slowdowns or SCENARIOS[a.scenario or DEFAULT_SCENARIO].devices)
    if a.local is not None and not 0 <= a.local <= n_devices:
        p.error(f"--local must be between 0 and the number of devices ({n_devices}), got {a.local}")
    a.scenarios = list(SCENARIOS.values()) if a.matrix else [_chosen_scenario(a)]
    for sc in a.scenarios:
        if problem := scenario_problem(sc):
            p.error(problem)
    a.frames = a.frames or (6 if a.quick else 30)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.solo_frames = 3 if a.quick else 8
    a.search_frames = 1 if a.quick else 2
    return a


def _chosen_scenario(a: argparse.Namespace) -> BenchScenario:
    base = SCENARIOS[a.scenario or DEFAULT_SCENARIO]
    height = a.size if a.size is not None else a.height
    width = a.size if a.size is not None else a.width
    return with_overrides(base, slowdowns=a.slowdowns, mbit=a.mbit, model=a.model, height=height, width=width,
                          local=a.local)


def _one_line(message: str, code: int) -> int:
    print(f"kaitian bench inference: {message}", file=sys.stderr)
    return code


def _json_path(a: argparse.Namespace) -> Path:
    if a.json is not None:
        return a.json
    if a.matrix:
        return RESULTS / "inference_matrix.json"
    name = a.scenarios[0].name
    return RESULTS / ("inference.json" if name == DEFAULT_SCENARIO else f"inference_{name}.json")


def _write(res: dict, path: Path) -> Path:
    from kaitian_ros.bench import inference_report as report

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    png = path.with_suffix(".png")
    report.plot(res, png)
    return png


def _run_one(args: argparse.Namespace, sc: BenchScenario, path: Path, say: Any) -> dict:
    from kaitian_ros.bench import inference_report as report

    res = run(args, sc, say)
    png = _write(res, path)
    print(report.table(res))
    print(f"[bench] wrote {path} and {png} ({res['wall_s']} s)", flush=True)
    return res


def _run_matrix(args: argparse.Namespace, path: Path, say: Any) -> int:
    """Every scenario in turn; a failed one is reported in the summary and the others still run."""
    from kaitian_ros.bench import inference_report as report

    t0 = time.monotonic()
    results: dict[str, dict] = {}
    failed = 0
    for sc in args.scenarios:
        one = path.with_name(f"{path.stem}_{sc.name}.json")
        try:
            results[sc.name] = _run_one(args, sc, one, say) | {"file": str(one)}
        except (RuntimeError, ValueError) as exc:
            failed += 1
            results[sc.name] = {"error": " ".join(str(exc).split())[:500]}
            say(f"[bench] scenario {sc.name} FAILED: {results[sc.name]['error']}")
    summary = report.summary(results, quick=args.quick, wall_s=round(time.monotonic() - t0, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(report.summary_table(summary))
    print(f"[bench] wrote {path} ({summary['wall_s']} s)", flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    args = parse_args(argv)
    path = _json_path(args)

    def say(line: str) -> None:
        print(line, flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    prev_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    try:
        if args.matrix:
            return _run_matrix(args, path, say)
        _run_one(args, args.scenarios[0], path, say)
        return 0
    except KeyboardInterrupt:
        return _one_line("interrupted (namespaces, qdiscs and processes cleaned up)", 130)
    except ValueError as exc:  # the scenario cannot run here (model, input size): before anything started
        return _one_line(str(exc), 2)
    except RuntimeError as exc:
        return _one_line(str(exc), 1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, prev_int)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
