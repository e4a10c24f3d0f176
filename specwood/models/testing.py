"""Tiny random models for tests: configs, canonical weights, and writers for GGUF / HF files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specwood.models.config import ModelConfig
from specwood.models.canonical import canonical_shapes
from specwood.models.gguf_file import _PERMUTED_QK_ARCHS
from specwood.models.gguf_dequant import permute_qk
from specwood.models.hf_export import to_hf_model
from specwood.models.rope import longrope_attention_factor

if TYPE_CHECKING:
    from gguf import GGUFWriter
    from transformers import PreTrainedTokenizerFast


def random_tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """A tiny model (dim 64, 2 layers, 4 heads, 2 kv heads, vocab 128) of the given architecture."""
    kwargs: dict[str, Any] = dict(
        arch=arch,
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=128,
        norm_eps=1e-6,
        rope_theta=10000.0 if arch != "qwen2" else 1000000.0,
        max_position_embeddings=256,
        tie_embeddings=arch == "qwen2",
        qkv_bias=arch == "qwen2",
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=[2],
        name=f"tiny-{arch}",
    )
    kwargs.update(_TINY_ARCH_FIELDS.get(arch, {}))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def longrope_scaling(pairs: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    return {"rope_type": "longrope", "original_max_position_embeddings": 128,
            "short_factor": (1 + torch.rand(pairs, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(pairs, generator=g)).tolist()}


# What each architecture adds, at tiny sizes: head_dim apart from dim / heads (Qwen3); 4 layers with
# a global one among sliding ones of window 8 on their own RoPE base (Gemma 3); LongRoPE (Phi-3)
_TINY_ARCH_FIELDS: dict[str, dict[str, object]] = {
    "qwen3": dict(head_dim=32, qk_norm=True, rope_theta=1000000.0, tie_embeddings=True),
    "gemma3": dict(head_dim=32, n_layers=4, qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                   embed_scale=8.0, attention_scale=32 ** -0.5, sliding_window=8,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_theta=1000000.0, rope_local_theta=10000.0, tie_embeddings=True),
    "phi3": dict(rope_scaling=longrope_scaling(8)),
    "qwen3moe": dict(head_dim=32, qk_norm=True, n_experts=4, n_experts_used=2, moe_intermediate_size=32,
                     norm_topk_prob=True),
    # Granite's four multipliers; OLMo 2's norms after attention and MLP only, q and k normed whole;
    # SmolLM3's RoPE skipped on every 4th layer
    "granite": dict(embed_scale=4.0, attention_scale=0.2, residual_scale=0.5, logit_scale=2.0, tie_embeddings=True),
    "olmo2": dict(qk_norm=True, qk_norm_whole=True, pre_norms=False, sandwich_norms=True, norm_eps=1e-5),
    "smollm3": dict(n_layers=4, nope_layers=[3], tie_embeddings=True),
}


def random_state_dict(config: ModelConfig, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Canonical weights with scales that keep activations O(1) through the layers (so logits differ
    meaningfully between tokens and numerical comparisons are not dominated by tiny values)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, shape in canonical_shapes(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name == "tok_embeddings.weight":
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        sd[name] = t.to(dtype)
    return sd


# ----------------------------------------------------------------------------- GGUF writer (tests)

_GGUF_LAYER = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wq.bias": "attn_q.bias",
    "attention.wk.weight": "attn_k.weight",
    "attention.wk.bias": "attn_k.bias",
    "attention.wv.weight": "attn_v.weight",
    "attention.wv.bias": "attn_v.bias",
    "attention.wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "attention.q_norm.weight": "attn_q_norm.weight",
    "attention.k_norm.weight": "attn_k_norm.weight",
    "attention_post_norm.weight": "post_attention_norm.weight",
    "ffn_post_norm.weight": "post_ffw_norm.weight",
    "attention.wqkv.weight": "attn_qkv.weight",  # Phi-3's fused tensors (fused_for_gguf)
    "feed_forward.w13.weight": "ffn_up.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.experts.w1.weight": "ffn_gate_exps.weight",
    "feed_forward.experts.w3.weight": "ffn_up_exps.weight",
    "feed_forward.experts.w2.weight": "ffn_down_exps.weight",
}
_GGUF_GLOBAL = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "output.weight": "output.weight"}


def gguf_tensor_name(canonical: str) -> str:
    """The GGUF name of a canonical tensor; a name already in the file's form ("blk.N....") as it is."""
    if canonical.startswith("blk."):
        return canonical
    if canonical in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[canonical]
    _, i, rest = canonical.split(".", 2)
    return f"blk.{i}.{_GGUF_LAYER[rest]}"


def write_gguf(
    path: str | os.PathLike[str],
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    qtype: str = "F32",
    arch: str | None = None,
    extra_metadata: dict[str, object] | None = None,
    permute: bool | None = None,
    tokens: list[str] | None = None,
    raw_blocks: dict[str, tuple[str, np.ndarray]] | None = None,
) -> Path:
    """Write ``state_dict`` as a llama.cpp-style GGUF: 2-D weights in ``qtype`` (F32, F16, BF16, Q8_0,
    Q4_0, Q5_0, ...; whatever gguf.quants can quantise), 1-D tensors in F32, q/k permuted as llama.cpp
    does for llama/mistral (``permute=False``: the caller already permuted them). ``tokens`` (e.g.
    ``byte_level_tokens(...)``) adds the vocabulary llama.cpp itself needs to load the file.
    ``raw_blocks`` maps canonical names to (type, block bytes [rows, bytes per row]) written as they
    are, in place of the state dict's tensor: the k-quants gguf-py cannot quantise (kquant_blocks)."""
    import gguf

    arch = arch or config.arch
    if permute is None:
        permute = arch in _PERMUTED_QK_ARCHS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(config.name or "tiny")
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.dim)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    if config.head_dim != config.dim // config.n_heads or arch == "gemma3":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    _add_arch_metadata(w, config, arch)
    w.add_tokenizer_model("gpt2")
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        w.add_eos_token_id(config.eos_token_ids[0])
    if tokens is not None:
        _add_vocab(w, tokens)
    for key, value in (extra_metadata or {}).items():  # a standard key given here replaces its value
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
    q = gguf.GGMLQuantizationType[qtype]
    if arch == "phi3":
        state_dict = fused_for_gguf(config, state_dict)
        raw_blocks = fused_blocks(config, raw_blocks) if raw_blocks else raw_blocks
    for name, t in state_dict.items():
        if raw_blocks and name in raw_blocks:
            kind, blocks = raw_blocks[name]
            w.add_tensor(gguf_tensor_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        t = t.float()
        if permute and name.endswith(("attention.wq.weight", "attention.wq.bias")):
            t = permute_qk(t, config.n_heads)
        elif permute and name.endswith(("attention.wk.weight", "attention.wk.bias")):
            t = permute_qk(t, config.n_kv_heads)
        arr = np.ascontiguousarray(t.numpy())
        if arr.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_tensor_name(name), arr.astype(np.float32))
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_tensor_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_arch_metadata(w: GGUFWriter, config: ModelConfig, arch: str) -> None:
    """The keys llama.cpp's converter writes for Gemma 3's local layers, Phi-3's LongRoPE, Granite's
    multipliers and the experts."""
    if config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    if config.layer_types is not None and config.sliding_window:
        w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in config.layer_types])
    if config.rope_local_theta is not None:
        w.add_float32(f"{arch}.rope.freq_base_swa", config.rope_local_theta)
    if config.final_logit_softcap is not None:
        w.add_final_logit_softcapping(config.final_logit_softcap)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        # always, as llama.cpp's converter does: without the key llama.cpp scales cos / sin by 1.0
        w.add_rope_scaling_attn_factors(longrope_attention_factor(config, scaling))
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    if arch == "phi3":
        w.add_rope_dimension_count(config.head_dim)
    if arch == "granite":  # llama.cpp's converter writes all four
        w.add_embedding_scale(config.embed_scale or 1.0)
        w.add_attention_scale(config.attention_scale or config.head_dim ** -0.5)
        w.add_residual_scale(config.residual_scale or 1.0)
        w.add_logit_scale(config.logit_scale or 1.0)
    if config.n_experts:
        w.add_expert_count(config.n_experts)
        w.add_expert_used_count(config.n_experts_used)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)


def fused_for_gguf(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's layout: q, k, v in one tensor, gate above up in another (its ffn_up)."""
    out = dict(state_dict)
    for i in range(config.n_layers):
        p = f"layers.{i}."
        if p + "attention.wq.weight" in out:
            out[p + "attention.wqkv.weight"] = torch.cat([out.pop(p + f"attention.w{n}.weight") for n in "qkv"])
            out[p + "feed_forward.w13.weight"] = torch.cat([out.pop(p + "feed_forward.w1.weight"),
                                                            out.pop(p + "feed_forward.w3.weight")])
    return out


def fused_blocks(config: ModelConfig, raw: dict[str, tuple[str, np.ndarray]]) -> dict[str, tuple[str, np.ndarray]]:
    """fused_for_gguf for raw k-quant blocks: the parts' rows one above the other (one type each)."""
    out = dict(raw)
    for i in range(config.n_layers):
        p = f"layers.{i}."
        for fused, parts in (("attention.wqkv.weight",
                              ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight"]),
                             ("feed_forward.w13.weight", ["feed_forward.w1.weight", "feed_forward.w3.weight"])):
            if all(p + part in out for part in parts):
                kinds = {out[p + part][0] for part in parts}
                if len(kinds) != 1:
                    raise ValueError(f"{p}{fused}: parts of different types {sorted(kinds)} cannot be one tensor")
                out[p + fused] = (kinds.pop(), np.concatenate([out.pop(p + part)[1] for part in parts]))
    return out


def kquant_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks [rows, bytes per row] of a k-quant type (Q4_K, Q5_K, Q6_K, ...): every
    code the format can hold, with small finite fp16 factors where each format keeps them."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(seed).integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    at = {"Q6_K": [size - 2], "Q3_K": [size - 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}.get(qtype, [0])  # d (and dmin)
    factors = (np.random.default_rng(seed + 1).random((raw.shape[0], len(at))) * 0.02 - 0.005).astype(np.float16)
    for i, pos in enumerate(at):
        raw[:, pos:pos + 2] = factors[:, i:i + 1].view(np.uint8)
    return raw.reshape(rows, -1)


def write_q4_k_m_gguf(path: str | os.PathLike[str], config: ModelConfig, seed: int = 0,
                      tokens: list[str] | None = None, types: dict[str, str] | None = None) -> Path:
    """A random model laid out as a Q4_K_M file: the layers' linears in Q4_K, their v and down
    projections in Q6_K (so each fused qkv mixes two types; Phi-3's one qkv tensor is all Q4_K),
    a MoE layer's experts likewise (gate and up Q4_K, down Q6_K, [E, N, K] each), every other
    tensor in F32. The layers' widths must be multiples of 256 (a k-quant superblock). `types`
    maps canonical names' endings to other types (e.g. {"experts.w3.weight": "Q5_K"})."""
    sd = random_state_dict(config, seed)
    raw = {}
    six = ("feed_forward.w2.weight",) if config.arch == "phi3" else ("attention.wv.weight", "w2.weight")
    for i, (name, t) in enumerate(sd.items()):
        if name.startswith("layers.") and t.dim() >= 2 and "router" not in name:  # llama.cpp keeps routers in F32
            kind = next((k for end, k in (types or {}).items() if name.endswith(end)),
                        "Q6_K" if name.endswith(six) else "Q4_K")
            blocks = kquant_blocks(kind, t.shape[:-1].numel(), t.shape[-1], seed=seed * 1000 + i)
            raw[name] = (kind, blocks.reshape(*t.shape[:-1], -1))
    return write_gguf(path, config, sd, "F32", tokens=tokens, raw_blocks=raw)


def byte_level_tokens(vocab_size: int, specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
                      ) -> list[str]:
    """A GPT-2 byte-level vocabulary: the 256 byte symbols (sorted, as the tests' tiny tokenizers number
    them), then ``specials`` (ids 256, 257, ...), padded with unused tokens to ``vocab_size``."""
    from tokenizers import pre_tokenizers

    toks = sorted(pre_tokenizers.ByteLevel.alphabet()) + list(specials)
    return toks + [f"[PAD{i}]" for i in range(len(toks), vocab_size)]


def _add_vocab(w: GGUFWriter, tokens: list[str]) -> None:
    import gguf

    t = gguf.TokenType
    w.add_token_list(tokens)
    w.add_token_types([t.CONTROL if s.startswith("<|") else t.UNUSED if s.startswith("[PAD") else t.NORMAL
                       for s in tokens])
    w.add_tokenizer_pre("default")
    w.add_token_merges(["Ġ Ġ"])  # llama.cpp's BPE loader wants a merge list; one is enough


def save_hf_folder(path: str | os.PathLike[str], config: ModelConfig, state_dict: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    """Save canonical weights as a Hugging Face folder via transformers' save_pretrained."""
    model = to_hf_model(config, state_dict, dtype)
    kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return Path(path)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 259 tokens (256 bytes, then <|endoftext|>, <|im_start|>, <|im_end|>)
    with a ChatML template: what the tiny test models and benchmarks run with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i, special in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def tiny_hf_folder(path: str | os.PathLike[str], seed: int = 1, max_positions: int = 128) -> Path:
    """A tiny random Qwen2 model (vocabulary 264) saved as a Hugging Face folder with the tiny
    tokenizer: what `specwood generate|serve --target PATH` takes in tests and benchmarks."""
    cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=max_positions)
    folder = save_hf_folder(path, cfg, random_state_dict(cfg, seed=seed))
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_pair_folders(root: str | os.PathLike[str], max_positions: int = 256) -> tuple[Path, Path]:
    """A tiny random target and draft as Hugging Face folders under `root`."""
    return (tiny_hf_folder(Path(root) / "target", 1, max_positions),
            tiny_hf_folder(Path(root) / "draft", 2, max_positions))
