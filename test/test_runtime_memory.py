"""runtime.memory: freed heap goes back to the OS when a node trims after a burst.

Runs in a fresh interpreter: the burst is 3000 blocks of 100 KB (heap-allocated, below glibc's
mmap threshold) of which every tenth stays alive, so the freed ~270 MB lie between live blocks,
where glibc never returns them on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kaitian_ros.runtime import memory

BURST = r"""
import json
from kaitian_ros.runtime import memory
blocks = [bytearray(100 * 1024) for _ in range(3000)]
kept = blocks[::10]
before = memory.rss_bytes()
del blocks
freed = memory.rss_bytes()
trimmed = memory.trim_heap()
after = memory.rss_bytes()
print(json.dumps({"before": before, "freed": freed, "after": after, "trimmed": trimmed, "kept": len(kept)}))
"""


def test_rss_of_this_process_is_read():
    assert memory.rss_bytes() > 10 * 1024 * 1024
    assert memory.rss_bytes(2**22 + 12345) == 0  # no such process: 0, no exception


@pytest.mark.e2e
def test_trim_after_a_burst_returns_the_freed_heap():
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    mb = 1024 * 1024
    assert r["before"] - r["freed"] < 50 * mb, r  # freeing alone gives (almost) nothing back
    assert r["trimmed"] is True
    assert r["freed"] - r["after"] > 200 * mb, r  # the trim does
