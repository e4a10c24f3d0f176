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
        built: TokenTree = done.value
        return built
    finally:
        drafting.close()


FORCED_MIN = 2  # a shorter forced run is left to the (masked) drafter, which also drafts past it
FORCED_MAX = 64


def forced_run(processors: Processors) -> list[int]:
    """The grammar's forced run after the committed state, or [] when it is shorter than
    FORCED_MIN (then the masked drafter drafts through it). The step keeps its length with the
    tree it starts (specwood.engine.step.draft_trees): nothing of it is kept here."""
    run = processors.forced_run(FORCED_MAX)
    return run if len(run) >= FORCED_MIN else []


def forced_tree(root: int, run: list[int], processors: Processors) -> TokenTree:
    """A chain root -> the forced run, as "selected" candidates (the deterministic rule verifies
    them: the target may still prefer another tokenisation of the forced text). It costs no draft
    forward; `drafting_after` grafts a drafted tree onto its end."""
    tree = TokenTree.with_root(root, "selected")
    node = 0
    for token in run:
        node = tree.add_node(node, token)
    processors.forced += len(run)  # for the stats
    return tree


def drafting_after(drafting: Drafting, chain: TokenTree) -> Drafting:
    """`drafting` (a shape drafting from the forced run's last token, its context extended by the
    run) grafted onto the end of the forced `chain`: its calls reach the draft source (and the
    processors) as calls on the whole tree -- a source with state reads the chain in the same
    forward as its first nodes -- and the tree returned is chain + drafted subtree. The chain's
    nodes have no draft distribution, so the verifier takes them by the selected rule either way."""
    k = len(chain) - 1  # the chain's end: the drafted subtree's root

    def graft(sub: TokenTree) -> TokenTree:
        whole = TokenTree(list(chain.tokens), list(chain.parents), list(chain.depths), list(chain.probs),
                          child_rule=sub.child_rule, without_replacement=sub.without_replacement)
        for i in range(1, len(sub)):
            whole.add_node(sub.parents[i] + k, sub.tokens[i], sub.probs[i])
        whole.child_dists = {i + k: d for i, d in sub.child_dists.items()}
        whole.selected = ({i + k for i in sub.selected}
                          | (set(range(1, k + 1)) if sub.child_rule == "sampled" else set()))
        return whole

    try:
        call: Any = next(drafting)
        while True:
            sub, nodes = call
            logits = yield graft(sub), [n + k for n in nodes]
            call = drafting.send(logits)
    except StopIteration as done:
        return graft(done.value)
    finally:
        drafting.close()


def prune_refused(tree: TokenTree, processors: Processors) -> TokenTree:
    """The tree without the "selected" nodes whose path the grammar refuses (and their subtrees);
    the same tree when nothing is refused or there is no grammar. A forced run's nodes are
    allowed: they keep their indices 1..k."""
    if processors.matcher is None or len(tree) == 1 or tree.child_rule != "selected":
        return tree
    ok = processors.valid(tree_paths(tree))
    if all(ok):
        return tree
    processors.pruned += sum(not v for v in ok)
    return tree.keep([i for i, v in enumerate(ok) if v])
