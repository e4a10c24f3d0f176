"""EAGLE draft heads in their published Hugging Face layout (EAGLE-1/EAGLE-2: one folder with a
Llama-style config.json and the head's weights, *.safetensors or pytorch_model.bin).

The layout: `fc.weight` [H, 2H] (and `fc.bias` where the config's `bias` is true or absent),
one layer `layers.0.self_attn.{q,k,v,o}_proj` (q/k/v biases for Qwen2 heads),
`layers.0.mlp.{gate,up,down}_proj`, `layers.0.post_attention_layernorm`; no input norm on that
layer, no final norm, no vocabulary head (the target's is used as it is). The features are the
target's final-normed hidden states and a pair is [embedding, feature] at the feature's
position: exactly specwood's own head (specwood.drafting.head), with the whole vocabulary as the
draft vocabulary. A copy of the target's token table (`embed_tokens.weight`) may be in the
folder; the target's own is used instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specwood.drafting.head import DraftHead, HeadSpec, new_head
from specwood.errors import ModelFileError
from specwood.models.transformer import Transformer

_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias", "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}


def read_eagle_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights (safetensors, else a PyTorch .bin read without unpickling code)."""
    from specwood.models.hf_loader import weight_files

    if list(path.glob("*.safetensors")):
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for name, f in weight_files(path).items():
            try:
                with safe_open(str(f), framework="pt") as sf:
                    out[name] = sf.get_tensor(name)
            except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
                raise ModelFileError(f"{f}: cannot read tensor {name} ({e}); "
                                     "the file is truncated or corrupt") from None
        return out
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelFileError(f"{path}: no *.safetensors or pytorch_model.bin weights; give an EAGLE head folder")
    out = {}
    for f in bins:
        try:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{f}: unreadable weights ({type(e).__name__}: {e}); re-download the head") from None
    return out


def load_eagle_head(path: str | Path, target: Transformer) -> DraftHead:
    """An EAGLE-1/2 head folder as a DraftHead drafting for `target` (whole vocabulary)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no config.json; "
                             "an EAGLE head folder holds config.json and its weights") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path / 'config.json'}: unreadable or invalid JSON ({e})") from None
    tensors = read_eagle_tensors(path)
    if any(k.startswith("midlayer.") for k in tensors) or "d2t" in tensors:
        raise ModelFileError(f"{path} is an EAGLE-3 head; specwood loads EAGLE-1/EAGLE-2 heads (fc + layers.0) "
                             "and its own (`specwood train-drafter`)")
    if "fc.weight" not in tensors:
        raise ModelFileError(f"{path}: no fc.weight; not an EAGLE head")
    try:
        dim, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        spec = HeadSpec(
            target_name=str(raw.get("_name_or_path", path.name)), target_vocab_size=int(raw["vocab_size"]), dim=dim,
            intermediate_size=int(raw["intermediate_size"]), draft_vocab_size=int(raw["vocab_size"]),
            input_norm="layers.0.input_layernorm.weight" in tensors, fc_bias="fc.bias" in tensors,
            n_heads=n_heads, n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or dim // n_heads),
            qkv_bias="layers.0.self_attn.q_proj.bias" in tensors,
            rope_theta=float(raw.get("rope_theta") or 10000.0), norm_eps=float(raw.get("rms_norm_eps") or 1e-6))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{path / 'config.json'}: missing or invalid {e}; not an EAGLE head config") from None
    state = {"fc.weight": tensors["fc.weight"]}
    if spec.fc_bias:
        state["fc.bias"] = tensors["fc.bias"]
    canonical = {}
    for name, t in tensors.items():
        if name.startswith("layers.0.") and name[len("layers.0."):] in _LAYER:
            canonical[_LAYER[name[len("layers.0."):]]] = t.float()
    missing = [n for n in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                           "feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight",
                           "ffn_norm.weight") if n not in canonical]
    if missing:
        raise ModelFileError(f"{path}: the head's layer lacks {missing[0]} (incomplete checkpoint)")
    state["layers.0.attention.wqkv.weight"] = torch.cat([canonical[f"attention.w{n}.weight"] for n in "qkv"])
    if spec.qkv_bias:
        state["layers.0.attention.wqkv.bias"] = torch.cat([canonical[f"attention.w{n}.bias"] for n in "qkv"])
    state["layers.0.attention.wo.weight"] = canonical["attention.wo.weight"]
    state["layers.0.feed_forward.w13.weight"] = torch.cat([canonical["feed_forward.w1.weight"],
                                                          canonical["feed_forward.w3.weight"]])
    state["layers.0.feed_forward.w2.weight"] = canonical["feed_forward.w2.weight"]
    state["layers.0.ffn_norm.weight"] = canonical["ffn_norm.weight"]
    if spec.input_norm:
        state["layers.0.attention_norm.weight"] = canonical["attention_norm.weight"]
    return new_head(target, spec, torch.arange(spec.draft_vocab_size), {k: v.float() for k, v in state.items()},
                    where=str(path))
