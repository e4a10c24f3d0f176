"""Greedy verification: exactly the autoregressive greedy output."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specwood.sampling import SamplingParams, next_token
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict, children_table, verify, verify_greedy, verify_sampling

V = 8


def chain(tokens: list[int], root: int = 0) -> TokenTree:
    tree = TokenTree.with_root(root)
    parent = 0
    for t in tokens:
        parent = tree.add_node(parent, t)
    return tree


def peaked(rows: list[int]) -> torch.Tensor:
    """Logits whose argmax in row i is rows[i]."""
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
    return logits


def test_full_acceptance_gives_bonus_token() -> None:
    tree = chain([3, 5, 2])
    out = verify_greedy(tree, peaked([3, 5, 2, 6]))
    assert out == Verdict([1, 2, 3], 6)
    assert out.tokens(tree) == [3, 5, 2, 6]


def test_mismatch_gives_correction() -> None:
    tree = chain([3, 5, 2])
    assert verify_greedy(tree, peaked([3, 4, 2, 6])) == Verdict([1], 4)
    assert verify_greedy(tree, peaked([1, 5, 2, 6])) == Verdict([], 1)


def test_root_only_tree() -> None:
    assert verify_greedy(TokenTree.with_root(4), peaked([7])) == Verdict([], 7)


def test_multi_branch_follows_the_argmax_child() -> None:
    tree = TokenTree.with_root(0)
    a, b, c = (tree.add_node(0, t) for t in (5, 7, 1))  # 1, 2, 3
    _a1, _b1, b2 = tree.add_node(a, 2), tree.add_node(b, 3), tree.add_node(b, 4)  # 4, 5, 6
    b2x = tree.add_node(b2, 6)  # 7
    rows = [7, 0, 0, 0, 0, 0, 0, 0]
    rows[b], rows[b2], rows[b2x] = 4, 6, 2
    out = verify_greedy(tree, peaked(rows))
    assert out == Verdict([b, b2, b2x], 2) and out.tokens(tree) == [7, 4, 6, 2]
    rows[0] = 1  # third sibling
    assert verify_greedy(tree, peaked(rows)) == Verdict([c], 0)
    rows[0], rows[b] = 7, 5  # right first step, no matching grandchild
    assert verify_greedy(tree, peaked(rows)) == Verdict([b], 5)


def test_duplicate_siblings_take_the_first() -> None:
    tree = TokenTree.with_root(0)
    tree.add_node(0, 3)
    tree.add_node(0, 3)
    assert verify_greedy(tree, peaked([3, 1, 2])) == Verdict([1], 1)


def test_ties_break_like_the_autoregressive_sampler() -> None:
    logits = torch.zeros(1, V)
    logits[0, [2, 5]] = 1.0
    want = int(next_token(logits[0], SamplingParams(), None))
    assert verify_greedy(TokenTree.with_root(0), logits).next_token == want


def test_row_count_is_checked() -> None:
    with pytest.raises(ValueError):
        verify_greedy(chain([1]), torch.zeros(3, V))


def path_logits(path: tuple[int, ...]) -> torch.Tensor:
    """A synthetic greedy target: logits as a function of the whole path."""
    g = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.randn(V, generator=g)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 30))
def test_equals_autoregressive_greedy(seed: int, n: int) -> None:
    rng = random.Random(seed)
    tree = TokenTree.with_root(rng.randrange(V))
    paths = [(tree.tokens[0],)]
    for _ in range(n):
        parent = rng.randrange(len(tree))
        # often the target's choice, so long paths get accepted; sometimes anything
        tok = int(path_logits(paths[parent]).argmax()) if rng.random() < 0.6 else rng.randrange(V)
        if tok in [tree.tokens[c] for c in tree.children(parent)]:
            continue  # distinct siblings, as a greedy drafter makes them
        tree.add_node(parent, tok)
        paths.append(paths[parent] + (tok,))
    logits = torch.stack([path_logits(p) for p in paths])
    out = verify_greedy(tree, logits)

    # plain greedy decoding from the root
    ar, ctx = [], paths[0]
    for _ in range(tree.max_depth + 1):
        tok = int(next_token(path_logits(ctx), SamplingParams(), None))
        ar.append(tok)
        ctx += (tok,)
    emitted = out.tokens(tree)
    assert emitted == ar[: len(emitted)]
    # and it is the longest such path in the tree
    longest = max(len(p) - 1 for p in paths if list(p[1:]) == ar[: len(p) - 1])
    assert len(out.accepted) == longest
    # verify() dispatches to greedy; the sampling verifier with greedy params agrees exactly
    assert verify(tree, logits, SamplingParams(), None) == out
    tree.child_rule = "sampled"
    tree.child_dists = {i: torch.softmax(logits[i] * 0.5, 0) for i in range(len(tree))}
    assert verify_sampling(tree, logits, SamplingParams(), None) == out


def test_verify_dispatches_to_sampling() -> None:
    tree = chain([3, 5])
    g = torch.Generator().manual_seed(0)
    out = verify(tree, peaked([3, 5, 2]), SamplingParams(temperature=1.0), g)
    assert isinstance(out, Verdict) and out.accepted in ([], [1], [1, 2])


def test_children_table() -> None:
    parents = [-1, 0, 0, 1, 0, 3]
    assert children_table(parents).tolist() == [[1, 2, 4], [3, -1, -1], [-1, -1, -1], [5, -1, -1], [-1] * 3, [-1] * 3]
