"""Prompt lookup (n-gram) drafting: no model, just copy what followed the same n-gram earlier.

The drafts are deterministic, so the tree uses the "selected" rule (the verifier treats q as
one-hot), which keeps sampling lossless.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specwood.drafting.base import Drafting, TreeShape
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens,
    trying n = max_ngram down to min_ngram; [] when nothing matches."""
    n_tok = len(tokens)
    if k < 1 or n_tok < 2:
        return []
    seq = torch.as_tensor(list(tokens), dtype=torch.long)
    body = seq[:-1]  # a match must be followed by at least one token, and is never the suffix itself
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        hits = (body.unfold(0, n, 1) == seq[-n:]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


@dataclass
class PromptLookupShape(TreeShape):
    """A chain of up to `k` tokens copied from the context (the root included). Rule "selected";
    needs no source (makes no draft calls); an empty tree (root only) when nothing matches."""

    k: int = 8
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "pld"
    needs_model = False  # copies from the context: no draft calls

    @property
    def max_nodes(self) -> int:
        return self.k

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecwoodError("pld n-gram sizes need 1 <= min_ngram <= max_ngram, "
                                f"got {self.min_ngram}..{self.max_ngram}")

    def draft(
        self,
        context: list[int],
        root: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafting:
        yield from ()  # a coroutine that makes no draft calls
        return copied_chain(root, find_continuation([*context, root], self.k, self.max_ngram, self.min_ngram))


def copied_chain(root: int, tokens: Sequence[int]) -> TokenTree:
    """`root` followed by the copied `tokens` as a chain, rule "selected" (a deterministic draft)."""
    tree = TokenTree.with_root(root, "selected")
    node = 0
    for token in tokens:
        node = tree.add_node(node, token, 1.0)
    return tree
