"""The model-runner seam: what decoding needs from a target model, whatever runs it.

A ModelRunner holds ONE sequence's KV state: `prefill` the prompt, `forward_tree` (logits after
every node of a token tree rooted right after the committed tokens), `commit` the accepted
root-to-node path (the rest of the tree is forgotten), `rollback` to a shorter prefix. The
llama.cpp backend's LlamaCppModel implements it, and so does TorchRunner over our own runtime.

RunnerExecutor runs a runner for the engine and the server (under the one Scheduler): requests
one at a time (a runner has one sequence), composing the sequential executor's step
(`SequentialStep`) with the runner as its rows (`TargetRows`).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from specwood.drafting.base import DraftSource
from specwood.drafting.model_source import ModelDraftSource
from specwood.engine.executor import Executor
from specwood.engine.request import Request, State
from specwood.engine.sequential import Chunk, SequentialStep, TargetRows, read_own_draft
from specwood.engine.step import StepRecord, advance, tree_row
from specwood.errors import ContextLengthError
from specwood.models.batch import forward_rows
from specwood.models.prefill import PREFILL_CHUNK, prefill_rows
from specwood.models.transformer import Transformer
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict


class ModelRunner(Protocol):
    n_ctx: int  # tokens the runner's KV state holds (committed + one tree)
    n_past: int  # committed tokens

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens to the committed ones; float32 logits after the last, [V]."""

    def forward_tree(self, tree: TokenTree) -> torch.Tensor:
        """Logits [len(tree), V] after every node of `tree` (root at position n_past); the tree
        stays uncommitted until `commit` or `rollback`."""

    def commit(self, path: Sequence[int]) -> None:
        """Keep the last tree's nodes `path` (root first, parent to child) as committed tokens."""

    def rollback(self, n: int) -> None:
        """Keep only the first n committed tokens."""

    def reset(self) -> None:
        """Forget everything."""


class TorchRunner:
    """ModelRunner over our own runtime: a Transformer and a one-row KV cache."""

    def __init__(self, model: Transformer, n_ctx: int) -> None:
        self.model = model
        self.n_ctx = min(n_ctx, model.max_positions)
        self.cache = model.new_cache(self.n_ctx)

    @property
    def n_past(self) -> int:
        return self.cache.lengths[0]

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        # prefill_rows writes ids[start:]; the ids before are cached already (their values unused here)
        start = self.n_past
        ids = [0] * start + [int(t) for t in tokens]
        with torch.inference_mode():
            return prefill_rows(self.model, self.cache, [(0, ids, start, len(ids))])[0].float()

    def forward_tree(self, tree: TokenTree) -> torch.Tensor:
        with torch.inference_mode():
            return forward_rows(self.model, self.cache, [tree_row(0, tree, self.n_past)])[0].float()

    def commit(self, path: Sequence[int]) -> None:
        L = self.n_past
        self.cache.compact([L + i for i in path], L, 0)

    def rollback(self, n: int) -> None:
        self.cache.lengths[0] = n

    def reset(self) -> None:
        self.cache.lengths[0] = 0


class RunnerExecutor(Executor, TargetRows):
    """The sequential step (`SequentialStep`: the same drafting, verification and bookkeeping as the
    batched one) on a ModelRunner's one sequence: one request at a time (the others wait), its
    prompt at once, each step one tree forward."""

    name = "sequential"
    records_steps = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.tree_room = 0  # a tree that does not fit next to the context is decoded plainly
        self.row_len = runner.n_ctx
        self.steps = SequentialStep(self, self)

    def draft_source(self, model: Any) -> DraftSource:
        # one request at a time: a torch draft gets a one-row cache of its own
        return ModelDraftSource(model) if isinstance(model, Transformer) else model.new_source()

    def ensure_room(self, needed: int, idle: bool = True) -> None:
        if needed > self.runner.n_ctx:
            raise ContextLengthError(f"the request needs {needed} context tokens but the model's context holds "
                                     f"{self.runner.n_ctx}; shorten the prompt or lower max_tokens (or raise "
                                     "--max-context)")

    def free_slots(self, running: int) -> int:
        return 0 if running else 1

    def admit(self, req: Request) -> None:
        self.runner.reset()
        if req.uses_draft_model:
            req.attach_draft()
        req.row = 0

    def step(self, running: list[Request]) -> StepRecord | None:
        return self.steps.step(running)

    def release(self, req: Request) -> None:
        req.row = None
        req.drafter.close()

    # --- the rows of its step (TargetRows): the runner's one sequence ----------------------------

    def prefill_chunks(self, newcomers: list[Request], decoding: list[Request]) -> list[Chunk]:
        """Each newcomer's prompt whole on the target (nobody else is decoding); its draft reads
        the prompt after the first token, PREFILL_CHUNK tokens a step while it decodes plainly
        (a `draft_first` request's at once, before its first token), by its own source."""
        for req in newcomers:
            if req.draft_first and req.draft_behind:
                read_own_draft(self, req, req.draft_prefilled, len(req.prompt_ids))
        for req in decoding:
            if req.draft_behind:
                end = min(len(req.prompt_ids), req.draft_prefilled + PREFILL_CHUNK)
                read_own_draft(self, req, req.draft_prefilled, end)
        return [(req, 0, len(req.prompt_ids)) for req in newcomers if req.state is State.PREFILL]

    def prefill(self, chunks: list[Chunk]) -> None:
        for req, _, end in chunks:
            try:
                req.prefill_logits = self.runner.prefill(req.prompt_ids)
                req.prefilled = end
            except Exception as e:  # noqa: BLE001
                self.fail(req, e)

    def fits(self, req: Request, tree: TokenTree) -> bool:
        return self.runner.n_past + len(tree) <= self.runner.n_ctx

    def forward(self, live: list[Request], trees: dict[Request, TokenTree], failed: dict[Request, BaseException],
                chunks: list[Chunk]) -> list[torch.Tensor | None]:
        outs: list[torch.Tensor | None] = []
        for req in live:  # (no chunks ride: a newcomer waits until the request before it ends)
            try:
                outs.append(self.runner.forward_tree(trees[req]))
            except Exception as e:  # noqa: BLE001
                failed[req] = e
                outs.append(None)
        return outs

    def commit(self, req: Request, tree: TokenTree, verdict: Verdict, cost: StepRecord, forced: int = 0) -> list[int]:
        self.runner.commit([0] + verdict.accepted)
        return advance(req, tree, verdict, cost, forced)
