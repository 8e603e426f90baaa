"""kaitian_ros.heap: freed heap goes back to the OS when a node trims after a burst.

Runs in a fresh interpreter: the burst is 3000 blocks of 100 KB (heap-allocated, below glibc's
mmap threshold) of which every tenth stays alive, so the freed ~270 MB lie between live blocks,
where glibc never returns them on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kaitian_ros import heap

BURST = r"""
import json
from kaitian_ros import heap
blocks = [bytearray(100 * 1024) for _ in range(3000)]
kept = blocks[::10]
before = heap.rss_bytes()
del blocks
freed = heap.rss_bytes()
trimmed = heap.trim_heap()
after = heap.rss_bytes()
print(json.dumps({"before": before, "freed": freed, "after": after, "trimmed": trimmed, "kept": len(kept)}))
"""


def test_rss_of_this_process_is_read():
    assert heap.rss_bytes() > 10 * 1024 * 1024
    assert heap.rss_bytes(2**22 + 12345) == 0  # no such process: 0, no exception


@pytest.mark.e2e
def test_trim_after_a_burst_returns_the_freed_heap():
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    mb = 1024 * 1024
    assert r["before"] - r["freed"] < 50 * mb, r  # freeing alone gives (almost) nothing back
    assert r["trimmed"] is True
    assert r["freed"] - r["after"] > 200 * mb, r  # the trim does


ALLOCATE = r"""
import json, resource
import numpy as np
from kaitian_ros import heap
tuned = heap.tune_allocator()
np.ones(10 * 1024 * 1024, dtype=np.float32).sum()  # 40 MiB: above glibc's largest dynamic threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    np.ones(10 * 1024 * 1024, dtype=np.float32).sum()  # allocated, every page written, freed
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@pytest.mark.e2e
def test_tuned_allocator_keeps_large_buffers_in_the_heap():
    """A 40 MiB buffer allocated, written and freed 20 times: glibc's default maps and unmaps it
    every time (page faults for the pages written each time); tuned, the pages stay in the heap."""
    import os

    runs = {}
    for tune in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env["KAITIAN_MALLOC_TUNE"] = tune
        out = subprocess.run([sys.executable, "-c", ALLOCATE], capture_output=True, text=True,
                             timeout=120, check=True, env=env)
        runs[tune] = json.loads(out.stdout)
    assert runs["0"]["tuned"] is False and runs["1"]["tuned"] is True
    # at least one fault per 2 MiB written each time (transparent huge pages fault per 2 MiB)
    assert runs["0"]["faults"] >= 20 * 20, runs
    assert runs["1"]["faults"] * 10 < runs["0"]["faults"], runs
