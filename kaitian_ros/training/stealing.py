"""Work stealing inside one training step: slice boundaries move to whoever finishes first.

The sampler's shares come from past steps; on a shared machine one step's compute time
still swings by +-30 %, and the fast rank then waits for the slow one at the all-reduce
(``docs/training.md``). Here the planned contiguous slices only fix where each
rank *starts*; the boundaries between neighbours are settled at run time:

* rank 0 starts at the batch's first sample and claims to the right, rank N-1 starts at
  its end and claims to the left, a middle rank starts in the middle of its planned slice
  and claims in both directions. The samples between two neighbours' start points form a
  *gap* that only those two claim from, from opposite ends.
* one counter per gap in the rendezvous store (``Store.add`` is atomic) holds how many of
  its samples have been claimed, by either side; a claim that would pass the gap's size
  is cut to what is left. So every sample of the batch is computed exactly once, and each
  rank's samples stay one contiguous range, in rank order -- the split is still a
  contiguous split, only its counts are decided late.
* claims shrink geometrically (half of a rank's plan in its first claim, then a fraction of
  what is left, down to ``min_fraction`` of its plan): few claims when the plan is right,
  fine-grained ones where the boundary is actually decided.

Exactness does not depend on who computed what: every rank scales its summed per-sample
gradient by ``1 / B`` (``training.trainer``), so the reduced gradient is the mean over the
global batch whatever the final counts are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CounterStore(Protocol):
    """The part of ``torch.distributed.Store`` a claim needs (atomic add, key removal)."""

    def add(self, key: str, value: int) -> int: ...

    def delete_key(self, key: str) -> bool: ...


def start_points(counts: Sequence[int]) -> tuple[int, ...]:
    """Where each rank starts claiming inside a batch split into ``counts`` (rank order).

    Rank 0 at 0, rank N-1 at the batch's end, a middle rank in the middle of its slice.
    """
    if len(counts) < 2:
        raise ValueError("work stealing needs at least two ranks")
    if any(c < 0 for c in counts):
        raise ValueError(f"negative slice size in {list(counts)}")
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + int(c))
    middle = [offsets[r] + int(counts[r]) // 2 for r in range(1, len(counts) - 1)]
    return (0, *middle, offsets[-1])


@dataclass(frozen=True)
class Side:
    """One direction a rank claims in: the gap it eats into and its planned part of it."""

    gap: int  # gap g lies between ranks g and g+1
    start: int  # first position of the gap (batch coordinates)
    size: int  # samples in the gap
    rightwards: bool  # True: this rank is the gap's left neighbour, claims from ``start`` on
    planned: int  # samples of this rank's planned slice inside the gap


def sides_of(counts: Sequence[int], rank: int) -> tuple[Side, ...]:
    """The gaps ``rank`` claims from: left gap first, then right gap (absent at the ends)."""
    if not 0 <= rank < len(counts):
        raise ValueError(f"rank {rank} outside {len(counts)} ranks")
    starts = start_points(counts)
    end_of_slice = sum(int(c) for c in counts[:rank + 1])
    out = []
    if rank > 0:  # gap between rank-1 and rank; this rank claims leftwards from its start
        lo, hi = starts[rank - 1], starts[rank]
        out.append(Side(gap=rank - 1, start=lo, size=hi - lo, rightwards=False,
                        planned=starts[rank] - (end_of_slice - int(counts[rank]))))
    if rank < len(counts) - 1:
        lo, hi = starts[rank], starts[rank + 1]
        out.append(Side(gap=rank, start=lo, size=hi - lo, rightwards=True,
                        planned=end_of_slice - starts[rank]))
    return tuple(out)


class StepClaims:
    """One rank's claims in one step; ``next()`` returns ``(start, stop)`` or None when done.

    ``store`` is shared by all ranks (the rendezvous store); ``key`` must be unique for the
    step (the global step number) and identical on every rank. A rank whose planned slice is
    empty claims nothing: the sampler left it out because its fixed cost alone exceeds a
    balanced step, and stealing a few samples would only delay the all-reduce.
    """

    def __init__(self, store: CounterStore, key: str, counts: Sequence[int], rank: int, *,
                 first_fraction: float = 0.5, min_fraction: float = 0.02, min_chunk: int = 1,
                 max_chunk: int = 0) -> None:
        """``min_chunk``/``max_chunk`` (samples; 0 = no cap) bound every claim besides the
        fractions: a claim is one forward/backward pass, and a pass of a few samples costs
        far more per sample than one of the device's best pass size (``micro_batch``)."""
        if not 0 < first_fraction <= 1 or not 0 < min_fraction <= 1:
            raise ValueError("first_fraction and min_fraction must be in (0, 1]")
        if min_chunk < 1 or max_chunk < 0 or (max_chunk and max_chunk < min_chunk):
            raise ValueError(f"need 1 <= min_chunk <= max_chunk (or max_chunk 0), got {min_chunk}, {max_chunk}")
        self.store, self.key = store, key
        self.first_fraction = first_fraction
        planned = int(counts[rank])
        self.sides = sides_of(counts, rank) if planned > 0 else ()
        self.min_chunk = max(min_chunk, math.ceil(min_fraction * planned))
        self.max_chunk = max(max_chunk, self.min_chunk) if max_chunk else 0
        self.taken = [0] * len(self.sides)  # samples this rank claimed on each side
        self.seen = [0] * len(self.sides)  # the gap's claimed total at this rank's last claim
        self.done = [s.size == 0 for s in self.sides]

    def _chunk(self, i: int) -> int:
        side = self.sides[i]
        frac = max(side.planned, 0) / side.size  # open sides are never empty
        left = side.size - self.seen[i]
        want = max(self.min_chunk, math.ceil(self.first_fraction * frac * left))
        return min(want, self.max_chunk) if self.max_chunk else want

    def _pick_side(self) -> int | None:
        open_ = [i for i in range(len(self.sides)) if not self.done[i]]
        if not open_:
            return None
        # a middle rank alternates so that both its boundaries move at the planned pace
        return min(open_, key=lambda i: (self.taken[i] / max(self.sides[i].planned, 1), -i))

    def next(self) -> tuple[int, int] | None:
        while True:
            i = self._pick_side()
            if i is None:
                return None
            side, want = self.sides[i], self._chunk(i)
            total = int(self.store.add(f"{self.key}/{side.gap}", want))
            before = total - want
            self.seen[i] = min(total, side.size)
            got = min(want, side.size - before)
            if got <= 0:
                self.done[i] = True
                continue
            if total >= side.size:
                self.done[i] = True
            if side.rightwards:
                lo = side.start + self.taken[i]
                rng = (lo, lo + got)
            else:
                hi = side.start + side.size - self.taken[i]
                rng = (hi - got, hi)
            self.taken[i] += got
            return rng

    @property
    def range(self) -> tuple[int, int] | None:
        """This rank's claimed samples as one contiguous range (None before any claim)."""
        if not any(self.taken):
            return None
        lo = hi = None
        for side, n in zip(self.sides, self.taken):
            if side.rightwards:
                lo = side.start if lo is None else lo
                hi = side.start + n
            else:
                lo = side.start + side.size - n
                hi = side.start + side.size if hi is None else hi
        return (lo, hi)  # type: ignore[return-value]

    @property
    def count(self) -> int:
        return sum(self.taken)


def forget_step(store: CounterStore, key: str, gaps: int) -> None:
    """Remove a finished step's counters (call once every rank has left that step)."""
    for g in range(gaps):
        store.delete_key(f"{key}/{g}")  # False for a gap nobody claimed from: fine
