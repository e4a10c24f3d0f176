"""The cmake flags that build llama.cpp for this CPU without `-DGGML_NATIVE=ON`.

A native build of the llama.cpp vendored in llama-cpp-python dies with a general-protection fault
on Intel Xeon VMs whose flags list AMX (its AMX kernels fault there as soon as a prompt is
evaluated); built with explicit AVX512 flags and AMX off it runs. So every build of ours names its
instruction sets: AVX2/FMA/F16C/BMI2 always (every x86-64 CPU this project runs on has them),
AVX512 with VNNI/BF16/VBMI where /proc/cpuinfo lists them, AVX-VNNI where only that exists, and
AMX never.

Standard library only, so the README's install command can run it before specwood is installed:

    CMAKE_ARGS="$(python3 specwood/bench/llama_cpu_flags.py)" pip install -e '.[llamacpp]'
"""
from __future__ import annotations

import platform
import sys
from pathlib import Path

# our cpuinfo flag -> the cmake options it turns on (in order); AVX512 needs the F/BW/DQ/VL set
_AVX512_BASE = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_AVX512_EXTRAS = (("avx512_vnni", "-DGGML_AVX512_VNNI=ON"), ("avx512_bf16", "-DGGML_AVX512_BF16=ON"),
                  ("avx512vbmi", "-DGGML_AVX512_VBMI=ON"))
_BASE = ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
         "-DGGML_F16C=ON", "-DGGML_BMI2=ON")
_AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's flags from /proc/cpuinfo (or the text given); empty when unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_flags(flags: set[str] | None = None, machine: str | None = None) -> list[str]:
    """Explicit instruction-set flags for this CPU (see the module docstring). Off x86-64 the
    compiler's defaults are kept (GGML_NATIVE=OFF only)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return ["-DGGML_NATIVE=OFF"]
    flags = cpu_flags() if flags is None else flags
    out = list(_BASE)
    if all(f in flags for f in _AVX512_BASE):
        out.append("-DGGML_AVX512=ON")
        out += [opt for flag, opt in _AVX512_EXTRAS if flag in flags]
    elif "avx_vnni" in flags:
        out.append("-DGGML_AVX_VNNI=ON")
    return out + list(_AMX_OFF)


if __name__ == "__main__":
    print(" ".join(cmake_flags()))
    sys.exit(0)
