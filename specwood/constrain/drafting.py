"""The processors on the drafting side: draft rows processed per node, refused candidates pruned.

A shape's drafting coroutine (specwood.drafting.base.Drafting) yields (tree, nodes) calls and is
sent the draft logits after those nodes; `processed_drafting` sends it those rows after the
request's processors for each node's path instead, so the proposal q a shape draws from or ranks
by is already masked: every sampled child is allowed, and selected children are the best allowed
tokens (a shape never takes a token with q = 0). Whatever reaches the tree anyway (prompt lookup,
a forced guess) and the grammar refuses is removed with its subtree by `prune_refused` before the
target forward -- for "selected" children only, where rejecting a token of target probability
zero would change nothing; a "sampled" child was drawn from the masked q, so it is never refused.
"""
from __future__ import annotations

from typing import Any, Generator

import torch

from specwood.constrain.processors import Processors, tree_paths
from specwood.tree.token_tree import TokenTree

Drafting = Generator[tuple[TokenTree, list[int]], torch.Tensor, TokenTree]


def processed_drafting(drafting: Drafting, processors: Processors) -> Drafting:
    """`drafting` with every answer processed for its nodes' paths (same calls, same tree)."""
    try:
        call: Any = next(drafting)
        while True:
            logits = yield call
            tree, nodes = call
            call = drafting.send(processors.tree_rows(tree, logits, nodes))
    except StopIteration as done:
        return done.value
    finally:
        drafting.close()


FORCED_MIN = 2  # a shorter forced run is left to the (masked) drafter, which also drafts past it
FORCED_MAX = 64


def forced_tree(root: int, processors: Processors) -> TokenTree | None:
    """A chain root -> the grammar's forced run, as "selected" candidates (the deterministic rule
    verifies them: the target may still prefer another tokenisation of the forced text), or None
    when fewer than FORCED_MIN tokens are forced. It costs no draft forward; the drafter starts
    from the end of the run at the next step."""
    run = processors.forced_run(FORCED_MAX)
    if len(run) < FORCED_MIN:
        return None
    tree = TokenTree.with_root(root, "selected")
    node = 0
    for token in run:
        node = tree.add_node(node, token)
    processors.forced += len(run)
    processors.forced_tree = tree
    return tree


def prune_refused(tree: TokenTree, processors: Processors) -> TokenTree:
    """The tree without the "selected" nodes whose path the grammar refuses (and their subtrees);
    the same tree when nothing is refused or there is no grammar."""
    if processors.matcher is None or len(tree) == 1 or tree.child_rule != "selected":
        return tree
    ok = processors.valid(tree_paths(tree))
    if all(ok):
        return tree
    processors.pruned += sum(not v for v in ok)
    return tree.keep([i for i, v in enumerate(ok) if v])
