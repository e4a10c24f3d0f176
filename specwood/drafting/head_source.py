"""The draft source of a feature-level draft head (specwood.drafting.head): one request's drafting
state on a row of the head's KV pool.

The head's cache holds one entry per context token after the first: the pair (x_{s+1}, f_s) in
slot s, at position s, f_s being the target's feature of token s. The target hands its features
over as it computes them: the prompt's in its prefill (`take_prompt_features`), the tree's in each
verification forward (`take_tree_features`). A tree's root x_L pairs with f_{L-1}; any other node
with its parent's head output g, so the head processes a tree one level per forward. After
verification only the root's entry is kept (it used the target's own feature); the accepted
nodes go back in as pending pairs with the target's features, which are better than the head's
guesses, and are read in the next draft forward together with the next root.
"""
from __future__ import annotations

import torch

from specwood.drafting.model_source import ModelDraftSource, _DraftRows
from specwood.errors import SpecwoodError
from specwood.models.batch import RowInput
from specwood.tree.token_tree import TokenTree


class FeatureHeadSource(ModelDraftSource):
    """A ModelDraftSource whose rows are (token, feature) pairs instead of tokens."""

    wants_target_features = True  # the scheduler asks the target's forwards for this request's features

    def shares_prefixes(self) -> bool:
        return False  # its rows hold (token, feature) pairs: a token prefix's K/V is not theirs

    def attach(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        super().attach(prompt_len, max_new_tokens)
        self.known: list[torch.Tensor] = []  # target features f_m.. not yet read (m: the cache's length)
        self.n_known = 0  # the prompt's features received so far (a re-run chunk is not taken twice)
        self.tree_features: torch.Tensor | None = None  # the target's, for this step's verified tree
        self.node_features: dict[int, torch.Tensor] = {}  # tree node -> the head's g after it

    def defer(self, prompt_tokens: list[int]) -> None:
        """The prompt's pairs wait for the target's prefill to bring their features."""
        self.pending = list(prompt_tokens[1:])

    def prefill_part(self, prompt_tokens: list[int], start: int, end: int) -> None:
        raise SpecwoodError("a draft head reads the prompt from the target's features (defer_draft_prefill)")

    def take_prompt_features(self, start: int, end: int, features: torch.Tensor) -> None:
        """The target's features [end - start, dim] of prompt tokens [start, end)."""
        if end > self.n_known:
            self.known.append(features[max(self.n_known - start, 0):])
            self.n_known = end

    def take_tree_features(self, features: torch.Tensor) -> None:
        """The target's features [len(tree), dim] of this step's verified tree."""
        self.tree_features = features

    # --- drafting -------------------------------------------------------------------------------

    def _known(self) -> torch.Tensor:
        if len(self.known) != 1:
            self.known = [torch.cat(self.known)] if self.known else []
        if not self.known or len(self.known[0]) != len(self.pending) + 1:
            raise SpecwoodError("the draft head has no target features for this request's context; it needs "
                                "the sequential executor on the torch backend")
        return self.known[0]

    def ready(self, tree: TokenTree, todo: list[int]) -> list[int]:
        """Only nodes whose parent's output is in (or the root): one tree level per forward."""
        return [n for n in todo if n == 0 or tree.parents[n] in self.node_features]

    def plan_forward(self, tree: TokenTree, nodes: list[int]) -> _DraftRows | None:
        rows = super().plan_forward(tree, nodes)
        if rows is None:
            return None
        known = self._known()
        n_pending = len(rows.tokens) - len(rows.todo)
        feats = [known[:n_pending]] if n_pending else []
        feats += [known[-1:] if n == 0 else self.node_features[tree.parents[n]][None] for n in rows.todo]
        rows.inputs = self.model.pair_inputs(torch.tensor(rows.tokens), torch.cat(feats))
        return rows

    def row_input(self, rows: _DraftRows) -> RowInput:
        row = super().row_input(rows)
        row.features = row.outputs  # the head's g of each tree node: its children's input
        return row

    def absorb(self, rows: _DraftRows, out: torch.Tensor, features: torch.Tensor | None = None) -> None:
        had_pending = bool(self.pending)
        super().absorb(rows, out)
        if had_pending:  # read: what is left is the root's feature
            self.known = [self.known[0][-1:]]
        assert features is not None  # wants_target_features: the forward computed them
        for k, node in enumerate(rows.todo):
            self.node_features[node] = features[k]

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """Keep the root's entry if this step processed it; the accepted nodes become pending
        pairs with the target's features, and the last of those features pairs with the next root."""
        if self.tree_features is None:
            raise SpecwoodError("the draft head got no target features for the verified tree; it needs the "
                                "sequential executor on the torch backend")
        path = [0] + accepted
        got = self.tree_features[path]
        root_read = self.seen is not None and 0 in self.slot_of
        if root_read:
            cache, row = self.kv_row()
            cache.compact([self.slot_of[0]], self.length, row)
            self.pending = [tree.tokens[i] for i in accepted]
            self.known = [got]
        else:  # nothing of this tree was processed: the root joins the pending pairs
            self.pending += [tree.tokens[i] for i in path]
            self.known = [torch.cat(self.known + [got])] if self.known else [got]
        self.slot_of, self.node_logits, self.node_features, self.seen, self.tree_features = {}, {}, {}, None, None
