"""Property tests of TokenTree against independent re-computations of the tree relations."""
from __future__ import annotations

from collections import deque

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specwood.tree.token_tree import TokenTree

SETTINGS = settings(max_examples=500, deadline=None)


@st.composite
def trees(draw, max_nodes: int = 40) -> TokenTree:
    """Any topologically ordered tree (not only BFS order), with probs and some child_dists."""
    n = draw(st.integers(1, max_nodes))
    raw = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    rule = draw(st.sampled_from(["sampled", "selected"]))
    tree = TokenTree.with_root(tokens[0], child_rule=rule, without_replacement=draw(st.booleans()))
    for i in range(1, n):
        tree.add_node(raw[i] % i, tokens[i], prob=(raw[i] % 997) / 997)
    # tag each distribution with its node so re-indexing can be checked
    for i in range(n):
        if raw[i] % 3:
            tree.child_dists[i] = torch.tensor([float(i)])
    return tree


def ancestors(parents: list[int], i: int) -> set[int]:
    """i and all its ancestors, by walking the parent list."""
    out = set()
    while i != -1:
        out.add(i)
        i = parents[i]
    return out


@SETTINGS
@given(trees(), st.integers(0, 64))
def test_masks_positions_depths(tree: TokenTree, prefix: int) -> None:
    n = len(tree)
    anc = [ancestors(tree.parents, i) for i in range(n)]
    want = torch.tensor([[j in anc[i] for j in range(n)] for i in range(n)], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), want)
    assert tree.depths == [len(a) - 1 for a in anc]
    assert tree.positions(prefix).tolist() == [prefix + len(a) - 1 for a in anc]
    mask = tree.attention_mask(prefix)
    assert mask.shape == (n, prefix + n) and mask.dtype == torch.bool
    assert bool(mask[:, :prefix].all())
    assert torch.equal(mask[:, prefix:], want)
    assert tree.size == n - 1 and tree.max_depth == max(tree.depths)


@SETTINGS
@given(trees())
def test_children_paths_leaves(tree: TokenTree) -> None:
    n = len(tree)
    for i in range(n):
        assert tree.children(i) == [j for j in range(n) if tree.parents[j] == i]
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i and set(path) == ancestors(tree.parents, i)
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
    assert tree.leaves() == [i for i in range(n) if i not in tree.parents]


@SETTINGS
@given(trees(), st.data())
def test_reroot_keeps_exactly_the_subtree(tree: TokenTree, data: st.DataObject) -> None:
    n = len(tree)
    node = data.draw(st.integers(0, n - 1))
    keep = [j for j in range(n) if node in ancestors(tree.parents, j)]  # node and descendants, in order
    sub = tree.reroot(node)
    assert sub.tokens == [tree.tokens[j] for j in keep]
    assert sub.parents == [-1] + [keep.index(tree.parents[j]) for j in keep[1:]]
    assert sub.depths == [tree.depths[j] - tree.depths[node] for j in keep]
    assert sub.probs == [1.0] + [tree.probs[j] for j in keep[1:]]
    assert {k: float(d) for k, d in sub.child_dists.items()} == {
        k: float(j) for k, j in enumerate(keep) if j in tree.child_dists
    }
    assert (sub.child_rule, sub.without_replacement) == (tree.child_rule, tree.without_replacement)
    # the relative structure is the old one restricted to the subtree
    idx = torch.tensor(keep)
    assert torch.equal(sub.ancestor_mask(), tree.ancestor_mask()[idx][:, idx])
    # the original tree is untouched
    assert len(tree) == n


@SETTINGS
@given(trees())
def test_bfs_order_preserves_structure_and_sibling_order(tree: TokenTree) -> None:
    n = len(tree)
    new, order = tree.bfs()
    # independent BFS: FIFO queue, children in index (= drafting) order
    want, queue = [], deque([0])
    while queue:
        i = queue.popleft()
        want.append(i)
        queue.extend(j for j in range(n) if tree.parents[j] == i)
    assert order == want
    assert new.tokens == [tree.tokens[i] for i in order]
    assert new.parents == [-1] + [order.index(tree.parents[i]) for i in order[1:]]
    assert new.depths == [tree.depths[i] for i in order]
    assert new.depths == sorted(new.depths)
    assert new.probs == [1.0] + [tree.probs[i] for i in order[1:]]
    assert {k: float(d) for k, d in new.child_dists.items()} == {
        k: float(i) for k, i in enumerate(order) if i in tree.child_dists
    }
    for k in range(n):  # sibling order kept
        assert [order[c] for c in new.children(k)] == tree.children(order[k])
    again, order2 = new.bfs()
    assert order2 == list(range(n)) and again.tokens == new.tokens and again.parents == new.parents


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 10**6), min_size=0, max_size=6), min_size=0, max_size=5))
def test_append_layer_grows_in_bfs_order(layers: list[list[int]]) -> None:
    tree = TokenTree.with_root(7)
    frontier = [0]
    for raw in layers:
        if not frontier or not raw:
            break
        parents = sorted(frontier[r % len(frontier)] for r in raw)  # grouped by parent, in frontier order
        frontier = tree.append_layer(parents, [r % 100 for r in raw])
    _, order = tree.bfs()
    assert order == list(range(len(tree)))
