"""Canonical weights -> a transformers model, for the `hf` benchmark baseline and logit-parity tests.

The transformers model is built from a config matching ours and gets exactly our tensors, so any
difference in logits comes from the runtimes, never from the weights.
"""
from __future__ import annotations

from typing import Any

import torch

from specwood.models.config import ModelConfig
from specwood.models.hf_loader import HF_GLOBAL_NAMES, NORM_SHIFT, hf_layer_names
from specwood.models.canonical import validate_state_dict
from specwood.models.layer_kinds import layer_kinds

__all__ = ["hf_config", "hf_state_dict", "to_hf_model"]


def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A transformers config (LlamaConfig, Qwen2Config, MistralConfig, Qwen3Config,
    Gemma3TextConfig, Phi3Config, Qwen3MoeConfig, GraniteConfig, Olmo2Config, SmolLM3Config)
    equivalent to ``config``."""
    from transformers import (Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, Olmo2Config, Phi3Config,
                              Qwen2Config, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    c = config
    rope: dict[str, Any] = {"rope_type": "default"}
    if c.rope_scaling:
        rope.update({k: v for k, v in c.rope_scaling.items() if k != "freq_factors"})
        rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = c.rope_theta
    common: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        rope_parameters=rope,
        bos_token_id=c.bos_token_id,
        eos_token_id=(c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)) or None,
        hidden_act="silu",
        dtype=dtype,
    )
    if c.arch == "qwen3":
        types = ["sliding_attention" if k.window else "full_attention" for k in layer_kinds(c)]
        cfg = Qwen3Config(**common, head_dim=c.head_dim, attention_bias=c.qkv_bias,
                          use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                          layer_types=types, **overrides)
    elif c.arch == "qwen3moe":
        cfg = Qwen3MoeConfig(**common, head_dim=c.head_dim, attention_bias=c.qkv_bias, num_experts=c.n_experts,
                             num_experts_per_tok=c.n_experts_used, moe_intermediate_size=c.moe_intermediate_size,
                             norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                             **overrides)
    elif c.arch == "gemma3":
        common.pop("hidden_act")
        local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
        common["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        types = ["sliding_attention" if k.window else "full_attention" for k in layer_kinds(c)]
        cfg = Gemma3TextConfig(**common, head_dim=c.head_dim, hidden_activation="gelu_pytorch_tanh",
                               sliding_window=c.sliding_window, layer_types=types,
                               query_pre_attn_scalar=round((c.attention_scale or c.head_dim ** -0.5) ** -2),
                               final_logit_softcapping=c.final_logit_softcap, attn_logit_softcapping=None,
                               attention_bias=c.qkv_bias, **overrides)
    elif c.arch == "phi3":
        scaling = c.rope_scaling or {}
        if "original_max_position_embeddings" in scaling:
            common["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
        cfg = Phi3Config(**common, sliding_window=c.sliding_window, pad_token_id=None, **overrides)
    elif c.arch in ("granite", "olmo2", "smollm3"):
        if c.head_dim != c.dim // c.n_heads or (c.qkv_bias and c.arch != "smollm3"):
            raise ValueError(f"transformers' {c.arch} has head_dim = hidden_size / heads (and o_proj a bias "
                             "with attention_bias)")
        if c.arch == "granite":
            cfg = GraniteConfig(**common, attention_bias=False, mlp_bias=False,
                                embedding_multiplier=c.embed_scale or 1.0,
                                attention_multiplier=c.attention_scale or c.head_dim ** -0.5,
                                residual_multiplier=c.residual_scale or 1.0, logits_scaling=c.logit_scale or 1.0,
                                **overrides)
        elif c.arch == "olmo2":
            cfg = Olmo2Config(**common, attention_bias=False, **overrides)
        else:
            nope = set(c.nope_layers or ())
            cfg = SmolLM3Config(**common, attention_bias=c.qkv_bias, mlp_bias=False, use_sliding_window=False,
                                pad_token_id=None, no_rope_layers=[int(i not in nope) for i in range(c.n_layers)],
                                **overrides)
    elif c.arch == "qwen2":
        if not c.qkv_bias or c.head_dim != c.dim // c.n_heads:
            raise ValueError("transformers' Qwen2 always has q/k/v biases and head_dim = hidden_size / heads")
        cfg = Qwen2Config(**common, use_sliding_window=c.sliding_window is not None,
                          sliding_window=c.sliding_window, max_window_layers=c.n_layers, **overrides)
    elif c.arch == "mistral":
        if c.qkv_bias:
            raise ValueError("transformers' Mistral has no q/k/v biases")
        cfg = MistralConfig(**common, head_dim=c.head_dim, sliding_window=c.sliding_window, **overrides)
    else:
        cfg = LlamaConfig(**common, head_dim=c.head_dim, attention_bias=c.qkv_bias, mlp_bias=False, **overrides)
    return cfg


def hf_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical names -> transformers names (lm_head shares the embedding when tied)."""
    out: dict[str, torch.Tensor] = {}
    layer_names, shift = hf_layer_names(config.arch), NORM_SHIFT.get(config.arch)
    for name, t in state_dict.items():
        if shift is not None and name.endswith("norm.weight"):
            t = (t.float() - shift).to(t.dtype)  # back to the checkpoint's (factor - 1)
        if name in HF_GLOBAL_NAMES:
            out[HF_GLOBAL_NAMES[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("feed_forward.experts."):  # transformers >= 5 holds experts as 3-D tensors
            out[f"model.layers.{i}.mlp.experts.{rest.split('.')[2]}"] = t
            continue
        out[f"model.layers.{i}.{layer_names[rest]}"] = t
    for i in range(config.n_layers if config.n_experts else 0):
        p = f"model.layers.{i}.mlp.experts."
        if p + "w1" in out:
            out[p + "gate_up_proj"] = torch.cat([out.pop(p + "w1"), out.pop(p + "w3")], dim=1)
            out[p + "down_proj"] = out.pop(p + "w2")
    if config.arch == "phi3":  # q, k, v and gate, up fused, as Phi-3 stores them
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            if p + "self_attn.q_proj.weight" in out:
                out[p + "self_attn.qkv_proj.weight"] = torch.cat([out.pop(p + f"self_attn.{n}_proj.weight")
                                                                  for n in "qkv"])
                out[p + "mlp.gate_up_proj.weight"] = torch.cat([out.pop(p + "mlp.gate_proj.weight"),
                                                                out.pop(p + "mlp.up_proj.weight")])
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if config.arch == "llama" and config.qkv_bias:
        # transformers' attention_bias also gives o_proj a bias; ours has none, i.e. zero.
        for i in range(config.n_layers):
            key = f"model.layers.{i}.self_attn.o_proj.weight"
            if key in out:
                out[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(config.dim, dtype=out[key].dtype)
    return out


def to_hf_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
):  # -> transformers.PreTrainedModel
    """A transformers LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM holding our weights."""
    import transformers
    from transformers.initialization import no_init_weights

    validate_state_dict(config, state_dict, config.name or "state_dict")
    cls = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                 "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                                 "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                                 "smollm3": "SmolLM3ForCausalLM"}[config.arch])
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    cfg = hf_config(config, dtype, **kwargs)
    # Build on the meta device (no memory, no random init), then adopt our tensors with assign=True.
    with no_init_weights(), torch.device("meta"):
        model = cls(cfg)
    sd = {k: v.to(dtype) for k, v in hf_state_dict(config, state_dict).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or missing:
        raise ValueError(f"weights do not fit {cls.__name__}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_embeddings:
        model.tie_weights()
    # Non-persistent buffers (RoPE inv_freq) were created on meta: rebuild the rotary module on the CPU.
    rotary = model.model.rotary_emb
    with torch.device("cpu"):
        model.model.rotary_emb = type(rotary)(cfg)
    embed = model.model.embed_tokens
    if hasattr(embed, "scalar_embed_scale"):  # Gemma's scaled embedding keeps its scale as a buffer
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"{cls.__name__}: tensors left uninitialised: {left[:4]}")
    return model.eval()
