"""Model hyper-parameters in one architecture-neutral dataclass (Llama family)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, asdict
from typing import Any

from specwood.errors import ModelFileError

# Architectures the runtime implements; all are Llama-style decoders that differ in small flags.
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 -> dim // n_heads
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelFileError(
                f"unsupported architecture '{self.arch}' (specwood runs {', '.join(SUPPORTED_ARCHS)}); "
                "use a Llama, SmolLM2, Qwen2/Qwen2.5 or Mistral checkpoint"
            )
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ModelFileError(f"model config: {name} must be a positive integer, got {value!r} (a damaged "
                                     "or unsupported config)")
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ModelFileError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = self.dim * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * self.dim * self.intermediate_size
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * per_layer + emb * (1 if self.tie_embeddings else 2) + self.dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}.get(model_type, model_type or "unknown")
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        n_heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(arch == "qwen2") or bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
