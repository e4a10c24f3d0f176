"""The AMX path of the k-quant linears (`kernels/kquants_amx.cpp`): chosen once per process, used
by every `KQuantLinear` call with at least `min_rows` rows (trees, batches, prefill); fewer rows
stay on the VNNI kernel, which reads the weights at the memory's speed already.

Choosing it takes three checks, so that a machine that lists AMX but cannot run it still works:
the CPU's flags (amx_tile, amx_int8), a probe in a child process (specwood.models.amx_probe: it
asks Linux for tile data, runs every type on the AMX kernel against the VNNI kernel for
bit-identical results, and times both to find from how many rows AMX pays; a fault or refusal
kills only the child), and this process's own request for tile data. The probe's verdict is kept
beside the kernel build, keyed by the CPU, the OS release and the build, so it runs once per
machine. One line names the path taken; on CPUs without AMX nothing changes and nothing is said.

SPECWOOD_AMX: `auto` (default), `off` (VNNI only), or `emulate` (the kernel over a C++ model of the
tile unit, for tests on CPUs without AMX); SPECWOOD_AMX_MIN_ROWS fixes the threshold.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from specwood.models.kernels import CpuKernel, cpu_flags, cpu_identity
from specwood.models.kquant_kernels import AMX_FLAGS, AMX_KERNEL, EMULATED_KERNEL, VNNI_KERNEL

DEFAULT_MIN_ROWS = 4  # where no timing decided it (emulation); the probe measures it on real AMX
PROBE_TIMEOUT_S = 300.0
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # the row counts the probe times
PROBING = "SPECWOOD_AMX_PROBING"  # set in the probe's child process
OPS = ("q4_linear", "q5_linear", "q6_linear", "q8_linear")


@dataclass(frozen=True)
class TilePath:
    """The kernel module that runs calls of at least `min_rows` rows, and its name for notices."""

    kernel: Any
    min_rows: int
    name: str


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    why: str = ""  # when not ok: one line
    min_rows: int | None = None  # when ok: from how many rows AMX is at least as fast (None: never)
    timings_ms: dict[str, list[float]] | None = None  # rows -> [vnni, amx]


_chosen: tuple[TilePath | None] | None = None


def tile_path() -> TilePath | None:
    """The AMX path for this process, or None (VNNI only). Decided once, with one line when the
    CPU lists AMX or SPECWOOD_AMX asks for something."""
    global _chosen
    if _chosen is None:
        path, notice = choose_tile_path(os.environ.get("SPECWOOD_AMX", "auto"))
        if notice:
            print(f"[load] {notice}", file=sys.stderr)
        _chosen = (path,)
    return _chosen[0]


def decided_tile_path() -> TilePath | None:
    """The path this process runs, if it has decided (linears were built), without deciding."""
    return _chosen[0] if _chosen is not None else None


def choose_tile_path(setting: str) -> tuple[TilePath | None, str | None]:
    """(the path, the line that says so); `setting` is SPECWOOD_AMX's value."""
    if os.environ.get(PROBING):
        return None, None  # inside the probe: its own linears stay on VNNI, no probe of the probe
    if setting not in ("auto", "off", "emulate"):
        return None, f"SPECWOOD_AMX={setting!r} is not one of auto, off, emulate; k-quant linears run on AVX512-VNNI"
    if setting == "off":
        return None, "k-quant linears: AVX512-VNNI (AMX turned off by SPECWOOD_AMX=off)"
    emulate = setting == "emulate"
    missing = [f for f in AMX_FLAGS if f not in cpu_flags()]
    if missing and not emulate:
        return None, None  # no AMX here: nothing changes, nothing to say
    kernel_spec = EMULATED_KERNEL if emulate else AMX_KERNEL
    kernel = kernel_spec.load()
    if kernel is None or VNNI_KERNEL.load() is None:
        return None, f"k-quant linears: AVX512-VNNI ({kernel_spec.failure or VNNI_KERNEL.failure})"
    probe = cached_probe(kernel_spec, emulate)
    if not probe.ok:
        return None, f"k-quant linears: AVX512-VNNI (the AMX probe failed: {probe.why})"
    refused = kernel.request_tile_permission()
    if refused:
        return None, f"k-quant linears: AVX512-VNNI (Linux refused AMX tile data: {os.strerror(refused)})"
    fixed = os.environ.get("SPECWOOD_AMX_MIN_ROWS")
    min_rows = int(fixed) if fixed else probe.min_rows if not emulate else DEFAULT_MIN_ROWS
    if min_rows is None:
        return None, "k-quant linears: AVX512-VNNI (AMX tiles were slower at every row count the probe timed)"
    name = "emulated AMX tiles (a test build, slow)" if emulate else "AMX int8 tiles"
    return TilePath(kernel, min_rows, name), f"k-quant linears: {name} from {min_rows} rows, AVX512-VNNI below"


def probe_cache_key(kernel_spec: CpuKernel) -> str:
    return hashlib.sha256(json.dumps([cpu_identity(), platform.release(), kernel_spec.build_dir().name]).encode()
                          ).hexdigest()[:12]


def cached_probe(kernel_spec: CpuKernel, emulate: bool) -> ProbeResult:
    """The probe's verdict for this CPU, OS release and build: from its file beside the build, or
    run now (in a child) and kept. A forced fault (SPECWOOD_AMX_PROBE_FAULT, for tests) is neither
    read from nor kept in the file."""
    forced = bool(os.environ.get("SPECWOOD_AMX_PROBE_FAULT"))
    record = kernel_spec.build_dir() / f"probe-{probe_cache_key(kernel_spec)}.json"
    if not forced and record.exists():
        try:
            return ProbeResult(**json.loads(record.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # a damaged record: probe again
    result = run_probe(emulate)
    if not forced:
        try:
            record.write_text(json.dumps(result.__dict__))
        except OSError:
            pass
    return result


def run_probe(emulate: bool, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Run the probe in a child process; whatever it dies of, this process lives."""
    command = [sys.executable, "-m", "specwood.models.amx_probe"] + (["--emulate"] if emulate else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, PROBING: "1"})
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"it did not finish in {timeout_s:.0f} s")
    if done.returncode < 0:
        return ProbeResult(False, f"the child died of {signal.Signals(-done.returncode).name} on a tile instruction")
    lines = done.stdout.strip().splitlines()
    try:
        return ProbeResult(**json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeResult(False, f"the child exited with {done.returncode}: {tail[:200]}")
