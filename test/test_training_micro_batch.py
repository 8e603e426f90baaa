"""TrainingConfig.micro_batch: a slice computed in several passes gives the same training."""

from __future__ import annotations

import pytest
import torch

from kaitian_ros.training.config import TrainingConfig
from kaitian_ros.training.local_ranks import run_local
from kaitian_ros.training.trainer import RankTrainer, micro_slices


def test_micro_slices_cover_the_slice_once_in_order() -> None:
    assert micro_slices(10, 0) == [(0, 10)]
    assert micro_slices(0, 4) == [(0, 0)]  # an empty slice still runs its (empty) pass
    assert micro_slices(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert micro_slices(8, 8) == [(0, 8)]
    with pytest.raises(ValueError, match="micro_batch"):
        TrainingConfig(micro_batch=-1)


def _params(rank: int, world: int, cfg: TrainingConfig) -> list:
    t = RankTrainer(cfg)
    res = t.run()
    return [torch.cat([p.detach().flatten() for p in t.model.parameters()]).tolist(),
            [s.local_batch for s in res.history]]


@pytest.mark.e2e
@pytest.mark.parametrize("world", [1, 2])
def test_micro_batches_train_the_same_model_as_one_pass(world: int) -> None:
    base = dict(epochs=1, max_steps=4, global_batch=64, seed=1, policy="equal", work_stealing="off",
                devices=("cpu",) if world == 1 else ("cpu:a", "cpu:b"), evaluate_every_epoch=False)
    whole = run_local(_params, world, TrainingConfig(**base), timeout_s=120)
    micro = run_local(_params, world, TrainingConfig(**base, micro_batch=10), timeout_s=120)
    for a, b in zip(whole, micro):
        assert a[1] == b[1]  # same slices
        diff = (torch.tensor(a[0]) - torch.tensor(b[0])).abs().max().item()
        assert diff < 1e-5, diff  # the same gradients, summed in another order
    assert max(abs(x) for x in whole[0][0]) > 0  # it trained something


def test_the_bench_picks_the_pass_size_it_measured_fastest() -> None:
    from kaitian_ros.bench.training_runs import MICRO_BATCH_MIN, fastest_micro_batch

    cfg = TrainingConfig(model="digits_cnn", dataset="digits", image_size=8, global_batch=64)
    best, per_sample = fastest_micro_batch(cfg, repeats=1)
    assert sorted(per_sample) == [16, 32, 64] and MICRO_BATCH_MIN == 16
    assert all(v > 0 for v in per_sample.values()) and per_sample[best] <= 1.02 * min(per_sample.values())


def test_among_pass_sizes_measuring_alike_the_largest_is_picked() -> None:
    from kaitian_ros.bench.training_runs import pick_pass_size

    measured = {512: 708.0, 256: 598.0, 128: 598.0, 64: 609.0, 32: 644.0, 16: 591.0}
    assert pick_pass_size(measured) == 256  # 598 is within 2 % of 591
    assert pick_pass_size(measured, tie=0.0) == 16
    assert pick_pass_size({512: 300.0, 256: 150.0, 128: 152.0}) == 256
    assert pick_pass_size({64: 100.0}) == 64
