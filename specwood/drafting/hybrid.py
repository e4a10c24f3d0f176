"""Hybrid trees: the draft model's tree and a suffix proposal verified in one forward.

The suffix nodes are merged into the model's tree by token: where a suffix path already exists
(the model drafted the same tokens) it is shared, the rest is added after the node's existing
children. Added nodes are deterministic candidates, so a "sampled" tree marks them `selected`:
the verifier tries them after every sampled sibling with the selected rule, and a sampled child
is never replaced or reordered (its law as a draw from q stays intact), which keeps sampling
lossless (tests/test_hybrid_statistics.py). Siblings still carry distinct tokens. `auto` drafts
such trees (specwood.planner.suffix_choice).
"""
from __future__ import annotations

from specwood.drafting.suffix_tree import SuffixDraft
from specwood.tree.token_tree import TokenTree


def merge_suffix(tree: TokenTree, draft: SuffixDraft) -> int:
    """Add `draft`'s nodes to `tree` (in place; roots must agree); the number of nodes added."""
    if len(draft.tree) <= 1:
        return 0
    if draft.tree.tokens[0] != tree.tokens[0]:
        raise ValueError("a suffix draft merges only into a tree with the same root")
    kids: dict[int, dict[int, int]] = {}  # node -> token -> child, for the nodes we look into
    for i in range(1, len(tree)):
        kids.setdefault(tree.parents[i], {})[tree.tokens[i]] = i
    mark = tree.child_rule == "sampled"
    where = [0]  # suffix node -> merged node
    added = 0
    src = draft.tree
    for i in range(1, len(src)):
        parent = where[src.parents[i]]
        token = src.tokens[i]
        node = kids.setdefault(parent, {}).get(token)
        if node is None:
            node = tree.add_node(parent, token, src.probs[i])
            kids[parent][token] = node
            if mark:
                tree.selected.add(node)
            added += 1
        where.append(node)
    return added
