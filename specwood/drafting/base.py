"""What a draft source and a tree shape are.

A *source* says which tokens might come next (a draft model, the target's own first layers,
n-gram lookup). A *shape* is a small policy that asks for distributions and decides which nodes
to add to the tree. A shape's `draft` is a coroutine: it yields each draft call it needs (the
tree so far and the nodes whose next-token logits it wants) and is sent the logits back. That is
what lets the engine answer the calls of many requests' shapes with ONE batched draft forward;
`build` answers them one by one from a single source. The engine composes any shape with any
source it supports.

The base classes here declare everything the engine calls on a source or a shape (docs/engine.md,
"Plug-in contracts"); tests/test_contracts.py checks that the engine probes neither.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Generator, Sequence

import torch

from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams, target_probs, without_padding
from specwood.tree.token_tree import TokenTree

if TYPE_CHECKING:
    from specwood.engine.step import StepRecord
    from specwood.models.cache import KVCache
    from specwood.verify import Verdict

# A draft call: "the logits after each of these nodes of this tree".
DraftCall = tuple[TokenTree, list[int]]
# A shape's drafting coroutine: yields calls, is sent float32 logits [len(nodes), V], returns the tree.
Drafting = Generator[DraftCall, torch.Tensor, TokenTree]

MAX_BUDGET = 1024  # the most drafted nodes of any tree (a row keeps MAX_BUDGET + 1 slots for one)


class DraftSource(ABC):
    """A model-like source of next-token distributions over tree nodes: one request's state.

    Everything the engine asks of a source is declared here, by role; a source subclasses this
    and overrides the methods of the roles it has (the flags say which). The engine never probes
    a source for attributes.

    - every source: `start`, `logits`, `commit` (required), `close`.
    - a draft model with KV state of its own (`uses_draft_model`: a cache row, a llama.cpp
      context): the executor `attach`es it at admission, then prefills it (`prefill_part`) or,
      where it `defers_prefill`, leaves the prompt for its first forward (`defer`).
    - a draft model on the engine's own runtime (`batched`): its rows (`model`, `cache`, `row`)
      are run together with other requests' -- its draft calls in one forward per model and pool
      (specwood.drafting.model_source.forward_draft_calls), its prompt chunks in the executor's
      prefill forward -- instead of through `logits` and `prefill_part`; `shares_prefixes` says
      whether the prefix cache may copy K/V into its row and keep it (`pending`, `length`).
    - a feature consumer (`wants_target_features`: a feature-level draft head): the target's
      forwards hand it their features (`take_prompt_features`, `take_tree_features`).
    """

    vocab_size: int

    # --- every source -------------------------------------------------------------------------

    @abstractmethod
    def start(self, prompt_tokens: list[int], max_new_tokens: int = 0) -> None:
        """Begin a request on its own (a caller outside the executors: the planner's
        measurements, a pipeline rank): the source now knows the prompt (all of it, the root
        excluded)."""

    @abstractmethod
    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Float32 logits [len(nodes), V] for the token that follows each of `nodes`.

        The source runs its forward over whatever of the tree it has not processed yet (at least
        the path to each requested node), with the tree mask. Called for each draft call of a
        step whose source is not `batched`.
        """

    @abstractmethod
    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """After each step's verification: it accepted the root and the nodes `accepted`
        (indices, root excluded) and produced `next_token` (the next root): keep the accepted
        path, forget the rest."""

    def close(self) -> None:
        """The request ended (finished, failed or cancelled; the executor's `release`): give back
        what the source borrowed (a pool row, a llama.cpp context). Idempotent."""

    # --- a draft model with KV state of its own -----------------------------------------------

    uses_draft_model: bool = False  # the executor attaches and prefills it (below)
    defers_prefill: bool = False  # `defer` works: its prompt may wait for its first draft forward

    def attach(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        """At admission: take the KV state (a cache row, a context) for a request of
        `prompt_len` prompt tokens and `max_new_tokens` new ones; the prompt comes next, by
        `prefill_part` or `defer`."""
        raise NotImplementedError(f"{type(self).__name__} has no KV state of its own to attach")

    def defer(self, prompt_tokens: list[int]) -> None:
        """At admission, after `attach`, for a drafter with `defer_draft_prefill`: no prefill;
        the prompt is read in the source's first draft forward (if it ever drafts)."""
        raise NotImplementedError(f"{type(self).__name__} cannot defer its prefill")

    def prefill_part(self, prompt_tokens: list[int], start: int, end: int) -> None:
        """Prefill prompt tokens [start, end) (chunks in order; a source that is not `batched`:
        the executor's batched prefill runs the others)."""
        raise NotImplementedError(f"{type(self).__name__} has no prompt to prefill")

    # --- rows the engine batches across requests (the engine's own draft runtime) --------------

    batched: bool = False  # its calls and prompt chunks run in the engine's batched forwards
    model: Any = None  # the draft model of those forwards
    cache: "KVCache | None" = None  # the KV cache its row lives in (a pool shared with other requests)
    row: int | None = None  # its row there; None until attached
    pending: Sequence[int] = ()  # context tokens its row has not read yet (a deferred prompt, accepted leaves)

    def kv_row(self) -> tuple[KVCache, int]:
        """Its cache and row, once attached."""
        if self.cache is None or self.row is None:
            raise RuntimeError(f"{type(self).__name__} has no cache row attached")
        return self.cache, self.row

    @property
    def length(self) -> int:
        """Context tokens its row holds."""
        return 0

    def shares_prefixes(self) -> bool:
        """Whether its row, on a pool shared with other requests, holds the draft model's K/V of
        the context tokens alone, so that the prefix cache may restore a prefix into it and keep
        its committed tokens (specwood.engine.prefix_reuse)."""
        return False

    # --- a feature consumer (a feature-level draft head) -----------------------------------------

    wants_target_features: bool = False  # the target's forwards compute this request's features

    def take_prompt_features(self, start: int, end: int, features: torch.Tensor) -> None:
        """After each target prefill chunk: the target's features [end - start, dim] of prompt
        tokens [start, end)."""

    def take_tree_features(self, features: torch.Tensor) -> None:
        """After each target forward over a step's tree, before `commit`: the target's features
        [len(tree), dim] of every node."""


def draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The draft's proposal distribution q: same temperature/top-k/top-p as the target when
    sampling; plain softmax when the target is greedy (q then only ranks and scores candidates)."""
    if params.greedy:
        return torch.softmax(without_padding(logits, params), dim=-1)
    return target_probs(logits, params)


class ShapePolicy(ABC):
    """A request's tree-shape policy: asked before each step for the shape to draft with, told
    after it what came of it. A TreeShape is its own policy (the same shape every step); `auto`'s
    PlannedShape chooses a shape per step by the load and what it has measured. The optional
    hooks are no-ops here: a policy overrides the ones it needs, and the engine calls them all."""

    name: str
    watches_root_logits: bool = False  # the engine calls `on_root_logits` each step (it costs a copy)

    @abstractmethod
    def for_batch(self, batch_size: int, context_len: int, riding: int = 0, free: int = 0) -> "TreeShape | None":
        """Before each step: the shape to draft with (None: a plain step), knowing how many
        requests share the step, the context length (the forced run included), how many
        newcomers' prefill tokens ride in its target forward (`riding`) and how many tokens of
        the grammar's forced run the tree grows after (`free`)."""

    def on_step(self, tree: TokenTree, verdict: "Verdict", cost: "StepRecord | None" = None) -> None:
        """After each step's verification: the drafted part of the tree, its verdict and what the
        step cost the batch (None where the executor does not measure it)."""

    def on_root_logits(self, logits: torch.Tensor) -> None:
        """Each step, where `watches_root_logits`: the target's processed logits after the
        context, padding ids masked (what the sampler chooses from)."""

    def repeatable(self) -> None:
        """At request creation, for a seeded sampled request: choose trees that the same seed
        repeats (nothing by measured time)."""

    def close(self) -> None:
        """The request ended: a policy with state that outlives it (a suffix source's answer for
        the global cache) finishes it."""


class TreeShape(ShapePolicy):
    """A small policy that asks a source for distributions and decides which nodes to add.

    `draft` is the one required method; `build` answers its calls from one source. A shape that
    makes no draft calls (copies from the context) sets `needs_model` False: it runs without a
    draft model."""

    needs_model: bool = True  # asks a draft source for distributions

    @abstractmethod
    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        """Draft a tree rooted at `root` (the newest token; `context` holds every token before it).

        The returned tree records `child_rule` (sampled or selected) and, for sampled children,
        the draft distribution each node's children were drawn from in `child_dists`.
        """

    def build(self, context: list[int], root: int, source: DraftSource | None, params: SamplingParams,
              generator: torch.Generator | None) -> TokenTree:
        """`draft` with every call answered by `source`."""
        return run_drafting(self.name, self.draft(context, root, params, generator), source)

    def for_batch(self, batch_size: int, context_len: int, riding: int = 0, free: int = 0) -> "TreeShape | None":
        return self

    @property
    def max_nodes(self) -> int:
        """The most nodes (root excluded) its trees can have (the pipeline sizes its KV by it)."""
        return MAX_BUDGET


def run_drafting(name: str, drafting: Drafting, source: DraftSource | None) -> TokenTree:
    """Drive a drafting coroutine, answering each call from `source` (no batching)."""
    try:
        call = next(drafting)
        while True:
            if source is None:
                drafting.close()
                raise SpecwoodError(f"tree shape '{name}' needs a draft model (source); only 'pld' works without one")
            call = drafting.send(source.logits(*call))
    except StopIteration as done:
        tree: TokenTree = done.value
        return tree
