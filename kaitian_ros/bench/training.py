"""``kaitian bench training``: heterogeneous data-parallel training, policies compared.

Two configurations (``--config digits|compute|all``, default all), both ``digits_cnn`` on the
digits data (CPU, gloo, ranks forked on this host, one thread each):

* ``digits``: images upsampled to 16x16; every run of the table below;
* ``compute``: images upsampled to 32x32: 4x the compute per sample with the same gradient
  (the adaptive pool makes the parameter count independent of the input size), so compute
  per step clearly dominates communication; the 1 : 0.33 runs only, fewer epochs.

Runs, at EMULATED speeds 1 : 0.33 (slowdowns 1, 3): ``equal`` (plain DDP), ``equal+stealing``,
``profile_once``, ``adaptive`` (adaptive shares: the product's default) and
``adaptive+stealing`` (the same with work stealing), so that the gain of adaptive shares and
the gain of stealing can be told apart; for digits
also the control 1 : 1 (equal, adaptive) and a drift (1 : 1, rank 1 slows 2x halfway;
profile_once, adaptive).

Efficiency = samples/s of a run over the sum of its devices' solo samples/s, measured under
the run's own arrangement (``bench.training_runs``) right before and right after it (the mean
of both; consecutive runs of the same speeds share the measurement between them), so solo
and run measurements alternate. Solo jobs and the runs without work stealing compute in
passes of the size this machine computes fastest per sample (``fastest_micro_batch``,
measured first): the ideal is each device at its best, and the baselines get that tuning too
(stealing computes in its own chunks). ``--repeats N`` runs everything N times; the JSON holds the
median and the min-max of every number. Comm % = the time each rank sits blocked in the comm
hook (transfer and waiting for the other rank), the mean over the ranks (min and max over the
ranks reported beside it), over the training wall time. Wait % = per step the largest minus
the smallest blocked time (the early rank waiting); of it, "systematic" is the part that falls
on one rank more than on the other over the run (a better split could remove it; the rest
changes side from step to step: compute-time noise). Transfer % = per step the smallest blocked
time (the last rank's: no waiting in it). With two ranks, comm % = transfer % + wait % / 2.
The first two steps of every run are left out of all rates.

Accuracy: a single-device run per configuration (speed 1, the full schedule; deterministic,
so run once) gives the reference. For digits the accuracy check (``bench.training_accuracy``)
adds the float32 noise floor and one-process replays of the last repeat's runs; the compute
configuration skips it (13 one-process trainings at 32x32 would outlast the rest).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.training_accuracy import accuracy_check
from kaitian_ros.bench.training_report import plot, summarise, table, targets
from kaitian_ros.bench.training_runs import RunSpec, concurrent_solo, fastest_micro_batch, ideal_rate, run
from kaitian_ros.progress import Progress

DEFAULT_DIR = Path("bench/results")
DIGITS_STEPS_PER_EPOCH = 3  # 1347 training samples / global batch 512


@dataclass(frozen=True)
class BenchConfig:
    name: str
    image_size: int
    epochs: int
    quick_epochs: int
    warmup_steps: int  # lr warm-up
    solo_steps: int  # steps of the slowest device in one solo measurement (after warm-up)
    quick_solo_steps: int
    full_table: bool  # the 1:1 control and the drift runs too
    accuracy_check: bool


CONFIGS = {
    # 60 epochs: upsampled digits converge (0.98 single device)
    "digits": BenchConfig("digits", 16, 60, 16, 9, 24, 10, True, True),
    # 20 epochs, 12 solo steps: at 10 and 6 the repeats of one run spread by up to 0.27
    "compute": BenchConfig("compute", 32, 20, 4, 3, 12, 4, False, False),
}


def specs_for(bc: BenchConfig, steps_total: int) -> list[RunSpec]:
    out = [
        RunSpec("equal", (1.0, 3.0), "equal", work_stealing="off"),
        RunSpec("equal+stealing", (1.0, 3.0), "equal", work_stealing="on"),
        RunSpec("profile_once", (1.0, 3.0), "profile_once", work_stealing="off"),
        RunSpec("adaptive", (1.0, 3.0), "adaptive", work_stealing="off"),
        RunSpec("adaptive+stealing", (1.0, 3.0), "adaptive", work_stealing="on"),
    ]
    if bc.full_table:
        out += [
            RunSpec("equal@1:1", (1.0, 1.0), "equal", work_stealing="off"),
            RunSpec("adaptive@1:1", (1.0, 1.0), "adaptive", work_stealing="off"),
            RunSpec("profile_once+drift", (1.0, 1.0), "profile_once", work_stealing="off",
                    drift=(1, steps_total // 2, 2.0)),
            RunSpec("adaptive+drift", (1.0, 1.0), "adaptive", work_stealing="off",
                    drift=(1, steps_total // 2, 2.0)),
        ]
    return out


def base_config(bc: BenchConfig, epochs: int, image_size: int | None = None) -> Any:
    from kaitian_ros.training.config import TrainingConfig

    # Adam at lr 0.01 on standardised inputs, cosine to 0 after a warm-up: 0.98 single device
    # at 16x16, and one-process runs that differ only in how each batch's gradient is summed
    # end on the same test accuracy. SGD (lr 0.02-0.1) stayed below 0.96 or spread by 2-6 test
    # samples (docs/training.md)
    return TrainingConfig(model="digits_cnn", dataset="digits",
                          image_size=image_size or bc.image_size, global_batch=512, epochs=epochs,
                          optimizer="adam", lr=0.01, standardize_inputs=True, seed=0,
                          rebalance_every=3, lr_schedule="cosine", warmup_steps=bc.warmup_steps,
                          ewma_alpha=0.5, evaluate_every_epoch=False, timeout_s=120)


def _record(spec: RunSpec, r: dict, solo: dict[tuple[float, ...], list[float]],
            before: dict, after: dict, single_acc: float, cfg: Any) -> dict[str, Any]:
    ideal = ideal_rate(r["slowdown_per_step"], r["global_batches"], solo)
    return {
        "samples_per_s": r["samples_per_s"], "ideal_samples_per_s": ideal,
        "efficiency": r["samples_per_s"] / ideal if ideal else 0.0,
        "comm_overhead_pct": r["comm_overhead_pct"],
        "comm_overhead_min_pct": r["comm_overhead_min_pct"],
        "comm_overhead_max_pct": r["comm_overhead_max_pct"],
        "comm_overhead_by_rank_pct": r["comm_overhead_by_rank_pct"],
        "imbalance_pct": r["imbalance_pct"], "transfer_pct": r["transfer_pct"],
        "systematic_wait_pct": r["systematic_wait_pct"], "final_accuracy": r["final_accuracy"],
        "accuracy_minus_single_pp": 100 * (r["final_accuracy"] - single_acc),
        "policy": spec.policy, "work_stealing": "on" if spec.config(cfg).steals else "off",
        "emulated_speeds": ":".join(f"{1 / s:.2g}" for s in spec.slowdowns),
        "drift": (f"rank {spec.drift[0]} slows to speed {1 / spec.drift[2]:.2g} at step "
                  f"{spec.drift[1]}" if spec.drift else None),
        "final_shares": r["final_shares"], "steps": len(r["throughput"]), "wall_s": r["wall_s"],
        "solo_samples_per_s_before_after": {":".join(map(str, ph)): [before[ph], after[ph]]
                                            for ph in spec.phases()},
    }


def run_config(bc: BenchConfig, quick: bool, repeats: int, progress: Progress,
               epochs: int | None = None, image_size: int | None = None
               ) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """All runs of one configuration, ``repeats`` times; returns its JSON part and the last
    repeat's per-step throughput (for the plot)."""
    t0 = time.perf_counter()
    epochs = epochs or (bc.quick_epochs if quick else bc.epochs)
    base = base_config(bc, epochs, image_size)
    micro, per_sample_us = fastest_micro_batch(base)
    base = replace(base, micro_batch=micro)
    progress.advance(f"{bc.name}: passes of {micro} samples ("
                     + ", ".join(f"{k}: {v:.0f}" for k, v in per_sample_us.items()) + " us/sample)")
    specs = specs_for(bc, epochs * DIGITS_STEPS_PER_EPOCH)
    solo_steps = bc.quick_solo_steps if quick else bc.solo_steps
    single = run(RunSpec("single device", (1.0,), "equal", solo=True), base)
    single_acc = single["final_accuracy"]
    progress.advance(f"{bc.name}: single device accuracy {single_acc:.4f}")
    records: dict[str, list[dict]] = {s.name: [] for s in specs}
    last_runs: dict[str, dict] = {}
    last_solo: dict[tuple[float, ...], list[float]] = {}
    for rep in range(repeats):
        for spec in specs:
            phases = spec.phases()
            # the measurement right after the previous run is this one's "before" where the
            # speeds are the same: solo and run measurements alternate
            before = {ph: last_solo[ph] if ph in last_solo else concurrent_solo(ph, base, solo_steps)
                      for ph in phases}
            r = run(spec, base)
            after = {ph: concurrent_solo(ph, base, solo_steps) for ph in phases}
            last_solo = after
            solo = {ph: [(a + b) / 2 for a, b in zip(before[ph], after[ph])] for ph in phases}
            rec = _record(spec, r, solo, before, after, single_acc, base)
            records[spec.name].append(rec)
            r["spec"] = spec
            last_runs[spec.name] = r
            progress.advance(f"{bc.name} repeat {rep + 1}/{repeats} {spec.name}: efficiency "
                             f"{rec['efficiency']:.3f}, comm {rec['comm_overhead_pct']:.2f} %")
    policies = {name: summarise(recs) for name, recs in records.items()}
    out: dict[str, Any] = {
        "policies": policies, "single_device_accuracy": single_acc, "repeats": repeats,
        "targets": targets(policies["adaptive"]),
        "setup": {"model": base.model, "dataset": base.dataset, "image_size": base.image_size,
                  "global_batch": base.global_batch, "epochs": epochs,
                  "optimizer": base.optimizer, "lr": base.lr,
                  "standardize_inputs": base.standardize_inputs,
                  "lr_schedule": base.lr_schedule, "warmup_steps": base.warmup_steps,
                  "rebalance_every": base.rebalance_every, "share_model": base.share_model,
                  "threads_per_rank": 1, "quick": quick, "cpus": os.cpu_count(),
                  # ranks and solo jobs are pinned, so "auto" polls in collectives and emulates
                  # slowdowns busy (training.hooks, training.trainer.slow_down)
                  "spin_wait": base.spin_wait,
                  "solo_steps_of_slowest_device": solo_steps,
                  "micro_batch": micro, "micro_batch_us_per_sample": per_sample_us,
                  "single_device_samples_per_s": single["samples_per_s"]},
        "accuracy_check": None,
    }
    if bc.accuracy_check:
        out["accuracy_check"] = accuracy_check(base, last_runs, single_acc)
        progress.advance(f"{bc.name}: accuracy check (single-process replays) done")
    out["seconds"] = time.perf_counter() - t0
    return out, {n: r["throughput"] for n, r in last_runs.items()}


def run_bench(quick: bool, configs: list[str], repeats: int = 1, epochs: int | None = None,
              image_size: int | None = None) -> tuple[dict, dict[str, dict[str, list[float]]]]:
    """Every selected configuration, ``repeats`` times. The top-level ``policies``,
    ``single_device_accuracy``, ``setup`` and ``accuracy_check`` are the first configuration's
    (the keys of the single-configuration JSON before ``configs`` existed)."""
    import torch

    torch.set_num_threads(1)
    n_steps = sum(2 + repeats * len(specs_for(CONFIGS[c], 1)) + CONFIGS[c].accuracy_check
                  for c in configs)
    progress = Progress("kaitian bench training runs (EMULATED speeds)", n_steps)
    result: dict[str, Any] = {"configs": {}, "repeats": repeats, "emulated_speeds": True}
    traces: dict[str, dict[str, list[float]]] = {}
    try:
        for c in configs:
            result["configs"][c], traces[c] = run_config(CONFIGS[c], quick, repeats, progress,
                                                         epochs, image_size)
    finally:
        progress.close()
    first = result["configs"][configs[0]]
    for k in ("policies", "single_device_accuracy", "setup", "accuracy_check"):
        result[k] = first[k]
    return result, traces


def main(argv: list[str]) -> int:
    """``kaitian bench training [--config digits|compute|all] [--repeats N] [--quick] [--json PATH]``."""
    p = BenchArgumentParser(prog="kaitian bench training")
    p.add_argument("--json", help=f"result JSON path (default {DEFAULT_DIR}/training.json)")
    p.add_argument("--quick", action="store_true",
                   help="short schedules (a smoke run: its numbers are not the result)")
    p.add_argument("--config", choices=(*CONFIGS, "all"), default="all",
                   help="digits (16x16), compute (32x32, compute-dominated) or all (default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run everything N times; the JSON has medians and min-max (default 1)")
    p.add_argument("--epochs", type=int, default=None,
                   help="override every configuration's epochs (smoke tests)")
    p.add_argument("--image-size", type=int, default=None,
                   help="override every configuration's image size (8 = native digits)")
    p.add_argument("--out-dir", default=str(DEFAULT_DIR), help="where the PNG (and JSON) go")
    try:
        a = p.parse_args(argv)
        if a.image_size is not None and not 4 <= a.image_size <= 256:
            p.error(f"--image-size must be in 4..256, got {a.image_size}")
        if a.repeats < 1 or (a.epochs is not None and a.epochs < 1):
            p.error("--repeats and --epochs must be >= 1")
    except SystemExit as e:
        return int(e.code or 0)
    configs = list(CONFIGS) if a.config == "all" else [a.config]
    out_dir = Path(a.out_dir)
    json_path = Path(a.json) if a.json else out_dir / "training.json"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        result, traces = run_bench(a.quick, configs, a.repeats, a.epochs, a.image_size)
        result["bench_seconds"] = time.perf_counter() - t0
        png = out_dir / "training_throughput.png"
        plot(result, traces, png)
        result["plot"] = str(png)
        json_path.write_text(json.dumps(result, indent=2))
    except Exception as e:  # noqa: BLE001 - a command: any failure is one error line and exit code 1
        print(f"kaitian bench training: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"wrote {json_path} and {png} ({result['bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
