"""The q4 weight mode: 4-bit weights (GGUF Q4_K layout, exact) x int8 activations on our own kernel.

A Q4_K_M file stores most of its linears as Q4_K: per group of 32 inputs a scale and a minimum,
w = scale * q - min with q in 0..15, the scales and minimums themselves 6-bit codes of an fp16
factor per 256 inputs. `Q4Linear` keeps exactly that (Q4Weights), so a target read from the GGUF
runs on the weights llama.cpp runs, at 4.6 bits a weight instead of int8's 8. torch 2.13 has no
kernel that reads 4-bit weights at this CPU's bandwidth (BENCHMARKS.md §7k, §7l), so the multiply
is `kernels/kquants_vnni.cpp` (AVX512-VNNI, or the same source on AVX2 where the CPU has no
AVX512, with the same bits), compiled on first use with torch's cpp_extension and cached; the
file's Q6_K tensors run on the same kernel as they are stored (specwood.models.q6k). Machines
without AVX2 or a C++ compiler get a one-line error naming the alternative (--dtype int8).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from specwood.errors import SpecwoodError
from specwood.models.amx import tile_path
from specwood.models.kquant_kernels import KERNEL_CFLAGS, kquant_kernel  # noqa: F401

GROUP = 32
LANES = 16  # output channels interleaved in one 512-bit register
BLOCK = 32  # output channels per block of the packed layout (two registers)
SUPER = 8  # groups per superblock (Q4_K: 256 inputs)
HEADER_BYTES = 2 * BLOCK * 2  # a superblock's d and dmin, fp16, per channel of a block
GROUP_STRIDE = 2 * BLOCK + BLOCK * GROUP // 2  # a group's scale and minimum codes, then its nibbles
KERNEL = kquant_kernel()  # KERNEL_CFLAGS, imported with it, is used by benchmarks/q4_kernel_ab.py


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


class Q4Weights(NamedTuple):
    """4-bit weights [N, K] as GGUF's Q4_K holds them: w = d * sc * q - dmin * m, with per group of
    32 inputs a scale code sc and a minimum code m (0..63), and per superblock of 8 groups (256
    inputs; the last may be shorter) an fp16 d and dmin. d * sc is exact in fp32, so these values
    are the file's weights bit for bit."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    sub_scales: torch.Tensor  # uint8 [N, K/32], 0..63
    sub_mins: torch.Tensor  # uint8 [N, K/32], 0..63
    super_scales: torch.Tensor  # fp16 [N, ceil(K/256)]
    super_mins: torch.Tensor  # fp16 [N, ceil(K/256)]

    def scales(self) -> torch.Tensor:
        """Each group's scale d * sc, fp32 [N, K/32]."""
        return self.sub_scales.float() * _per_group(self.super_scales, self.sub_scales.shape[1])

    def mins(self) -> torch.Tensor:
        """Each group's minimum dmin * m, fp32 [N, K/32]."""
        return self.sub_mins.float() * _per_group(self.super_mins, self.sub_mins.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The weights, fp32 [N, K] (as ggml computes them: q * (d * sc) - dmin * m)."""
        n, k = self.codes.shape
        g = self.codes.float().reshape(n, k // GROUP, GROUP)
        return (g * self.scales()[..., None] - self.mins()[..., None]).reshape(n, k)

    @classmethod
    def cat(cls, parts: list[Q4Weights]) -> Q4Weights:
        """Several weights stacked along the output channels (a fused qkv or gate/up linear)."""
        return cls(*(torch.cat(field) for field in zip(*parts)))


def _per_group(per_super: torch.Tensor, groups: int) -> torch.Tensor:
    return per_super.float().repeat_interleave(SUPER, 1)[:, :groups]


def _split_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative per-group values [N, G] -> (codes uint8 [N, G] in 0..63, fp16 [N, ceil(G/8)])
    with codes * factor >= v: rounded up, so a group's range stays covered."""
    n, groups = v.shape
    supers = -(-groups // SUPER)
    padded = torch.nn.functional.pad(v, (0, supers * SUPER - groups)).reshape(n, supers, SUPER)
    # just above max/63 in fp16 (fp16 rounds by at most 2**-11), so no code needs 64
    factor = (padded.amax(-1) / 63 * (1 + 2 ** -10)).half()
    f = factor.float()[..., None]
    codes = torch.where(f > 0, torch.ceil(padded / f.clamp(min=1e-30)), torch.zeros_like(padded))
    return codes.clamp_(0, 63).to(torch.uint8).reshape(n, -1)[:, :groups], factor


def quantize_q4(w: torch.Tensor, rows: int = 16384) -> Q4Weights:
    """Float weight [N, K] -> Q4Weights: per group of 32 inputs, a minimum covering the group's
    lowest value and a scale splitting the rest of its range in 15 steps, both as 6-bit codes of
    an fp16 factor per superblock (Q4_K's form); the 4-bit codes are rounded against the stored
    values, so each weight is within half a step of its float. Rows are independent: `rows` at a
    time, so a token table's float temporaries stay small (1.2 GB for a whole 0.5B one)."""
    n, k = w.shape
    if n > rows:
        return Q4Weights.cat([quantize_q4(w[i:i + rows], rows) for i in range(0, n, rows)])
    g = w.float().reshape(n, k // GROUP, GROUP)
    sub_mins, super_mins = _split_codes((-g.amin(-1)).clamp(min=0))
    mins = sub_mins.float() * _per_group(super_mins, k // GROUP)
    sub_scales, super_scales = _split_codes((g.amax(-1) + mins).clamp(min=0) / 15)
    scales = sub_scales.float() * _per_group(super_scales, k // GROUP)
    q = torch.round((g + mins[..., None]) / scales.clamp(min=1e-30)[..., None]).clamp_(0, 15).to(torch.uint8)
    return Q4Weights(q.reshape(n, k), sub_scales, sub_mins, super_scales, super_mins)


def to_lanes(blocks: int, t: torch.Tensor) -> torch.Tensor:
    """Per-channel values [N, X] -> [N/32, X, 32]: each block's 32 channels side by side."""
    return t.reshape(blocks, BLOCK, -1).permute(0, 2, 1)


def from_lanes(blocks: int, t: torch.Tensor) -> torch.Tensor:
    """The inverse of to_lanes: [N/32, X, 32] -> [N, X]."""
    return t.permute(0, 2, 1).reshape(blocks * BLOCK, -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of codes [N, K] as the kernel reads them, uint8 [N/32, K/32, 512]: per group
    two halves of 16 channels, each 4 chunks of 64 bytes; in chunk c, channel n's bytes 4n..4n+3
    hold inputs 8c..8c+3 in their low nibbles and 8c+4..8c+7 in their high ones."""
    n, k = codes.shape
    b, g = n // BLOCK, k // GROUP
    v = (codes & 0x0F).reshape(b, 2, LANES, g, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)  # block, group, half, chunk, channel, j, low/high
    return (v[..., 0] | (v[..., 1] << 4)).reshape(b, g, 512)


def unpack_nibbles(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of pack_nibbles: [N/32, K/32, 512] -> codes [N, K] (0..15)."""
    b, g = raw.shape[:2]
    nib = torch.stack([raw & 0x0F, raw >> 4], -1).reshape(b, g, 2, 4, LANES, 4, 2)
    return nib.permute(0, 2, 4, 1, 3, 6, 5).reshape(b * BLOCK, in_features)


def pack_q4(w: Q4Weights) -> torch.Tensor:
    """Q4Weights -> the kernel's layout, uint8 [N/32, bytes of a block]: for each block of 32
    output channels, per superblock a 128-byte header (d of the 32 channels, then dmin, fp16), then
    per group a 576-byte line: the 32 scale codes, the 32 minimum codes, and 512 bytes of nibbles
    (pack_nibbles)."""
    return _pack_k(w)


def _pack_k(w: Q4Weights, *more: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout (pack_q4), each group's line followed by `more` bytes [N/32, K/32, X]."""
    b = w.codes.shape[0] // BLOCK
    header = torch.cat([to_lanes(b, w.super_scales.half()).contiguous().view(torch.uint8),
                        to_lanes(b, w.super_mins.half()).contiguous().view(torch.uint8)], -1)
    return to_stream(header, torch.cat([to_lanes(b, w.sub_scales), to_lanes(b, w.sub_mins), pack_nibbles(w.codes),
                                        *more], -1))


def to_stream(header: torch.Tensor, lines: torch.Tensor) -> torch.Tensor:
    """A packed layout's bytes: per block of 32 channels, per superblock of 8 groups its header
    [blocks, supers, H] then its groups' lines [blocks, groups, L]; a last, shorter superblock ends
    after its own lines."""
    b, g, stride = lines.shape
    supers = header.shape[1]
    padded = torch.zeros(b, supers * SUPER, stride, dtype=torch.uint8)
    padded[:, :g] = lines
    stream = torch.cat([header, padded.reshape(b, supers, SUPER * stride)], -1).reshape(b, -1)
    full, rest = divmod(g, SUPER)
    size = full * (header.shape[2] + SUPER * stride) + (header.shape[2] + rest * stride if rest else 0)
    return stream[:, :size].contiguous()


def from_stream(packed: torch.Tensor, groups: int, header_bytes: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_stream: (headers [blocks, supers, H], lines [blocks, groups, L])."""
    b = packed.shape[0]
    supers = -(-groups // SUPER)
    per_super = header_bytes + SUPER * stride
    stream = torch.nn.functional.pad(packed, (0, supers * per_super - packed.shape[1])).reshape(b, supers, per_super)
    return stream[..., :header_bytes], stream[..., header_bytes:].reshape(b, supers * SUPER, stride)[:, :groups]


def unpack_q4(packed: torch.Tensor, in_features: int) -> Q4Weights:
    """The inverse of pack_q4."""
    return _unpack_k(packed, in_features, GROUP_STRIDE)[0]


def _unpack_k(packed: torch.Tensor, in_features: int, stride: int) -> tuple[Q4Weights, torch.Tensor]:
    """The inverse of _pack_k: (the Q4_K values with the codes' low 4 bits, the lines' `more` bytes)."""
    b, g = packed.shape[0], in_features // GROUP
    header, lines = from_stream(packed, g, HEADER_BYTES, stride)
    header = header.contiguous().view(torch.float16)  # [b, supers, 64]
    codes = unpack_nibbles(lines[..., 2 * BLOCK:2 * BLOCK + 512], in_features)
    return Q4Weights(codes, from_lanes(b, lines[..., :BLOCK]), from_lanes(b, lines[..., BLOCK:2 * BLOCK]),
                     from_lanes(b, header[..., :BLOCK]), from_lanes(b, header[..., BLOCK:])), lines[..., GROUP_STRIDE:]


class KQuantLinear(nn.Module):
    """A linear on one of our kernel's packed weight types (`op`, with `pack`/`unpack` for its
    layout) times int8 activations quantised per group of 32 inputs (llama.cpp's Q8_0
    granularity); fp32 accumulation, output in the input's dtype. Needs N % 32 == 0 and K % 32 == 0.

    Row-exact: each row's output is computed by the same operations whatever the other rows are,
    so a tree verified in one forward gives each node what a one-token forward along its path
    gives (lossless speculation against our own ar)."""

    op: str

    @staticmethod
    def pack(weights: Any) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def unpack(packed: torch.Tensor, in_features: int) -> Any:
        raise NotImplementedError

    def __init__(self, weights: Any, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernel = require_q4()
        self.tiles = tile_path()  # AMX for calls of many rows, where the CPU has it
        self.out_features, self.in_features = weights.codes.shape
        self.register_buffer("packed", self.pack(weights), persistent=False)
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else torch.empty(0),
                             persistent=False)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % BLOCK == 0 and in_features % GROUP == 0

    @property
    def weights(self) -> Any:
        """The stored values, unpacked (fresh tensors)."""
        return self.unpack(self.packed, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight [N, K] (fp32, a fresh copy), e.g. for a reference model."""
        return self.weights.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = kquant_matmul(self.kernel, self.tiles, self.op, flat, self.packed, self.bias)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def kquant_matmul(kernel: Any, tiles: Any, op: str, x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the packed weights of `op`'s type: on the AMX tiles (`tiles`, a TilePath or
    None) from their row count on, else on the VNNI `kernel`; the bits are the same either way."""
    if not x.is_contiguous():
        x = x.contiguous()
    if tiles is not None and x.shape[0] >= tiles.min_rows:
        kernel = tiles.kernel
    return getattr(kernel, op)(x, packed, bias)


class Q4Linear(KQuantLinear):
    """4-bit weights in Q4_K's form (Q4Weights): exact against a Q4_K tensor; `from_linear`
    quantises float weights to that form (drafts, q4-lite)."""

    op = "q4_linear"
    pack = staticmethod(pack_q4)
    unpack = staticmethod(unpack_q4)

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Q4Linear:
        w = linear.weight.data if isinstance(linear.weight, torch.Tensor) else linear.weight
        return cls(quantize_q4(w), getattr(linear, "bias", None))


class Q5Weights(Q4Weights):
    """5-bit weights [N, K] as GGUF's Q5_K holds them: Q4_K's form with codes in 0..31."""


Q5_GROUP_STRIDE = GROUP_STRIDE + BLOCK * GROUP // 8  # Q4_K's line, then the codes' fifth bits


def pack_fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """Bit 4 of codes [N, K] as the kernel reads it, uint8 [N/32, K/32, 128]: per half of 16
    channels and chunk (pack_nibbles), one 64-bit mask for the low nibbles' vector and one for the
    high nibbles', bit i for byte i of the vector."""
    n, k = codes.shape
    b, g = n // BLOCK, k // GROUP
    bits = ((codes >> 4) & 1).reshape(b, 2, LANES, g, 4, 2, 4).permute(0, 3, 1, 4, 5, 2, 6)  # block, group, half, chunk, low/high, channel, j
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (bits.reshape(b, g, 128, 8) * weights).sum(-1, dtype=torch.uint8)


def pack_q5(w: Q5Weights) -> torch.Tensor:
    """Q5Weights -> the kernel's layout: pack_q4's, with the 128 bytes of pack_fifth_bits after
    each group's nibbles (5.625 bits a weight, Q5_K's own size)."""
    return _pack_k(w, pack_fifth_bits(w.codes))


def unpack_q5(packed: torch.Tensor, in_features: int) -> Q5Weights:
    """The inverse of pack_q5."""
    low, masks = _unpack_k(packed, in_features, Q5_GROUP_STRIDE)
    b, g = packed.shape[0], in_features // GROUP
    bits = ((masks[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(b, g, 2, 4, 2, LANES, 4)
    fifth = bits.permute(0, 2, 5, 1, 3, 4, 6).reshape(b * BLOCK, in_features)
    return Q5Weights(low.codes | (fifth << 4), *low[1:])


class Q5Linear(KQuantLinear):
    """Q5_K weights (Q5Weights, the file's values) on the kernel; see KQuantLinear."""

    op = "q5_linear"
    pack = staticmethod(pack_q5)
    unpack = staticmethod(unpack_q5)


class StackedLinear(nn.Module):
    """Linears stacked along the output channels, run one after the other: a fused qkv whose v
    the file stores in another type than q and k (Q4_K_M: Q6_K in half the layers)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def weight(self) -> torch.Tensor:
        """The parts' dequantised weights, stacked (fp32, a fresh copy), e.g. for a reference model."""
        return torch.cat([p.weight for p in self.parts])

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases, stacked (None without; a KQuantLinear keeps an empty one)."""
        biases = [getattr(p, "bias", None) for p in self.parts]
        if any(b is None or b.numel() == 0 for b in biases):
            return None
        return torch.cat(biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)


class QuantEmbedding(nn.Module):
    """A token embedding kept as the file stores it (any of our kernels' weight types: a GGUF's
    Q4_K, Q5_K, Q6_K or Q8_0 `token_embd`, exactly; a Q4_K table's codes two to a byte): a step
    looks up a few rows and dequantises only those. The default target's Q4_K table (151,936 x
    1,536) takes 135 MB against bf16's 467."""

    def __init__(self, weights: Any, dtype: torch.dtype):
        super().__init__()
        self.kind = type(weights)
        self.nibbles = self.kind is Q4Weights  # 4-bit codes: two to a byte
        codes = weights.codes
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("packed", codes[:, 0::2] | (codes[:, 1::2] << 4) if self.nibbles else codes,
                             persistent=False)
        self.fields = weights._fields[1:]  # the per-row scales: indexed like the codes
        for name in self.fields:
            self.register_buffer(name, getattr(weights, name), persistent=False)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes = self.packed[flat]
        if self.nibbles:
            codes = torch.stack([codes & 0x0F, codes >> 4], -1).reshape(-1, self.embedding_dim)
        rows = self.kind(codes, *(getattr(self, name)[flat] for name in self.fields))
        return rows.dequantize().reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised table (fp32, a fresh copy)."""
        return self._rows(torch.arange(self.num_embeddings, device=self.packed.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(ids).to(self.dtype)
