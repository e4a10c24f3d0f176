"""Hugging Face model folders (config.json + *.safetensors, sharded or not) -> canonical weights."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specwood.errors import ModelFileError
from specwood.models.config import ModelConfig
from specwood.models.canonical import (check_dropped_bias, check_layers, layer_index, split_fused, stack_experts,
                                      validate_state_dict)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
# Gemma 3 norms around both attention and MLP: its post_attention_layernorm is not the MLP's input norm
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_layernorm.weight": "attention_post_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "ffn_post_norm.weight"}
# Phi-3 stores q, k, v in one tensor and gate, up in another: split on loading (canonical.split_fused)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "self_attn.qkv_proj.weight": "attention.wqkv.weight",
                     "mlp.gate_up_proj.weight": "feed_forward.w13.weight"}
_PHI3_FUSED_PARTS = {**{f"attention.w{p}.weight": "attention.wqkv.weight" for p in "qkv"},
                     **{f"feed_forward.w{p}.weight": "feed_forward.w13.weight" for p in "13"}}
# Qwen3-MoE: the router, and one tensor per expert and projection (canonical.stack_experts stacks them)
_MOE_LAYER_NAMES = {**_LAYER_NAMES, "mlp.gate.weight": "feed_forward.router.weight"}
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_PARTS = {"gate": "w1", "up": "w3", "down": "w2"}
# OLMo 2 norms the outputs of attention and MLP only: its post_attention_layernorm too
_OLMO2_LAYER_NAMES = {**{k: v for k, v in _LAYER_NAMES.items()
                         if v not in ("attention_norm.weight", "ffn_norm.weight")},
                      "post_attention_layernorm.weight": "attention_post_norm.weight",
                      "post_feedforward_layernorm.weight": "ffn_post_norm.weight"}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES, "qwen3moe": _MOE_LAYER_NAMES,
                     "olmo2": _OLMO2_LAYER_NAMES}
# Gemma's RMSNorm multiplies by (1 + w): canonical norms hold the factor (see canonical)
NORM_SHIFT = {"gemma3": 1.0}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Inverse maps, used by hf_export to rebuild a transformers state dict.
HF_GLOBAL_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}


def hf_layer_names(arch: str) -> dict[str, str]:
    """Canonical layer name (after `layers.{i}.`) -> the architecture's transformers name."""
    return {v: k for k, v in _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES).items()}


def hf_tensor_name(canonical: str, arch: str = "llama") -> str:
    """Canonical name -> the transformers tensor name, for messages (one expert's, `...experts.{e}.w1...`,
    too; a stacked expert tensor, whose checkpoint holds one tensor per expert, stays as is)."""
    if canonical in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[canonical]
    if canonical.startswith("layers."):
        _, idx, rest = canonical.split(".", 2)
        names = hf_layer_names(arch)
        if arch == "phi3" and rest in _PHI3_FUSED_PARTS:
            rest = _PHI3_FUSED_PARTS[rest]
        if rest in names:
            return f"model.layers.{idx}.{names[rest]}"
        expert = re.match(r"^feed_forward\.experts\.(\d+)\.(w[123])\.weight$", rest)
        if expert:
            part = {v: k for k, v in _EXPERT_PARTS.items()}[expert.group(2)]
            return f"model.layers.{idx}.mlp.experts.{expert.group(1)}.{part}_proj.weight"
    return canonical


def canonical_name(hf_name: str, arch: str = "llama") -> str | None:
    """HF tensor name -> canonical name (None for tensors we do not use, e.g. rotary inv_freq)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}"
    expert = _EXPERT_RE.match(m.group(2)) if m and arch == "qwen3moe" else None
    if m and expert:
        return f"layers.{m.group(1)}.feed_forward.experts.{expert.group(1)}.{_EXPERT_PARTS[expert.group(2)]}.weight"
    return None


def read_hf_config(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Any]]:
    path = Path(path)
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no config.json; "
                             "give a Hugging Face model folder (config.json + *.safetensors)") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{cfg_file}: unreadable or invalid JSON ({e}); re-download the model folder") from None
    try:
        config = ModelConfig.from_hf(raw, name=path.name)
    except KeyError as e:
        raise ModelFileError(f"{cfg_file}: missing key {e}; not a config of an architecture specwood runs") from None
    # transformers >= 5 writes rope scaling into rope_parameters instead of rope_scaling.
    params = raw.get("rope_parameters")
    if config.rope_scaling is None and isinstance(params, dict) and params.get("rope_type", "default") != "default":
        config.rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return config, raw


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it (from the shard index, or by listing each single file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{index}: invalid shard index ({e}); re-download the model folder") from None
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (only PyTorch .bin weights found: convert them to safetensors)" if list(path.glob("*.bin")) else ""
        raise ModelFileError(f"{path}: no *.safetensors weights{hint}; give a complete Hugging Face model folder")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                out.update({k: f for k in sf.keys()})
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelFileError(f"{f}: unreadable safetensors file ({e}); "
                                 "it is truncated or corrupt, re-download it") from None
    return out


def load_hf_folder(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, layers: range | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face folder -> (config, canonical weights in ``dtype``); see specwood.models.loader."""
    from safetensors import safe_open

    path = Path(path)
    config, _ = read_hf_config(path)
    check_layers(config, layers)
    files = weight_files(path)
    wanted: dict[Path, list[tuple[str, str]]] = {}
    dropped_biases: dict[Path, list[str]] = {}
    for hf_name, f in files.items():
        cname = canonical_name(hf_name, config.arch)
        if cname is None and hf_name.endswith(".bias") and _LAYER_RE.match(hf_name):
            dropped_biases.setdefault(f, []).append(hf_name)
        if cname is None or (cname == "output.weight" and config.tie_embeddings):
            continue
        li = layer_index(cname)
        if li is not None and layers is not None and li not in layers:
            continue
        wanted.setdefault(f, []).append((hf_name, cname))
    sd: dict[str, torch.Tensor] = {}
    shift = NORM_SHIFT.get(config.arch)
    for f in dict.fromkeys([*wanted, *dropped_biases]):
        if not f.is_file():
            raise ModelFileError(f"{f}: shard listed in the index is missing; re-download the model folder")
        try:
            with safe_open(f, framework="pt") as sf:
                for hf_name in dropped_biases.get(f, ()):
                    check_dropped_bias(path, hf_name, sf.get_tensor(hf_name))
                for hf_name, cname in wanted.get(f, []):
                    t = sf.get_tensor(hf_name)
                    if shift is not None and cname.endswith("norm.weight"):
                        t = t.float() + shift  # in fp32, as the model's norm computes it
                    sd[cname] = t.to(dtype)
        except ModelFileError:
            raise
        except Exception as e:
            raise ModelFileError(f"{f}: cannot read tensors ({e}); "
                                 "the file is truncated or corrupt, re-download it") from None
    split_fused(config, sd)
    file_names = lambda name: hf_tensor_name(name, config.arch)  # noqa: E731 - errors name tensors as the file does
    stack_experts(config, sd, path, file_names)
    validate_state_dict(config, sd, path, layers, file_names)
    return config, sd


def load_hf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelFileError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e}); "
                             "the folder needs tokenizer files") from None
