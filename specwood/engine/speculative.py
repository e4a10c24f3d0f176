"""Speculative decoding on one device: draft a tree -> one target forward -> verify -> compact."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from specwood.drafting.base import DraftSource, TreeShape
from specwood.drafting.shapes import MAX_BUDGET
from specwood.engine.autoregressive import prefill
from specwood.errors import SpecwoodError
from specwood.models.transformer import Transformer
from specwood.sampling import SamplingParams, next_token
from specwood.tree.token_tree import TokenTree
from specwood.verify import verify

if TYPE_CHECKING:
    from specwood.engine.api import Engine

MAX_TREE_NODES = MAX_BUDGET + 1  # the largest budget a shape accepts, plus the root


@dataclass
class SpecStats:
    """Per-request speculative statistics."""

    steps: int = 0
    accepted: int = 0  # drafted tokens accepted (the bonus/correction token not counted)
    drafted_depth: int = 0  # sum of tree depths: what a perfect draft would have had accepted
    tree_nodes: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    by_depth_reached: list[int] = field(default_factory=list)  # steps whose path reached depth d+1
    by_depth_offered: list[int] = field(default_factory=list)  # steps whose tree had depth >= d+1

    def record(self, tree: TokenTree, n_accepted: int, draft_s: float, verify_s: float) -> None:
        self.steps += 1
        self.accepted += n_accepted
        depth = tree.max_depth
        self.drafted_depth += depth
        self.tree_nodes += tree.size
        self.draft_s += draft_s
        self.verify_s += verify_s
        while len(self.by_depth_offered) < depth:
            self.by_depth_offered.append(0)
            self.by_depth_reached.append(0)
        for d in range(depth):
            self.by_depth_offered[d] += 1
            self.by_depth_reached[d] += d < n_accepted

    def as_dict(self) -> dict[str, Any]:
        s = max(self.steps, 1)
        return {
            "spec_steps": self.steps,
            # AAT: tokens emitted per target forward, the bonus/correction token included
            "mean_accepted_tokens": round((self.accepted + self.steps) / s, 4),
            "acceptance_rate": round(self.accepted / self.drafted_depth, 4) if self.drafted_depth else 0.0,
            "acceptance_by_depth": [round(r / o, 4) for r, o in zip(self.by_depth_reached, self.by_depth_offered)],
            "mean_tree_nodes": round(self.tree_nodes / s, 2),
            "mean_tree_depth": round(self.drafted_depth / s, 3),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
        }


def speculative_steps(target: Transformer, source: DraftSource | None, shape: TreeShape, prompt: list[int],
                      max_tokens: int, params: SamplingParams, generator: torch.Generator | None,
                      stats: SpecStats) -> Iterator[list[int]]:
    """Yield the tokens of each step: first the prefill's token, then accepted path + next token."""
    dev = target.device
    cache = target.new_cache(len(prompt) + max_tokens + MAX_TREE_NODES)
    logits = prefill(target, cache, prompt)
    root = int(next_token(logits, params, generator))
    if source is not None:  # the draft's prefill is part of the time to the first token
        source.start(prompt, max_tokens)
    yield [root]
    context = list(prompt)
    while True:
        t0 = time.perf_counter()
        L = cache.length
        tree = shape.build(context, root, source, params, generator)
        if L + tree.max_depth >= target.max_positions:  # no room to speculate: plain step
            tree = TokenTree.with_root(root)
        t1 = time.perf_counter()
        n = len(tree)
        slots = torch.arange(L, L + n, device=dev)
        out = target(torch.tensor([tree.tokens], device=dev), tree.positions(L).to(dev),
                     tree.attention_mask(L).to(dev), cache, slots)[0]
        verdict = verify(tree, out, params, generator)
        path = [0] + verdict.accepted
        cache.compact([L + i for i in path], L)
        if source is not None:
            source.commit(tree, verdict.accepted, verdict.next_token)
        stats.record(tree, len(verdict.accepted), t1 - t0, time.perf_counter() - t1)
        context.extend(tree.tokens[i] for i in path)
        root = verdict.next_token
        yield [tree.tokens[i] for i in verdict.accepted] + [root]


def build_method(engine: "Engine", method: str, options: dict[str, Any]) -> tuple[DraftSource | None, TreeShape]:
    """Compose a draft source and a tree shape for a method name."""
    from specwood.drafting.model_source import ModelDraftSource, early_exit_model
    from specwood.drafting.shapes import SHAPES, make_shape, needs_model

    options = dict(options)
    if method == "prior":
        from specwood.planner import prior_components

        return prior_components(engine, options)
    if method == "early-exit":
        layer = options.pop("exit_layer", None) or max(1, engine.target_config.n_layers // 4)
        shape_name = options.pop("shape", "chain")
        source = ModelDraftSource(early_exit_model(engine.target, int(layer)))
        return source, make_shape(shape_name, **options)
    if method not in SHAPES:
        raise SpecwoodError(f"unknown method '{method}' (choose from ar, auto, prior, early-exit, {', '.join(SHAPES)})")
    shape = make_shape(method, **options)
    if not needs_model(method):
        return None, shape
    if engine.draft_model is None:
        raise SpecwoodError(f"method '{method}' needs a draft model; pass --draft NAME|PATH (draft=... in the API)")
    return ModelDraftSource(engine.draft_model), shape


def speculative_run(target: Transformer, source: DraftSource | None, shape: TreeShape, prompt: list[int],
                    max_tokens: int, params: SamplingParams, generator: torch.Generator | None,
                    ) -> tuple[Iterator[list[int]], Callable[[], dict[str, Any]]]:
    """The step iterator and a function returning its statistics once it has run."""
    stats = SpecStats()
    return speculative_steps(target, source, shape, prompt, max_tokens, params, generator, stats), stats.as_dict
