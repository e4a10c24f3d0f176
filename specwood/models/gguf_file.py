"""GGUF headers -> ModelConfig: the metadata and the tensor table, parsed with ``struct`` over an mmap
instead of ``gguf.GGUFReader`` (the reader builds numpy views for every one of the ~300k vocabulary
strings and takes 8-12 s to open a Qwen GGUF, while we only need the scalar metadata and the tensor
table, ~0.2 s), the config they describe, and the canonical names of the tensors.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specwood.errors import ModelFileError
from specwood.models.config import SUPPORTED_ARCHS, ModelConfig
from specwood.models.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION, sliding_types

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
_PERMUTED_QK_ARCHS = ("llama", "mistral", "granite", "smollm3")

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
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "post_attention_norm.weight": "attention_post_norm.weight",
    "post_ffw_norm.weight": "ffn_post_norm.weight",
    "attn_qkv.weight": "attention.wqkv.weight",  # Phi-3: split on loading (canonical.split_fused)
    "ffn_gate_inp.weight": "feed_forward.router.weight",  # Qwen3-MoE: the router and the experts [E, ...]
    "ffn_gate_exps.weight": "feed_forward.experts.w1.weight",
    "ffn_up_exps.weight": "feed_forward.experts.w3.weight",
    "ffn_down_exps.weight": "feed_forward.experts.w2.weight",
}
# Phi-3's ffn_up holds gate and up, one above the other, as its checkpoint's gate_up_proj does
_FUSED_FFN_ARCHS = ("phi3",)
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


def canonical_name(gguf_name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> canonical name (None for tensors we do not use, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest == "ffn_up.weight" and arch in _FUSED_FFN_ARCHS and idx.isdigit():
            return f"layers.{idx}.feed_forward.w13.weight"
        if rest in _LAYER_NAMES and idx.isdigit():
            return f"layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


_FILE_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_FILE_GLOBAL_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
# what a fused architecture's file holds a canonical part in
_FUSED_PARTS = {"attention.wq.weight": "attn_qkv.weight", "attention.wk.weight": "attn_qkv.weight",
                "attention.wv.weight": "attn_qkv.weight", "feed_forward.w1.weight": "ffn_up.weight",
                "feed_forward.w3.weight": "ffn_up.weight", "feed_forward.w13.weight": "ffn_up.weight"}


def gguf_name(canonical: str, arch: str = "llama") -> str:
    """Canonical name -> the GGUF tensor (llama.cpp's name) that holds it, for messages: Phi-3's
    q, k, v and gate, up live in its fused tensors. A name with no GGUF counterpart stays as is."""
    if canonical in _FILE_GLOBAL_NAMES:
        return _FILE_GLOBAL_NAMES[canonical]
    if canonical.startswith("layers."):
        _, idx, rest = canonical.split(".", 2)
        if arch in _FUSED_FFN_ARCHS and rest in _FUSED_PARTS:
            return f"blk.{idx}.{_FUSED_PARTS[rest]}"
        if rest in _FILE_LAYER_NAMES:
            return f"blk.{idx}.{_FILE_LAYER_NAMES[rest]}"
    return canonical


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
            "use a Llama, SmolLM2, Qwen2/Qwen2.5, Mistral, Qwen3, Qwen3-MoE, Gemma 3, Phi-3, Granite 3, OLMo 2 or "
            "SmolLM3 GGUF"
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
    if not head_dim and "blk.0.attn_qkv.weight" in tensors:
        head_dim = tensors["blk.0.attn_qkv.weight"].shape[0] // (n_heads + 2 * n_kv)
    inter = count("feed_forward_length")
    if inter is None and "blk.0.ffn_gate.weight" in tensors:
        inter = tensors["blk.0.ffn_gate.weight"].shape[0]
    moe: dict[str, Any] = {}
    if arch == "qwen3moe":  # llama.cpp always renormalises Qwen3-MoE's top-k probabilities
        moe = dict(n_experts=count("expert_count", required=True, high=1 << 16),
                   n_experts_used=count("expert_used_count", required=True, high=1 << 16),
                   moe_intermediate_size=count("expert_feed_forward_length", required=True), norm_topk_prob=True)
        inter = inter or moe["moe_intermediate_size"]
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

    if arch == "phi3" and "rope_factors_long.weight" in tensors:
        rope_scaling = {"rope_type": "longrope"}  # the factors added by load_gguf
        if (orig := get("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        if (af := get("rope.scaling.attn_factor")) is not None:
            rope_scaling["attention_factor"] = float(af)
    rope_dims = count("rope.dimension_count", None, high=65536)
    if rope_dims is not None and head_dim and rope_dims != head_dim:
        raise ModelFileError(f"{path}: RoPE over {rope_dims} of each head's {head_dim} dimensions (partial rotary) "
                             "is not supported")

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = md.get(key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = md.get("tokenizer.ggml.bos_token_id")
    window = count("attention.sliding_window", None, low=0) or None
    layer_types = _layer_types(arch, md.get(f"{arch}.attention.sliding_window_pattern"), window, n_layers, path)
    arch_fields = _gemma3_fields(get, real, n_layers, head_dim or dim // n_heads, dim, n_heads) \
        if arch == "gemma3" else _granite_fields(real) if arch == "granite" else {}
    if arch == "olmo2":  # norms on the sublayers' outputs only, q and k each normed as a whole
        arch_fields = dict(pre_norms=False, sandwich_norms=True, qk_norm_whole=True)
    if arch == "smollm3":  # llama.cpp skips RoPE on every 4th layer (no key says so; SmolLM3's own default)
        arch_fields = dict(nope_layers=[i for i in range(n_layers) if (i + 1) % 4 == 0])

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
            sliding_window=window,
            layer_types=layer_types,
            qk_norm="blk.0.attn_q_norm.weight" in tensors or arch in ("qwen3", "gemma3", "qwen3moe", "olmo2"),
            **arch_fields,
            **moe,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            name=str(md.get("general.name") or path.stem),
        )
    except ModelFileError as e:  # the config's own checks: name the file
        raise ModelFileError(f"{path}: {e}") from None


def _layer_types(arch: str, pattern: Any, window: int | None, n_layers: int, path: Path) -> list[str] | None:
    """Which layers slide, from `{arch}.attention.sliding_window_pattern` (llama.cpp's key for
    every architecture): per layer, sliding or not, or a period (every n-th layer global). Without
    it a window applies to every layer, except Gemma 3's default period of 6 (llama.cpp's)."""
    if not window:
        return None
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(pattern, np.ndarray):
        if len(pattern) != n_layers or pattern.dtype.kind not in "biu":
            raise ModelFileError(f"{path}: {key} is {_show(pattern.tolist())}, not one sliding flag for each of "
                                 f"the file's {n_layers} layers; {_TRUNCATED_FIX}")
        return [SLIDING_ATTENTION if swa else FULL_ATTENTION for swa in pattern.tolist()]
    if pattern is None and arch != "gemma3":
        return None
    if pattern is not None and (isinstance(pattern, (bool, str, bytes)) or not float(pattern).is_integer()
                                or pattern < 0):
        raise ModelFileError(f"{path}: {key} is {_show(pattern)}, neither a period (a whole number) nor a flag per "
                             f"layer; {_TRUNCATED_FIX}")
    return sliding_types(n_layers, int(pattern or 6))


def _granite_fields(real: Any) -> dict[str, Any]:
    """Granite's multipliers, under the keys llama.cpp's converter writes them; one that is absent
    or 1 is left out (no operation), as llama.cpp's graph skips it."""
    fields = {}
    for key, field in (("embedding_scale", "embed_scale"), ("attention.scale", "attention_scale"),
                       ("residual_scale", "residual_scale"), ("logit_scale", "logit_scale")):
        value = real(key, 1.0)
        if value != 1.0:
            fields[field] = value
    return fields


def _gemma3_fields(get: Any, real: Any, n_layers: int, head_dim: int, dim: int, n_heads: int) -> dict[str, Any]:
    """What a Gemma 3 GGUF says (or llama.cpp assumes) beyond the Llama fields (its sliding layers:
    `_layer_types`): sliding layers on their own RoPE base (`rope.freq_base_swa`, 10000 by
    default), Gemma's sandwich norms, GELU-tanh MLP, sqrt(dim) embedding scale, and q.k scaled
    by 1/sqrt(head_dim) (1/sqrt(dim / heads) for the 62-layer 27B, whose query_pre_attn_scalar
    llama.cpp hard-codes)."""
    scalar = dim // n_heads if n_layers == 62 else head_dim
    cap = real("final_logit_softcapping", 1.0) if get("final_logit_softcapping") else None
    return dict(rope_local_theta=real("rope.freq_base_swa", 10000.0), sandwich_norms=True,
                hidden_act="gelu_tanh", embed_scale=dim ** 0.5, attention_scale=scalar ** -0.5,
                final_logit_softcap=cap)

