"""Giving a node's freed heap back to the operating system after a burst.

glibc keeps freed memory in its arenas for reuse: after a flood of chunks (queued messages,
forged requests' buffers) a node's resident size stays at its peak although Python and torch
freed everything. ``malloc_trim`` returns the free pages. Nodes call ``trim_heap`` when a burst
is over (a drained overflowing queue, evicted requests), not on every message: a trim walks
every arena.
"""

from __future__ import annotations

import ctypes
import os

_libc: ctypes.CDLL | None = None
_unavailable = False


def trim_heap() -> bool:
    """Return free heap pages to the OS; False where that is not possible (not glibc)."""
    global _libc, _unavailable
    if _unavailable:
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.malloc_trim.restype = ctypes.c_int
        except (OSError, AttributeError):  # musl, macOS: no malloc_trim
            _unavailable = True
            return False
    return bool(_libc.malloc_trim(0))


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default) from /proc; 0 if unreadable."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
