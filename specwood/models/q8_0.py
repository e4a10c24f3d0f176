"""Q8_0 weights as the file stores them, on the k-quant kernel file (kernels/kquants_vnni.cpp).

Q8_0 keeps per group of 32 inputs an fp16 d and int8 codes: w = d * q. Q4_0 (w = d * (q - 8)) and
Q5_0 (w = d * (q - 16)) are such values too, so they are held as Q8_0 exactly: wider than the file
(8.5 bits a weight against 4.5 and 5.5) but never coarser (Q5_0 is most of the default draft's
file). Activations are int8 per 32 inputs as for the k-quants: each group's integer dot is exact."""
from __future__ import annotations

from typing import NamedTuple

import torch

from specwood.models.w4a8 import BLOCK, GROUP, LANES, KQuantLinear, from_lanes, from_stream, to_lanes, to_stream

GROUP_STRIDE = 2 * BLOCK + BLOCK * GROUP  # the 32 channels' d, then their codes + 128


class Q8Weights(NamedTuple):
    """8-bit weights [N, K] as GGUF's Q8_0 holds them: w = d * q (ggml's values bit for bit)."""

    codes: torch.Tensor  # int8 [N, K]
    group_scales: torch.Tensor  # fp16 [N, K/32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.codes.float().reshape(n, k // GROUP, GROUP)
        return (g * self.group_scales.float()[..., None]).reshape(n, k)

    @classmethod
    def cat(cls, parts: list[Q8Weights]) -> Q8Weights:
        return cls(*(torch.cat(field) for field in zip(*parts)))


def quantize_q8(w: torch.Tensor) -> Q8Weights:
    """Float weight [N, K] -> Q8Weights (Q8_0's form, for tests): d = max|w| / 127 per group."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half()
    q = torch.round(g / d.float().clamp(min=1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
    return Q8Weights(q.reshape(n, k), d)


def from_offset_codes(codes: torch.Tensor, offset: int, d: torch.Tensor) -> Q8Weights:
    """Q4_0 / Q5_0 values, d * (q - offset) with q unsigned [N, K], as the same Q8_0 values."""
    return Q8Weights((codes.to(torch.int16) - offset).to(torch.int8), d)


def pack_q8(w: Q8Weights) -> torch.Tensor:
    """Q8Weights -> the kernel's layout, uint8 [N/32, (K/32) * 1088]: per group the 32 channels' d
    (fp16), then two halves of 16 channels, each 8 chunks of 64 bytes; in chunk c, channel n's bytes
    4n..4n+3 hold inputs 4c..4c+3, as q + 128 (no superblocks: an empty header)."""
    n, k = w.codes.shape
    b, g = n // BLOCK, k // GROUP
    shifted = (w.codes.to(torch.int16) + 128).to(torch.uint8)
    codes = shifted.reshape(b, 2, LANES, g, 8, 4).permute(0, 3, 1, 4, 2, 5).reshape(b, g, 2 * GROUP * LANES)
    d = to_lanes(b, w.group_scales.half()).contiguous().view(torch.uint8)
    return to_stream(torch.empty(b, -(-g // 8), 0, dtype=torch.uint8), torch.cat([d, codes], -1))


def unpack_q8(packed: torch.Tensor, in_features: int) -> Q8Weights:
    """The inverse of pack_q8."""
    b, g = packed.shape[0], in_features // GROUP
    _, lines = from_stream(packed, g, 0, GROUP_STRIDE)
    d = lines[..., :2 * BLOCK].contiguous().view(torch.float16)
    shifted = (lines[..., 2 * BLOCK:].reshape(b, g, 2, 8, LANES, 4).permute(0, 2, 4, 1, 3, 5)
               .reshape(b * BLOCK, in_features))
    return Q8Weights((shifted.to(torch.int16) - 128).to(torch.int8), from_lanes(b, d))


class Q8Linear(KQuantLinear):
    """Q8_0 weights (Q8Weights: a file's Q8_0, Q4_0 or Q5_0 values) on the kernel; see KQuantLinear."""

    op = "q8_linear"
    pack = staticmethod(pack_q8)
    unpack = staticmethod(unpack_q8)
