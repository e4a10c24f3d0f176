"""One forward for many cache rows: pad each row's tokens to a [B, T] batch with its own
positions, cache slots and mask, and return only the logits each row asked for."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specwood.models.cache import KVCache
from specwood.models.transformer import Transformer


@dataclass
class RowInput:
    """One cache row's part of a batched forward."""

    row: int  # the cache row
    tokens: torch.Tensor  # [n] token ids
    positions: torch.Tensor  # [n]
    slots: torch.Tensor  # [n] cache slots the tokens' K/V go to
    mask: torch.Tensor  # [n, s] bool over the row's slots [0, s)
    outputs: torch.Tensor  # indices (into the n tokens) whose logits are wanted


def forward_rows(model: Transformer, cache: KVCache, inputs: list[RowInput]) -> list[torch.Tensor]:
    """Run every row's tokens in ONE forward; logits [len(outputs), V] per row. Padding tokens
    write their K/V to the cache's scratch slot and attend to slot 0; nothing reads them."""
    dev = model.device
    for x in inputs:
        cache.check_room(x.mask.shape[1])
        model.check_positions(int(x.positions.max()))  # host-side tensors: no device sync
    if len(inputs) == 1:  # no padding: a view of the one row
        x = inputs[0]
        out = model(x.tokens[None].to(dev), x.positions.to(dev), x.mask.to(dev), cache, x.slots.to(dev),
                    output_rows=x.outputs.to(dev), rows=slice(x.row, x.row + 1))
        return [out[0]]
    B = len(inputs)
    T = max(len(x.tokens) for x in inputs)
    S = max(x.mask.shape[1] for x in inputs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    slots = torch.full((B, T), cache.scratch_slot, dtype=torch.long)
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    mask[:, :, 0] = True
    for b, x in enumerate(inputs):
        n, s = len(x.tokens), x.mask.shape[1]
        tokens[b, :n], positions[b, :n], slots[b, :n] = x.tokens, x.positions, x.slots
        mask[b, :n] = False
        mask[b, :n, :s] = x.mask
    sel_b = torch.cat([torch.full((len(x.outputs),), b, dtype=torch.long) for b, x in enumerate(inputs)])
    sel_t = torch.cat([x.outputs.long() for x in inputs])
    rows = torch.tensor([x.row for x in inputs], device=dev)
    out = model(tokens.to(dev), positions.to(dev), mask.to(dev), cache, slots.to(dev),
                output_rows=(sel_b.to(dev), sel_t.to(dev)), rows=rows)
    return list(out.split([len(x.outputs) for x in inputs]))
