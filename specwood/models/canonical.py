"""The canonical weight layout every loader returns, and the checks on it.

Every loader returns ``(ModelConfig, state_dict)`` with the *canonical* names below (float tensors,
dequantised, q/k in the Hugging Face "rotate-half" RoPE layout):

    tok_embeddings.weight                      [V, dim]
    layers.{i}.attention_norm.weight           [dim]
    layers.{i}.attention.wq.weight / .bias     [n_heads*hd, dim]   (bias when qkv_bias)
    layers.{i}.attention.wk.weight / .bias     [n_kv*hd, dim]
    layers.{i}.attention.wv.weight / .bias     [n_kv*hd, dim]
    layers.{i}.attention.wo.weight             [dim, n_heads*hd]
    layers.{i}.ffn_norm.weight                 [dim]
    layers.{i}.feed_forward.w1.weight          [inter, dim]   (gate_proj)
    layers.{i}.feed_forward.w3.weight          [inter, dim]   (up_proj)
    layers.{i}.feed_forward.w2.weight          [dim, inter]   (down_proj)
    norm.weight                                [dim]
    output.weight                              [V, dim]       (absent when tie_embeddings)

and what an architecture adds to the Llama layer's norms, or takes away (layer_norm_weights):

    layers.{i}.attention.q_norm.weight         [hd]   (qk_norm: Qwen3, Gemma 3; [n_heads*hd] with
    layers.{i}.attention.k_norm.weight         [hd]    qk_norm_whole, OLMo 2: [n_kv*hd])
    layers.{i}.attention_post_norm.weight      [dim]  (sandwich_norms: Gemma 3, OLMo 2)
    layers.{i}.ffn_post_norm.weight            [dim]

(OLMo 2 has no attention_norm and ffn_norm: pre_norms False.)

and in a Mixture-of-Experts layer (n_experts: Qwen3-MoE), in place of the feed_forward weights:

    layers.{i}.feed_forward.router.weight      [E, dim]
    layers.{i}.feed_forward.experts.w1.weight  [E, moe_inter, dim]   (each expert's gate_proj)
    layers.{i}.feed_forward.experts.w3.weight  [E, moe_inter, dim]   (up_proj)
    layers.{i}.feed_forward.experts.w2.weight  [E, dim, moe_inter]   (down_proj)

Norm weights are the factors the normalised activations are multiplied by: Gemma's (1 + w) is
stored as 1 + w, as llama.cpp's GGUF files store it.

With ``layers=range(a, b)`` only those layers' tensors are returned (keeping their global index i);
the non-layer tensors are always returned.
"""
from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.config import ModelConfig


def canonical_shapes(config: ModelConfig, layers: range | None = None) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name the config implies, with its expected shape."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (c.vocab_size, c.dim), "norm.weight": (c.dim,)}
    if not c.tie_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.dim)
    norms = layer_norm_weights(c)
    for i in (range(c.n_layers) if layers is None else layers):
        p = f"layers.{i}."
        # the input norms first in their places (the order random_state_dict draws tensors in)
        if c.pre_norms:
            shapes[p + "attention_norm.weight"] = (c.dim,)
        shapes[p + "attention.wq.weight"] = (q, c.dim)
        shapes[p + "attention.wk.weight"] = (kv, c.dim)
        shapes[p + "attention.wv.weight"] = (kv, c.dim)
        shapes[p + "attention.wo.weight"] = (c.dim, q)
        if c.qkv_bias:
            shapes[p + "attention.wq.bias"] = (q,)
            shapes[p + "attention.wk.bias"] = (kv,)
            shapes[p + "attention.wv.bias"] = (kv,)
        if c.pre_norms:
            shapes[p + "ffn_norm.weight"] = (c.dim,)
        if c.n_experts:
            e, inter = c.n_experts, c.moe_intermediate_size
            shapes[p + "feed_forward.router.weight"] = (e, c.dim)
            shapes[p + "feed_forward.experts.w1.weight"] = (e, inter, c.dim)
            shapes[p + "feed_forward.experts.w3.weight"] = (e, inter, c.dim)
            shapes[p + "feed_forward.experts.w2.weight"] = (e, c.dim, inter)
        else:
            shapes[p + "feed_forward.w1.weight"] = (c.intermediate_size, c.dim)
            shapes[p + "feed_forward.w3.weight"] = (c.intermediate_size, c.dim)
            shapes[p + "feed_forward.w2.weight"] = (c.dim, c.intermediate_size)
        for name, shape in norms.items():
            shapes[p + name] = shape
    return shapes


def layer_norm_weights(config: ModelConfig) -> dict[str, tuple[int]]:
    """The canonical norm weights of a layer (after `layers.{i}.`) the config's architecture has,
    with their shapes: the input norms of attention and MLP (not OLMo 2's), q/k norms, the
    norms of their outputs."""
    c, names = config, {}
    if c.pre_norms:
        names.update({"attention_norm.weight": (c.dim,), "ffn_norm.weight": (c.dim,)})
    if c.qk_norm:
        whole = c.qk_norm_whole
        names.update({"attention.q_norm.weight": (c.n_heads * c.head_dim if whole else c.head_dim,),
                      "attention.k_norm.weight": (c.n_kv_heads * c.head_dim if whole else c.head_dim,)})
    if c.sandwich_norms:
        names.update({"attention_post_norm.weight": (c.dim,), "ffn_post_norm.weight": (c.dim,)})
    return names


def split_fused(config: ModelConfig, sd: MutableMapping[str, Any]) -> None:
    """Split, in place, fused layer weights a file may hold (Phi-3's qkv and gate-up) into the
    canonical q, k, v and gate (w1), up (w3): the model fuses them again its own way. The values
    are tensors, or k-quant weights (NamedTuples of tensors whose rows are the weight's rows)."""
    c = config
    for name in [n for n in sd if n.endswith(("attention.wqkv.weight", "feed_forward.w13.weight"))]:
        fused, prefix = sd.pop(name), name.rsplit(".", 2)[0]
        rows_of = (lambda t, a, b: t[a:b]) if isinstance(fused, torch.Tensor) else \
            (lambda t, a, b: type(t)(*(part[a:b] for part in t)))
        n_rows = fused.shape[0] if isinstance(fused, torch.Tensor) else fused[0].shape[0]
        if name.endswith("wqkv.weight"):
            sizes = {"wq": c.n_heads * c.head_dim, "wk": c.n_kv_heads * c.head_dim, "wv": c.n_kv_heads * c.head_dim}
        else:
            sizes = {"w1": c.intermediate_size, "w3": c.intermediate_size}
        if n_rows != sum(sizes.values()):
            raise ModelFileError(f"tensor {name} has {n_rows} rows, the model config implies "
                                 f"{sum(sizes.values())}; the file's metadata does not match its weights")
        start = 0
        for part, rows in sizes.items():
            sd[f"{prefix}.{part}.weight"] = rows_of(fused, start, start + rows)
            start += rows


def stack_experts(config: ModelConfig, sd: dict[str, torch.Tensor], source: str | os.PathLike[str] = "",
                  file_name: Callable[[str], str] | None = None) -> None:
    """Stack, in place, one tensor per expert (`feed_forward.experts.{e}.w1.weight`, as Hugging
    Face checkpoints store them) into the canonical [E, ...] tensor of each layer. An expert
    missing or beyond the config's count is one line naming its tensor as the file does."""
    show = file_name or (lambda name: name)
    singles: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in sd if ".feed_forward.experts." in n]:
        head, rest = name.split(".feed_forward.experts.", 1)
        expert, part = rest.split(".", 1)
        if expert.isdigit():
            singles.setdefault(f"{head}.feed_forward.experts.{part}", {})[int(expert)] = sd.pop(name)
    for name, experts in singles.items():
        if sorted(experts) != list(range(config.n_experts)):
            head, part = name.split(".feed_forward.experts.", 1)
            missing = sorted(set(range(config.n_experts)) - set(experts))
            odd = missing[0] if missing else min(set(experts) - set(range(config.n_experts)))
            what = "is missing" if missing else "is an expert too many"
            raise ModelFileError(f"{source}: tensor {show(f'{head}.feed_forward.experts.{odd}.{part}')} {what}: the "
                                 f"config says {config.n_experts} experts, the checkpoint has {len(experts)} "
                                 f"(numbered {min(experts)}..{max(experts)})")
        sd[name] = torch.stack([experts[e] for e in range(config.n_experts)])


def check_dropped_bias(path: str | os.PathLike[str], name: str, bias: torch.Tensor) -> None:
    """A layer bias the file holds and our layers have no place for (e.g. Llama's `attention_bias`
    gives o_proj one; converters write it as zeros where the model has none) is skipped when it is
    zero; a non-zero one would change the model's outputs, so the load stops."""
    if bool(torch.any(bias != 0)):
        raise ModelFileError(f"{path}: tensor {name} is a non-zero bias that specwood's layers do not have (only "
                             "q/k/v biases are run); running without it would not be this model: use a checkpoint "
                             "without it or another runtime")


def check_layers(config: ModelConfig, layers: range | None) -> None:
    if layers is None:
        return
    if layers.step != 1 or layers.start < 0 or layers.stop > config.n_layers or layers.start >= layers.stop:
        raise SpecwoodError(
            f"layer range {layers.start}..{layers.stop} is not a non-empty contiguous part of the model's "
            f"{config.n_layers} layers"
        )


def layer_index(canonical_name: str) -> int | None:
    """Layer index of a canonical name ``layers.{i}...``, None for non-layer tensors."""
    if canonical_name.startswith("layers."):
        return int(canonical_name.split(".", 2)[1])
    return None


def validate_state_dict(
    config: ModelConfig, state_dict: dict[str, torch.Tensor], source: str | os.PathLike[str],
    layers: range | None = None, file_name: Callable[[str], str] | None = None,
) -> None:
    """Raise ModelFileError if a tensor the config needs is missing or has the wrong shape; the
    message names it as the file does (`file_name`: canonical name -> the file's; default: as is)."""
    show = file_name or (lambda name: name)
    expected = canonical_shapes(config, layers)
    missing = list(dict.fromkeys(show(k) for k in expected if k not in state_dict))  # fused parts: one file tensor
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(
            f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}; the file is incomplete or not a "
            "checkpoint of a supported architecture"
        )
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ModelFileError(
                f"{source}: tensor {show(name)} has shape {tuple(state_dict[name].shape)}, the model config implies "
                f"{shape}; the file's metadata does not match its weights (corrupt or unsupported variant)"
            )
