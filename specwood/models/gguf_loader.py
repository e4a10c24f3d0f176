"""GGUF checkpoints -> (ModelConfig, canonical float weights), and their tokenizers.

The header is parsed here with ``struct`` over an mmap instead of ``gguf.GGUFReader``: the reader
builds numpy views for every one of the ~300k vocabulary strings and takes 8-12 s to open a Qwen
GGUF, while we only need the scalar metadata and the tensor table (~0.2 s). Tensor data is
dequantised with ``gguf.quants.dequantize`` (numpy-vectorised, every type the package supports).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specwood.errors import ModelFileError
from specwood.models.config import SUPPORTED_ARCHS, ModelConfig
from specwood.models.canonical import check_layers, layer_index, validate_state_dict
from specwood.models.q6k import Q6Weights
from specwood.models.q8_0 import Q8Weights, from_offset_codes
from specwood.models.w4a8 import Q4Weights, Q5Weights

KQuantWeights = Q4Weights | Q5Weights | Q6Weights | Q8Weights  # what our kernels run as stored

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.constants.GGUFValueType): id -> struct format (None: variable size).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_FMT = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}
_NP_DTYPE = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
    _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64, _INT64: np.int64,
    _FLOAT64: np.float64,
}

# llama.cpp's converter interleaves q/k rows (Meta's original RoPE layout) for these archs only.
_PERMUTED_QK_ARCHS = ("llama", "mistral")

_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.weight": "attention.wk.weight",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.weight": "attention.wv.weight",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}

def _show(value: Any, limit: int = 60) -> str:
    """A value read from a (possibly damaged) file, fit for a one-line message: quoted, control
    characters escaped, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


_TRUNCATED_FIX = "the file is truncated or corrupt; re-download or re-assemble it (registry models: delete it from the specwood cache and run again)"


def canonical_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> canonical name (None for tensors we do not use, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES and idx.isdigit():
            return f"layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dims innermost-first; this is reversed)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]  # string arrays (vocabulary, merges) are skipped; only their length is kept
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int
    file_size: int
    alignment: int = DEFAULT_ALIGNMENT


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; running off the end means a truncated file."""

    def __init__(self, buf: Any, path: Path, size: int) -> None:
        self.buf, self.path, self.size, self.pos = buf, path, size, 0

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(f"{self.path}: header ends past the end of the file ({self.size} bytes); {_TRUNCATED_FIX}")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos, size = struct.unpack_from, self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self._need(8)
            (n,) = unpack("<Q", buf, pos)
            pos += 8 + n
        self.pos = pos
        if pos > size:
            self.pos = size
            self._need(1)

    def value(self, vtype: int, key: str, lengths: dict[str, int]) -> Any:
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if count > self.size:
                raise ModelFileError(f"{self.path}: metadata array {_show(key)} claims {count} items; {_TRUNCATED_FIX}")
            lengths[key] = count
            if etype == _STRING:
                self.skip_strings(count)
                return None
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype]).newbyteorder("<")
                self._need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr
            if etype == _ARRAY:  # arrays of arrays: never in model files; a deep nest would recurse unbounded
                raise ModelFileError(f"{self.path}: metadata {_show(key)} is a nested array, which GGUF model files do "
                                     f"not use; {_TRUNCATED_FIX}")
            for _ in range(count):
                self.value(etype, key, {})
            return None
        raise ModelFileError(f"{self.path}: unknown metadata value type {vtype} for {_show(key)}; {_TRUNCATED_FIX}")


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse GGUF metadata and the tensor table; ModelFileError for non-GGUF, truncated or corrupt files."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read GGUF file ({e.strerror})") from None
    if size < 24:
        raise ModelFileError(f"{path}: only {size} bytes, not a GGUF model; {_TRUNCATED_FIX}")
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file (bad magic {bytes(mm[:4])!r}); give a .gguf model file")
            cur = _Cursor(mm, path, size)
            cur.pos = 4
            version = cur.scalar("<I")
            if version not in (2, 3):
                hint = " (big-endian GGUF files are not supported)" if version & 0xFFFF == 0 else ""
                raise ModelFileError(f"{path}: unsupported GGUF version {version}{hint}; convert it with a recent llama.cpp")
            n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
            if n_tensors > size or n_kv > size:
                raise ModelFileError(f"{path}: header counts are impossible ({n_tensors} tensors, {n_kv} keys); {_TRUNCATED_FIX}")
            metadata: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar("<I"), key, lengths)
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.scalar("<I")
                if n_dims > 8:
                    raise ModelFileError(f"{path}: tensor {_show(name)} has {n_dims} dims; {_TRUNCATED_FIX}")
                dims = [cur.scalar("<Q") for _ in range(n_dims)]
                infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
            header_end = cur.pos
    alignment = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{path}: invalid general.alignment {alignment}; {_TRUNCATED_FIX}")
    data_offset = (header_end + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, rel in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(
                f"{path}: tensor {_show(name)} has unknown ggml type {ggml_type}; upgrade the gguf package "
                "(pip install -U gguf) or use a file with a common quantisation (Q4_K_M, Q8_0, F16)"
            ) from None
        n_el = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise ModelFileError(f"{path}: tensor {_show(name)} row length {dims[0]} is not a multiple of its block size {block}; {_TRUNCATED_FIX}")
        n_bytes = n_el // block * type_size
        start = data_offset + rel
        if start + n_bytes > size:
            raise ModelFileError(
                f"{path}: tensor {_show(name)} data ends at byte {start + n_bytes} but the file has {size} bytes; {_TRUNCATED_FIX}"
            )
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, n_bytes)
    return GGUFHeader(path, version, metadata, lengths, tensors, data_offset, size, alignment)


# ----------------------------------------------------------------------------- config


def config_from_gguf(header: GGUFHeader) -> ModelConfig:
    md, path = header.metadata, header.path
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f"{path}: unsupported GGUF architecture {_show(arch)} (specwood runs {', '.join(SUPPORTED_ARCHS)}); "
            "use a Llama, SmolLM2, Qwen2/Qwen2.5 or Mistral GGUF"
        )

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        v = md.get(f"{arch}.{key}")
        if v is None:
            if required:
                raise ModelFileError(f"{path}: GGUF metadata lacks {_show(f'{arch}.{key}')}; {_TRUNCATED_FIX}")
            return default
        if isinstance(v, np.ndarray):  # per-layer arrays (e.g. head counts) -- we need uniform layers
            if len(set(v.tolist())) != 1:
                raise ModelFileError(f"{path}: {_show(f'{arch}.{key}')} varies per layer, which specwood does not support")
            v = v.tolist()[0]
        return v

    def count(key: str, default: int | None = None, required: bool = False, low: int = 1,
              high: int = 1 << 20) -> int | None:
        """An integer field within [low, high]: a string, a float or an absurd value is a bad file,
        not a traceback or an allocation without bound."""
        v = get(key, default, required)
        if v is None:
            return None
        if isinstance(v, (bool, str, bytes)) or not float(v).is_integer() or not low <= int(v) <= high:
            raise ModelFileError(f"{path}: GGUF metadata {_show(f'{arch}.{key}')} is {_show(v)}, not an integer in "
                                 f"[{low}, {high}]; {_TRUNCATED_FIX}")
        return int(v)

    def real(key: str, default: float) -> float:
        v = get(key, default)
        if isinstance(v, (bool, str, bytes)) or not np.isfinite(float(v)) or float(v) <= 0:
            raise ModelFileError(f"{path}: GGUF metadata {_show(f'{arch}.{key}')} is {_show(v)}, not a positive number; "
                                 f"{_TRUNCATED_FIX}")
        return float(v)

    tensors = header.tensors
    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path}: no token_embd.weight tensor; the file is incomplete or not a decoder model")
    vocab, dim = tensors["token_embd.weight"].shape
    n_heads = count("attention.head_count", required=True, high=4096)
    n_kv = count("attention.head_count_kv", n_heads, high=n_heads)
    head_dim = count("attention.key_length", 0, low=0, high=65536) or 0
    if not head_dim and "blk.0.attn_q.weight" in tensors:
        head_dim = tensors["blk.0.attn_q.weight"].shape[0] // n_heads
    inter = count("feed_forward_length")
    if inter is None and "blk.0.ffn_gate.weight" in tensors:
        inter = tensors["blk.0.ffn_gate.weight"].shape[0]
    # the layers the tensors hold: block_count must name exactly those (a huge one would make
    # every per-layer table that size)
    blocks = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    n_layers = count("block_count", required=True, high=max(blocks, default=0) + 1)
    if blocks != set(range(n_layers)):
        raise ModelFileError(f"{path}: '{arch}.block_count' is {n_layers} but the file has tensors for layers "
                             f"{min(blocks, default=0)}..{max(blocks, default=-1)}; {_TRUNCATED_FIX}")

    rope_scaling = None
    stype = get("rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": float(get("rope.scaling.factor", 1.0))}
        if (orig := get("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        if (af := get("rope.scaling.attn_factor")) is not None:
            rope_scaling["attention_factor"] = float(af)
        for k_gguf, k_hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (v := get(f"rope.scaling.{k_gguf}")) is not None:
                rope_scaling[k_hf] = float(v)
    elif "rope_freqs.weight" in tensors:
        # Llama 3.1-style: llama.cpp stores the per-frequency divisors as a tensor instead of metadata.
        rope_scaling = {"rope_type": "freq_factors"}  # values added by load_gguf

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = md.get(key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = md.get("tokenizer.ggml.bos_token_id")
    window = get("attention.sliding_window")

    try:
        return ModelConfig(
            arch=arch,
            vocab_size=int(vocab),
            dim=count("embedding_length", dim, high=1 << 16),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            intermediate_size=int(inter or 0),
            head_dim=head_dim,
            norm_eps=real("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=real("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=count("context_length", 4096, high=1 << 24),
            tie_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            sliding_window=int(window) if window else None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            name=str(md.get("general.name") or path.stem),
        )
    except ModelFileError as e:  # the config's own checks: name the file
        raise ModelFileError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- weights


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
    buf: np.ndarray, info: GGUFTensorInfo, dtype: torch.dtype = torch.float32, path: Path | str = "", use_torch: bool = True
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


_threads_lock = threading.Lock()
_threads_users = 0
_threads_saved = 0


def _single_torch_thread_enter() -> None:
    # Counted, so loads running concurrently in one process restore the caller's setting only once.
    global _threads_users, _threads_saved
    with _threads_lock:
        if _threads_users == 0:
            _threads_saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _threads_users += 1


def _single_torch_thread_exit() -> None:
    global _threads_users
    with _threads_lock:
        _threads_users -= 1
        if _threads_users == 0:
            torch.set_num_threads(_threads_saved)


def load_gguf(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    layers: range | None = None,
    progress: bool | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a GGUF file -> (config, canonical float weights in ``dtype``); see specwood.models.loader."""
    path = Path(path)
    header = read_gguf_header(path)
    config = config_from_gguf(header)
    check_layers(config, layers)
    wanted: list[tuple[str, GGUFTensorInfo]] = []
    for gname, info in header.tensors.items():
        cname = canonical_name(gname)
        if cname is None:
            continue
        li = layer_index(cname)
        if li is not None and layers is not None and li not in layers:
            continue
        wanted.append((cname, info))
    permute = config.arch in _PERMUTED_QK_ARCHS
    if progress is None:
        progress = header.file_size > (256 << 20) and sys.stderr.isatty()

    sd: dict[str, torch.Tensor] = {}
    # np.memmap rather than mmap.mmap: views into it stay valid however long anything keeps them.
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, file untouched
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(i.n_bytes for _, i in wanted), desc=f"loading {path.name}", unit="B",
                   unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False, dynamic_ncols=True)

    def convert(item: tuple[str, GGUFTensorInfo]) -> torch.Tensor:
        cname, info = item
        t = dequantize_tensor(mm, info, dtype, path)
        if permute and cname.endswith(("attention.wq.weight", "attention.wq.bias")):
            t = unpermute_qk(t, config.n_heads).contiguous()
        elif permute and cname.endswith(("attention.wk.weight", "attention.wk.bias")):
            t = unpermute_qk(t, config.n_kv_heads).contiguous()
        return t

    # Parallel over tensors (torch releases the GIL) with single-threaded torch ops: intra-op OpenMP
    # threads spin at barriers and were 7x slower than one thread on a busy 2-core machine.
    order = sorted(wanted, key=lambda it: -it[1].n_bytes)  # biggest first: no lone embedding at the tail
    try:
        _single_torch_thread_enter()
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            for (cname, info), t in zip(order, pool.map(convert, order)):
                sd[cname] = t
                if bar is not None:
                    bar.update(info.n_bytes)
        if config.rope_scaling and config.rope_scaling.get("rope_type") == "freq_factors":
            freqs = dequantize_tensor(mm, header.tensors["rope_freqs.weight"], torch.float32, path)
            config.rope_scaling["freq_factors"] = freqs.tolist()
    except (ValueError, RuntimeError) as e:  # view/reshape failures: a tensor table inconsistent with the data
        raise ModelFileError(f"{path}: cannot decode tensor data ({e}); {_TRUNCATED_FIX}") from None
    finally:
        _single_torch_thread_exit()
        if bar is not None:
            bar.close()
        del mm
    validate_state_dict(config, sd, path, layers)
    return config, sd


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_cache_dir(path: Path) -> Path:
    """Where the converted tokenizer of ``path`` lives: next to a registry model (keyed by its sha256),
    else under $SPECWOOD_CACHE/tokenizers keyed by the file's absolute path, size and mtime."""
    from specwood.models.registry import cache_dir

    marker = path.with_name(path.name + ".verified")
    st = path.stat()
    try:
        info = json.loads(marker.read_text())
        if info.get("size") == st.st_size and info.get("mtime_ns") == st.st_mtime_ns:
            return path.parent / f"tokenizer-{info['sha256'][:16]}"
    except (OSError, ValueError, KeyError):
        pass
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{path.stem}-{key}"


def load_gguf_tokenizer(path: str | os.PathLike[str]):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer embedded in a GGUF file, converted by transformers once and cached as an HF folder."""
    from transformers import AutoTokenizer

    path = Path(path)
    cached = _tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry is rebuilt below
            shutil.rmtree(cached, ignore_errors=True)

    header = read_gguf_header(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelFileError(
            f"{path}: transformers cannot convert the GGUF tokenizer ({type(e).__name__}: {e}); "
            "use the model's Hugging Face folder instead"
        ) from None
    template = header.metadata.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template  # transformers' GGUF conversion drops it
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process cached it first; theirs is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


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


def _f16_rows(b: torch.Tensor, rows: int) -> torch.Tensor:
    """Each block's fp16 factor (2 bytes of b), as stored, laid out [rows, blocks a row]."""
    return b.contiguous().view(torch.float16).reshape(rows, -1)


def _q4k_parts(blocks: torch.Tensor, rows: int) -> Q4Weights:
    blocks = blocks.reshape(-1, 144)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return Q4Weights(_unpack_k_nibbles(blocks[:, 16:], torch.uint8).reshape(rows, -1), sc.reshape(rows, -1),
                     mn.reshape(rows, -1), _f16_rows(blocks[:, 0:2], rows), _f16_rows(blocks[:, 2:4], rows))


def _q5k_parts(blocks: torch.Tensor, rows: int) -> Q5Weights:
    blocks = blocks.reshape(-1, 176)
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    fifth = (blocks[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # bit j of byte i: sub-block j, element i
    codes = _unpack_k_nibbles(blocks[:, 48:], torch.uint8) | (fifth << 4)
    return Q5Weights(codes.reshape(rows, -1), sc.reshape(rows, -1), mn.reshape(rows, -1),
                     _f16_rows(blocks[:, 0:2], rows), _f16_rows(blocks[:, 2:4], rows))


def _q8_0_parts(blocks: torch.Tensor, rows: int) -> Q8Weights:
    blocks = blocks.reshape(-1, 34)
    return Q8Weights(blocks[:, 2:].contiguous().view(torch.int8).reshape(rows, -1),
                     _f16_rows(blocks[:, :2], rows))


def _q4_0_parts(blocks: torch.Tensor, rows: int) -> Q8Weights:
    blocks = blocks.reshape(-1, 18)
    codes = _unpack_32(blocks, 2, torch.uint8)
    return from_offset_codes(codes.reshape(rows, -1), 8, _f16_rows(blocks[:, :2], rows))


def _q5_0_parts(blocks: torch.Tensor, rows: int) -> Q8Weights:
    blocks = blocks.reshape(-1, 22)
    n = blocks.shape[0]
    fifth = ((blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(n, 32)  # bit i of a uint32
    codes = _unpack_32(blocks, 6, torch.uint8) | (fifth << 4)
    return from_offset_codes(codes.reshape(rows, -1), 16, _f16_rows(blocks[:, :2], rows))


def _q6k_parts(blocks: torch.Tensor, rows: int) -> Q6Weights:
    blocks = blocks.reshape(-1, 210)
    return Q6Weights(_q6k_codes(blocks).reshape(rows, -1),
                     blocks[:, 192:208].contiguous().view(torch.int8).reshape(rows, -1),
                     _f16_rows(blocks[:, 208:210], rows))


def kquant_weights(path: str | os.PathLike[str], layers: range | None = None) -> dict[str, KQuantWeights]:
    """The layers' quantised weight tensors (and such a token table or output head) of a GGUF file
    as llama.cpp holds them: canonical name -> Q4Weights, Q5Weights, Q6Weights or Q8Weights (the
    codes, their scale codes and fp16 factors; Q4_0 and Q5_0 as the same values in Q8_0's form).
    For the q4 weight mode, which runs these values on our kernels instead of requantising floats
    (specwood.models.w4a8, specwood.models.q6k, specwood.models.q8_0)."""
    from gguf.constants import GGMLQuantizationType as Q

    readers = {Q.Q4_K: _q4k_parts, Q.Q5_K: _q5k_parts, Q.Q6_K: _q6k_parts, Q.Q8_0: _q8_0_parts,
               Q.Q4_0: _q4_0_parts, Q.Q5_0: _q5_0_parts}
    path = Path(path)
    header = read_gguf_header(path)
    config = config_from_gguf(header)
    permute = config.arch in _PERMUTED_QK_ARCHS
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    out: dict[str, KQuantWeights] = {}
    try:
        for gname, info in header.tensors.items():
            cname = canonical_name(gname)
            li = layer_index(cname) if cname else None
            read = readers.get(info.ggml_type)
            if cname is None or not cname.endswith(".weight") or read is None:
                continue
            if li is None and cname not in ("tok_embeddings.weight", "output.weight"):
                continue
            if li is not None and layers is not None and li not in layers:
                continue
            parts = read(torch.frombuffer(mm[info.offset: info.offset + info.n_bytes], dtype=torch.uint8), info.shape[0])
            if permute and cname.endswith("attention.wq.weight"):
                parts = type(parts)(*(unpermute_qk(t, config.n_heads).contiguous() for t in parts))
            elif permute and cname.endswith("attention.wk.weight"):
                parts = type(parts)(*(unpermute_qk(t, config.n_kv_heads).contiguous() for t in parts))
            out[cname] = parts
    except (ValueError, RuntimeError) as e:
        raise ModelFileError(f"{path}: cannot decode tensor data ({e}); {_TRUNCATED_FIX}") from None
    finally:
        del mm
    return out
