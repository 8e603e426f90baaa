"""``kaitian bench training``: heterogeneous data-parallel training, policies compared.

In one run, on digits with ``digits_cnn`` (CPU, gloo, ranks forked on this host; images
upsampled to ``--image-size``, default 16, for realistic compute per step):

* solo runs: each emulated device speed alone on the whole global batch, one thread, the
  same process setup -> its throughput. They are measured again right before every
  multi-rank run and again right after it (the mean of both: the box is shared and its load
  drifts) -> "ideal_isolated"; speed 1
  trained for the full schedule gives the single-device accuracy;
* concurrent solo runs: right before and after every multi-rank run, all its devices' solo
  jobs at once (they share this CPU's caches and memory bus in the run too); "ideal" is the sum
  of these rates;
* 2 ranks at emulated speeds 1 : 0.33 with policies equal / profile_once / adaptive;
* control 1 : 1 (equal, adaptive);
* drift: 1 : 1 and rank 1 slows 2x halfway through (profile_once, adaptive).

Speeds are EMULATED: a rank with slowdown s sleeps (s-1) x its real compute time after
its compute before each all-reduce (``training.trainer``). Efficiency = samples/s / ideal samples/s. Communication
overhead = per step the smallest blocked-in-communication time over the ranks (the last
rank to arrive waits for nobody, so its blocked time is the transfer itself), summed,
over the training wall time. The first two steps of every run (lazy initialisation, DDP's
bucket rebuild) are left out of all rates.

Accuracy check (``accuracy_check`` in the JSON): single-process runs that differ from the
single device only in how each global batch's gradient is summed (split into weighted
slices at fixed shares) give the float32 noise floor of the final accuracy; a replay of
the adaptive run's exact per-step split in one process must reproduce the distributed
run's parameters (bitwise for 2 ranks: a + b is commutative) -- if it does, any accuracy
difference to the single device is summation-order noise, not a weighting bug.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.training_accuracy import accuracy_check
from kaitian_ros.progress import Progress

DEFAULT_DIR = Path("bench/results")
# digits upsampled to 16x16: 4x the compute per sample of the native 8x8 with the same
# gradient size (see docs/training.md "Step size"); --image-size 8 is the native set
DEFAULT_IMAGE_SIZE = 16
WARMUP = 2  # first steps of every run left out of rates (lazy init, DDP bucket rebuild)


@dataclass(frozen=True)
class RunSpec:
    name: str
    slowdowns: tuple[float, ...]
    policy: str
    drift: tuple[int, int, float] | None = None  # (rank, at step, new slowdown)
    solo: bool = False  # one rank on the whole batch; ``max_steps`` limits it
    max_steps: int | None = None

    def phases(self) -> list[tuple[float, ...]]:
        """The slowdown vectors the run goes through (two with a drift)."""
        out = [tuple(self.slowdowns)]
        if self.drift:
            after = list(self.slowdowns)
            after[self.drift[0]] = self.drift[2]
            out.append(tuple(after))
        return out


def _rank_fn(rank: int, world: int, cfg: Any, drift: tuple[int, int, float] | None) -> dict:
    from kaitian_ros.training.results import TrainingStep
    from kaitian_ros.training.trainer import RankTrainer

    box: dict[str, Any] = {}

    def on_step(s: TrainingStep) -> None:
        if drift is not None and rank == drift[0] and s.step + 1 == drift[1]:
            box["t"].set_emulated_slowdown(drift[2])

    box["t"] = RankTrainer(cfg, on_step=on_step)
    res = box["t"].run()
    import torch

    params = torch.cat([p.detach().flatten() for p in box["t"].model.parameters()])
    return {"acc": res.test_accuracy, "shares": list(res.final_shares),
            "params": params.numpy().copy(),
            "steps": [(h.step, h.global_batch, h.local_batch, h.step_ms, h.comm_ms, h.slowdown,
                       h.compute_ms) for h in res.history]}


def _run(spec: RunSpec, base: Any) -> dict:
    from kaitian_ros.training.local_ranks import run_local

    world = len(spec.slowdowns)
    devices = ("cpu",) if world == 1 else tuple(f"cpu:{chr(97 + r)}" for r in range(world))
    cfg = replace(base, devices=devices, emulated_slowdown=spec.slowdowns, policy=spec.policy,
                  max_steps=spec.max_steps)
    outs = run_local(_rank_fn, world, cfg, spec.drift, timeout_s=120)
    n = len(outs[0]["steps"])
    per_step_wall = [max(o["steps"][i][3] for o in outs) for i in range(n)]
    per_step_comm = [min(o["steps"][i][4] for o in outs) for i in range(n)]
    # time the early rank(s) sit blocked waiting for the last one (load imbalance)
    per_step_wait = [max(o["steps"][i][4] for o in outs) - per_step_comm[i] for i in range(n)]
    gb = [s[1] for s in outs[0]["steps"]]
    # leave out the warm-up steps everywhere; ranks' step boundaries are offset, so the
    # training time is the largest per-rank sum of step times (not a sum of per-step maxima)
    w = WARMUP
    wall_s = max(sum(s[3] for s in o["steps"][w:]) for o in outs) / 1e3
    samples = sum(gb[w:])
    return {"outs": outs, "samples_per_s": samples / wall_s if wall_s else 0.0,
            "comm_overhead_pct": 100 * sum(per_step_comm[w:]) / 1e3 / wall_s if wall_s else 0.0,
            "imbalance_pct": 100 * sum(per_step_wait[w:]) / 1e3 / wall_s if wall_s else 0.0,
            "final_accuracy": outs[0]["acc"], "final_shares": outs[0]["shares"],
            "throughput": [g / (w / 1e3) for g, w in zip(gb, per_step_wall)],
            "slowdown_per_step": [[o["steps"][i][5] for o in outs] for i in range(len(gb))],
            "global_batches": gb,
            "counts": [tuple(o["steps"][i][2] for o in outs) for i in range(n)]}


def _solo_child(index: int, spec: RunSpec, base: Any, q: Any) -> None:
    try:
        q.put((index, _run(spec, base)["samples_per_s"], None))
    except Exception as e:  # noqa: BLE001 - a child process: any failure goes to the parent, which reports it
        q.put((index, 0.0, f"{type(e).__name__}: {e}"))


def _concurrent_solo(slowdowns: Sequence[float], base: Any, steps: int) -> list[float]:
    """Every device's solo rate (whole global batch, no communication) measured with all of
    them running at the same time, as they do in the multi-rank run: the emulated devices
    share this CPU's caches and memory bandwidth, which slows each when the others are busy.
    A device s times slower runs s/max(s) of the steps so that all stay busy together."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    top = max(slowdowns)
    procs = []
    for i, s in enumerate(slowdowns):
        n = WARMUP + max(4, round((steps - WARMUP) * top / s))
        spec = RunSpec(f"concurrent solo {s}", (s,), "equal", solo=True, max_steps=n)
        p = ctx.Process(target=_solo_child, args=(i, spec, base, q), daemon=False)
        p.start()
        procs.append(p)
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    errors = [e for _, _, e in got if e]
    if errors:
        raise RuntimeError(f"concurrent solo run failed: {errors[0]}")
    rates = [0.0] * len(slowdowns)
    for i, r, _ in got:
        rates[i] = r
    return rates


def _isolated_rate(solo: Mapping[float, float], slowdowns: tuple[float, ...]) -> float:
    """The summed solo rates of devices at ``slowdowns``, each measured alone."""
    return sum(solo[s] for s in slowdowns)


def _concurrent_rate(concurrent: Mapping[tuple[float, ...], Sequence[float]], slowdowns: tuple[float, ...]) -> float:
    """The summed solo rates of devices at ``slowdowns``, measured running side by side."""
    return sum(concurrent[slowdowns])


def _ideal(slowdowns_per_step: Sequence[Sequence[float]], global_batches: Sequence[int],
           rate_of: Callable[[tuple[float, ...]], float]) -> float:
    """Samples/s if the devices ran at their solo rates, phase by phase (drift changes it);
    ``rate_of(slowdowns)`` is the summed solo rate of the devices at those slowdowns."""
    t = sum(g / rate_of(tuple(sl))
            for sl, g in zip(slowdowns_per_step[WARMUP:], global_batches[WARMUP:]))
    return sum(global_batches[WARMUP:]) / t if t else 0.0


def _plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in runs.items():
        th = r["throughput"]
        k = 3  # moving average: single steps are noisy on a shared 2-core box
        sm = [sum(th[max(0, i - k + 1):i + 1]) / len(th[max(0, i - k + 1):i + 1])
              for i in range(len(th))]
        ax.plot(range(WARMUP, len(sm)), sm[WARMUP:], label=name, lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel("global samples/s (3-step moving average)")
    ax.set_title("Heterogeneous training throughput (digits_cnn, CPU, EMULATED device speeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(quick: bool, image_size: int | None = DEFAULT_IMAGE_SIZE) -> tuple[dict, dict[str, dict]]:
    import statistics

    import torch

    from kaitian_ros.training.config import TrainingConfig

    torch.set_num_threads(1)
    epochs = 16 if quick else 60  # 60: upsampled digits converge (0.98 single device)
    base = TrainingConfig(model="digits_cnn", dataset="digits", image_size=image_size,
                          global_batch=512, epochs=epochs,
                          # Adam at lr 0.01 on standardised inputs, cosine to 0 after a
                          # 3-epoch warm-up: 0.98 single device, and one-process runs that
                          # differ only in how each batch's gradient is summed (9 splits, 3
                          # seeds) end on the same test accuracy. SGD (lr 0.02-0.1) stayed
                          # below 0.96 or spread by 2-6 test samples (docs/training.md)
                          optimizer="adam", lr=0.01, standardize_inputs=True,
                          seed=0, rebalance_every=3, lr_schedule="cosine", warmup_steps=9,
                          ewma_alpha=0.5, evaluate_every_epoch=False, timeout_s=60)
    steps_total = epochs * 3  # 1347 training samples / 512 -> 3 steps per epoch
    solo_steps = 10 if quick else 24
    single = RunSpec("solo speed 1 (single device)", (1.0,), "equal", solo=True)
    specs = [
        RunSpec("equal", (1.0, 3.0), "equal"),
        RunSpec("profile_once", (1.0, 3.0), "profile_once"),
        RunSpec("adaptive", (1.0, 3.0), "adaptive"),
        RunSpec("equal@1:1", (1.0, 1.0), "equal"),
        RunSpec("adaptive@1:1", (1.0, 1.0), "adaptive"),
        RunSpec("profile_once+drift", (1.0, 1.0), "profile_once",
                drift=(1, steps_total // 2, 2.0)),
        RunSpec("adaptive+drift", (1.0, 1.0), "adaptive", drift=(1, steps_total // 2, 2.0)),
    ]
    runs: dict[str, dict] = {}
    solo_log: dict[float, list[float]] = {}

    def measure_solo(slowdown: float) -> float:
        r = _run(RunSpec(f"solo {slowdown}", (slowdown,), "equal", solo=True,
                         max_steps=solo_steps), base)
        solo_log.setdefault(slowdown, []).append(r["samples_per_s"])
        return r["samples_per_s"]

    # one step per run (between runs: no cost while one is measured), on stderr
    progress = Progress("kaitian bench training runs (EMULATED speeds)", 1 + len(specs) + 1)
    try:
        t0 = time.perf_counter()
        r = _run(single, base)
        r["seconds"], r["spec"] = time.perf_counter() - t0, single
        runs[single.name] = r
        solo_log.setdefault(1.0, []).append(r["samples_per_s"])
        progress.advance(f"{single.name}: {r['samples_per_s']:.0f} samples/s")
        for spec in specs:
            # solo rates of this run's device speeds, measured right before and right after it
            # (the mean of both: the box's speed drifts by 10-30 % within minutes)
            phases = spec.phases()
            needed = sorted({x for ph in phases for x in ph})
            solo_before = {s: measure_solo(s) for s in needed}
            conc_before = {ph: _concurrent_solo(ph, base, solo_steps) for ph in phases}
            t0 = time.perf_counter()
            r = _run(spec, base)
            r["seconds"] = time.perf_counter() - t0
            solo_after = {s: measure_solo(s) for s in needed}
            conc_after = {ph: _concurrent_solo(ph, base, solo_steps) for ph in phases}
            r["spec"], r["name"] = spec, spec.name
            r["solo"] = {s: (solo_before[s] + solo_after[s]) / 2 for s in needed}
            r["concurrent_solo"] = {ph: [(a + b) / 2 for a, b in zip(conc_before[ph], conc_after[ph])]
                                    for ph in phases}
            r["ideal_samples"] = {"isolated_before_after": {str(s): [solo_before[s], solo_after[s]]
                                                            for s in needed},
                                  "concurrent_before_after": {":".join(map(str, ph)): [conc_before[ph],
                                                                                         conc_after[ph]]
                                                              for ph in phases}}
            runs[spec.name] = r
            progress.advance(f"{spec.name}: {r['samples_per_s']:.0f} samples/s, accuracy {r['final_accuracy']:.4f}")
        single_acc = runs[single.name]["final_accuracy"]
        result: dict[str, Any] = {
            "policies": {},
            "single_device_accuracy": single_acc,
            "emulated_speeds": True,
            "setup": {"model": base.model, "dataset": base.dataset, "image_size": base.image_size,
                      "global_batch": base.global_batch,
                      "epochs": epochs, "optimizer": base.optimizer, "lr": base.lr,
                      "standardize_inputs": base.standardize_inputs, "lr_schedule": base.lr_schedule,
                      "warmup_steps": base.warmup_steps, "rebalance_every": base.rebalance_every,
                      "share_model": base.share_model, "threads_per_rank": 1, "quick": quick,
                      "cpus": os.cpu_count(),
                      "solo_samples_per_s_median": {f"{1 / k:.2g}": statistics.median(v)
                                                    for k, v in sorted(solo_log.items())},
                      "solo_samples_per_s_all": {f"{1 / k:.2g}": v
                                                 for k, v in sorted(solo_log.items())}},
        }
        for name, r in runs.items():
            spec = r["spec"]
            if spec.solo:
                continue
            isolated = _ideal(r["slowdown_per_step"], r["global_batches"], functools.partial(_isolated_rate, r["solo"]))
            ideal = _ideal(r["slowdown_per_step"], r["global_batches"],
                           functools.partial(_concurrent_rate, r["concurrent_solo"]))
            speeds = ":".join(f"{1 / s:.2g}" for s in spec.slowdowns)
            result["policies"][name] = {
                "samples_per_s": r["samples_per_s"], "ideal_samples_per_s": ideal,
                "efficiency": r["samples_per_s"] / ideal if ideal else 0.0,
                "ideal_isolated_samples_per_s": isolated,
                "efficiency_vs_isolated": r["samples_per_s"] / isolated if isolated else 0.0,
                "concurrent_solo_samples_per_s": {":".join(f"{1 / x:.2g}" for x in ph): v
                                                  for ph, v in r["concurrent_solo"].items()},
                "comm_overhead_pct": r["comm_overhead_pct"], "final_accuracy": r["final_accuracy"],
                "accuracy_minus_single_pp": 100 * (r["final_accuracy"] - single_acc),
                "policy": spec.policy, "emulated_speeds": speeds,
                "drift": (f"rank {spec.drift[0]} slows to speed {1 / spec.drift[2]:.2g} at step "
                          f"{spec.drift[1]}" if spec.drift else None),
                "final_shares": r["final_shares"], "steps": len(r["throughput"]),
                "ideal_measurements": r["ideal_samples"],
                "imbalance_pct": r["imbalance_pct"],
            }
        result["accuracy_check"] = accuracy_check(base, runs, single_acc)
        progress.advance("accuracy check (single-process replays) done")
        return result, runs
    finally:
        progress.close()


def _table(result: dict) -> str:
    rows = [(f"{'run':22s} {'speeds (EMULATED)':>17s} {'samples/s':>10s} {'ideal':>8s} "
             f"{'eff':>6s} {'eff-iso':>7s} {'comm %':>7s} {'wait %':>7s} {'acc':>7s}  shares")]
    for name, p in result["policies"].items():
        rows.append(f"{name:22s} {p['emulated_speeds']:>17s} {p['samples_per_s']:10.0f} "
                    f"{p['ideal_samples_per_s']:8.0f} {p['efficiency']:6.3f} "
                    f"{p['efficiency_vs_isolated']:7.3f} "
                    f"{p['comm_overhead_pct']:7.2f} {p['imbalance_pct']:7.2f} "
                    f"{p['final_accuracy']:7.4f}  "
                    f"{[round(s, 3) for s in p['final_shares']]}"
                    + (f"  ({p['drift']})" if p["drift"] else ""))
    rows.append(f"single-device accuracy: {result['single_device_accuracy']:.4f}; solo "
                f"samples/s by speed (median): "
                + ", ".join(f"{k}: {v:.0f}" for k, v in
                            result["setup"]["solo_samples_per_s_median"].items()))
    a = result.get("accuracy_check")
    if a:
        rows.append("accuracy check, single process with the gradient summed over slices: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in
                                a["single_process_accuracy_by_split"].items())
                    + f" -> noise floor {a['noise_floor_pp']:.2f} pp")
        for name, rp in a["replays"].items():
            rows.append(f"  replay of {name:20s} in one process: accuracy "
                        f"{rp['replay_accuracy']:.4f} (distributed {rp['distributed_accuracy']:.4f}),"
                        f" max |param diff| {rp['max_abs_param_diff']:.1e}, ranks bitwise equal: "
                        f"{rp['ranks_bitwise_equal']}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """``kaitian bench training [--json PATH] [--quick]``."""
    p = BenchArgumentParser(prog="kaitian bench training")
    p.add_argument("--json", help=f"result JSON path (default {DEFAULT_DIR}/training.json)")
    p.add_argument("--quick", action="store_true", help="short schedule (about 5 min on 2 cores)")
    p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                   help=f"digits resized to this square size (default {DEFAULT_IMAGE_SIZE}; 8 = native)")
    p.add_argument("--out-dir", default=str(DEFAULT_DIR), help="where the PNG (and JSON) go")
    try:
        a = p.parse_args(argv)
        if not 4 <= a.image_size <= 256:
            p.error(f"--image-size must be in 4..256, got {a.image_size}")
    except SystemExit as e:
        return int(e.code or 0)
    out_dir = Path(a.out_dir)
    json_path = Path(a.json) if a.json else out_dir / "training.json"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        result, runs = run_bench(a.quick, a.image_size)  # 8 = native: resizing is a no-op
        result["bench_seconds"] = time.perf_counter() - t0
        png = out_dir / "training_throughput.png"
        _plot({k: v for k, v in runs.items() if not v["spec"].solo}, png)
        result["plot"] = str(png)
        json_path.write_text(json.dumps(result, indent=2))
    except Exception as e:  # noqa: BLE001 - a command: any failure is one error line and exit code 1
        print(f"kaitian bench training: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(_table(result))
    print(f"wrote {json_path} and {png} ({result['bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
