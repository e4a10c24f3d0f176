"""Static, preallocated KV cache written at explicit slots."""
from __future__ import annotations

import torch

from specwood.errors import ContextLengthError


class KVCache:
    """K and V for every layer of one model (or one pipeline stage): [layers, B, H_kv, max_len, D].

    Slots are plain indices; the engine decides where tokens go (tree nodes are written after the
    committed prefix, and `compact` moves an accepted path next to it). Rejected slots are simply
    overwritten later.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # committed contiguous prefix (slots [0, length))

    def check_room(self, needed: int) -> None:
        """Raise a clear error if `needed` slots exceed the cache."""
        if needed > self.max_len:
            raise ContextLengthError(
                f"KV cache full: {needed} tokens needed but the cache holds {self.max_len} "
                "(shorten the prompt, lower --max-tokens, or raise --max-context)"
            )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H_kv, T, D] go to `slots` [T]."""
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def compact(self, kept: list[int] | torch.Tensor, start: int) -> None:
        """Move the entries at slots `kept` (in order) to the contiguous slots start, start+1, …"""
        kept = torch.as_tensor(kept, dtype=torch.long, device=self.k.device)
        n = kept.numel()
        self.check_room(start + n)
        if n and not torch.equal(kept, torch.arange(start, start + n, device=kept.device)):
            self.k[:, :, :, start:start + n] = self.k[:, :, :, kept]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, kept]
        self.length = start + n

    def reset(self) -> None:
        self.length = 0
