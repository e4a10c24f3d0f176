"""A draft source on the llama.cpp backend: the draft model's tree drafting as llama.cpp decodes.

One request's drafting state lives in one llama.cpp context (its own KV cache), borrowed from a
`LlamaCppDraft` pool. The committed context is sequence 0. Each draft call decodes, in ONE batch,
the tokens accepted last step that the draft never processed (`pending`, on sequence 0) and the
requested tree nodes not processed yet together with their unprocessed ancestors. Tree nodes get
sequences as the tree grows: a node continues its parent's sequence while the parent is that
sequence's tip, and opens a new one (given the parent's path with seq_cp) where the parent
already has a processed child. After verification `commit` keeps the processed part of the
accepted path as sequence 0 and drops every other tree cell (seq_rm / seq_keep).
"""
from __future__ import annotations

from typing import Any

import torch

from specwood.drafting.base import DraftSource
from specwood.drafting.model_source import processed_path
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.models.llamacpp import LlamaCppModel
from specwood.tree.token_tree import TokenTree


class LlamaCppDraftSource(DraftSource):
    """A DraftSource on a llama.cpp context (see the module docstring): its own KV state, which it
    prefills and drafts on itself (not `batched`)."""

    uses_draft_model = True

    def __init__(self, owner: Any) -> None:
        self.owner = owner  # the LlamaCppDraft whose contexts this source borrows
        self.vocab_size = owner.config.vocab_size
        self.ctx: LlamaCppModel | None = None
        self.forwards = 0
        self._clear()
        self.pending: list[int] = []

    def _clear(self) -> None:
        self.node_seq: dict[int, int] = {}  # processed tree node -> the sequence it was decoded for
        self.tips: dict[int, int] = {0: -1}  # sequence -> its deepest node (-1: the committed prefix)
        self.node_logits: dict[int, torch.Tensor] = {}
        self.seen: TokenTree | None = None
        self.root_pos = 0

    # --- request life cycle ---------------------------------------------------------------------

    def attach(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        if self.ctx is None:
            self.ctx = self.owner.borrow()
        if prompt_len + max_new_tokens > self.ctx.n_ctx:
            raise ContextLengthError(f"{prompt_len} + {max_new_tokens} tokens do not fit the llama.cpp draft "
                                     f"context of {self.ctx.n_ctx}; raise --max-context")
        self.ctx.reset()
        self.pending = []
        self._clear()

    def _context(self) -> LlamaCppModel:
        """The context `attach` borrowed."""
        if self.ctx is None:
            raise RuntimeError("a llama.cpp draft source used before attach")
        return self.ctx

    def prefill_part(self, prompt_tokens: list[int], start: int, end: int) -> None:
        self._context().prefill(prompt_tokens[start:end])

    def start(self, prompt_tokens: list[int], max_new_tokens: int = 0) -> None:
        self.attach(len(prompt_tokens), max_new_tokens)
        self.prefill_part(prompt_tokens, 0, len(prompt_tokens))

    def close(self) -> None:
        if self.ctx is not None:
            self.owner.give_back(self.ctx)
            self.ctx = None

    # --- drafting -------------------------------------------------------------------------------

    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        self.seen = tree
        todo = sorted({a for n in nodes for a in tree.path_to(n) if a not in self.node_seq})
        if todo or self.pending:
            self._forward(tree, todo)
        if not nodes:
            return torch.empty(0, self.vocab_size)
        return torch.stack([self.node_logits[n] for n in nodes])

    def _forward(self, tree: TokenTree, todo: list[int]) -> None:
        ctx, pending = self._context(), self.pending
        if not self.node_seq:
            self.root_pos = ctx.n_past + len(pending)
        cells = ctx.n_past + len(pending) + len(self.node_seq) + len(todo)  # llama.cpp needs a cell each
        if cells > ctx.n_ctx or len(pending) + len(todo) > ctx.n_batch:
            raise ContextLengthError("no room in the llama.cpp draft context for this tree")
        try:
            fresh = self._assign_sequences(tree, todo)
            new = set(todo)
            through: dict[int, set[int]] = {n: set() for n in todo}  # a new cell: the sequences below it
            for node in todo:
                a = node
                while a in new:
                    through[a].add(self.node_seq[node])
                    a = tree.parents[a]
            ctx.decode_batch(
                pending + [tree.tokens[n] for n in todo],
                list(range(ctx.n_past, self.root_pos)) + [self.root_pos + tree.depths[n] for n in todo],
                [[0, *fresh]] * len(pending) + [sorted(through[n]) for n in todo],
                [False] * len(pending) + [True] * len(todo),
            )
        except Exception:  # forget this tree's cells: the cache is the committed prefix again
            ctx.rollback(ctx.n_past)
            self._clear()
            raise
        ctx.n_past += len(pending)
        self.pending = []
        self.forwards += 1
        for node, row in zip(todo, ctx.output_logits(len(todo))):
            self.node_logits[node] = row

    def _assign_sequences(self, tree: TokenTree, todo: list[int]) -> list[int]:
        """Give each new node a sequence (its parent's while the parent is that sequence's tip, else
        a new one holding the parent's path); the new sequences."""
        ctx, new, fresh = self._context(), set(todo), []
        for node in todo:  # parents come before children in a TokenTree
            parent = tree.parents[node]
            seq = self.node_seq[parent] if parent >= 0 else 0
            if self.tips.get(seq) != parent:  # the parent's sequence goes on elsewhere: branch off
                seq = len(self.tips)
                if seq >= ctx.n_seq_max:
                    raise SpecwoodError(f"a draft tree with more than {ctx.n_seq_max - 1} branches exceeds the "
                                        "llama.cpp draft's sequences; lower --budget")
                old = parent
                while old in new:  # the part of the path already in the cache comes by seq_cp
                    old = tree.parents[old]
                if old >= 0:
                    ctx.share_prefix(self.node_seq[old], seq, self.root_pos + tree.depths[old] + 1)
                else:
                    ctx.share_prefix(0, seq)
                fresh.append(seq)
            self.node_seq[node] = seq
            self.tips[seq] = node
        return fresh

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """Keep the processed part of the accepted path as sequence 0; queue the rest as pending."""
        tokens = [tree.tokens[0]] + [tree.tokens[i] for i in accepted]
        if self.pending:  # nothing of this tree was processed: the old pending tokens still wait
            self.pending += tokens
        else:
            kept = processed_path(self.seen if self.seen is not None else tree, tokens, self.node_seq)
            if kept:
                self._context().keep_path(self.node_seq[kept[-1]], self.root_pos + len(kept))
            self.pending = tokens[len(kept):]
        self._clear()
