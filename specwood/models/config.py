"""Model hyper-parameters in one architecture-neutral dataclass (Llama family and what each other
architecture adds to its layer: q/k norms, sandwich norms, sliding-window layers, ...)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, asdict
from typing import Any

from specwood.errors import ModelFileError
from specwood.models.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION, check_layer_types, sliding_types

# Architectures the runtime implements; all are Llama-style decoders that differ in what their
# layers add (docs/models.md): the fields below say what, per model.
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", "qwen3moe", "granite", "olmo2", "smollm3")
ACTIVATIONS = ("silu", "gelu_tanh")  # of the gated MLP
# RoPE scalings specwood.models.rope computes ("su": LongRoPE's older name); any other is refused
# when the config is read, before a weight is decoded
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")
_ROPE_ALIASES = ("su",)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """A RoPE scaling's type, under either key config.json has used for it ("rope_type", "type")."""
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default")


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
    layer_types: list[str] | None = None  # per layer, layer_kinds.LAYER_TYPES; None: see layer_kinds
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # ... over all of q's heads at once, and all of k's (OLMo 2), not head by head
    pre_norms: bool = True  # norms on the attention's and the MLP's inputs (all but OLMo 2)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs (Gemma 3: too; OLMo 2: only)
    nope_layers: list[int] | None = None  # layers that skip RoPE (SmolLM3's NoPE layers; see layer_kinds)
    hidden_act: str = "silu"  # the gated MLP's activation
    embed_scale: float | None = None  # token embeddings times this (Gemma 3: sqrt(dim))
    attention_scale: float | None = None  # q.k scale; None: 1/sqrt(head_dim)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    residual_scale: float | None = None  # attention's and MLP's outputs times this before the residual add (Granite)
    logit_scale: float | None = None  # logits divided by this (Granite's logits_scaling)
    n_experts: int = 0  # > 0: every layer's MLP is that many routed experts (Qwen3-MoE)
    n_experts_used: int = 0  # experts per token (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the k chosen probabilities renormalised to sum to 1
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelFileError(
                f"unsupported architecture '{self.arch}' (specwood runs {', '.join(SUPPORTED_ARCHS)}); "
                "use a checkpoint of one of these (docs/models.md)"
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
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ModelFileError(f"model config: {self.n_experts_used} experts per token of {self.n_experts}")
        if self.n_experts and self.moe_intermediate_size < 1:
            raise ModelFileError("model config: the experts' MLP width must be a positive integer")
        if self.rope_scaling is not None and rope_type(self.rope_scaling) not in ROPE_TYPES + _ROPE_ALIASES:
            raise ModelFileError(f"unsupported rope scaling type '{rope_type(self.rope_scaling)}' (specwood runs "
                                 f"{', '.join(ROPE_TYPES)})")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelFileError(f"unsupported MLP activation '{self.hidden_act}' (specwood runs {', '.join(ACTIVATIONS)})")
        if self.nope_layers is not None:
            if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in self.nope_layers):
                raise ModelFileError(f"model config: the layers without RoPE must be layer indices, got "
                                     f"{self.nope_layers!r}")
            # cut to n_layers, as layer_types: an early-exit draft or a draft head replaces n_layers
            self.nope_layers = sorted({int(i) for i in self.nope_layers if i < self.n_layers}) or None
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.n_layers)
            # a copy cut to n_layers: an early-exit draft or a draft head replaces n_layers of a config
            self.layer_types = list(self.layer_types[:self.n_layers])
            if not self.sliding_window and set(self.layer_types) == {FULL_ATTENTION}:
                self.layer_types = None  # what None means: one way to say it (transformers >= 5 writes the list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = self.dim * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = (3 * self.dim * self.moe_intermediate_size * self.n_experts + self.dim * self.n_experts if self.n_experts
               else 3 * self.dim * self.intermediate_size)
        qk = (self.n_heads + self.n_kv_heads) * self.head_dim if self.qk_norm_whole else 2 * self.head_dim
        norms = (2 * self.pre_norms + 2 * self.sandwich_norms) * self.dim + (qk if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        emb = self.vocab_size * self.dim
        return self.n_layers * per_layer + emb * (1 if self.tie_embeddings else 2) + self.dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            raise ModelFileError("a multimodal Gemma 3 folder (model_type gemma3): specwood runs the text model "
                                 "(Gemma3ForCausalLM, model_type gemma3_text)")
        arch = _HF_MODEL_TYPES.get(model_type, model_type or "unknown")
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        n_heads = cfg["num_attention_heads"]
        n_layers = cfg["num_hidden_layers"]
        rope = _hf_rope(cfg, arch)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in _WINDOWED_ARCHS) else None
        layer_types = cfg.get("layer_types")
        if layer_types is None and arch == "gemma3" and window:
            period = _whole(cfg.get("sliding_window_pattern") or 6, "sliding_window_pattern")
            layer_types = sliding_types(n_layers, period)
        if layer_types is None and arch in ("qwen2", "qwen3") and window and "max_window_layers" in cfg:
            # transformers' rule before it wrote layer_types: the layers from max_window_layers on slide
            first = _whole(cfg["max_window_layers"], "max_window_layers")
            layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n_layers)]
        if arch == "gemma3" and cfg.get("attn_logit_softcapping") is not None:
            raise ModelFileError("attention logit softcapping (Gemma 2) is not supported; Gemma 3 has none")
        if float(cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                 or 1.0) != 1.0:
            raise ModelFileError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        gemma = arch == "gemma3"
        if arch == "qwen3moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
            raise ModelFileError("Qwen3-MoE with dense layers among the sparse ones (mlp_only_layers, "
                                 "decoder_sparse_step) is not supported")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        olmo2, granite = arch == "olmo2", arch == "granite"
        scales = _granite_scales(cfg) if granite else {}
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            intermediate_size=cfg["intermediate_size"],
            head_dim=head_dim,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope["theta"],
            rope_scaling=rope["scaling"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma or arch == "smollm3")),
            qkv_bias=(arch == "qwen2") or bool(cfg.get("attention_bias", False)),
            sliding_window=_whole(window, "sliding_window") if window else None,
            layer_types=layer_types,
            rope_local_theta=rope["local_theta"],
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmo2"),
            qk_norm_whole=olmo2,
            pre_norms=not olmo2,
            sandwich_norms=gemma or olmo2,
            nope_layers=_nope_layers(cfg, n_layers) if arch == "smollm3" else None,
            hidden_act=_HF_ACTIVATIONS.get(act, act),
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else scales.get("embedding_multiplier"),
            attention_scale=(cfg.get("query_pre_attn_scalar", head_dim) ** -0.5 if gemma
                             else scales.get("attention_multiplier")),
            final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            residual_scale=scales.get("residual_multiplier"),
            logit_scale=scales.get("logits_scaling"),
            # transformers >= 5 writes num_local_experts
            n_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if arch == "qwen3moe" else 0,
            n_experts_used=cfg.get("num_experts_per_tok", 0) if arch == "qwen3moe" else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if arch == "qwen3moe" else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3",
                   "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "granite": "granite",
                   "olmo2": "olmo2", "smollm3": "smollm3"}
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_WINDOWED_ARCHS = ("mistral", "gemma3", "phi3")  # archs whose sliding_window applies without use_sliding_window


def _whole(value: Any, key: str) -> int:
    """A config.json integer field, or one line saying it is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer() or value < 0:
        raise ModelFileError(f"config.json's {key} is {value!r}, not a whole number (a damaged or unsupported config)")
    return int(value)


def _granite_scales(cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's four multipliers, those that are not neutral (a neutral one is no operation at
    all: the forward skips it rather than multiply by 1)."""
    out = {}
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        value = cfg.get(key)
        if value is None or value == 1.0:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
            raise ModelFileError(f"config.json's {key} is {value!r}, not a positive number (a damaged config)")
        out[key] = float(value)
    return out


def _nope_layers(cfg: dict[str, Any], n_layers: int) -> list[int]:
    """SmolLM3's layers without RoPE: `no_rope_layers` (a flag per layer, 1 = RoPE), else every
    `no_rope_layer_interval`-th layer (4 by default, what llama.cpp always assumes)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = _whole(cfg.get("no_rope_layer_interval") or 4, "no_rope_layer_interval")
        return [i for i in range(n_layers) if (i + 1) % interval == 0]
    if not isinstance(flags, list) or len(flags) < n_layers or any(f not in (0, 1) for f in flags):
        raise ModelFileError(f"config.json's no_rope_layers is not one 0/1 flag for each of the {n_layers} layers")
    return [i for i in range(n_layers) if not flags[i]]


def _hf_rope(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """RoPE base, scaling and the sliding layers' base, from a config.json of either transformers
    layout: rope_theta / rope_scaling / rope_local_base_freq (before 5), or rope_parameters (5;
    per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    per_type = params.get("full_attention") if isinstance(params.get("full_attention"), dict) else None
    global_params = per_type or params
    theta = cfg.get("rope_theta") or global_params.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling")
    if scaling is None and global_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in global_params.items() if k != "rope_theta"}
    if scaling is not None and arch == "phi3" and "original_max_position_embeddings" not in scaling \
            and "original_max_position_embeddings" in cfg:
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    local = None
    if arch == "gemma3":
        local_params = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else {}
        if local_params.get("rope_type", "default") != "default":
            raise ModelFileError(f"unsupported rope scaling type '{local_params['rope_type']}' for sliding layers "
                                 "(supported there: default)")
        local = float(cfg.get("rope_local_base_freq") or local_params.get("rope_theta") or 10000.0)
    return {"theta": theta, "scaling": scaling, "local_theta": local}
