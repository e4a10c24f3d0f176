"""The draft tree of a suffix match: the continuations of the matched occurrences, merged by
prefix, scored by their counts.

A path's count is the number of continuations that start with it; its probability the count over
the number of continuations (the frequency ratios along the path multiplied out). Nodes are taken
best first by that probability (ties: shallower, then the newer occurrence's), while at least
`min_prob`, up to `budget` nodes: a child's count never exceeds its parent's, so the tree stays
connected. Its expected accepted length is the sum of the kept nodes' path probabilities (each
node is accepted with the probability that the text follows its path).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from specwood.tree.token_tree import TokenTree


@dataclass
class SuffixDraft:
    """A suffix source's proposal: its tree (rule "selected"), each node's path probability, the
    expected accepted length, the match length it came from and where it matched ("local": the
    request's own prompt and output, "global": earlier answers)."""

    tree: TokenTree
    path_probs: list[float]  # per node, the root's 1.0 included
    expected: float
    match: int
    occurrences: int = 0  # the continuations it was built from
    source: str = "local"

    @classmethod
    def empty(cls, root: int) -> "SuffixDraft":
        return cls(TokenTree.with_root(root, "selected"), [1.0], 0.0, 0)


def continuation_tree(root: int, continuations: Sequence[Sequence[int]], budget: int, min_prob: float = 0.0,
                      match: int = 0) -> SuffixDraft:
    """The best `budget` nodes of the prefix tree of `continuations` (newest first), under `root`."""
    tree = TokenTree.with_root(root, "selected")
    probs = [1.0]
    counts = [len(continuations)]
    n = len(continuations)
    if n == 0 or budget < 1:
        return SuffixDraft(tree, probs, 0.0, match, n)
    order = 0
    heap: list[tuple[int, int, int, int, int, list[int]]] = []  # (-count, depth, order, parent, token, rows)

    def push_children(node: int, depth: int, rows: list[int]) -> None:
        nonlocal order
        groups: dict[int, list[int]] = {}
        for r in rows:
            c = continuations[r]
            if len(c) > depth:
                groups.setdefault(c[depth], []).append(r)
        for token, members in groups.items():  # first seen = newest occurrence first
            if len(members) >= min_prob * n:
                heapq.heappush(heap, (-len(members), depth + 1, order, node, token, members))
                order += 1

    push_children(0, 0, list(range(n)))
    expected = 0.0
    while heap and tree.size < budget:
        neg, depth, _, parent, token, rows = heapq.heappop(heap)
        node = tree.add_node(parent, token, -neg / counts[parent])  # the frequency ratio at its parent
        counts.append(-neg)
        probs.append(-neg / n)
        expected += -neg / n
        push_children(node, depth, rows)
    return SuffixDraft(tree, probs, expected, match, n)
