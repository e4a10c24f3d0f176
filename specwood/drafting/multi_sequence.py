"""DuoDecoding's dynamic multi-sequence drafting, as a tree shape over TokenTree.

Let p(i, j) be the draft probability of the j-th ranked token at position i (position 1 is the
token after the root). The first sequence is the greedy draft; theta = p(1,1) * p(2,1) is the
estimated probability of accepting its first two tokens. Every other first-position token with
p(1, j) > theta (up to `max_sequences` sequences in all) starts a sequence of its own. The budget
(gamma drafted tokens) is split between the sequences, the top one getting the remainder; branching
happens only at the first position, below it every sequence is a chain. All sequences advance
together: one draft call per depth for every sequence that still grows.

The tree is a root with `n` first-level children, each heading a chain:

* first position: the top-ranked tokens of q ("selected": no `child_dists` for the root, so the
  sampling verifier treats them as deterministic candidates, accept x with prob r(x)); in the
  parallel executor they are guesses of the target's bonus token and are never verified at all:
  the bonus token is sampled from p as usual and a sequence is kept only if it starts with it;
* below: a chain drawn from q under sampling params (`child_dists` recorded, verified by the
  multi-candidate rule) or q's argmax under greedy params.

Both are lossless with the existing verifiers (specwood.verify).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specwood.drafting.base import Drafting, TreeShape, draft_probs
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams, sample_index
from specwood.tree.token_tree import TokenTree

MAX_SEQUENCES = 8


def split_budget(budget: int, n: int) -> list[int]:
    """`budget` tokens over `n` sequences (n <= budget), the remainder to the top ones."""
    return [budget // n + (1 if i < budget % n else 0) for i in range(n)]


@dataclass
class MultiSequenceShape(TreeShape):
    budget: int = 6  # gamma: drafted tokens over all sequences
    max_sequences: int = MAX_SEQUENCES
    max_depth: int | None = None  # cap on a sequence's length
    name: str = "duo"

    @property
    def max_nodes(self) -> int:
        return self.budget

    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        sample = not params.greedy
        tree = TokenTree.with_root(root, "sampled" if sample else "selected")
        cap = self.budget if self.max_depth is None else min(self.budget, self.max_depth)
        if self.budget < 1 or cap < 1:
            return tree
        q1 = draft_probs((yield tree, [0]), params)[0]
        k = min(self.max_sequences, self.budget, int((q1 > 0).sum()))
        if k <= 0:
            return tree
        top = torch.topk(q1, k)
        vals, idx = top.values.tolist(), top.indices.tolist()
        first = tree.add_node(0, idx[0], vals[0])
        if self.budget == 1:
            return tree
        q2 = draft_probs((yield tree, [first]), params)[0]
        theta = vals[0] * float(q2.max())
        n = 1 + sum(1 for v in vals[1:] if v > theta)  # vals are sorted: the top n - 1 of the rest
        lengths = [min(cap, L) for L in split_budget(self.budget, n)]
        ends = [first] + [tree.add_node(0, idx[j], vals[j]) for j in range(1, n)]
        known = {first: q2}  # node -> q after it
        left = [L - 1 for L in lengths]
        while any(left):
            need = [ends[i] for i in range(n) if left[i] and ends[i] not in known]
            if need:
                qs = draft_probs((yield tree, need), params)
                known.update(zip(need, qs))
            for i in range(n):
                if not left[i]:
                    continue
                q = known.pop(ends[i])
                if not bool((q > 0).any()):
                    left[i] = 0
                    continue
                token = sample_index(q, generator) if sample else int(q.argmax())
                if sample:
                    tree.child_dists[ends[i]] = q
                ends[i] = tree.add_node(ends[i], token, float(q[token]))
                left[i] -= 1
        return tree


def make_multi_sequence(budget: int | None = None, depth: int | None = None,
                        max_sequences: int | None = None) -> MultiSequenceShape:
    """The `duo` shape with checked options (budget: gamma, default 6; depth: cap per sequence)."""
    from specwood.drafting.shapes import MAX_BUDGET

    for what, value, low, high in (("budget", budget, 1, MAX_BUDGET), ("depth", depth, 1, None),
                                   ("max_sequences", max_sequences, 1, 64)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            bound = f"an integer in [{low}, {high}]" if high is not None else "a positive integer"
            raise SpecwoodError(f"{what} must be {bound}, got {value!r}")
    return MultiSequenceShape(budget=budget or 6, max_sequences=max_sequences or MAX_SEQUENCES, max_depth=depth)


def sequence_end(tree: TokenTree, first: int) -> int:
    """The last node of the chain a first-level node heads."""
    node = first
    while True:
        kids = tree.children(node)
        if not kids:
            return node
        node = kids[0]
