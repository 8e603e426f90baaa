"""Which CPU cores a local rank runs on: ranks of one host on cores of their own.

Ranks of one host that compute on the CPU (or feed an accelerator from it) share its cores.
Left to the scheduler, a rank's compute thread migrates between cores and meets its
neighbour's helper threads (gloo's, the rendezvous store's, the heartbeat's) on the same
core; every such collision delays that rank's step, and in synchronous training the others
wait for the slowest. On this 2-core machine, two ranks pinned to a core each waited less
for each other than unpinned ones (the equal-speed run's efficiency 0.93 unpinned, 0.98
pinned, medians of three runs each; ``docs/training.md``). So a rank takes ``threads`` cores
of the ones this process may use, in local-rank order, when there are enough for every local
rank; otherwise none (pinning several ranks onto one core would only make them queue).
``KAITIAN_PIN_CORES=0`` leaves ranks unpinned.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def rank_cores(allowed: Sequence[int], local_rank: int, local_world: int, threads: int = 1) -> tuple[int, ...]:
    """The cores of ``local_rank`` among ``local_world`` ranks of ``threads`` threads each, out
    of ``allowed`` (taken in ascending order); empty when the cores do not go round (the rank then stays
    unpinned)."""
    if not 0 <= local_rank < local_world or threads < 1:
        raise ValueError(f"local rank {local_rank} of {local_world} with {threads} thread(s)")
    cores = sorted(allowed)
    if len(cores) < local_world * threads:
        return ()
    return tuple(cores[local_rank * threads:(local_rank + 1) * threads])


def pin_local_rank(local_rank: int, local_world: int, threads: int = 1) -> tuple[int, ...]:
    """Pin this process to its cores (`rank_cores` of the cores it may use now); returns them,
    empty where it stays unpinned (too few cores, no affinity control on this OS, or
    ``KAITIAN_PIN_CORES=0``)."""
    if not hasattr(os, "sched_setaffinity") or os.environ.get("KAITIAN_PIN_CORES", "1") == "0":
        return ()
    global _pinned
    cores = rank_cores(tuple(os.sched_getaffinity(0)), local_rank, local_world, threads)
    if cores:
        os.sched_setaffinity(0, cores)
        _pinned = cores
    return cores


_pinned: tuple[int, ...] = ()


def pinned_cores() -> tuple[int, ...]:
    """The cores ``pin_local_rank`` gave this process (its own), empty if it did not pin it."""
    return _pinned
