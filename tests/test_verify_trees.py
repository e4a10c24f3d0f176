"""`verify_trees`, the engine step's one call for every request's sampled tree, gives each tree
exactly the verdict it gets alone (`verify_sampling`, whose law the statistical tests prove) on the
same draws: trees of different sizes, child rules, with and without replacement, hybrid
(selected) nodes, nodes without a draft distribution and lone roots, under two sampling laws."""
from __future__ import annotations

import random

import torch

from specwood.sampling import SamplingParams, next_token
from specwood.tree.token_tree import TokenTree
from specwood.verify import tree_uniforms, verify_sampling, verify_trees

V = 16
LAWS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


def random_tree(rnd: random.Random, g: torch.Generator) -> TokenTree:
    rule = rnd.choice(["sampled", "sampled", "selected"])
    tree = TokenTree.with_root(rnd.randrange(V), rule, without_replacement=rnd.random() < 0.7)
    for _ in range(rnd.randrange(0, 9)):  # 0: a lone root
        parent = rnd.randrange(len(tree))
        if rule == "sampled" and parent not in tree.child_dists and rnd.random() < 0.85:
            tree.child_dists[parent] = torch.softmax(torch.randn(V, generator=g) * 2, -1)
        q = tree.child_dists.get(parent)
        # mostly a token drawn from q; sometimes one q cannot have drawn (verified as selected)
        token = int(torch.multinomial(q, 1, generator=g)) if q is not None and rnd.random() < 0.8 else rnd.randrange(V)
        node = tree.add_node(parent, token)
        if rule == "sampled" and rnd.random() < 0.1:
            tree.selected.add(node)  # a hybrid tree's deterministic candidate
    # a selected candidate comes after all of its sampled siblings (TokenTree.selected): unflag
    # one that a sampled sibling follows
    for node in sorted(tree.selected):
        later = [c for c in tree.children(tree.parents[node]) if c > node]
        if any(c not in tree.selected for c in later):
            tree.selected.discard(node)
    return tree


def test_verify_trees_gives_each_tree_its_own_verdict():
    rnd, g = random.Random(7), torch.Generator().manual_seed(7)
    trees = [random_tree(rnd, g) for _ in range(300)]
    # the target near the draft where there is one, so that drafts are accepted at every depth
    logits = [torch.stack([t.child_dists[k].log() + 0.5 * torch.randn(V, generator=g) if k in t.child_dists
                           else 1.5 * torch.randn(V, generator=g) for k in range(len(t))]) for t in trees]
    params = [LAWS[i % 2] for i in range(len(trees))]
    uniforms = [tree_uniforms(t, torch.Generator().manual_seed(1000 + i)) for i, t in enumerate(trees)]
    together = verify_trees(trees, logits, params, uniforms)
    alone = [verify_sampling(t, lg, p, torch.Generator().manual_seed(1000 + i))
             for i, (t, lg, p) in enumerate(zip(trees, logits, params))]
    assert together == alone
    # not vacuous: acceptances and rejections at several depths, lone roots among them
    assert sum(len(v.accepted) >= 2 for v in alone) > 20 and sum(not v.accepted and len(t) > 1
                                                                  for v, t in zip(alone, trees)) > 20
    assert sum(len(t) == 1 for t in trees) > 10


def test_a_lone_root_draws_as_the_plain_sampler():
    """A plain step's token is the one `next_token` draws from the same generator: speculative
    steps of sampled requests and `ar` share their random streams as before batching."""
    g = torch.Generator().manual_seed(0)
    for i in range(50):
        logits = torch.randn(1, V, generator=g) * 2
        params = LAWS[i % 2]
        tree = TokenTree.with_root(3, "sampled")
        v = verify_trees([tree], [logits], [params], [tree_uniforms(tree, torch.Generator().manual_seed(i))])[0]
        assert v.accepted == [] and v.next_token == int(next_token(logits[0], params, torch.Generator().manual_seed(i)))
