"""A GGUF file's k-quant weights as llama.cpp stores them (codes, scale codes, fp16 factors), not
dequantised: for the q4 weight mode, which runs them on our kernels (specwood.models.w4a8,
specwood.models.q6k, specwood.models.q8_0).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import numpy as np
import torch

from specwood.errors import ModelFileError
from specwood.models.canonical import layer_index, split_fused
from specwood.models.gguf_dequant import _k_scale_min, _q6k_codes, _unpack_32, _unpack_k_nibbles, unpermute_qk
from specwood.models.gguf_file import (_PERMUTED_QK_ARCHS, _TRUNCATED_FIX, GGUFTensorInfo, canonical_name,
                                       config_from_gguf, read_gguf_header)
from specwood.models.q6k import Q6Weights
from specwood.models.q8_0 import Q8Weights, from_offset_codes
from specwood.models.w4a8 import Q4Weights, Q5Weights

KQuantWeights = Q4Weights | Q5Weights | Q6Weights | Q8Weights  # what our kernels run as stored


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


class KQuantTensors(MutableMapping):
    """A GGUF file's quantised tensors by canonical name (kquant_weights), each decoded from the file
    when it is looked up, and not kept: a build packs each as it takes it, so a load holds one
    tensor's unpacked values (a byte a weight) at a time, not the whole model's beside its packed
    copy (a MoE's experts are most of a file). `in` and `kind` decode nothing; a value set here
    (split_fused's parts) is kept."""

    def __init__(self, path: Path, decoders: dict[str, tuple[type, Callable[[], KQuantWeights]]]):
        self.path, self._decoders, self._held = path, decoders, {}

    def __getitem__(self, name: str) -> KQuantWeights:
        if name in self._held:
            return self._held[name]
        decode = self._decoders[name][1]
        try:
            return decode()
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(f"{self.path}: cannot decode tensor data ({e}); {_TRUNCATED_FIX}") from None

    def __setitem__(self, name: str, value: KQuantWeights) -> None:
        self._decoders.pop(name, None)
        self._held[name] = value

    def __delitem__(self, name: str) -> None:
        if name in self._held:
            del self._held[name]
        else:
            del self._decoders[name]

    def __contains__(self, name: object) -> bool:
        return name in self._held or name in self._decoders

    def __iter__(self) -> Iterator[str]:
        return iter([*self._decoders, *self._held])

    def __len__(self) -> int:
        return len(self._decoders) + len(self._held)

    def kind(self, name: str) -> type:
        """The weight's type (Q4Weights, ...), without decoding it."""
        return type(self._held[name]) if name in self._held else self._decoders[name][0]

    def only(self, kind: type) -> KQuantTensors:
        """The tensors of one type, still decoded when looked up."""
        out = KQuantTensors(self.path, {n: d for n, d in self._decoders.items() if d[0] is kind})
        out._held = {n: w for n, w in self._held.items() if type(w) is kind}
        return out


def kquant_weights(path: str | os.PathLike[str], layers: range | None = None,
                   q4k_only: bool = False) -> KQuantTensors:
    """The layers' quantised weight tensors (and such a token table or output head) of a GGUF file
    as llama.cpp holds them: canonical name -> Q4Weights, Q5Weights, Q6Weights or Q8Weights (the
    codes, their scale codes and fp16 factors; Q4_0 and Q5_0 as the same values in Q8_0's form).
    For the q4 weight mode, which runs these values on our kernels instead of requantising floats
    (specwood.models.w4a8, specwood.models.q6k, specwood.models.q8_0). A MoE layer's expert tensor
    [E, N, K] comes as one [E * N, K] weight, expert e's rows from e * N (KQuantExperts); one in a
    quantised type the kernels do not run is a ModelFileError naming the type and the tensor (its
    floats, 2 bytes a weight where the file has ~0.6, are what --dtype bf16 is for). `q4k_only`:
    the Q4_K tensors alone (all that q4-lite runs as stored; the others are not read). Each tensor is
    decoded when it is looked up (KQuantTensors)."""
    from gguf.constants import GGMLQuantizationType as Q

    readers = {Q.Q4_K: (Q4Weights, _q4k_parts)} if q4k_only else {
        Q.Q4_K: (Q4Weights, _q4k_parts), Q.Q5_K: (Q5Weights, _q5k_parts), Q.Q6_K: (Q6Weights, _q6k_parts),
        Q.Q8_0: (Q8Weights, _q8_0_parts), Q.Q4_0: (Q8Weights, _q4_0_parts), Q.Q5_0: (Q8Weights, _q5_0_parts)}
    floats = {Q.F32, Q.F16, Q.BF16}
    path = Path(path)
    header = read_gguf_header(path)
    config = config_from_gguf(header)
    permute = config.arch in _PERMUTED_QK_ARCHS
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # kept by the decoders: views of it stay valid

    def decoder(info: GGUFTensorInfo, read: Callable[[torch.Tensor, int], KQuantWeights], rows: int,
                heads: int | None) -> Callable[[], KQuantWeights]:
        def decode() -> KQuantWeights:
            parts = read(torch.frombuffer(mm[info.offset: info.offset + info.n_bytes], dtype=torch.uint8), rows)
            return parts if heads is None else type(parts)(*(unpermute_qk(t, heads).contiguous() for t in parts))
        return decode

    decoders: dict[str, tuple[type, Callable[[], KQuantWeights]]] = {}
    for gname, info in header.tensors.items():
        cname = canonical_name(gname, config.arch)
        li = layer_index(cname) if cname else None
        kind, read = readers.get(info.ggml_type, (None, None))
        experts = cname is not None and ".feed_forward.experts." in cname and len(info.shape) == 3
        if li is not None and layers is not None and li not in layers:
            continue
        if experts and read is None and not q4k_only and info.ggml_type not in floats:
            raise ModelFileError(
                f"{path}: tensor {gname} is {Q(info.ggml_type).name}, a type the q4 weight mode does not run "
                f"for MoE experts (it runs {', '.join(t.name for t in readers)}); use --dtype bf16 "
                "(the experts dequantised to floats) or a file whose experts are in one of those types")
        if cname is None or not cname.endswith(".weight") or read is None or (len(info.shape) != 2 and not experts):
            continue
        if li is None and cname not in ("tok_embeddings.weight", "output.weight"):
            continue
        rows = info.shape[0] * info.shape[1] if experts else info.shape[0]
        heads = None
        if permute and cname.endswith("attention.wq.weight"):
            heads = config.n_heads
        elif permute and cname.endswith("attention.wk.weight"):
            heads = config.n_kv_heads
        decoders[cname] = (kind, decoder(info, read, rows, heads))
    out = KQuantTensors(path, decoders)
    split_fused(config, out)  # Phi-3's fused qkv and gate-up: their rows, as the canonical weights
    return out
