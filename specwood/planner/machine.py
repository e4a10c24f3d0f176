"""What a measured plan knows of where it was measured: the machine and our build (a plan from
another CPU or other kernels is not used), and how busy the machine was (a plan measured beside
other work is not stored).

A plan's timings hold only for the CPU model, the instruction sets it exposes (a VM may hide
AVX512 on the same model) and the kernels that ran: `machine_record` is stored with each plan and
`machine_change` says what differs at load. Other processes' CPU use is read from /proc/stat
while we sleep, at the start and the end of a measurement (`LoadWatch`): busy when they used more
than `busy_cores()` cores.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from pathlib import Path

BUSY_CORES_ENV = "SPECWOOD_PLAN_BUSY_CORES"  # others' cores above which a measurement is busy ("inf": never)
WINDOW_S = 0.5  # each sample of the others' CPU use
# the instruction sets timings depend on (the rest of /proc/cpuinfo's flags vary with microcode and hypervisor)
_ISA = re.compile(r"^(sse\d.*|ssse3|avx.*|fma|f16c|amx.*|bmi\d|vnni.*|asimd.*|sve.*|neon|fp16|bf16|i8mm|dotprod)$")


@functools.cache
def machine_record() -> dict[str, str]:
    """This machine and build, as a plan stores it: the CPU model, its instruction sets that
    timings depend on, a digest of our kernels (`kernel_sources`), torch's and specwood's versions."""
    import torch

    from specwood.models.kernels import cpu_flags, cpu_model
    from specwood.version import __version__

    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(path.name.encode() + path.read_bytes())
    return {"cpu": cpu_model() or "unknown",
            "isa": " ".join(sorted(f for f in cpu_flags() if _ISA.match(f))),
            "kernels": f"{digest.hexdigest()[:12]} torch {torch.__version__} specwood {__version__}"}


# the Python modules that choose which kernel runs a layer (e.g. linears.py sends large fp32 linears
# to oneDNN): a change there changes the timings as much as a change in the C++ sources
KERNEL_CHOICES = ("linears.py", "layer_ops.py", "kquant_kernels.py", "w4a8.py", "amx.py")


def kernel_sources() -> list[Path]:
    """The files whose digest `machine_record` stores: our C++ kernels' sources and headers, and
    the modules of KERNEL_CHOICES."""
    models = Path(__file__).resolve().parent.parent / "models"
    return sorted((models / "kernels").glob("*.[ch]*")) + [models / name for name in KERNEL_CHOICES]


def machine_change(recorded: dict[str, str]) -> str | None:
    """What differs between the machine and build a plan was measured on and this one (None:
    nothing); a plan that does not say is from before plans said."""
    if not recorded:
        return "it does not say which CPU and kernels it was measured with"
    now = machine_record()
    if recorded.get("cpu") != now["cpu"]:
        return f"it was measured on another CPU ({recorded.get('cpu')!r}, this one is {now['cpu']!r})"
    if recorded.get("isa") != now["isa"]:
        then, here = set(str(recorded.get("isa", "")).split()), set(now["isa"].split())
        differ = [f"{f} {'missing' if f in then else 'added'} here" for f in sorted(then ^ here)]
        return f"it was measured on a CPU with other instruction sets ({', '.join(differ[:4])})"
    if recorded.get("kernels") != now["kernels"]:
        return f"it was measured with other kernels ({recorded.get('kernels')}, now {now['kernels']})"
    return None


def busy_cores() -> float:
    """Others' CPU use (in cores) above which a measurement counts as busy: a quarter of the
    machine, at least half a core ($SPECWOOD_PLAN_BUSY_CORES overrides; "inf" never)."""
    given = os.environ.get(BUSY_CORES_ENV)
    if given:
        return float(given)
    return max(0.5, 0.25 * (os.cpu_count() or 1))


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every CPU since boot (None without /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def others_cores(window_s: float = WINDOW_S) -> float | None:
    """The cores other processes kept busy over `window_s` seconds while this one slept (a VM's
    stolen time included); None where /proc/stat cannot tell."""
    before, own = _cpu_times(), time.process_time()
    time.sleep(window_s)
    after, own = _cpu_times(), time.process_time() - own
    if before is None or after is None or after[1] <= before[1]:
        return None
    cores = os.cpu_count() or 1
    busy_s = (after[0] - before[0]) / (after[1] - before[1]) * cores * window_s
    return max(0.0, (busy_s - own) / window_s)


class LoadWatch:
    """Others' CPU use at the start of a measurement (made at construction) and at its end
    (`finish`); `busy` of what it returns says why the measurement is not to be stored.
    Nothing is sampled where busy_cores() is "inf"."""

    def __init__(self) -> None:
        from specwood.planner.pauses import undisturbed

        self.limit = busy_cores()
        self._sample = lambda: undisturbed(others_cores)  # a pause of ours (a server's work) is taken again
        self.start = self._sample() if self.limit != float("inf") else None
        self.end: float | None = None

    def finish(self) -> dict[str, float]:
        """The end's sample; both, as a plan stores them (empty where nothing was sampled)."""
        if self.limit != float("inf"):
            self.end = self._sample()
        return {k: round(v, 3) for k, v in (("start", self.start), ("end", self.end)) if v is not None}


def busy(load: dict[str, float], limit: float | None = None) -> str | None:
    """Why a measurement with these samples of others' CPU use (LoadWatch.finish) is not to be
    stored, or None."""
    limit = busy_cores() if limit is None else limit
    over = [f"{v:.2f} at its {k}" for k, v in load.items() if v > limit]
    if not over:
        return None
    return (f"other processes kept {' and '.join(over)} of the {os.cpu_count() or 1} cores busy while it "
            f"measured (over {limit:g}), so its timings are partly theirs")
