"""Greedy tree verification and the verdict type shared by all verifiers.

With a greedy target, plain decoding emits argmax(logits) after every token; a drafted child is
kept iff it is exactly that token, so walking the tree along argmax matches reproduces the
autoregressive output token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specwood.tree.token_tree import TokenTree


@dataclass
class Verdict:
    """Outcome of verifying one tree.

    `accepted` holds the indices of the accepted drafted nodes along one root-to-node path (root
    excluded), in order; `next_token` is the one extra token the target contributes: the bonus
    token after a fully accepted path, or the correction where the path stopped.
    """

    accepted: list[int]
    next_token: int

    def tokens(self, tree: TokenTree) -> list[int]:
        """The tokens this step emits: accepted node tokens, then `next_token`."""
        return [tree.tokens[i] for i in self.accepted] + [self.next_token]


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children of every node in insertion (= drafting = trial) order, in one O(n) pass."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """Follow the child equal to the target argmax from the root; stop at the first mismatch.

    `target_logits` is [len(tree), V]: row i holds the target logits for the token after node i.
    """
    if target_logits.shape[0] != len(tree):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for a tree of {len(tree)} nodes")
    # One argmax over all rows and one host transfer: cheaper than a sync per visited node.
    # Same op as the autoregressive greedy sampler (sampling.next_token), so ties break alike.
    best = target_logits.argmax(-1).tolist()
    kids = children_lists(tree.parents)
    node, accepted = 0, list[int]()
    while True:
        want = best[node]
        match = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if match is None:
            return Verdict(accepted, int(want))
        accepted.append(match)
        node = match
