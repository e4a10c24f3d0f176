"""Model-backed draft sources: a separate draft model, or the target's own first layers."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specwood.drafting.shapes import MAX_BUDGET
from specwood.engine.autoregressive import prefill
from specwood.errors import SpecwoodError
from specwood.models.transformer import Transformer
from specwood.tree.token_tree import TokenTree


class ModelDraftSource:
    """Runs a draft model over tree nodes with its own static KV cache.

    The cache holds the committed context; nodes of the current tree get slots after it as they
    are first needed (a node is processed together with any unprocessed ancestors, so a
    layer-wise shape costs one forward per layer and a heap shape one per expansion). Accepted
    tokens the draft never processed (leaves) are kept as `pending` and go into the next forward.
    """

    def __init__(self, model: Transformer, extra_slots: int = MAX_BUDGET + 1):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.extra_slots = extra_slots
        self.cache = None
        self.pending: list[int] = []
        self.slot_of: dict[int, int] = {}  # tree node -> cache slot, for the current tree
        self.node_logits: dict[int, torch.Tensor] = {}  # tree node -> draft logits after it
        self.seen: TokenTree | None = None  # the tree the current slots belong to
        self.forwards = 0

    def start(self, prompt_tokens: list[int], max_new_tokens: int = 0) -> None:
        need = len(prompt_tokens) + max_new_tokens + self.extra_slots
        if self.cache is None or self.cache.max_len < need:
            self.cache = self.model.new_cache(need)
        self.cache.reset()
        self.pending, self.slot_of, self.node_logits, self.seen = [], {}, {}, None
        prefill(self.model, self.cache, prompt_tokens)

    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        self.seen = tree
        todo = sorted({a for n in nodes for a in tree.path_to(n) if a not in self.slot_of})
        if todo or self.pending:
            self._forward(tree, todo)
        if not nodes:
            return torch.empty(0, self.vocab_size)
        return torch.stack([self.node_logits[n] for n in nodes]).float()

    def _forward(self, tree: TokenTree, todo: list[int]) -> None:
        dev = self.model.device
        base = self.cache.length  # committed context
        n_pending = len(self.pending)
        tree_base = base + n_pending
        first_new = tree_base + len(self.slot_of)
        for k, node in enumerate(todo):
            self.slot_of[node] = first_new + k
        S = first_new + len(todo)
        T = n_pending + len(todo)
        tokens = self.pending + [tree.tokens[n] for n in todo]
        positions = list(range(base, tree_base)) + [tree_base + tree.depths[n] for n in todo]
        slots = list(range(base, tree_base)) + [self.slot_of[n] for n in todo]
        mask = torch.zeros(T, S, dtype=torch.bool)
        for r in range(n_pending):
            mask[r, : base + r + 1] = True
        for r, node in enumerate(todo, start=n_pending):
            mask[r, :tree_base] = True
            for a in tree.path_to(node):
                mask[r, self.slot_of[a]] = True
        slots_t = torch.tensor(slots, device=dev)
        self.cache.check_room(S)
        out = self.model(torch.tensor([tokens], device=dev), torch.tensor(positions, device=dev),
                         mask.to(dev), self.cache, slots_t)[0]
        self.forwards += 1
        if n_pending:
            self.cache.length = tree_base
            self.pending = []
        for k, node in enumerate(todo):
            self.node_logits[node] = out[n_pending + k]

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """Keep the processed part of the accepted path in the cache; queue the rest as pending.

        The verified tree may be a pruned copy of the drafted one (eagle reranks), so the path is
        followed by tokens down the drafted tree, where siblings carry distinct tokens.
        """
        tokens = [tree.tokens[0]] + [tree.tokens[i] for i in accepted]
        seen = self.seen if self.seen is not None else tree
        kept: list[int] = []
        node: int | None = 0
        for k, token in enumerate(tokens):
            if k:
                node = next((c for c in seen.children(node) if seen.tokens[c] == token), None)
            if node is None or node not in self.slot_of:
                break
            kept.append(self.slot_of[node])
        if self.pending:  # nothing of this tree was processed: the old pending tokens still wait
            self.pending += tokens
        else:
            self.cache.compact(kept, self.cache.length)
            self.pending = tokens[len(kept):]
        self.slot_of, self.node_logits, self.seen = {}, {}, None


def early_exit_model(target: Transformer, n_layers: int) -> Transformer:
    """The target's first `n_layers` blocks plus its final norm and head, sharing the weights."""
    if not (target.is_first and target.is_last):
        raise SpecwoodError("early-exit drafting needs the whole target model on one device")
    if not 1 <= n_layers < target.config.n_layers:
        raise SpecwoodError(f"early-exit layer must be in 1..{target.config.n_layers - 1}, got {n_layers}")
    config = replace(target.config, n_layers=n_layers)
    with torch.device("meta"):
        draft = Transformer(config, max_positions=target.max_positions)
    draft.tok_embeddings = target.tok_embeddings
    draft.layers = nn.ModuleList(target.layers[:n_layers])
    draft.norm, draft.output = target.norm, target.output
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft
