"""What a draft source and a tree shape are.

A *source* says which tokens might come next (a draft model, the target's own first layers,
n-gram lookup). A *shape* is a small policy that asks for distributions and decides which nodes
to add to the tree. A shape's `draft` is a coroutine: it yields each draft call it needs (the
tree so far and the nodes whose next-token logits it wants) and is sent the logits back. That is
what lets the engine answer the calls of many requests' shapes with ONE batched draft forward;
`build` answers them one by one from a single source. The engine composes any shape with any
source it supports.
"""
from __future__ import annotations

from typing import Generator, Protocol

import torch

from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams, target_probs, without_padding
from specwood.tree.token_tree import TokenTree

# A draft call: "the logits after each of these nodes of this tree".
DraftCall = tuple[TokenTree, list[int]]
# A shape's drafting coroutine: yields calls, is sent float32 logits [len(nodes), V], returns the tree.
Drafting = Generator[DraftCall, torch.Tensor, TokenTree]


class DraftSource(Protocol):
    """A model-like source of next-token distributions over tree nodes (one request's state)."""

    vocab_size: int

    def start(self, prompt_tokens: list[int], max_new_tokens: int = 0) -> None:
        """Begin a request: the source now knows the prompt (all of it, the root excluded)."""

    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Float32 logits [len(nodes), V] for the token that follows each of `nodes`.

        The source runs its forward over whatever of the tree it has not processed yet (at least
        the path to each requested node), with the tree mask.
        """

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        """Verification accepted the root and the nodes `accepted` (indices, root excluded) and
        produced `next_token` (the next root): keep the accepted path, forget the rest."""


def draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The draft's proposal distribution q: same temperature/top-k/top-p as the target when
    sampling; plain softmax when the target is greedy (q then only ranks and scores candidates)."""
    if params.greedy:
        return torch.softmax(without_padding(logits, params), dim=-1)
    return target_probs(logits, params)


class TreeShape(Protocol):
    name: str

    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        """Draft a tree rooted at `root` (the newest token; `context` holds every token before it).

        The returned tree records `child_rule` (sampled or selected) and, for sampled children,
        the draft distribution each node's children were drawn from in `child_dists`.
        """

    def build(self, context: list[int], root: int, source: DraftSource | None, params: SamplingParams,
              generator: torch.Generator | None) -> TokenTree:
        """`draft` with every call answered by `source`."""


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
        return done.value


class ShapeBase:
    """Gives a shape with a `draft` coroutine the one-source `build`."""

    name: str

    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        raise NotImplementedError

    def build(self, context: list[int], root: int, source: DraftSource | None, params: SamplingParams,
              generator: torch.Generator | None) -> TokenTree:
        return run_drafting(self.name, self.draft(context, root, params, generator), source)
