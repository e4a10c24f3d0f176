"""Rotary position embeddings (rotate-half layout, as in Hugging Face checkpoints).

A model has one set of rotary tables per RoPE setting its layers use (`rope_settings`): the global
one, and where the config gives sliding layers their own base (Gemma 3) theirs; a layer's
`LayerKind.rope` says which it reads."""
from __future__ import annotations

import math
from typing import Any

import torch

from specwood.errors import ModelFileError
from specwood.models.config import ROPE_TYPES, ModelConfig, rope_type


def rope_settings(config: ModelConfig) -> list[tuple[float, dict[str, Any] | None]]:
    """(base, scaling) of each rotary table, indexed as LayerKind.rope: the global one, then the
    sliding layers' own base (unscaled, as Gemma 3 runs them) where the config has one."""
    settings = [(config.rope_theta, config.rope_scaling)]
    if config.rope_local_theta is not None:
        settings.append((config.rope_local_theta, None))
    return settings


def inverse_frequencies(config: ModelConfig, theta: float | None = None, scaling: dict[str, Any] | None = None,
                        max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float64) of a RoPE base and scaling (default: the
    config's global ones) for a model of `max_len` positions, and the factor cos and sin are
    multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    dim = config.head_dim
    if theta is None:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
    kind = rope_type(scaling)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(mid, blended, out), 1.0
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: each frequency divided by its factor
        return inv / torch.tensor(scaling["freq_factors"], dtype=torch.float64), 1.0
    if kind in ("longrope", "su"):
        return _longrope(config, inv, scaling, max_len or config.max_position_embeddings)
    raise ModelFileError(f"unsupported rope scaling type '{kind}' (supported: {', '.join(ROPE_TYPES)})")


def _longrope(config: ModelConfig, inv: torch.Tensor, scaling: dict[str, Any], max_len: int
              ) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by a per-frequency factor, the long ones for a model
    built for more positions than it was pretrained on, else the short ones (the choice llama.cpp
    makes from its context size; transformers switches tables once a forward passes the pretrained
    length, which would leave the cache's earlier keys rotated by the other table), and cos and sin
    scaled by sqrt(1 + ln(s) / ln(pretrained length)) for s = context / pretrained length."""
    original = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    factors = scaling["long_factor"] if max_len > original else scaling["short_factor"]
    if len(factors) != len(inv):
        raise ModelFileError(f"longrope factors: {len(factors)} given, the heads need {len(inv)}")
    return inv / torch.tensor(factors, dtype=torch.float64), longrope_attention_factor(config, scaling)


def longrope_attention_factor(config: ModelConfig, scaling: dict[str, Any]) -> float:
    """LongRoPE's cos / sin factor: the config's, else sqrt(1 + ln(s) / ln(pretrained length)) for
    s = context / pretrained length (what transformers and llama.cpp's converter compute)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    s = config.max_position_embeddings / original
    return math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0


def rope_tables(config: ModelConfig, max_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [len(rope_settings) * max_len, head_dim] in float32: the rows of table k
    (LayerKind.rope) start at k * max_len, so a model of one table indexes them by position alone."""
    t = torch.arange(max_len, dtype=torch.float64)
    cos, sin = [], []
    for theta, scaling in rope_settings(config):
        inv, factor = inverse_frequencies(config, theta, scaling, max_len)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos.append(emb.cos() * factor)
        sin.append(emb.sin() * factor)
    return torch.cat(cos).float().to(device), torch.cat(sin).float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D] already gathered at the tokens' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
