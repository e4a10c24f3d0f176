"""What kind of attention each layer runs, in one place: the model config says it per layer, the
transformer builds one mask and one set of rotary tables per kind and hands each layer its own.

Two kinds today: global attention (over the whole context) and sliding-window attention (over the
last `window` tokens of the query's own context, counting itself), each with its rotary tables or
none (SmolLM3's NoPE layers: q and k unrotated). A new kind (linear attention, say) is a new value here and a layer that reads its own block; nothing
is threaded through the forward.

A sliding layer's KV cache keeps every slot, as a global layer's does: the cache stays one shape
for every layer (prefix reuse, compaction and pipeline stages work unchanged) and the window is
applied by the mask. That costs memory past the window, not correctness.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specwood.errors import ModelFileError

if TYPE_CHECKING:
    from specwood.models.config import ModelConfig

FULL_ATTENTION = "full_attention"  # Hugging Face's names, as config.json's `layer_types` writes them
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

GLOBAL_ROPE, LOCAL_ROPE = 0, 1  # indices of a model's rotary tables (see rope.rope_settings)


@dataclass(frozen=True)
class LayerKind:
    """How a layer attends. `window`: None for the whole context, else the number of most recent
    tokens of the query's own context it sees (itself included); `rope`: which rotary tables, None
    for none (a NoPE layer)."""

    window: int | None = None
    rope: int | None = GLOBAL_ROPE


def check_layer_types(layer_types: list[str], n_layers: int) -> None:
    """One line for a layer type we do not run (or a list of the wrong length)."""
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ModelFileError(f"unsupported layer type '{unknown[0]}' (specwood runs {', '.join(LAYER_TYPES)})")
    if len(layer_types) < n_layers:
        raise ModelFileError(f"layer_types names {len(layer_types)} layers, the model has {n_layers}")


def layer_kinds(config: ModelConfig) -> list[LayerKind]:
    """Each layer's kind: from `layer_types` where the config has them, else every layer sliding
    where a window is set (Mistral v0.1), else every layer global; the layers of `nope_layers`
    without rotary tables."""
    c = config
    types = c.layer_types or [SLIDING_ATTENTION if c.sliding_window else FULL_ATTENTION] * c.n_layers
    local_rope = LOCAL_ROPE if c.rope_local_theta is not None else GLOBAL_ROPE
    nope = set(c.nope_layers or ())
    return [LayerKind(c.sliding_window if t == SLIDING_ATTENTION else None,
                      None if i in nope else local_rope if t == SLIDING_ATTENTION else GLOBAL_ROPE)
            for i, t in enumerate(types[:c.n_layers])]


def sliding_types(n_layers: int, pattern: int) -> list[str]:
    """Gemma 3's pattern: every `pattern`-th layer global, the others sliding (1: all global)."""
    return [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(n_layers)]


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A bool mask (True = may attend, slots on the last axis) cut to each query's `window` most
    recent allowed slots. A query's allowed slots are its own context -- the committed prefix and,
    for a tree node, its ancestors -- laid out in position order, so the last `window` of them are
    the positions (p - window, p]: a tree node's window counts from its own position."""
    after = mask.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # allowed slots at or after each slot
    return mask & (after <= window)
