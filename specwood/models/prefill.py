"""Writing a prompt's K/V into a cache row: the first forward of every request, for target and draft."""
from __future__ import annotations

import functools

import torch

from specwood.models.batch import RowInput, forward_rows_features
from specwood.models.cache import KVCache
from specwood.models.transformer import Transformer

PREFILL_CHUNK = 512  # tokens per forward: bounds the attention and MLP activations


def prefill_chunk(model: Transformer, cache: KVCache, prompt: list[int], start: int, end: int,
                  row: int = 0) -> torch.Tensor | None:
    """Write prompt tokens [start, end) into slots [start, end) of cache row `row` (slots before
    `start` must hold the earlier tokens) and set the row's length to `end`. Returns the last
    prompt token's logits [V] when `end` reaches the end of the prompt, else None."""
    logits = prefill_rows(model, cache, [(row, prompt, start, end)])[0]
    return logits if end == len(prompt) else None


def prefill(model: Transformer, cache: KVCache, prompt: list[int], chunk: int = PREFILL_CHUNK,
            row: int = 0) -> torch.Tensor:
    """Write the whole prompt's K/V into slots [0, len) of row `row`; the last token's logits [V]."""
    logits = None
    for start in range(0, len(prompt), chunk):
        logits = prefill_chunk(model, cache, prompt, start, min(start + chunk, len(prompt)), row)
    if logits is None:
        raise ValueError("prefill of an empty prompt")
    return logits


def prefill_rows(model: Transformer, cache: KVCache,
                 chunks: list[tuple[int, list[int], int, int]]) -> list[torch.Tensor]:
    """Prefill several requests' chunks in ONE forward (padded blocks, `forward_rows`): chunk
    (row, prompt, start, end) writes prompt tokens [start, end) into slots [start, end) of cache
    row `row` and sets the row's length to `end`. Returns each chunk's last-token logits [V]
    (meaningful where `end` is the prompt's end)."""
    return prefill_rows_features(model, cache, chunks)[0]


def prefill_rows_features(model: Transformer, cache: KVCache, chunks: list[tuple[int, list[int], int, int]],
                          features: list[bool] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """`prefill_rows`, and the features of every token of the chunks whose `features` flag is set
    (what a feature-level draft head reads of the target's prefill; None for the others)."""
    wanted = features or [False] * len(chunks)
    logits, feats = forward_rows_features(model, cache, [prefill_input(*c, f) for c, f in zip(chunks, wanted)])
    return prefill_outputs(cache, chunks, logits), feats


def prefill_input(row: int, prompt: list[int], start: int, end: int, features: bool = False) -> RowInput:
    """Prompt tokens [start, end) as a row of a batched forward: into slots [start, end) of cache
    row `row`, causal over the earlier slots; the last token's logits wanted (and, with
    `features`, every token's features). After the forward, `prefill_outputs` sets the row's
    length to `end`."""
    small = (end - start) * end <= _CACHED_MASK_CELLS
    pos, causal, last = _cached_chunk_layout(start, end) if small else _chunk_layout(start, end)
    return RowInput(row, torch.tensor(prompt[start:end], dtype=torch.long), pos, pos, causal, last,
                    torch.arange(end - start) if features else None)


def _chunk_layout(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions (and slots) [start, end), the causal mask over slots [0, end) and the last token's
    index."""
    pos = torch.arange(start, end)
    # a comparison, not ones().tril(): tril enters an OpenMP region whatever its size, which costs
    # milliseconds per call when another process holds the other cores (a prefill per request)
    causal = torch.arange(end) <= pos.unsqueeze(1)
    return pos, causal, torch.tensor([end - start - 1])


# the same for every short prompt chunk at [start, end), so built once (the forward only reads a
# RowInput's tensors; four tensor calls a request were ~5% of a batch of short prompts); at most
# 256 masks of 64k cells (16 MB), long chunks built each time
_CACHED_MASK_CELLS = 1 << 16
_cached_chunk_layout = functools.lru_cache(maxsize=256)(_chunk_layout)


def prefill_outputs(cache: KVCache, chunks: list[tuple[int, list[int], int, int]], out: list[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """After a forward over the chunks' `prefill_input` rows (`out`: their logits): each row's
    length is its chunk's end; returns each chunk's last-token logits [V]."""
    for row, _, _, end in chunks:
        cache.lengths[row] = end
    return [o[0] for o in out]
