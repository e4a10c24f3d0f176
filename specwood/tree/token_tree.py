"""The speculative token tree.

Node 0 is the root: the last accepted token, whose KV is not yet in the target cache, so one
target forward over all nodes yields the distribution after every node. Nodes are stored in a
topological order (parent before child); trees grown layer by layer are BFS-ordered, and
`bfs()` reorders any tree. Siblings keep their insertion order, which is the order in which they
were drafted and so the order in which the verifier must try them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

# How a node's children were chosen: drawn from the draft distribution ("sampled": verified by
# multi-candidate speculative sampling) or picked by a deterministic rule ("selected").
ChildRule = Literal["sampled", "selected"]


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    depths: list[int]
    probs: list[float]  # draft probability of each token when it was drafted (1.0 for the root)
    # draft distribution over the token after node i (the one its children were drafted from)
    child_dists: dict[int, torch.Tensor] = field(default_factory=dict)
    child_rule: ChildRule = "selected"
    without_replacement: bool = True
    # nodes verified with the "selected" rule whatever child_rule says: deterministic candidates
    # (suffix matches) added after a node's sampled children in a hybrid tree
    selected: set[int] = field(default_factory=set)

    @classmethod
    def with_root(cls, token: int, child_rule: ChildRule = "selected", without_replacement: bool = True) -> "TokenTree":
        return cls([int(token)], [-1], [0], [1.0], {}, child_rule, without_replacement)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def size(self) -> int:
        """Number of drafted nodes (the root excluded): what a budget counts."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add_node(self, parent: int, token: int, prob: float = 1.0) -> int:
        """Append one child of `parent`; returns its index."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} not in tree of {len(self.tokens)} nodes")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(self.depths[parent] + 1)
        self.probs.append(float(prob))
        return len(self.tokens) - 1

    def append_layer(self, parents: list[int], tokens: list[int], probs: list[float] | None = None) -> list[int]:
        """Add a whole layer (children of frontier nodes); keeps BFS order when parents are the deepest layer."""
        probs = probs if probs is not None else [1.0] * len(tokens)
        return [self.add_node(p, t, q) for p, t, q in zip(parents, tokens, probs)]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def ancestor_mask(self) -> torch.Tensor:
        """M[i, j] is True iff j is i or an ancestor of i."""
        n = len(self.tokens)
        if n <= 64:  # Python lists: two tensor writes a node cost more, up to ~64 nodes (n^2 cells after)
            rows: list[list[bool]] = []
            for i, p in enumerate(self.parents):
                row = rows[p].copy() if p >= 0 else [False] * n
                row[i] = True
                rows.append(row)
            return torch.tensor(rows, dtype=torch.bool).reshape(n, n)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Sequence position of each node: the root sits right after the `prefix_len` cached tokens."""
        return torch.tensor(self.depths, dtype=torch.long) + prefix_len

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """[n, prefix_len + n] boolean mask: every node sees the whole prefix and its own ancestors."""
        n = len(self.tokens)
        return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), self.ancestor_mask()], dim=1)

    def keep(self, nodes: list[int]) -> "TokenTree":
        """A new tree of `nodes` (ascending, the root first, every kept node's parent kept)."""
        return self._select(nodes)

    def _select(self, order: list[int]) -> "TokenTree":
        """A new tree of the nodes in `order` (parents must precede children; order[0] is the new root)."""
        index = {old: new for new, old in enumerate(order)}
        base = self.depths[order[0]]
        return TokenTree(
            tokens=[self.tokens[i] for i in order],
            parents=[index.get(self.parents[i], -1) if k else -1 for k, i in enumerate(order)],
            depths=[self.depths[i] - base for i in order],
            probs=[self.probs[i] if k else 1.0 for k, i in enumerate(order)],
            child_dists={index[i]: d for i, d in self.child_dists.items() if i in index},
            child_rule=self.child_rule,
            without_replacement=self.without_replacement,
            selected={index[i] for i in self.selected if i in index and index[i] > 0},
        )

    def bfs(self) -> tuple["TokenTree", list[int]]:
        """BFS-ordered copy (stable: siblings keep their order) and the old index of each new node."""
        out = [0]  # layer by layer, children in parent order then sibling order
        layer = [0]
        while layer:
            nxt = [c for p in layer for c in self.children(p)]
            out.extend(nxt)
            layer = nxt
        return self._select(out), out

    def reroot(self, node: int) -> "TokenTree":
        """To-subtree pruning: keep `node` and its descendants, with `node` as the new root."""
        keep = [node]
        inside = {node}
        for i in range(node + 1, len(self.tokens)):
            if self.parents[i] in inside:
                inside.add(i)
                keep.append(i)
        return self._select(keep)
