"""The accuracy check of ``kaitian bench training`` (``accuracy_check`` in the JSON): one-process
replays of a global batch summed over weighted slices, which give the float32 noise floor of the
final accuracy and must reproduce the distributed run's parameters (docs/training.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_DATA: dict[tuple[str, int | None, bool], Any] = {}


def split_train(cfg: Any, *, shares: Sequence[float] | None = None,
                counts_per_step: Sequence[Sequence[int]] | None = None) -> tuple[float, Any]:
    """One process, same global batches as ``cfg``'s run, gradient summed over weighted slices.

    Each global batch is cut into contiguous slices (``split_counts`` of ``shares``, or the
    recorded ``counts_per_step`` of a distributed run); each slice's mean-loss gradient is
    scaled by ``b_i / B`` exactly as the DDP hook does and the scaled gradients are added
    in rank order. ``shares=None`` and no counts: the plain single-device step. Returns
    (test accuracy, flat parameters).
    """
    import torch
    from torch import nn

    from kaitian_ros.training.config import lr_at, make_optimizer, set_lr
    from kaitian_ros.training.data import dataset_size, evaluate, gather_batch, load_data
    from kaitian_ros.training.sampler import AdaptiveBatchSampler, split_counts
    from kaitian_ros.training.trainer import build_training_model

    torch.set_num_threads(1)  # as every rank: kernels (and their summation order) match
    torch.manual_seed(cfg.seed)
    key = (cfg.dataset, cfg.image_size, cfg.standardize_inputs)
    data = _DATA.get(key) or _DATA.setdefault(key, load_data(
        cfg.dataset, cfg.num_classes, cfg.image_size, standardize=cfg.standardize_inputs))
    model = build_training_model(cfg, data).train()
    opt = make_optimizer(cfg, model)
    sampler = AdaptiveBatchSampler(dataset_size(data.train), cfg.global_batch, 0, 1, seed=cfg.seed,
                                   policy="equal")
    params = list(model.parameters())
    step = 0
    for epoch in range(cfg.epochs):
        for sl in sampler.epoch(epoch):
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
            idx = list(sl.indices)
            big = sl.global_batch
            if counts_per_step is not None:
                counts = tuple(counts_per_step[step])
            elif shares is not None:
                counts = split_counts(big, shares)
            else:
                counts = (big,)
            if sum(counts) != big:
                raise ValueError(f"step {step}: counts {counts} do not sum to {big}")
            total: list[Any] = [None] * len(params)
            off = 0
            for b in counts:
                part = idx[off:off + b]
                off += b
                opt.zero_grad(set_to_none=False)
                x, y = gather_batch(data.train, part)
                if b:
                    loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / b
                    loss.backward()
                for i, p in enumerate(params):
                    # a run's very first chunk of 0 samples has no gradient yet: it adds zeros
                    grad = p.grad if p.grad is not None else torch.zeros_like(p)
                    g = grad.mul(b / big) if len(counts) > 1 else grad.clone()
                    total[i] = g if total[i] is None else total[i] + g
            for p, g in zip(params, total):
                assert p.grad is not None  # the counts sum to the batch: some chunk ran backward
                p.grad.copy_(g)
            set_lr(opt, lr_at(cfg, sl.step, sampler.steps_per_epoch()))
            opt.step()
            step += 1
    flat = torch.cat([p.detach().flatten() for p in params])
    return evaluate(model, data.test, torch.device("cpu")), flat.numpy().copy()


def _random_counts(base: Any, seed: int, world: int = 2) -> list[tuple[int, ...]]:
    """Per-step splits drawn at random (shares 0.1..0.9): what adaptive re-splitting does."""
    import numpy as np

    from kaitian_ros.training.sampler import split_counts

    rng = np.random.default_rng(seed)
    n, B = 1347, base.global_batch  # digits: 1347 training samples
    sizes = [min(B, n - k * B) for k in range(-(-n // B))] * base.epochs
    out = []
    for g in sizes:
        sh = rng.uniform(0.1, 0.9, size=world)
        out.append(split_counts(g, sh / sh.sum()))
    return out


def accuracy_check(base: Any, runs: dict[str, dict], single_acc: float) -> dict:
    """Noise floor of the final accuracy under re-summation, and replays of the real runs.

    Noise floor: single-process runs identical to the single device except that each
    global batch's gradient is the weighted sum of slice gradients (fixed shares, or a
    random split every step). Replays: every multi-rank run's recorded per-step split
    redone in one process; equal parameters mean the distributed run computed exactly the
    single-process gradient sum, so its accuracy differs from the single device only by
    summation order.
    """
    import numpy as np

    variants: dict[str, Any] = {"unsplit": None, "0.5/0.5": (0.5, 0.5),
                                "0.75/0.25": (0.75, 0.25), "0.25/0.75": (0.25, 0.75),
                                "0.5/0.3/0.2": (0.5, 0.3, 0.2)}
    accs = {}
    for name, sh in variants.items():
        accs[name] = split_train(base, shares=sh)[0]
    for k in range(3):
        accs[f"random split {k}"] = split_train(base, counts_per_step=_random_counts(base, k))[0]
    replays = {}
    for name, r in runs.items():
        if r["spec"].solo:
            continue
        acc, params = split_train(base, counts_per_step=r["counts"])
        replays[name] = {
            "distributed_accuracy": r["final_accuracy"], "replay_accuracy": acc,
            "max_abs_param_diff": float(np.max(np.abs(params - r["outs"][0]["params"]))),
            "ranks_bitwise_equal": all(np.array_equal(o["params"], r["outs"][0]["params"])
                                       for o in r["outs"])}
    vals = list(accs.values())
    return {
        "single_process_accuracy_by_split": accs,
        "noise_floor_pp": 100 * (max(vals) - min(vals)),
        "noise_floor_below_single_pp": 100 * (single_acc - min(vals)),
        "replays": replays,
        "one_test_sample_pp": 100 / 450,
    }
