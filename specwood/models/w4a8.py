"""The q4 weight mode: 4-bit weights (GGUF Q4_K layout, exact) x int8 activations on our own kernel.

A Q4_K_M file stores most of its linears as Q4_K: per group of 32 inputs a scale and a minimum,
w = scale * q - min with q in 0..15. `Q4Linear` keeps exactly that (scales and minimums rounded
to fp16), so a target read from the GGUF runs on the weights llama.cpp runs, at 5 bits a weight
instead of int8's 8. torch 2.13 has no kernel that reads 4-bit weights at this CPU's bandwidth
(BENCHMARKS.md §7k, §7l), so the multiply is `kernels/q4_vnni.cpp` (AVX512-VNNI), compiled on first
use with torch's cpp_extension and cached. Machines without AVX512-VNNI or a C++ compiler get a
one-line error naming the alternative (--dtype int8).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specwood.errors import SpecwoodError
from specwood.models.kernels import AVX512_FLAGS, CpuKernel

GROUP = 32
LANES = 16  # output channels interleaved in one 512-bit register
BLOCK = 32  # output channels per block of the packed layout (two registers)
KERNEL_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-fopenmp"]
KERNEL = CpuKernel("specwood_q4_vnni", "q4_vnni.cpp", KERNEL_CFLAGS, AVX512_FLAGS + ("avx512_vnni", "f16c"),
                   "the q4 weight mode")


def q4_unavailable_reason() -> str | None:
    """Why the q4 kernel cannot run here (None: it can). Compiles it on first call."""
    KERNEL.load()
    return None if KERNEL.failure is None else f"{KERNEL.failure}; use --dtype int8"


def q4_available() -> bool:
    return q4_unavailable_reason() is None


def require_q4() -> Any:
    kernel = KERNEL.load()
    if kernel is None:
        raise SpecwoodError(q4_unavailable_reason() or "the q4 kernel is unavailable; use --dtype int8")
    return kernel


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (codes uint8 [N, K] in 0..15, scales [N, K/32], minimums [N, K/32]):
    w ~ scale * q - min per group of 32 inputs, the group's range split in 15 steps (scale and
    minimum rounded to fp16 first, so the codes fit the stored values)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    mins = (-lo).half().float()
    q = torch.round((g + mins[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, mins


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, minimums) -> the kernel's layout: for each block of 32 output channels and
    group of 32 inputs, 512 bytes: two halves of 16 channels, each 4 chunks of 64 bytes; in chunk
    c, channel n's bytes 4n..4n+3 hold inputs 8c..8c+3 in their low nibbles and 8c+4..8c+7 in
    their high ones. Scales and minimums as fp16 [N/32, K/32, 32]."""
    n, k = codes.shape
    b, g = n // BLOCK, k // GROUP
    v = codes.reshape(b, 2, LANES, g, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)  # block, group, half, chunk, channel, j, low/high
    packed = (v[..., 0] | (v[..., 1] << 4)).contiguous().reshape(b, g, 512)

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, BLOCK, g).permute(0, 2, 1).contiguous().half()

    return packed, lanes(scales), lanes(mins)


class Q4Linear(nn.Module):
    """W4A8 Linear on the q4 kernel: 4-bit weights per group of 32 (scale and minimum, GGUF Q4_K's
    layout) times per-row int8 activations; fp32 accumulation, output in the input's dtype.

    Lossy against float weights (exact against a Q4_K tensor up to fp16 scales, plus the int8
    activations), but row-exact like Int8Linear: each row's output is computed by the same
    operations whatever the other rows are, so a tree verified in one forward gives each node what
    a one-token forward along its path gives. Needs N % 32 == 0 and K % 32 == 0."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.kernel = require_q4()
        self.out_features, self.in_features = codes.shape
        packed, s, m = pack_q4(codes, scales, mins)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", s, persistent=False)
        self.register_buffer("mins", m, persistent=False)
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else torch.empty(0),
                             persistent=False)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % BLOCK == 0 and in_features % GROUP == 0

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Q4Linear:
        w = linear.weight.data if isinstance(linear.weight, torch.Tensor) else linear.weight
        return cls(*quantize_q4(w), getattr(linear, "bias", None))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight [N, K] (fp32, a fresh copy), e.g. for a reference model."""
        b, g, _ = self.packed.shape
        nib = torch.stack([self.packed & 0x0F, self.packed >> 4], -1).reshape(b, g, 2, 4, LANES, 4, 2)
        codes = nib.permute(0, 2, 4, 1, 3, 6, 5).reshape(self.out_features, g, GROUP).float()
        s = self.scales.float().permute(0, 2, 1).reshape(self.out_features, g, 1)
        m = self.mins.float().permute(0, 2, 1).reshape(self.out_features, g, 1)
        return (codes * s - m).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = self.kernel.q4_linear(flat, self.packed, self.scales, self.mins, self.bias)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


class Q4Embedding(nn.Module):
    """A token embedding kept as 4-bit codes with a scale and a minimum per group of 32 (a GGUF's
    Q4_K `token_embd`, exactly): a step looks up a few rows and dequantises only those. A third
    of the bf16 table's memory (151,936 x 1,536 for the default target: 146 against 467 MB)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("packed", codes[:, 0::2] | (codes[:, 1::2] << 4), persistent=False)
        self.register_buffer("scales", scales.half(), persistent=False)
        self.register_buffer("mins", mins.half(), persistent=False)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.packed[ids]
        codes = torch.stack([packed & 0x0F, packed >> 4], -1).reshape(*ids.shape, -1, GROUP).float()
        out = codes * self.scales[ids].float()[..., None] - self.mins[ids].float()[..., None]
        return out.reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised table (fp32, a fresh copy)."""
        return self._rows(torch.arange(self.num_embeddings, device=self.packed.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(ids).to(self.dtype)
