"""One forward for many cache rows: pad each row's tokens to a [B, T] batch with its own
positions, cache slots and mask, and return only the logits each row asked for. Rows of very
different lengths (a decode step beside a prefill chunk) go in separate padded blocks packed into
the same forward, so nobody's one token is computed at the length of someone's chunk."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specwood.models.cache import KVCache
from specwood.models.cuda_graphs import GraphedForward
from specwood.models.transformer import Transformer


@dataclass
class RowInput:
    """One cache row's part of a batched forward."""

    row: int  # the cache row
    tokens: torch.Tensor  # [n] token ids (or [n, dim] hidden states into a later pipeline stage)
    positions: torch.Tensor  # [n]
    slots: torch.Tensor  # [n] cache slots the tokens' K/V go to
    mask: torch.Tensor  # [n, s] bool over the row's slots [0, s)
    outputs: torch.Tensor  # indices (into the n tokens) whose logits are wanted (a stage without the
    # head returns every token's hidden state instead)
    features: torch.Tensor | None = None  # indices whose features (`model.features`) are wanted too


def similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in blocks to pad together, longest first. A padded block computes
    every row at its longest row's length, so a row less than half as long as its block's
    longest starts a new block (which costs one more attention call per layer, not another
    pass over the weights)."""
    blocks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        if blocks and 2 * lengths[i] > lengths[blocks[-1][0]]:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    return blocks


def pad_rows(inputs: list[RowInput], scratch_slot: int) -> tuple[torch.Tensor, ...]:
    """tokens [B, T(, dim)], positions [B, T], slots [B, T] and mask [B, T, S] of the rows padded to
    the longest; padding tokens go to the scratch slot and attend to slot 0. Scattered in a fixed
    number of ops whatever B (a copy per row and tensor was ~2 ms for 256 rows, a fifth of a tiny
    model's batched step)."""
    B = len(inputs)
    lengths = [x.tokens.shape[0] for x in inputs]  # (shape[0] here and below: Tensor.__len__ costs ~1 us)
    widths = [x.mask.shape[1] for x in inputs]
    T, S = max(lengths), max(widths)
    first = inputs[0].tokens
    n = torch.tensor(lengths)
    row_of = torch.repeat_interleave(torch.arange(B), n)  # each row token's (batch row, column)
    col = torch.arange(len(row_of)) - torch.repeat_interleave(n.cumsum(0) - n, n)
    tokens = torch.zeros((B, T, *first.shape[1:]), dtype=first.dtype, device=first.device)
    tokens[row_of.to(first.device), col.to(first.device)] = torch.cat([x.tokens for x in inputs])
    positions = torch.zeros(B, T, dtype=torch.long)
    positions[row_of, col] = torch.cat([x.positions for x in inputs])
    slots = torch.full((B, T), scratch_slot, dtype=torch.long)
    slots[row_of, col] = torch.cat([x.slots for x in inputs])
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    mask[:, :, 0] = True
    if all(w == S for w in widths):
        mask[row_of, col] = torch.cat([x.mask for x in inputs])
    else:  # each row's [n, s] block, element by element into the flat [B, T, S] (its slot 0 included)
        w = torch.tensor(widths)
        cells = n * w
        width = torch.repeat_interleave(w, cells)
        k = torch.arange(len(width)) - torch.repeat_interleave(cells.cumsum(0) - cells, cells)
        b = torch.repeat_interleave(torch.arange(B), cells)
        mask.view(-1)[(b * T + k // width) * S + k % width] = torch.cat([x.mask.reshape(-1) for x in inputs])
    return tokens, positions, slots, mask


def forward_rows(model: Transformer, cache: KVCache, inputs: list[RowInput]) -> list[torch.Tensor]:
    """Run every row's tokens in ONE forward; logits [len(outputs), V] per row (hidden states
    [n, dim] on a pipeline stage without the head). Padding tokens write their K/V to the cache's
    scratch slot and attend to slot 0; nothing reads them."""
    return forward_rows_features(model, cache, inputs)[0]


def forward_rows_features(model: Transformer, cache: KVCache, inputs: list[RowInput]
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """`forward_rows`, and each row's features [len(features), dim] where it asks for them
    (`RowInput.features`; None elsewhere): what a feature-level draft head reads of the target."""
    dev = model.device
    for x in inputs:
        cache.check_room(x.mask.shape[1])
        model.check_positions(int(x.positions.max()))  # host-side tensors: no device sync
    graphs = getattr(cache, "graphs", None)
    if graphs is not None and graphs.fits(len(inputs), max(x.tokens.shape[0] for x in inputs)):
        return _forward_graphed(model, graphs, inputs)
    if len(inputs) == 1 and inputs[0].features is None:  # no padding: a view of the one row
        x = inputs[0]
        out = model(x.tokens[None].to(dev), x.positions.to(dev), x.mask.to(dev), cache, x.slots.to(dev),
                    output_rows=x.outputs.to(dev), rows=slice(x.row, x.row + 1))
        return [out[0]], [None]
    return _forward_packed(model, cache, inputs, similar_lengths([x.tokens.shape[0] for x in inputs]))


def _features(model: Transformer, hidden: torch.Tensor, inputs: list[RowInput], first: list[int]
              ) -> list[torch.Tensor | None]:
    """The features each row asked for, out of the forward's hidden states [N, dim] (row i's
    tokens start at `first[i]`)."""
    return [model.features(hidden[(x.features.long() + first[i]).to(hidden.device)]) if x.features is not None
            else None for i, x in enumerate(inputs)]


def _forward_packed(model: Transformer, cache: KVCache, inputs: list[RowInput], blocks: list[list[int]]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The rows in one or more padded blocks, one after another in ONE forward (`hidden_packed`);
    hidden states out on a pipeline stage without the head (each row's own tokens)."""
    dev = model.device
    parts, start = [], 0
    first = [0] * len(inputs)  # where each row's tokens start among the packed tokens
    for members in blocks:
        rows_in = [inputs[i] for i in members]
        tokens, positions, slots, mask = pad_rows(rows_in, cache.scratch_slot)
        T = tokens.shape[1]
        for b, i in enumerate(members):
            first[i] = start + b * T
        start += len(members) * T
        parts.append((tokens.to(dev), positions.to(dev), mask.to(dev), slots.to(dev),
                      torch.tensor([x.row for x in rows_in], device=dev)))
    hidden = model.hidden_packed(parts, cache)
    if not getattr(model, "is_last", True):
        return [hidden[first[i]:first[i] + x.tokens.shape[0]] for i, x in enumerate(inputs)], [None] * len(inputs)
    counts = [x.outputs.shape[0] for x in inputs]
    wanted = (torch.cat([x.outputs for x in inputs]).long()
              + torch.repeat_interleave(torch.tensor(first), torch.tensor(counts)))
    out = model.head(hidden[wanted.to(dev)])
    return list(out.split(counts)), _features(model, hidden, inputs, first)


def _forward_graphed(model: Transformer, graphs: GraphedForward, inputs: list[RowInput]
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The same forward through fixed-shape CUDA graphs (`GraphedForward` pads it to a bucket)."""
    tokens, positions, slots, mask = pad_rows(inputs, graphs.cache.scratch_slot)
    hidden = graphs(tokens, positions, mask, slots, [x.row for x in inputs])
    if not getattr(model, "is_last", True):
        return [hidden[b, :x.tokens.shape[0]].clone() for b, x in enumerate(inputs)], [None] * len(inputs)
    out = model.head(hidden, _wanted(inputs, hidden.device))
    T = hidden.shape[1]
    feats = _features(model, hidden.flatten(0, 1), inputs, [b * T for b in range(len(inputs))])
    return list(out.split([x.outputs.shape[0] for x in inputs])), feats


def _wanted(inputs: list[RowInput], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, token) index pairs of the logits each row asked for."""
    sel_b = torch.cat([torch.full((x.outputs.shape[0],), b, dtype=torch.long) for b, x in enumerate(inputs)])
    sel_t = torch.cat([x.outputs.long() for x in inputs])
    return sel_b.to(dev), sel_t.to(dev)
