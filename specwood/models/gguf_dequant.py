"""GGUF tensor data -> new float torch tensors: our torch dequantisers for the types common in
llama.cpp files, ``gguf.quants.dequantize`` (numpy-vectorised, every type the package supports)
for the rest, and llama.cpp's q/k row permutation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from specwood.errors import ModelFileError
from specwood.models.gguf_file import GGUFTensorInfo


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` (interleaved RoPE pairs) -> HF rotate-half row order.

    llama.cpp: ``w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation (HF layout -> GGUF layout); for writing test files."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Torch dequantisers for the types common in llama.cpp files (Q4_K_M, Q5_K_M, Q8_0, F16, BF16). They follow
# ggml's block layouts (same arithmetic order as gguf.quants, so results match it exactly) but run
# multi-threaded in torch; gguf's numpy versions process 16 rows per call and load a 1.5B Q4_K_M
# file in ~35 s on two cores. Every other type goes through gguf.quants.dequantize.
def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K -> two [n, 8] tensors."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


# Each kernel writes the unpacked integers straight into a float32 buffer (conversion happens in the
# copy) and scales it in place: about 2.5x faster than building intermediate integer tensors.


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q.mul_(_f16(b[:, :2]))


def _unpack_32(b: torch.Tensor, offset: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q4_0/Q5_0 nibbles of 16 bytes -> [n, 32]: low nibbles are elements 0..15, high 16..31."""
    n = b.shape[0]
    qs = b[:, offset:offset + 16].reshape(n, 1, 16)
    q = torch.empty(n, 2, 16, dtype=dtype)
    q[:, 0:1] = qs & 0x0F
    q[:, 1:2] = qs >> 4
    return q.view(n, 32)


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _unpack_32(b, 2).sub_(8).mul_(_f16(b[:, :2]))


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8)
    qh = ((b[:, 2:6, None] >> shifts) & 1).reshape(n, 32)  # bit i of the little-endian uint32
    q = _unpack_32(b, 6)
    q.add_(qh, alpha=16)
    return q.sub_(16).mul_(_f16(b[:, :2]))


def _k_quant_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)


def _unpack_k_nibbles(qs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q4_K/Q5_K 128 nibble bytes -> [n, 8, 32] (chunk c of 32 bytes: low nibbles = sub-block 2c)."""
    n = qs.shape[0]
    qs = qs.reshape(n, 4, 1, 32)
    q = torch.empty(n, 4, 2, 32, dtype=dtype)
    q[:, :, 0:1] = qs & 0x0F
    q[:, :, 1:2] = qs >> 4
    return q.view(n, 8, 32)


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_quant_scales(b)
    return _unpack_k_nibbles(b[:, 16:]).mul_(d).sub_(dm).view(-1, 256)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_quant_scales(b)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # bit j of byte i -> sub-block j, element i
    q = _unpack_k_nibbles(b[:, 48:])
    q.add_(qh, alpha=16)
    return q.mul_(d).sub_(dm).view(n, 256)


def _q6k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> the 6-bit codes q (0..63, before ggml's -32), uint8 [n, 256]."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = torch.empty(n, 2, 2, 64, dtype=torch.uint8)
    q[:, :, 0:1] = ql & 0x0F
    q[:, :, 1:2] = ql >> 4
    return (q.view(n, 8, 32) | (qh << 4)).view(n, 256)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _q6k_codes(b).to(torch.float32).sub_(32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    return q.view(n, 16, 16).mul_(d).view(n, 256)


def _torch_dequantizers() -> dict[int, Any]:
    from gguf.constants import GGMLQuantizationType as Q

    return {Q.Q8_0: _dq_q8_0, Q.Q4_0: _dq_q4_0, Q.Q5_0: _dq_q5_0, Q.Q4_K: _dq_q4_k, Q.Q5_K: _dq_q5_k, Q.Q6_K: _dq_q6_k}


_CHUNK_VALUES = 1 << 20  # values per torch call: float32 temporaries of ~4 MiB stay in cache


def dequantize_tensor(
    buf: np.ndarray, info: GGUFTensorInfo, dtype: torch.dtype = torch.float32, path: Path | str = "",
    use_torch: bool = True
) -> torch.Tensor:
    """One GGUF tensor from the mapped file -> a new torch tensor of ``dtype`` and torch shape ``info.shape``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    qtype = Q(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw_np = buf[info.offset : info.offset + info.n_bytes]
    shape = tuple(info.shape) or (1,)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        view = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        t = torch.frombuffer(raw_np, dtype=torch.uint8).view(view).reshape(shape)
        return t.to(dtype, copy=True)  # copy: never hand out views of the file mapping
    fast = _torch_dequantizers().get(qtype) if use_torch else None
    if fast is not None:
        blocks = torch.frombuffer(raw_np, dtype=torch.uint8).reshape(-1, type_size)
        out = torch.empty(blocks.shape[0], block, dtype=dtype)
        step = max(1, _CHUNK_VALUES // block)
        for s in range(0, blocks.shape[0], step):
            out[s : s + step] = fast(blocks[s : s + step])
        return out.reshape(shape)
    from gguf.quants import dequantize

    raw = raw_np.reshape(*shape[:-1], shape[-1] // block * type_size)
    try:
        arr = dequantize(raw, qtype)
    except NotImplementedError:
        raise ModelFileError(
            f"{path}: tensor '{info.name}' is {qtype.name}, which the installed gguf package cannot dequantise; "
            "upgrade it (pip install -U gguf) or use a Q4_K_M/Q8_0/F16 file"
        ) from None
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape)).to(dtype)
