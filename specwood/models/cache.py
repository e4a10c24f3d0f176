"""Static, preallocated KV cache written at explicit slots: a pool of rows, one per request."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specwood.errors import ContextLengthError

if TYPE_CHECKING:
    from specwood.models.cuda_graphs import GraphedForward

# Which cache rows a forward touches: None = all rows (the batch is the whole cache), a slice of
# consecutive rows (a view, no copy), or a tensor of row indices (gathered per layer).
Rows = slice | torch.Tensor | None


def kv_bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one slot's K and V take in every layer of a pool of this shape."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize


class KVCache:
    """K and V for every layer of one model (or one pipeline stage): [layers, rows, H_kv, max_len + 1, D].

    Allocated once; requests borrow a row (`allocate`/`release`) and keep their own committed
    length (`lengths[row]`). Slots are plain indices inside a row; the engine decides where tokens
    go (tree nodes are written after the committed prefix, and `compact` moves an accepted path
    next to it). Rejected slots are simply overwritten later. Each row has one extra scratch slot
    (index `max_len`) where padding tokens of a batched forward write their K/V.
    """

    graphs: GraphedForward | None = None  # on CUDA, the pool's forwards replayed from CUDA graphs

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len  # usable slots per row
        self.scratch_slot = max_len
        self.rows = batch
        self.lengths = [0] * batch  # committed contiguous prefix of each row (slots [0, length))
        self._free = list(range(batch - 1, -1, -1))

    # --- one-row use (a model run on its own) -------------------------------------------------

    @property
    def length(self) -> int:
        return self.lengths[0]

    @length.setter
    def length(self, value: int) -> None:
        self.lengths[0] = value

    def reset(self) -> None:
        self.lengths = [0] * self.rows

    # --- the pool ------------------------------------------------------------------------------

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Borrow a free row (its length set to 0)."""
        if not self._free:
            raise RuntimeError("no free cache row (the scheduler admits at most one request per row)")
        row = self._free.pop()
        self.lengths[row] = 0
        return row

    def release(self, row: int) -> None:
        if row in self._free or not 0 <= row < self.rows:
            raise RuntimeError(f"cache row {row} released twice or out of range")
        self.lengths[row] = 0
        self._free.append(row)

    def grow(self, max_len: int, rows: int) -> None:
        """Make room for at least `rows` rows of `max_len` slots, in place (the same object, so
        holders of row numbers stay valid): rows in use keep their entries and lengths."""
        max_len, rows = max(max_len, self.max_len), max(rows, self.rows)
        if (max_len, rows) == (self.max_len, self.rows):
            return
        L, B, H, _, D = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros((L, rows, H, max_len + 1, D), dtype=old.dtype, device=old.device)
            new[:, :B, :, :self.max_len] = old[:, :, :, :self.max_len]
            setattr(self, name, new)
        self._free = list(range(rows - 1, B - 1, -1)) + self._free  # old free rows are handed out first
        self.lengths += [0] * (rows - B)
        self.rows, self.max_len, self.scratch_slot = rows, max_len, max_len

    def resize(self, max_len: int) -> None:
        """Rows of `max_len` slots, in place (the same object, so holders of row numbers stay
        valid). Growing keeps every slot of every row (tree slots past a row's length included);
        shrinking is for a pool with no row in use, whose entries are not kept."""
        if max_len == self.max_len:
            return
        shrink = max_len < self.max_len
        if shrink and self.free_rows != self.rows:
            raise RuntimeError("a KV pool with rows in use can only grow")
        L, B, H, _, D = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            if shrink:  # nothing to keep: free the old rows first
                setattr(self, name, None)
                dtype, device = old.dtype, old.device
                del old
                setattr(self, name, torch.zeros((L, B, H, max_len + 1, D), dtype=dtype, device=device))
                continue
            new = torch.zeros((L, B, H, max_len + 1, D), dtype=old.dtype, device=old.device)
            new[:, :, :, :self.max_len] = old[:, :, :, :self.max_len]
            setattr(self, name, new)
        self.max_len, self.scratch_slot = max_len, max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot's K and V take in every layer (what a cached token costs)."""
        L, _, H, _, D = self.k.shape
        return kv_bytes_per_slot(L, H, D, self.k.dtype)

    def check_room(self, needed: int) -> None:
        """Raise a clear error if `needed` slots exceed a row."""
        if needed > self.max_len:
            raise ContextLengthError(
                f"KV cache full: {needed} tokens needed but the cache holds {self.max_len} "
                "(shorten the prompt, lower --max-tokens, or raise --max-context)"
            )

    # --- what the forward calls ----------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows = None) -> None:
        """k, v [B, H_kv, T, D] go to `slots`: [T] (the same slots in every row) or [B, T]."""
        if rows is None or isinstance(rows, slice):
            tk, tv = self.k[layer], self.v[layer]
            if rows is not None:
                tk, tv = tk[rows], tv[rows]  # views
            if slots.dim() == 1 or tk.shape[0] == 1:
                s = slots.reshape(-1)
                tk.index_copy_(2, s, k)
                tv.index_copy_(2, s, v)
                return
            r = torch.arange(tk.shape[0], device=k.device)[:, None]
            tk[r, :, slots] = k.transpose(1, 2)  # advanced indices first: [B, T, H, D]
            tv[r, :, slots] = v.transpose(1, 2)
            return
        if slots.dim() == 1:
            slots = slots.expand(k.shape[0], -1)
        r = rows[:, None]
        self.k[layer][r, :, slots] = k.transpose(1, 2)
        self.v[layer][r, :, slots] = v.transpose(1, 2)

    def read(self, layer: int, length: int, rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, length) of `rows`: views for None or a slice, a gather otherwise."""
        idx = slice(None) if rows is None else rows
        return self.k[layer, idx, :, :length], self.v[layer, idx, :, :length]

    # --- what the prefix cache calls: committed slots in and out of a row ---------------------------

    def slots_of(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, H_kv, end - start, D] of slots [start, end) of `row` (views)."""
        return self.k[:, row, :, start:end], self.v[:, row, :, start:end]

    def put_slots(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V [layers, H_kv, n, D] into slots [start, start + n) of `row`."""
        self.check_room(start + k.shape[2])
        self.k[:, row, :, start:start + k.shape[2]] = k
        self.v[:, row, :, start:start + v.shape[2]] = v

    def copy_slots(self, row: int, source: int, start: int, end: int) -> None:
        """Slots [start, end) of row `source` into the same slots of `row`."""
        self.put_slots(row, start, *self.slots_of(source, start, end))

    def compact(self, kept: list[int] | torch.Tensor, start: int, row: int = 0) -> None:
        """Move row `row`'s entries at slots `kept` (in order) to the contiguous slots start, start+1, …"""
        if isinstance(kept, list) and kept == list(range(start, start + len(kept))):
            self.check_room(start + len(kept))  # already in place (a chain's whole path, a lone root)
            self.lengths[row] = start + len(kept)
            return
        kept = torch.as_tensor(kept, dtype=torch.long, device=self.k.device)
        n = kept.numel()
        self.check_room(start + n)
        if n and not torch.equal(kept, torch.arange(start, start + n, device=kept.device)):
            self.k[:, row, :, start:start + n] = self.k[:, row, :, kept]
            self.v[:, row, :, start:start + n] = self.v[:, row, :, kept]
        self.lengths[row] = start + n
