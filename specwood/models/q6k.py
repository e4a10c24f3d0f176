"""Q6_K weights as the file stores them, on the same kernel as Q4_K (kernels/kquants_vnni.cpp).

A Q4_K_M file keeps some linears in Q6_K: per sub-block of 16 inputs an int8 scale code sc, per
superblock of 256 inputs an fp16 d, w = d * sc * (q - 32) with q in 0..63. `Q6Linear` runs them at
their 6.5625 bits a weight instead of requantising them to 4 bits (what `--dtype q4-lite` does):
the 4-bit copy costs fidelity that no speculation gives back (BENCHMARKS.md, fidelity)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from specwood.models.w4a8 import (BLOCK, GROUP, LANES, SUPER, KQuantLinear, from_lanes, from_stream, pack_nibbles,
                                  to_lanes, to_stream, unpack_nibbles)

SUB = 16  # inputs per scale code
HEADER_BYTES = 2 * BLOCK  # a superblock's d, fp16, per channel of a block
GROUP_STRIDE = 2 * BLOCK + BLOCK * GROUP // 2 + BLOCK * GROUP // 4  # scale codes, low nibbles, top two bits


class Q6Weights(NamedTuple):
    """6-bit weights [N, K] as GGUF's Q6_K holds them: w = d * sc * (q - 32). d * sc is exact in
    fp32, so `dequantize` gives ggml's values bit for bit."""

    codes: torch.Tensor  # uint8 [N, K], 0..63
    sub_scales: torch.Tensor  # int8 [N, K/16]
    super_scales: torch.Tensor  # fp16 [N, ceil(K/256)]

    def scales(self) -> torch.Tensor:
        """Each sub-block's scale d * sc, fp32 [N, K/16]."""
        per_sub = self.super_scales.float().repeat_interleave(2 * SUPER, 1)[:, :self.sub_scales.shape[1]]
        return per_sub * self.sub_scales.float()

    def dequantize(self) -> torch.Tensor:
        """The weights, fp32 [N, K] (as ggml computes them: (d * sc) * (q - 32))."""
        n, k = self.codes.shape
        q = self.codes.float().sub_(32).reshape(n, k // SUB, SUB)
        return (q * self.scales()[..., None]).reshape(n, k)

    @classmethod
    def cat(cls, parts: list[Q6Weights]) -> Q6Weights:
        """Several weights stacked along the output channels."""
        return cls(*(torch.cat(field) for field in zip(*parts)))


def quantize_q6(w: torch.Tensor) -> Q6Weights:
    """Float weight [N, K] -> Q6Weights (Q6_K's form; for tests and float checkpoints): per
    sub-block of 16 inputs a scale of at least max|w| / 31 as an int8 code of an fp16 factor per 256
    inputs, the codes rounded against the stored scales. The fp16 factor and the scale codes round
    up, not to nearest: a stored scale below max|w| / 31 would clamp the sub-block's largest weights
    by more than half a step (by several on a small sub-block, whose code is a few units)."""
    n, k = w.shape
    subs = w.float().reshape(n, k // SUB, SUB)
    wanted = subs.abs().amax(-1) / 31
    supers = -(-(k // SUB) // (2 * SUPER))
    padded = torch.nn.functional.pad(wanted, (0, supers * 2 * SUPER - k // SUB)).reshape(n, supers, 2 * SUPER)
    exact = padded.amax(-1) / 127
    d = exact.half()
    d = torch.where(d.float() < exact, torch.nextafter(d, torch.full_like(d, float("inf"))), d)
    per_sub = d.float().repeat_interleave(2 * SUPER, 1)[:, :k // SUB]
    codes = torch.where(per_sub > 0, torch.ceil(wanted / per_sub.clamp(min=1e-30)), torch.zeros_like(wanted))
    sc = codes.clamp_(-128, 127).to(torch.int8)
    scale = (sc.float() * per_sub).clamp(min=1e-30)[..., None]
    q = torch.round(subs / scale).clamp_(-32, 31).add_(32).to(torch.uint8).reshape(n, k)
    return Q6Weights(q, sc, d)


def pack_q6(w: Q6Weights) -> torch.Tensor:
    """Q6Weights -> the kernel's layout, uint8 [N/32, bytes of a block]: for each block of 32 output
    channels, per superblock a 64-byte header (d of the 32 channels, fp16), then per group of 32
    inputs an 832-byte line: the scale codes of its two sub-blocks (32 channels each), the low
    nibbles as pack_q4 lays them out (512 bytes), and the top two bits (256 bytes: per half of 16
    channels and sub-block s, channel n's bytes 4n..4n+3 hold, two bits each from the bottom, the
    tops of chunk 2s's low and high nibbles and of chunk 2s+1's)."""
    n, k = w.codes.shape
    b, g = n // BLOCK, k // GROUP
    # ..., half, sub, channel, j, cc, low/high
    t = (w.codes >> 4).reshape(b, 2, LANES, g, 2, 2, 2, 4).permute(0, 3, 1, 4, 2, 7, 5, 6)
    tops = (t[..., 0, 0] | (t[..., 0, 1] << 2) | (t[..., 1, 0] << 4) | (t[..., 1, 1] << 6)).reshape(b, g, 256)

    scale_codes = to_lanes(b, w.sub_scales.view(torch.uint8)).reshape(b, g, 2 * BLOCK)
    header = to_lanes(b, w.super_scales.half()).contiguous().view(torch.uint8)
    return to_stream(header, torch.cat([scale_codes, pack_nibbles(w.codes), tops], -1))


def unpack_q6(packed: torch.Tensor, in_features: int) -> Q6Weights:
    """The inverse of pack_q6."""
    b, g = packed.shape[0], in_features // GROUP
    header, lines = from_stream(packed, g, HEADER_BYTES, GROUP_STRIDE)
    header = header.contiguous().view(torch.float16)  # [b, supers, 32]
    scale_codes = lines[..., :2 * BLOCK].reshape(b, g * 2, BLOCK)
    low = unpack_nibbles(lines[..., 2 * BLOCK:2 * BLOCK + 512], in_features)
    packed_tops = lines[..., 2 * BLOCK + 512:].reshape(b, g, 2, 2, LANES, 4)  # block, group, half, sub, channel, j
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    t = ((packed_tops[..., None] >> shifts) & 3).reshape(b, g, 2, 2, LANES, 4, 2, 2)  # ..., j, cc, low/high
    tops = t.permute(0, 2, 4, 1, 3, 6, 7, 5).reshape(b * BLOCK, in_features)
    return Q6Weights(low | (tops << 4), from_lanes(b, scale_codes).contiguous().view(torch.int8), from_lanes(b, header))


class Q6Linear(KQuantLinear):
    """Q6_K weights (Q6Weights, the file's values) on the kernel; see KQuantLinear."""

    op = "q6_linear"
    pack = staticmethod(pack_q6)
    unpack = staticmethod(unpack_q6)
