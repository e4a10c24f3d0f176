"""Plain autoregressive decoding: the baseline every speedup is measured against."""
from __future__ import annotations

from typing import Iterator

import torch

from specwood.models.cache import KVCache
from specwood.models.transformer import Transformer
from specwood.sampling import SamplingParams, next_token


def prefill(model: Transformer, cache: KVCache, prompt: list[int], chunk: int = 512) -> torch.Tensor:
    """Write the prompt's K/V into cache slots [0, len) and return the last token's logits [V].

    Long prompts go in chunks to bound the attention and MLP activations.
    """
    dev = model.device
    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
    cache.check_room(len(prompt))
    logits = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        pos = torch.arange(start, end, device=dev)
        mask = torch.ones(end - start, end, dtype=torch.bool, device=dev).tril(diagonal=start)
        logits = model(ids[None, start:end], pos, mask, cache, pos, output_rows=torch.tensor([end - start - 1], device=dev))
    cache.length = len(prompt)
    return logits[0, -1]


def autoregressive_steps(model: Transformer, cache: KVCache, prompt: list[int], params: SamplingParams,
                         generator: torch.Generator | None) -> Iterator[list[int]]:
    """Yield one token per step until the consumer stops iterating."""
    dev = model.device
    logits = prefill(model, cache, prompt)
    while True:
        token = int(next_token(logits, params, generator))
        yield [token]
        pos = cache.length
        cache.check_room(pos + 1)
        slot = torch.tensor([pos], device=dev)
        mask = torch.ones(1, pos + 1, dtype=torch.bool, device=dev)
        logits = model(torch.tensor([[token]], device=dev), slot, mask, cache, slot)[0, -1]
        cache.length = pos + 1
