"""The k-quant linears' kernel builds: AVX512-VNNI (`kernels/kquants_vnni.cpp`, every call where the
CPU has it), the same source on AVX2 + FMA + F16C where it has no AVX512 (`kernels/avx512_on_avx2.h`:
the same bits, at AVX2's speed), AMX tiles (`kernels/kquants_amx.cpp`, calls of many rows where
specwood.models.amx chose it), and the tile kernel over a C++ model of the tile unit (tests on CPUs
without AMX)."""
from __future__ import annotations

from specwood.models.kernels import AVX512_FLAGS, CpuKernel, build_for_this_cpu

KERNEL_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-fopenmp"]
VNNI_KERNEL = CpuKernel("specwood_kquants_vnni", "kquants_vnni.cpp", KERNEL_CFLAGS,
                        AVX512_FLAGS + ("avx512_vnni", "f16c"), "the q4 weight mode")
AMX_FLAGS = ("amx_tile", "amx_int8")
AMX_KERNEL = CpuKernel("specwood_kquants_amx", "kquants_amx.cpp", KERNEL_CFLAGS + ["-mamx-tile", "-mamx-int8"],
                       VNNI_KERNEL.required + AMX_FLAGS, "the AMX path")
EMULATED_KERNEL = CpuKernel("specwood_kquants_amx_emulated", "kquants_amx.cpp",
                            KERNEL_CFLAGS + ["-DSPECWOOD_TILE_EMULATION"], VNNI_KERNEL.required,
                            "the emulated AMX path")
AVX2_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DSPECWOOD_AVX2"]
AVX2_KERNEL = CpuKernel("specwood_kquants_avx2", "kquants_vnni.cpp", AVX2_CFLAGS, ("avx2", "fma", "f16c"),
                        "the q4 weight mode")
# the AVX2 build with the AVX512 build's loop for the integer dots, emulated (tests: the AVX2 dots'
# own loop must give its bits on any CPU with AVX2)
AVX2_EMULATED_DOTS_KERNEL = CpuKernel("specwood_kquants_avx2_emulated_dots", "kquants_vnni.cpp",
                                      AVX2_CFLAGS + ["-DSPECWOOD_EMULATED_DOTS"], AVX2_KERNEL.required,
                                      "the emulated AVX512 dots")


def kquant_kernel() -> CpuKernel:
    """The k-quant linears' build for this CPU: AVX512-VNNI where it has that, else AVX2's (whose
    missing flags, on a CPU with neither, are the least it would need)."""
    return build_for_this_cpu(VNNI_KERNEL, AVX2_KERNEL)
