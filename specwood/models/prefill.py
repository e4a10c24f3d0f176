"""Writing a prompt's K/V into a cache row: the first forward of every request, for target and draft."""
from __future__ import annotations

import torch

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
    return logits


def prefill_rows(model: Transformer, cache: KVCache, chunks: list[tuple[int, list[int], int, int]]) -> torch.Tensor:
    """Prefill several requests' chunks in ONE padded forward: chunk (row, prompt, start, end)
    writes prompt tokens [start, end) into slots [start, end) of cache row `row`. Returns the
    logits [len(chunks), V] of each chunk's last token (meaningful where `end` is the prompt's end)."""
    if len(chunks) == 1:
        row, prompt, start, end = chunks[0]
        cache.check_room(end)
        model.check_positions(end - 1)
        dev = model.device
        pos = torch.arange(start, end, device=dev)
        mask = torch.ones(end - start, end, dtype=torch.bool, device=dev).tril(diagonal=start)
        ids = torch.tensor(prompt[start:end], dtype=torch.long, device=dev)[None]
        out = model(ids, pos, mask, cache, pos, rows=slice(row, row + 1),
                    output_rows=torch.tensor([end - start - 1], device=dev))[0]
        cache.lengths[row] = end
        return out
    dev = model.device
    B = len(chunks)
    T = max(end - start for _, _, start, end in chunks)
    S = max(end for _, _, _, end in chunks)
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    slots = torch.full((B, T), cache.scratch_slot, dtype=torch.long)
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    mask[:, :, 0] = True  # padding rows attend to slot 0; their K/V go to the scratch slot
    for b, (row, prompt, start, end) in enumerate(chunks):
        cache.check_room(end)
        model.check_positions(end - 1)
        n = end - start
        tokens[b, :n] = torch.tensor(prompt[start:end])
        positions[b, :n] = torch.arange(start, end)
        slots[b, :n] = torch.arange(start, end)
        mask[b, :n] = torch.ones(n, S, dtype=torch.bool).tril(diagonal=start)
    last = torch.tensor([end - start - 1 for _, _, start, end in chunks], device=dev)
    rows = torch.tensor([row for row, _, _, _ in chunks], device=dev)
    out = model(tokens.to(dev), positions.to(dev), mask.to(dev), cache, slots.to(dev),
                output_rows=(torch.arange(B, device=dev), last), rows=rows)
    for row, _, _, end in chunks:
        cache.lengths[row] = end
    return out
