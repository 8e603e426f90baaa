"""Work stealing inside a step: exact coverage, contiguity, and an exact gradient.

The claim logic runs against torch's real in-process ``HashStore`` (the same ``add`` /
``delete_key`` interface the rendezvous TCPStore has); the end-to-end test uses real gloo
process groups on forked ranks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from kaitian_ros.training.config import TrainingConfig
from kaitian_ros.training.local_ranks import run_local
from kaitian_ros.training.stealing import StepClaims, forget_step, sides_of, start_points
from kaitian_ros.training.trainer import RankTrainer


def _claim_all(counts: list[int], order_seed: int, stop_after: dict[int, int] | None = None,
               **bounds: int) -> tuple[list[list[tuple[int, int]]], list[StepClaims]]:
    """Every rank claims until done, in a random interleaving; ``stop_after[r]`` = number
    of claims after which rank r stalls (a rank that is stuck in its last chunk); ``bounds``:
    StepClaims' min_chunk/max_chunk."""
    store = dist.HashStore()
    claims = [StepClaims(store, "7", counts, r, **bounds) for r in range(len(counts))]
    got: list[list[tuple[int, int]]] = [[] for _ in counts]
    live = set(range(len(counts)))
    rng = random.Random(order_seed)
    while live:
        r = rng.choice(sorted(live))
        if stop_after and len(got[r]) >= stop_after.get(r, 1 << 30):
            live.discard(r)
            continue
        c = claims[r].next()
        if c is None:
            live.discard(r)
        else:
            got[r].append(c)
    return got, claims


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=2, max_size=5).filter(lambda c: sum(c) > 0),
       st.integers(0, 10_000))
def test_every_sample_claimed_once_in_contiguous_rank_ordered_ranges(counts: list[int],
                                                                     seed: int) -> None:
    got, claims = _claim_all(counts, seed)
    B = sum(counts)
    cover = np.zeros(B, dtype=int)
    for ranges in got:
        for lo, hi in ranges:
            assert 0 <= lo < hi <= B
            cover[lo:hi] += 1
    assert (cover == 1).all()
    # each rank's samples form one range; the ranges follow rank order and tile the batch
    pos = 0
    for r, c in enumerate(claims):
        if c.count == 0:
            assert c.range is None
            continue
        lo, hi = c.range
        assert hi - lo == c.count == sum(end - start for start, end in got[r])
        assert lo == pos
        pos = hi
    assert pos == B


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=2, max_size=4), st.integers(0, 10_000),
       st.data())
def test_a_stalled_rank_loses_its_unclaimed_samples_to_its_neighbours(
        counts: list[int], seed: int, data: st.DataObject) -> None:
    stalled = data.draw(st.integers(0, len(counts) - 1))
    got, claims = _claim_all(counts, seed, stop_after={stalled: 1})
    cover = np.zeros(sum(counts), dtype=int)
    for ranges in got:
        for lo, hi in ranges:
            cover[lo:hi] += 1
    assert (cover == 1).all()  # the others took everything it did not claim
    assert claims[stalled].count <= counts[stalled]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 600), min_size=2, max_size=4).filter(lambda c: sum(c) > 0),
       st.integers(0, 10_000), st.sampled_from([(1, 0), (8, 32), (32, 128), (16, 16)]))
def test_chunk_bounds_hold_and_every_sample_is_still_claimed_once(
        counts: list[int], seed: int, bounds: tuple[int, int]) -> None:
    """Every claim is within [min_chunk, max_chunk] except one cut to what was left of its gap."""
    lo_b, hi_b = bounds
    got, _ = _claim_all(counts, seed, min_chunk=lo_b, max_chunk=hi_b)
    cover = np.zeros(sum(counts), dtype=int)
    short = 0
    for ranges in got:
        for lo, hi in ranges:
            cover[lo:hi] += 1
            assert hi_b == 0 or hi - lo <= max(hi_b, lo_b)
            short += hi - lo < lo_b
    assert (cover == 1).all()
    assert short <= len(counts) - 1  # at most one cut claim per gap


def test_chunk_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_chunk"):
        StepClaims(dist.HashStore(), "k", [3, 3], 0, min_chunk=0)
    with pytest.raises(ValueError, match="min_chunk"):
        StepClaims(dist.HashStore(), "k", [3, 3], 0, min_chunk=8, max_chunk=4)


def test_balanced_claims_meet_at_the_planned_boundaries() -> None:
    """Equal pace per planned sample (round robin weighted by plan) -> the planned split."""
    counts = [300, 60, 152]
    store = dist.HashStore()
    claims = [StepClaims(store, "0", counts, r) for r in range(3)]
    # each rank claims in turn; chunks are proportional to plans, so progress is too
    active = [True] * 3
    while any(active):
        for r in range(3):
            if active[r] and claims[r].next() is None:
                active[r] = False
    for r in range(3):
        assert abs(claims[r].count - counts[r]) <= 0.1 * counts[r] + 2, [c.count for c in claims]


def test_sides_and_start_points() -> None:
    assert start_points([4, 6, 2]) == (0, 7, 12)
    left, right = sides_of([4, 6, 2], 1)
    assert (left.gap, left.start, left.size, left.rightwards, left.planned) == (0, 0, 7, False, 3)
    assert (right.gap, right.start, right.size, right.rightwards, right.planned) == (1, 7, 5, True, 3)
    assert [s.gap for s in sides_of([4, 6, 2], 0)] == [0]
    assert [s.gap for s in sides_of([4, 6, 2], 2)] == [1]
    with pytest.raises(ValueError):
        start_points([5])
    with pytest.raises(ValueError):
        StepClaims(dist.HashStore(), "k", [3, 3], 0, first_fraction=0.0)


def test_empty_planned_slice_claims_nothing_and_forget_step_removes_counters() -> None:
    store = dist.HashStore()
    assert StepClaims(store, "3", [0, 10], 0).next() is None
    c = StepClaims(store, "3", [5, 5], 0)
    assert c.next() is not None
    assert store.check(["3/0"])
    forget_step(store, "3", 1)
    assert not store.check(["3/0"])


# -- end to end: stolen work still gives the single-process step ---------------------------
def _params_after(rank: int, world: int, cfg: TrainingConfig) -> dict:
    tr = RankTrainer(cfg)
    steps = []
    tr.on_step = steps.append
    tr.run()
    flat = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    return {"params": flat.numpy().copy(), "batches": [s.local_batch for s in steps]}


def test_stolen_steps_equal_single_process_steps() -> None:
    base = {"epochs": 1, "global_batch": 256, "seed": 5, "lr": 0.05, "image_size": 8,
            "max_steps": 3, "evaluate_every_epoch": False}
    single = run_local(_params_after, 1, TrainingConfig(**base), timeout_s=60)[0]
    # rank 1 emulates a device 4x slower; shares start equal and rebalance only after 5
    # steps, so every rank's planned slice is 128 and only stealing can move work
    cfg = TrainingConfig(**base, policy="adaptive", rebalance_every=5, work_stealing="on",
                         devices=("cpu:a", "cpu:b"), emulated_slowdown=(1.0, 4.0))
    assert cfg.steals
    multi = run_local(_params_after, 2, cfg, timeout_s=60)
    assert np.array_equal(multi[0]["params"], multi[1]["params"])
    assert np.max(np.abs(multi[0]["params"] - single["params"])) < 1e-6
    for b0, b1 in zip(multi[0]["batches"], multi[1]["batches"]):
        assert b0 + b1 == 256
    # the fast rank took samples planned for the slow one (the first step is left out: its
    # lazy initialisation can make either rank the slow one)
    assert all(b0 > 128 for b0 in multi[0]["batches"][1:])
