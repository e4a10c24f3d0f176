"""CUDA graphs for decode-sized forwards over a KV-cache pool.

On a GPU a 1.5B model's decode step is a few hundred small kernels; launched one by one from
Python they take ~20 ms where the GPU needs ~1 ms. A CUDA graph replays them with one launch. A
graph needs fixed shapes and fixed buffers, so every forward of B rows of T tokens is padded to a
bucket (B, T powers of two) and its mask to the cache's full row length: padding tokens write to
the scratch slot and attend to slot 0 (as in `forward_rows`), and the extra mask columns are
False, so each real token's attention sees exactly what the eager forward shows it. The graph
covers the embeddings and the layers; the norm and head run eagerly on the rows whose logits are
wanted. Graphs are captured on first use of a bucket and share one memory pool.

With `capture=False` the same padded static-shape path runs eagerly: that is how the CPU tests
check the padding, and what runs where CUDA is absent.
"""
from __future__ import annotations

import os

from typing import TYPE_CHECKING, Any

import torch

from specwood.models.cache import KVCache

if TYPE_CHECKING:
    from specwood.models.transformer import Transformer

MAX_GRAPH_TOKENS = 64  # larger forwards (prompt chunks) run eagerly: launch overhead is small there


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cuda_graphs_wanted() -> bool:
    """On by default on CUDA; SPECWOOD_CUDA_GRAPHS=0 turns them off (eager, for comparison)."""
    return os.environ.get("SPECWOOD_CUDA_GRAPHS", "1") != "0"


class _Static:
    """The fixed input buffers of one bucket and, once captured, its graph and output."""

    def __init__(self, B: int, T: int, S: int, scratch: int, tokens_shape: tuple[int, ...], tokens_dtype: torch.dtype,
                 device: torch.device):
        self.tokens = torch.zeros((B, T, *tokens_shape), dtype=tokens_dtype, device=device)
        self.positions = torch.zeros(B, T, dtype=torch.long, device=device)
        self.slots = torch.full((B, T), scratch, dtype=torch.long, device=device)
        self.mask = torch.zeros(B, T, S, dtype=torch.bool, device=device)
        self.mask[:, :, 0] = True
        self.rows = torch.zeros(B, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class GraphedForward:
    """Padded, fixed-shape forwards of `model` over `cache`, replayed from CUDA graphs."""

    def __init__(self, model: Transformer, cache: KVCache, capture: bool | None = None):
        self.model, self.cache = model, cache
        self.capture = cache.device.type == "cuda" if capture is None else capture
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool: Any = None  # the graphs' memory pool (torch's handle), shared by every bucket
        self._layout = self._cache_layout()
        self.replays = 0

    def _cache_layout(self) -> tuple[int, int, int]:
        return self.cache.k.data_ptr(), self.cache.max_len, self.cache.rows

    def fits(self, B: int, T: int) -> bool:
        return T <= MAX_GRAPH_TOKENS and B <= self.cache.rows

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                 rows: list[int]) -> torch.Tensor:
        """Hidden states [B', T', dim] (padded) for the batch tokens [B, T(, dim)] with per-row
        positions [B, T], mask [B, T, S <= max_len], slots [B, T] (host tensors) and cache rows."""
        if self._cache_layout() != self._layout:  # the pool was re-allocated: old graphs point at freed memory
            self._static.clear()
            self._pool = None
            self._layout = self._cache_layout()
        B, T = tokens.shape[:2]
        key = (_bucket(B), _bucket(T))
        st = self._static.get(key)
        if st is None:
            st = self._static[key] = _Static(*key, self.cache.max_len, self.cache.scratch_slot, tuple(tokens.shape[2:]),
                                             tokens.dtype, self.cache.device)
        dev = st.tokens.device
        st.tokens.zero_()
        st.tokens[:B, :T].copy_(tokens.to(dev, non_blocking=True))
        st.positions.zero_()
        st.positions[:B, :T].copy_(positions.to(dev, non_blocking=True))
        st.slots.fill_(self.cache.scratch_slot)
        st.slots[:B, :T].copy_(slots.to(dev, non_blocking=True))
        st.mask.zero_()
        st.mask[:, :, 0] = True
        st.mask[:B, :T, :mask.shape[2]].copy_(mask.to(dev, non_blocking=True))
        st.rows.zero_()
        st.rows[:B].copy_(torch.tensor(rows), non_blocking=True)
        if not self.capture:
            return self._run(st)
        graph, out = st.graph, st.out
        if graph is None or out is None:
            graph, out = self._capture(st)
        graph.replay()
        self.replays += 1
        return out

    def _run(self, st: _Static) -> torch.Tensor:
        return self.model.hidden(st.tokens, st.positions, st.mask, self.cache, st.slots, rows=st.rows)

    def _capture(self, st: _Static) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm-up on a side stream (lazy inits, autotuning) with slots at the scratch slot: harmless
        saved = st.slots.clone()
        st.slots.fill_(self.cache.scratch_slot)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(st)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = st.out = self._run(st)
        self._pool = graph.pool()
        st.graph = graph
        st.slots.copy_(saved)
        return graph, out
