"""Adaptive batch split for heterogeneous data-parallel training (DESIGN.md §6).

Every epoch has one deterministic permutation of the dataset, a pure function of
(seed, epoch), so every rank computes the same one without communication. It is cut into
consecutive global batches of ``global_batch`` samples (the last one may be short) and
each global batch into contiguous per-rank slices sized by the current shares. Hence every
sample is used exactly once per epoch whatever the shares are, and the union of the
slices of a step is the same batch a single process would train on.

Shares come from measured speed: every ``rebalance_every`` steps the ranks all-gather
their EWMA of compute seconds per sample and each computes the same new shares from the
same gathered vector with the pure :func:`shares_from_times` -- no coordinator.

Policies: ``equal`` (plain DDP split, never rebalanced), ``profile_once`` (rebalanced once
after the first ``rebalance_every`` steps, then frozen, like KAITIAN's profiling run) and
``adaptive`` (rebalanced every ``rebalance_every`` steps, follows drift).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

POLICIES = ("adaptive", "equal", "profile_once")


def shares_from_times(seconds_per_sample: Sequence[float]) -> tuple[float, ...]:
    """Shares proportional to speed (1 / seconds per sample), summing to 1.

    Ranks without a measurement (``nan``/``<= 0``, e.g. they had empty slices so far) get
    the mean speed of the measured ones, so they are probed rather than starved forever.
    """
    t = np.asarray(seconds_per_sample, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no ranks")
    ok = np.isfinite(t) & (t > 0)
    if not ok.any():
        return tuple([1.0 / t.size] * t.size)
    speed = np.zeros_like(t)
    speed[ok] = 1.0 / t[ok]
    speed[~ok] = speed[ok].mean()
    s = speed / speed.sum()
    return tuple(float(x) for x in s)


def split_counts(batch: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Integer slice sizes summing to ``batch``, proportional to ``shares``.

    Largest-remainder rounding: each rank gets ``floor(share * batch)`` plus at most one
    more, so a rank whose share is at least one sample never gets an empty slice; ties
    go to the lower rank so the result is deterministic.
    """
    if batch < 0:
        raise ValueError("negative batch")
    s = np.asarray(shares, dtype=np.float64)
    if s.size == 0 or (s < 0).any() or not np.isfinite(s).all() or s.sum() <= 0:
        raise ValueError(f"bad shares {list(shares)}")
    s = s / s.sum()
    exact = s * batch
    counts = np.floor(exact + 1e-9).astype(np.int64)  # 1e-9: 0.3*10 must floor to 3
    rest = batch - int(counts.sum())
    if rest > 0:
        frac = exact - counts
        order = sorted(range(s.size), key=lambda i: (-frac[i], i))
        for i in order[:rest]:
            counts[i] += 1
    elif rest < 0:  # only possible through the epsilon; take back from the largest
        order = sorted(range(s.size), key=lambda i: (-(counts[i] - exact[i]), i))
        for i in order[:-rest]:
            counts[i] -= 1
    return tuple(int(c) for c in counts)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The deterministic sample order of one epoch."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_samples)


@dataclass(frozen=True)
class StepSlice:
    """This rank's part of one global batch."""

    epoch: int
    step: int  # global step counter across epochs
    indices: tuple[int, ...]
    offset: int  # start of this rank's slice inside the global batch
    local_batch: int
    global_batch: int
    counts: tuple[int, ...]  # slice size of every rank


class AdaptiveBatchSampler:
    """Per-rank sampler; all ranks construct it with the same arguments except ``rank``.

    Drive it as: ``for sl in sampler.epoch(e): ...train...; sampler.record(compute_s,
    sl.local_batch)`` (optional: skip warm-up steps) ``; sampler.maybe_rebalance(gather)`` where ``gather(x)`` all-gathers one
    float from every rank (rank order). Shares may change between steps of an epoch; the
    iterator reads them lazily, and coverage stays exact because the permutation and the
    global batch boundaries do not depend on shares.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int,
                 *, seed: int = 0, policy: str = "adaptive", rebalance_every: int = 10,
                 ewma_alpha: float = 0.5, drop_last: bool = False,
                 initial_shares: Sequence[float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if global_batch <= 0 or num_samples <= 0 or rebalance_every <= 0:
            raise ValueError("num_samples, global_batch, rebalance_every must be positive")
        if not 0 < ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.policy = seed, policy
        self.rebalance_every, self.ewma_alpha = rebalance_every, ewma_alpha
        self.drop_last = drop_last
        self.shares: tuple[float, ...] = (
            tuple(initial_shares) if initial_shares is not None
            else tuple([1.0 / world_size] * world_size))
        if len(self.shares) != world_size:
            raise ValueError("initial_shares needs one share per rank")
        self.step = 0  # global steps taken (advanced by the iterator)
        self.rebalances = 0
        self._since_rebalance = 0
        self._ewma: float = math.nan  # compute seconds per sample on this rank

    # -- iteration -----------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def epoch(self, epoch: int, start_step_in_epoch: int = 0) -> Iterator[StepSlice]:
        perm = epoch_permutation(self.num_samples, self.seed, epoch)
        for k in range(start_step_in_epoch, self.steps_per_epoch()):
            batch = perm[k * self.global_batch:(k + 1) * self.global_batch]
            counts = split_counts(len(batch), self.shares)
            off = sum(counts[:self.rank])
            mine = batch[off:off + counts[self.rank]]
            sl = StepSlice(epoch=epoch, step=self.step, indices=tuple(int(i) for i in mine),
                           offset=off, local_batch=counts[self.rank],
                           global_batch=len(batch), counts=counts)
            self.step += 1
            yield sl

    # -- measurement and rebalancing ---------------------------------------------------
    def record(self, compute_seconds: float, local_batch: int,
               global_batch: int | None = None) -> None:
        """Feed this rank's compute time of one step (without time blocked in comm).

        Steps of a short global batch (end of epoch) are ignored when ``global_batch`` is
        given: with a per-step fixed cost their per-sample time is biased against slow
        devices, and the shares are for full batches anyway.
        """
        if global_batch is not None and global_batch < self.global_batch:
            return
        if local_batch <= 0 or compute_seconds <= 0:
            return  # no information about speed from an empty slice
        x = compute_seconds / local_batch
        a = self.ewma_alpha
        self._ewma = x if math.isnan(self._ewma) else a * x + (1 - a) * self._ewma

    @property
    def seconds_per_sample(self) -> float:
        return self._ewma

    def due(self) -> bool:
        """Whether this step is a rebalancing point (same answer on every rank)."""
        if self.policy == "equal" or self._since_rebalance < self.rebalance_every:
            return False
        return not (self.policy == "profile_once" and self.rebalances >= 1)

    def maybe_rebalance(self, gather: Callable[[float], Sequence[float]]) -> bool:
        """Count the step; collective when due: all ranks must call it after every step."""
        self._since_rebalance += 1
        if not self.due():
            return False
        times = list(gather(self._ewma))
        if len(times) != self.world_size:
            raise RuntimeError(f"gather returned {len(times)} values for {self.world_size} ranks")
        measured = [math.isfinite(t) and t > 0 for t in times]
        # Same gathered vector on every rank -> same decision everywhere. Without data
        # (warm-up, only short batches so far) keep the shares and don't spend the one
        # profile of profile_once on nothing.
        if not all(measured) if self.policy == "profile_once" else not any(measured):
            return False
        self.shares = shares_from_times(times)
        self.rebalances += 1
        self._since_rebalance = 0
        return True

    def reset_measurements(self) -> None:
        """Forget the speed estimate (e.g. after the device changed speed on purpose)."""
        self._ewma = math.nan

    def state_dict(self) -> dict:
        return {"shares": list(self.shares), "step": self.step, "rebalances": self.rebalances,
                "ewma": self._ewma}

    def load_state_dict(self, state: dict) -> None:
        self.shares = tuple(float(x) for x in state["shares"])
        self.step = int(state["step"])
        self.rebalances = int(state["rebalances"])
        self._ewma = float(state.get("ewma", math.nan))
        self._since_rebalance = 0
