"""Model-backed draft sources: a separate draft model, or the target's own first layers."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Container

import torch

from specwood.drafting.base import DraftSource
from specwood.drafting.shapes import MAX_BUDGET
from specwood.errors import SpecwoodError
from specwood.models.batch import RowInput, forward_rows_features
from specwood.models.cache import KVCache
from specwood.models.prefill import prefill_chunk
from specwood.models.transformer import Transformer
from specwood.tree.token_tree import TokenTree


@dataclass
class _DraftRows:
    """One source's part of a (batched) draft forward."""

    todo: list[int]  # tree nodes processed in this forward
    tokens: list[int]
    positions: list[int]
    slots: list[int]
    mask: torch.Tensor  # [T, S] bool over this source's cache row
    new_slots: dict[int, int]  # tree node -> slot, taken on by absorb (a failed forward leaves no trace)
    inputs: torch.Tensor | None = None  # the rows' model inputs where they are not just `tokens` (a head's pairs)


class ModelDraftSource(DraftSource):
    """Runs a draft model over tree nodes; one request's drafting state in one KV cache row.

    The row holds the committed context; nodes of the current tree get slots after it as they
    are first needed (a node is processed together with any unprocessed ancestors, so a
    layer-wise shape costs one forward per layer and a heap shape one per expansion). Accepted
    tokens the draft never processed (leaves) are kept as `pending` and go into the next forward.

    `pool` is a KVCache shared by the sources of many requests (a row each, borrowed in `attach`
    and given back in `close`), so `forward_draft_calls` can serve all their calls in one
    forward; without a pool the source keeps a one-row cache of its own.
    """

    uses_draft_model = True
    defers_prefill = True
    batched = True

    def __init__(self, model: Transformer, extra_slots: int = MAX_BUDGET + 1, pool: KVCache | None = None):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.extra_slots = extra_slots
        self.pool = pool
        self.cache: KVCache | None = pool
        self.row: int | None = None
        self.pending: list[int] = []
        self.slot_of: dict[int, int] = {}  # tree node -> cache slot, for the current tree
        self.node_logits: dict[int, torch.Tensor] = {}  # tree node -> draft logits after it
        self.seen: TokenTree | None = None  # the tree the current slots belong to
        self.forwards = 0

    # --- request life cycle ---------------------------------------------------------------------

    def attach(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        """Take a cache row with room for the request; the prompt goes in with `prefill_part`."""
        need = prompt_len + max_new_tokens + self.extra_slots
        if self.pool is None:
            if self.cache is None or self.cache.max_len < need:
                self.cache = self.model.new_cache(need)
            self.row = 0
        else:  # the pool's owner keeps its rows long enough as the request goes on (they may grow)
            self.pool.check_room(prompt_len + self.extra_slots)
            if self.row is None:
                self.row = self.pool.allocate()
        cache, row = self.kv_row()
        cache.lengths[row] = 0
        self.pending, self.slot_of, self.node_logits, self.seen = [], {}, {}, None

    def defer(self, prompt_tokens: list[int]) -> None:
        """Skip the prefill: the prompt waits as pending tokens, read in the first draft forward
        (if any: a request that never drafts never pays for it)."""
        self.pending = list(prompt_tokens)

    def prefill_part(self, prompt_tokens: list[int], start: int, end: int) -> None:
        cache, row = self.kv_row()
        prefill_chunk(self.model, cache, prompt_tokens, start, end, row)

    def start(self, prompt_tokens: list[int], max_new_tokens: int = 0, chunk: int = 512) -> None:
        self.attach(len(prompt_tokens), max_new_tokens)
        for s in range(0, len(prompt_tokens), chunk):
            self.prefill_part(prompt_tokens, s, min(s + chunk, len(prompt_tokens)))

    def close(self) -> None:
        """Give the pool row back (a source of its own keeps its cache for the next request)."""
        if self.pool is not None and self.row is not None:
            self.pool.release(self.row)
            self.row = None

    def shares_prefixes(self) -> bool:
        # on a shared pool, attached: its row holds the draft model's K/V of context tokens alone
        return self.pool is not None and self.row is not None

    # --- drafting -------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        cache, row = self.kv_row()
        return cache.lengths[row]

    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        return forward_draft_calls([(self, tree, nodes)])[0]

    def plan_forward(self, tree: TokenTree, nodes: list[int]) -> _DraftRows | None:
        """What this call needs the draft to process (None: everything is cached already)."""
        self.seen = tree
        todo = self.ready(tree, sorted({a for n in nodes for a in tree.path_to(n) if a not in self.slot_of}))
        if not todo and not self.pending:
            return None
        base = self.length  # committed context
        n_pending = len(self.pending)
        tree_base = base + n_pending
        first_new = tree_base + len(self.slot_of)
        slot_of = dict(self.slot_of)  # committed in absorb: a failed forward leaves no trace
        for k, node in enumerate(todo):
            slot_of[node] = first_new + k
        S = first_new + len(todo)
        self.kv_row()[0].check_room(S)
        self.model.check_positions(tree_base + max((tree.depths[n] for n in todo), default=0))
        paths = [[slot_of[a] for a in tree.path_to(node)] for node in todo]
        return _DraftRows(
            todo=todo,
            tokens=self.pending + [tree.tokens[n] for n in todo],
            positions=list(range(base, tree_base)) + [tree_base + tree.depths[n] for n in todo],
            slots=list(range(base, tree_base)) + [slot_of[n] for n in todo],
            mask=_draft_mask(n_pending, base, tree_base, S, paths),
            new_slots={n: slot_of[n] for n in todo},
        )

    def ready(self, tree: TokenTree, todo: list[int]) -> list[int]:
        """The nodes of `todo` (sorted, ancestors first) this forward can process: all of them
        for a model that reads tokens (a node goes in with its unprocessed ancestors)."""
        return todo

    def row_input(self, rows: _DraftRows) -> RowInput:
        """This source's rows of a draft forward; logits only for the tree nodes (pending tokens
        need none: the head is the largest matmul of a small draft)."""
        n = len(rows.tokens)
        if rows.inputs is None:  # one tensor call for the three index rows (each call ~3 us)
            tokens, positions, slots = torch.tensor([rows.tokens, rows.positions, rows.slots])
        else:
            tokens, (positions, slots) = rows.inputs, torch.tensor([rows.positions, rows.slots])
        return RowInput(self.kv_row()[1], tokens, positions, slots, rows.mask, torch.arange(n - len(rows.todo), n))

    def absorb(self, rows: _DraftRows, out: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Take the logits [len(todo), V] of this source's tree nodes in a draft forward (and
        their features, for a source that asked for them)."""
        self.forwards += 1
        self.slot_of.update(rows.new_slots)
        n_pending = len(self.pending)
        if n_pending:
            cache, row = self.kv_row()
            cache.lengths[row] = self.length + n_pending
            self.pending = []
        for k, node in enumerate(rows.todo):
            self.node_logits[node] = out[k]

    def answer(self, nodes: list[int]) -> torch.Tensor:
        if not nodes:
            return torch.empty(0, self.vocab_size)
        return torch.stack([self.node_logits[n] for n in nodes]).float()

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """Keep the processed part of the accepted path in the cache; queue the rest as pending.

        The verified tree may be a pruned copy of the drafted one (eagle reranks), so the path is
        followed by tokens down the drafted tree, where siblings carry distinct tokens.
        """
        tokens = [tree.tokens[0]] + [tree.tokens[i] for i in accepted]
        seen = self.seen if self.seen is not None else tree
        kept = [self.slot_of[n] for n in processed_path(seen, tokens, self.slot_of)]
        if self.pending:  # nothing of this tree was processed: the old pending tokens still wait
            self.pending += tokens
        else:
            cache, row = self.kv_row()
            cache.compact(kept, self.length, row)
            self.pending = tokens[len(kept):]
        self.slot_of, self.node_logits, self.seen = {}, {}, None


def processed_path(seen: TokenTree, tokens: list[int], processed: Container[int]) -> list[int]:
    """The nodes of the drafted tree `seen` along the accepted `tokens` (root first), as far as
    the draft has processed them. The verified tree may be a pruned copy of the drafted one
    (eagle reranks), so the path is followed by tokens; siblings carry distinct tokens."""
    path: list[int] = []
    node: int | None = 0
    for k, token in enumerate(tokens):
        if k and node is not None:
            node = next((c for c in seen.children(node) if seen.tokens[c] == token), None)
        if node is None or node not in processed:
            break
        path.append(node)
    return path


# below this many mask cells a draft call's mask is built as Python lists in one tensor call (~8 us
# for a few rows), above it with torch ops over whole blocks (~20 us for any size; lists cost ~0.3 us a cell)
_LIST_MASK_CELLS = 512


def _draft_mask(n_pending: int, base: int, tree_base: int, width: int, paths: list[list[int]]) -> torch.Tensor:
    """[n_pending + len(paths), width] bool: pending token r (position base + r) sees slots up to
    base + r; a tree node sees the committed slots [0, tree_base) and its path's slots."""
    rows = n_pending + len(paths)
    if rows * width <= _LIST_MASK_CELLS:
        cells = [[c <= base + r for c in range(tree_base)] + [False] * (width - tree_base) for r in range(n_pending)]
        for path in paths:
            row = [True] * tree_base + [False] * (width - tree_base)
            for slot in path:
                row[slot] = True
            cells.append(row)
        return torch.tensor(cells, dtype=torch.bool).reshape(rows, width)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    if n_pending:
        mask[:n_pending, :tree_base] = torch.ones(n_pending, tree_base, dtype=torch.bool).tril(diagonal=base)
    mask[n_pending:, :tree_base] = True
    at = [(r, slot) for r, path in enumerate(paths, start=n_pending) for slot in path]
    mask[[r for r, _ in at], [slot for _, slot in at]] = True
    return mask


def forward_draft_calls(calls: list[tuple[ModelDraftSource, TokenTree, list[int]]]) -> list[torch.Tensor]:
    """Answer the draft calls of many requests: ONE padded forward per draft model and cache pool
    (per-row positions, slots and masks over each row's own prefix), repeated while a source has
    nodes left that needed the last forward's output (a feature head goes level by level).
    Returns each call's logits."""
    while True:
        plans = [src.plan_forward(tree, nodes) for src, tree, nodes in calls]
        groups: dict[tuple[int, int], list[tuple[ModelDraftSource, _DraftRows]]] = {}
        for (src, _, _), plan in zip(calls, plans):
            if plan is not None:
                groups.setdefault((id(src.model), id(src.cache)), []).append((src, plan))
        if not groups:
            return [src.answer(nodes) for src, _, nodes in calls]
        for members in groups.values():
            first = members[0][0]
            logits, features = forward_rows_features(first.model, first.kv_row()[0],
                                                     [src.row_input(plan) for src, plan in members])
            for k, (src, plan) in enumerate(members):
                src.absorb(plan, logits[k], features[k])


def early_exit_model(target: Transformer, n_layers: int) -> Transformer:
    """The target's first `n_layers` blocks plus its final norm and head, sharing the weights."""
    if not isinstance(target, Transformer):
        raise SpecwoodError("early-exit drafts with the target's own first layers, which needs the torch "
                            "backend for the target (--backend torch)")
    if not (target.is_first and target.is_last):
        raise SpecwoodError("early-exit drafting needs the whole target model on one device")
    if not 1 <= n_layers < target.config.n_layers:
        raise SpecwoodError(f"early-exit layer must be in 1..{target.config.n_layers - 1}, got {n_layers}")
    config = replace(target.config, n_layers=n_layers)
    with torch.device("meta"):
        draft = Transformer(config, max_positions=target.max_positions)
    draft.tok_embeddings = target.tok_embeddings
    draft.layers = target.layers[:n_layers]
    draft.norm, draft.output = target.norm, target.output
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft
