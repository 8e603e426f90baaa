"""One measured run of ``kaitian bench training`` and the solo rates that normalise it.

A run is N ranks forked on this host by ``training.local_ranks.run_local`` (one thread each,
each on a core of its own where there are enough: ``training.affinity``; gloo, ``RankTrainer``
on the digits data at the configured image size). Its solo rates are measured under the same
arrangement: every device of the run trains alone on the whole global batch, all of them at
the same time (they share this CPU's cores, caches and memory bus in the run as well), each
one through ``run_local`` on the core its rank has in the run, with the same configuration,
data path, thread count, step loop, pass size (``fastest_micro_batch``), EMULATED slowdown and
warm-up exclusion as a rank of the run. The only differences are the ones that define the ideal: no partner to
communicate with and no slice (the whole global batch, so the fixed per-step cost is paid
once, as on a single device).

Speeds are EMULATED: a rank with slowdown s sleeps (s-1) x its real compute time
(``training.trainer``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

WARMUP = 2  # first steps of every run left out of rates (lazy init, DDP bucket rebuild)


@dataclass(frozen=True)
class RunSpec:
    name: str
    slowdowns: tuple[float, ...]
    policy: str
    drift: tuple[int, int, float] | None = None  # (rank, at step, new slowdown)
    solo: bool = False  # one rank on the whole batch; ``max_steps`` limits it
    max_steps: int | None = None
    work_stealing: str = "auto"  # TrainingConfig.work_stealing: auto | on | off

    def phases(self) -> list[tuple[float, ...]]:
        """The slowdown vectors the run goes through (two with a drift)."""
        out = [tuple(self.slowdowns)]
        if self.drift:
            after = list(self.slowdowns)
            after[self.drift[0]] = self.drift[2]
            out.append(tuple(after))
        return out

    def config(self, base: Any) -> Any:
        world = len(self.slowdowns)
        devices = ("cpu",) if world == 1 else tuple(f"cpu:{chr(97 + r)}" for r in range(world))
        return replace(base, devices=devices, emulated_slowdown=self.slowdowns, policy=self.policy,
                       max_steps=self.max_steps, work_stealing=self.work_stealing)


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


def run(spec: RunSpec, base: Any) -> dict:
    """Train ``spec`` once; its rates leave out the first ``WARMUP`` steps."""
    from kaitian_ros.training.local_ranks import run_local

    cfg = spec.config(base)
    outs = run_local(_rank_fn, len(spec.slowdowns), cfg, spec.drift, timeout_s=300)
    n = len(outs[0]["steps"])
    w = WARMUP
    per_step_wall = [max(o["steps"][i][3] for o in outs) for i in range(n)]
    gb = [s[1] for s in outs[0]["steps"]]
    # ranks' step boundaries are offset, so the training time is the largest per-rank sum of
    # step times (not a sum of per-step maxima)
    wall_s = max(sum(s[3] for s in o["steps"][w:]) for o in outs) / 1e3
    samples = sum(gb[w:])
    # every rank's time blocked in the comm hook (transfer + waiting for the others)
    comm_pct = [100 * sum(s[4] for s in o["steps"][w:]) / 1e3 / wall_s if wall_s else 0.0
                for o in outs]
    return {"outs": outs, "samples_per_s": samples / wall_s if wall_s else 0.0,
            "comm_overhead_pct": statistics.fmean(comm_pct),
            "comm_overhead_min_pct": min(comm_pct), "comm_overhead_max_pct": max(comm_pct),
            "comm_overhead_by_rank_pct": comm_pct,
            **comm_breakdown([[s[4] for s in o["steps"][w:]] for o in outs], wall_s),
            "final_accuracy": outs[0]["acc"], "final_shares": outs[0]["shares"],
            "throughput": [g / (t / 1e3) for g, t in zip(gb, per_step_wall)],
            "slowdown_per_step": [[o["steps"][i][5] for o in outs] for i in range(n)],
            "global_batches": gb, "wall_s": wall_s,
            "counts": [tuple(o["steps"][i][2] for o in outs) for i in range(n)]}


def comm_breakdown(comm_ms: Sequence[Sequence[float]], wall_s: float) -> dict[str, float]:
    """What the ranks' blocked time per step (``comm_ms[rank][step]``) is made of, each as a
    share of the training wall time: ``transfer_pct``, the time the last rank to arrive spends
    in the step's collectives (the smallest blocked time of the step: no waiting in it);
    ``imbalance_pct`` (wait %), the early ranks' waiting for it (per step the largest minus the
    smallest blocked time); ``systematic_wait_pct``, the part of the waiting that falls on
    some ranks more than on others over the run (the largest minus the smallest per-rank sum
    of waiting): a better split could remove that part, while waiting that changes side from
    step to step is the noise of the ranks' compute times, which no split removes."""
    if not wall_s or not comm_ms or not comm_ms[0]:
        return {"transfer_pct": 0.0, "imbalance_pct": 0.0, "systematic_wait_pct": 0.0}
    floor = [min(c[i] for c in comm_ms) for i in range(len(comm_ms[0]))]
    waits = [sum(c[i] - floor[i] for i in range(len(floor))) for c in comm_ms]
    per_step_wait = [max(c[i] for c in comm_ms) - floor[i] for i in range(len(floor))]
    pct = 100 / 1e3 / wall_s
    return {"transfer_pct": pct * sum(floor), "imbalance_pct": pct * sum(per_step_wait),
            "systematic_wait_pct": pct * (max(waits) - min(waits))}


MICRO_BATCH_MIN = 16  # the smallest pass size tried for the solo jobs' best


def fastest_micro_batch(base: Any, repeats: int = 3) -> tuple[int, dict[int, float]]:
    """(pass size, microseconds per sample of each size tried): the size, of the global batch
    and its halves down to ``MICRO_BATCH_MIN``, in which this machine computes a global batch of
    the configuration's model and data fastest (forward and backward, one thread, the median
    over ``repeats`` interleaved rounds).

    Per-sample compute depends on the pass size: at 32x32 a pass of 64 samples took half the
    time per sample of one of 512 here (activations that fit the caches). A device alone
    computing the whole batch in one pass is then not the fastest single device, and a run
    whose ranks compute smaller slices or work-stealing chunks measured above that "ideal"
    (efficiency 1.27-1.30). So solo jobs and the runs without stealing compute in passes of
    this size, and the ideal is each device at its best."""
    import time

    import torch

    from kaitian_ros import heap
    from kaitian_ros.training.data import load_data
    from kaitian_ros.training.trainer import build_training_model, micro_slices

    # with the heap the ranks train with (RankTrainer.run tunes it): untuned, every pass's
    # multi-MiB activations were fresh mmaps, which made small passes look fastest (32 samples
    # at 32x32 and 64 at 16x16, against 64 and 256 before the ranks were tuned)
    heap.tune_allocator()
    data = load_data(base.dataset, None, base.image_size, standardize=base.standardize_inputs)
    model = build_training_model(base, data)
    x_all, y_all = data.train
    g = min(base.global_batch, len(y_all))
    sizes, b = [], g
    while b >= MICRO_BATCH_MIN:
        sizes.append(b)
        b //= 2
    times: dict[int, list[float]] = {s: [] for s in sizes or [g]}
    for _ in range(repeats + 1):  # the first round warms up and is not counted
        for size in times:
            t0 = time.perf_counter()
            for a, b in micro_slices(g, size):
                torch.nn.functional.cross_entropy(model(x_all[a:b]), y_all[a:b], reduction="sum").backward()
            times[size].append((time.perf_counter() - t0) / g * 1e6)
    per_sample = {size: statistics.median(ts[1:]) for size, ts in times.items()}
    return pick_pass_size(per_sample), per_sample


PASS_SIZE_TIE = 0.02  # per-sample times this close are one speed to the measurement


def pick_pass_size(us_per_sample: Mapping[int, float], tie: float = PASS_SIZE_TIE) -> int:
    """The largest pass size within ``tie`` of the fastest per sample. With the heap tuned, the
    sizes from 16 to 256 at 32x32 measured within 2 % of each other and the fastest flipped
    between 16, 32 and 256 from one measurement to the next; among equals, fewer passes."""
    best = min(us_per_sample.values())
    return max(size for size, us in us_per_sample.items() if us <= best * (1.0 + tie))


def _solo_child(index: int, devices: int, spec: RunSpec, base: Any, q: Any) -> None:
    from kaitian_ros.training.affinity import pin_local_rank

    # on the core rank `index` of the run has (run_local pins each rank to one): the same
    # arrangement; its own one-rank run then stays there
    pin_local_rank(index, devices)
    try:
        q.put((index, run(spec, base)["samples_per_s"], None))
    except Exception as e:  # noqa: BLE001 - a child process: any failure goes to the parent, which reports it
        q.put((index, 0.0, f"{type(e).__name__}: {e}"))


def concurrent_solo(slowdowns: Sequence[float], base: Any, steps: int) -> list[float]:
    """Every device's solo rate, all of them training at the same time (module docstring).

    A device s times slower runs s/max(s) of the steps so that all stay busy together;
    the slowest runs ``steps`` steps after the warm-up.
    """
    import multiprocessing as mp

    from kaitian_ros.training.trainer import import_lazy_dependencies

    import_lazy_dependencies()  # once here, not in every solo job's ranks
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    top = max(slowdowns)
    procs = []
    for i, s in enumerate(slowdowns):
        n = WARMUP + max(4, round(steps * top / s))
        spec = RunSpec(f"solo {s}", (s,), "equal", solo=True, max_steps=n)
        p = ctx.Process(target=_solo_child, args=(i, len(slowdowns), spec, base, q), daemon=False)
        p.start()
        procs.append(p)
    got = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    errors = [e for _, _, e in got if e]
    if errors:
        raise RuntimeError(f"solo run failed: {errors[0]}")
    rates = [0.0] * len(slowdowns)
    for i, r, _ in got:
        rates[i] = r
    return rates


def ideal_rate(slowdowns_per_step: Sequence[Sequence[float]], global_batches: Sequence[int],
               solo: Mapping[tuple[float, ...], Sequence[float]]) -> float:
    """Samples/s if the devices ran at their solo rates, phase by phase (a drift changes
    them); ``solo[slowdowns]`` are the rates of the devices at those slowdowns."""
    t = sum(g / sum(solo[tuple(sl)])
            for sl, g in zip(slowdowns_per_step[WARMUP:], global_batches[WARMUP:]))
    return sum(global_batches[WARMUP:]) / t if t else 0.0
