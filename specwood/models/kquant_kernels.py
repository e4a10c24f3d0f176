"""The k-quant linears' kernel builds: AVX512-VNNI (`kernels/kquants_vnni.cpp`, every call where the
CPU has it) and AMX tiles (`kernels/kquants_amx.cpp`, calls of many rows where specwood.models.amx
chose it), and the tile kernel over a C++ model of the tile unit (tests on CPUs without AMX)."""
from __future__ import annotations

from specwood.models.kernels import AVX512_FLAGS, CpuKernel

KERNEL_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-fopenmp"]
VNNI_KERNEL = CpuKernel("specwood_kquants_vnni", "kquants_vnni.cpp", KERNEL_CFLAGS, AVX512_FLAGS + ("avx512_vnni", "f16c"),
                        "the q4 weight mode")
AMX_FLAGS = ("amx_tile", "amx_int8")
AMX_KERNEL = CpuKernel("specwood_kquants_amx", "kquants_amx.cpp", KERNEL_CFLAGS + ["-mamx-tile", "-mamx-int8"],
                       VNNI_KERNEL.required + AMX_FLAGS, "the AMX path")
EMULATED_KERNEL = CpuKernel("specwood_kquants_amx_emulated", "kquants_amx.cpp",
                            KERNEL_CFLAGS + ["-DSPECWOOD_TILE_EMULATION"], VNNI_KERNEL.required,
                            "the emulated AMX path")
