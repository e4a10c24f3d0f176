"""The process heap of a long-lived server: what glibc keeps and hands back, and which objects
Python's garbage collector walks (`freeze_loaded_objects`).

A step's forward allocates the same large buffers every time (the MLP's gate and up rows of a
prefill chunk: ~40 MB a layer for 570 tokens). glibc serves a request that large from a free
chunk of the heap when one fits, else maps fresh pages, which the kernel zeroes on first touch
and takes back on free: a page fault per 4 KiB, every layer, every step. A fresh process has
room left in its heap from loading; once the prefix cache's entries (tens of MB each) fill it,
every large buffer is mapped anew. Measured on a 2-core Zen 5, 8 prompts of 2.3k-5.8k tokens
at once, the 38 prefill-only steps: 0.85M minor faults and 1.2 s of system time in a fresh
server, 10.5M and 20 s once the prefix cache held the previous wave (60.8 -> 71.7 s).
`keep_freed_memory` has glibc keep what the process frees for its next buffers instead
(0.43M faults, 60.8 s, with the prefix cache full); raising the mmap threshold alone (32 MB at
most) leaves the 40 MB buffers mapped, and a trim threshold alone is worse (29M faults: setting
it turns off glibc's self-raising mmap threshold). BENCHMARKS.md §36.

Elsewhere (musl, macOS, Windows) the two glibc functions do nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_TOP_BYTES = (1 << 31) - 1  # mallopt takes an int: free memory at the heap's top above 2 GiB goes back
OPT_OUT_ENV = "SPECWOOD_SYSTEM_MALLOC"  # set to 1: leave glibc's defaults alone


@functools.cache
def _glibc() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to call
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere):
    loading frees float copies of every weight (GBs for the default pair), and a large prompt's
    tokenizer buffers, that would otherwise stay in the process's RSS."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """From now on, serve every allocation from the heap (no fresh mappings) and keep what is
    freed for reuse, up to 2 GiB free at the heap's top (module docstring). For a process that
    runs steps for a long time (a server, a benchmark); the price is an RSS that stays at its
    peak instead of shrinking between bursts (`release_freed_memory` still hands the free pages
    back when called). Returns whether glibc took it; `SPECWOOD_SYSTEM_MALLOC=1` opts out."""
    libc = _glibc()
    if libc is None or os.environ.get(OPT_OUT_ENV, "") not in ("", "0"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_TOP_BYTES))


def freeze_loaded_objects() -> int:
    """Move every object alive now (modules, the loaded models' Python objects, the tokenizer)
    out of the cyclic garbage collector's reach, for a process about to run steps for a long
    time: a full collection walks every tracked object, ~180 ms over the ~350k a process with the
    default pair loaded holds (2-core Zen 5), and Python runs one whenever enough new objects
    have survived -- a pause inside some step, which never frees any of those. Garbage made
    before the call is collected first; what dies later is freed by reference counting as ever
    (only reference cycles among the frozen objects would stay). Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
