"""Local ranks on cores of their own (``training.affinity``)."""

from __future__ import annotations

import os

import pytest

from kaitian_ros.training.affinity import pin_local_rank, rank_cores


def test_each_local_rank_gets_cores_of_its_own_when_they_go_round() -> None:
    assert rank_cores([3, 1], 0, 2) == (1,) and rank_cores([3, 1], 1, 2) == (3,)
    assert rank_cores(range(8), 1, 2, threads=3) == (3, 4, 5)
    assert rank_cores([0, 1], 1, 3) == ()  # three ranks, two cores: unpinned, not stacked
    assert rank_cores(range(4), 1, 2, threads=3) == ()
    with pytest.raises(ValueError, match="local rank 2 of 2"):
        rank_cores([0, 1], 2, 2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_a_rank_pins_itself_in_a_child_and_can_be_told_not_to() -> None:
    import multiprocessing as mp

    def child(env: str, q) -> None:  # type: ignore[no-untyped-def]
        os.environ["KAITIAN_PIN_CORES"] = env
        q.put((pin_local_rank(1, 2), sorted(os.sched_getaffinity(0))))

    allowed = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")
    for env, want in (("1", (allowed[1],)), ("0", ())):
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(env, q))
        p.start()
        got, now = q.get(timeout=30)
        p.join(timeout=10)
        assert got == want and now == (list(want) or allowed)
