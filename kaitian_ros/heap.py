"""The process's C heap (glibc malloc): keep large buffers in it, give it back after a burst.

Below every layer (standard library only): the runtime tunes it for message buffers, the
training ranks for activations, nodes trim it.

* ``tune_allocator``: glibc serves allocations above its mmap threshold with a fresh mmap and
  returns them with munmap, so every multi-MiB buffer freed and allocated again costs page
  faults and the kernel's zeroing of every page. A 4 MiB TensorChunk went through it several
  times per message (docs/transport.md); a training step's activations and gradients (several
  MiB per layer at 32x32) took 4 600-7 900 page faults per step, and the step 20-25 % longer
  with three times its spread (docs/training.md, "The process's heap").
* ``trim_heap``: glibc keeps freed memory in its arenas for reuse: after a flood of chunks
  (queued messages, forged requests' buffers) a node's resident size stays at its peak although
  Python and torch freed everything. ``malloc_trim`` returns the free pages. Nodes call it when
  a burst is over (a drained overflowing queue, evicted requests), not on every message: a trim
  walks every arena.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
_allocator_tuned = False
_libc: ctypes.CDLL | None = None
_unavailable = False


def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once; None where it is not there (musl, macOS)."""
    global _libc, _unavailable
    if _libc is None and not _unavailable:
        try:
            lib = ctypes.CDLL("libc.so.6")
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            lib.malloc_trim.restype = ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):
            _unavailable = True
    return _libc


def tune_allocator() -> bool:
    """Keep buffers up to 64 MiB in the heap instead of an mmap/munmap each (once per process).

    Freed memory up to 256 MiB then stays in the heap (``trim_heap`` returns it when a node
    wants). ``KAITIAN_MALLOC_TUNE=0`` turns it off; explicit ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` variables win. False where nothing was tuned (off, not glibc).
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if os.environ.get("KAITIAN_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None:  # not glibc (e.g. musl): nothing to tune
        return False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    _allocator_tuned = True
    return True


def trim_heap() -> bool:
    """Return free heap pages to the OS; False where that is not possible (not glibc)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


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
