"""specwood.heap: with keep_freed_memory, a large buffer allocated and freed over and over reuses
the heap instead of faulting in fresh pages each time (what a server's steps do); the opt-out
leaves glibc alone; freeze_loaded_objects takes what is alive out of the garbage collector's passes.
Each case runs in a fresh interpreter: the settings are for the whole process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specwood.heap import OPT_OUT_ENV, _glibc

_LOOP = """
import ctypes, resource, sys, torch
from specwood.heap import keep_freed_memory
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages whatever the host's THP setting
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.empty(48 << 20, dtype=torch.uint8).fill_(1)  # the first one faults in either case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 48 MiB: above glibc's largest mmap threshold (32 MiB)
    torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})}, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt: Linux with glibc only (CI's machines have it)")
def test_kept_memory_is_reused_without_page_faults() -> None:
    kept, kept_faults = _faults("keep")
    _, default_faults = _faults("default")
    pages = 20 * (48 << 20) // 4096
    assert kept == "True"
    assert default_faults > pages // 2  # each buffer mapped afresh: a fault per 4 KiB page
    assert kept_faults < default_faults // 10, (kept_faults, default_faults)


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt: Linux with glibc only (CI's machines have it)")
def test_the_opt_out_leaves_glibc_alone() -> None:
    kept, faults = _faults("keep", {OPT_OUT_ENV: "1"})
    assert kept == "False"
    assert faults > 20 * (48 << 20) // 4096 // 2


_FREEZE = """
import gc, weakref
from specwood.heap import freeze_loaded_objects

class Node:
    pass

kept, lost = Node(), Node()
lost.me = lost  # a cycle that only the collector can free
gone = weakref.ref(lost)
del lost
gc.disable()  # no collection before the call: it must free the cycle itself
frozen = freeze_loaded_objects()
tracked = {id(o) for o in gc.get_objects()}
young = Node()
print(frozen, gone() is None, id(kept) in tracked, id(young) in {id(o) for o in gc.get_objects()})
"""


def test_loaded_objects_leave_the_collectors_passes() -> None:
    """freeze_loaded_objects collects first (garbage made before is freed, not frozen), then moves
    every live object out of the collector's generations; objects made after are tracked as ever."""
    out = subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    frozen, freed, kept_tracked, young_tracked = int(out[0]), out[1], out[2], out[3]
    assert frozen > 1000  # the interpreter's and specwood's imports
    assert freed == "True"
    assert kept_tracked == "False" and young_tracked == "True"
