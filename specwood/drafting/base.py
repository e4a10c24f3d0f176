"""What a draft source and a tree shape are.

A *source* says which tokens might come next (a draft model, the target's own first layers,
n-gram lookup). A *shape* is a small policy that asks a source for distributions and decides
which nodes to add to the tree. The engine composes any shape with any source it supports.
"""
from __future__ import annotations

from typing import Protocol

import torch

from specwood.sampling import SamplingParams, target_probs
from specwood.tree.token_tree import TokenTree


class DraftSource(Protocol):
    """A model-like source of next-token distributions over tree nodes."""

    vocab_size: int

    def start(self, prompt_tokens: list[int]) -> None:
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
        return torch.softmax(logits.float(), dim=-1)
    return target_probs(logits, params)


class TreeShape(Protocol):
    name: str

    def build(
        self,
        context: list[int],
        root: int,
        source: DraftSource | None,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """Draft a tree rooted at `root` (the newest token; `context` holds every token before it).

        The returned tree records `child_rule` (sampled or selected) and, for sampled children,
        the draft distribution each node's children were drawn from in `child_dists`.
        """
