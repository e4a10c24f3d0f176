"""Rotary position embeddings (rotate-half layout, as in Hugging Face checkpoints)."""
from __future__ import annotations

import math

import torch

from specwood.errors import ModelFileError
from specwood.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(mid, blended, out)
    raise ModelFileError(f"unsupported rope scaling type '{kind}' (supported: default, linear, llama3)")


def rope_tables(config: ModelConfig, max_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, head_dim] in float32."""
    inv = inverse_frequencies(config)
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D] already gathered at the tokens' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
