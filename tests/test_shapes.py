"""Tree shapes over a tiny synthetic draft source (no models)."""
from __future__ import annotations

import itertools

import pytest
import torch

from specwood.drafting.base import draft_probs
from specwood.drafting.ngram import PromptLookupShape, find_continuation
from specwood.drafting.sequoia import (
    estimate_acceptance_vector,
    expected_accepted,
    rank_weights,
    sequoia_tree,
)
from specwood.drafting.shapes import (
    SHAPES,
    DySpecShape,
    DySpecThresholdShape,
    EagleShape,
    LayoutShape,
    make_shape,
    needs_model,
    static_layout,
)
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=0.8, seed=0)
SAMPLE_TOPK = SamplingParams(temperature=1.0, top_k=3, seed=0)  # q has only 3 tokens: shapes must stop there
ALL_PARAMS = [GREEDY, SAMPLE, SAMPLE_TOPK]
CONTEXT = [1, 2, 3]
ROOT = 4


class ToySource:
    """Logits are a deterministic pseudo-random function of the token path (root included)."""

    def __init__(self, vocab: int = 6, scale: float = 2.0, seed: int = 0) -> None:
        self.vocab_size = vocab
        self.scale = scale
        self.seed = seed
        self.calls: list[list[int]] = []

    def start(self, prompt_tokens: list[int]) -> None:
        pass

    def commit(self, tree: TokenTree, accepted: list[int], next_token: int) -> None:
        pass

    def path_logits(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed((hash(path) ^ self.seed) & 0x7FFFFFFF)
        return torch.randn(self.vocab_size, generator=g) * self.scale

    def logits(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        assert nodes and all(0 <= n < len(tree) for n in nodes)
        self.calls.append(list(nodes))
        return torch.stack([self.path_logits(path_tokens(tree, n)) for n in nodes])

    def q(self, path: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
        return draft_probs(self.path_logits(path)[None], params)[0]


def path_tokens(tree: TokenTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[i] for i in tree.path_to(node))


def build(shape, source, params, seed: int = 0) -> TokenTree:
    return shape.build(list(CONTEXT), ROOT, source, params, torch.Generator().manual_seed(seed))


def check_tree(tree: TokenTree, source: ToySource, params: SamplingParams, *, budget=None, depth=None, rule=None):
    assert tree.parents[0] == -1 and tree.tokens[0] == ROOT and tree.depths[0] == 0
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i, "parents precede children"
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
    for node in range(len(tree)):
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids)), "siblings are distinct tokens"
    if budget is not None:
        assert tree.size <= budget
    if depth is not None:
        assert tree.max_depth <= depth
    expected_rule = rule or ("selected" if params.greedy else "sampled")
    assert tree.child_rule == expected_rule
    if tree.child_rule == "sampled":
        parents = set(tree.parents[1:])
        assert set(tree.child_dists) == parents
        for node, q in tree.child_dists.items():
            assert torch.allclose(q, source.q(path_tokens(tree, node), params))
            for c in tree.children(node):
                assert q[tree.tokens[c]] > 0
    for i in range(1, len(tree)):  # recorded draft probability of each token
        q = source.q(path_tokens(tree, tree.parents[i]), params)
        assert tree.probs[i] == pytest.approx(float(q[tree.tokens[i]]), rel=1e-5)


# ------------------------------------------------------------------------------------------------
# every shape


@pytest.mark.parametrize("params", ALL_PARAMS, ids=["greedy", "sample", "sample-top3"])
@pytest.mark.parametrize("name", [s for s in SHAPES if s != "pld"])
def test_every_model_shape_builds_a_valid_tree(name, params):
    source = ToySource()
    shape = make_shape(name, budget=12, depth=4, topk=3, threshold=0.05)
    assert shape.name == name
    tree = build(shape, source, params)
    rule = "selected" if name == "eagle" else None
    check_tree(tree, source, params, budget=12, depth=4, rule=rule)
    assert tree.size >= 3
    if name == "eagle" or params.greedy:
        assert not tree.child_dists


def test_shapes_need_a_source_except_pld():
    for name in SHAPES:
        shape = make_shape(name)
        assert needs_model(name) == (name != "pld")
        if needs_model(name):
            with pytest.raises(SpecwoodError, match="needs a draft model"):
                build(shape, None, GREEDY)
        else:
            build(shape, None, SAMPLE)


# ------------------------------------------------------------------------------------------------
# chain, static, sequoia shapes


def greedy_path(source: ToySource, k: int) -> list[int]:
    path = (ROOT,)
    for _ in range(k):
        path += (int(source.path_logits(path).argmax()),)
    return list(path[1:])


def test_chain_greedy_follows_argmax_with_one_call_per_token():
    source = ToySource()
    tree = build(make_shape("chain", budget=5), source, GREEDY)
    assert tree.tokens[1:] == greedy_path(source, 5)
    assert tree.parents == [-1, 0, 1, 2, 3, 4]
    assert source.calls == [[0], [1], [2], [3], [4]]


def test_chain_length_is_min_of_budget_and_depth():
    assert make_shape("chain", budget=7, depth=3).build(CONTEXT, ROOT, ToySource(), GREEDY, None).size == 3


def test_static_default_is_specinfer_layout_layer_by_layer():
    source = ToySource(vocab=8)
    tree = build(make_shape("static"), source, GREEDY)
    per_depth = [tree.depths.count(d) for d in range(1, tree.max_depth + 1)]
    assert per_depth == [1, 1, 3, 3, 3, 3, 3, 3]
    assert len(source.calls) == 8 and [len(c) for c in source.calls] == [1, 1, 1, 3, 3, 3, 3, 3]
    root_kids = tree.children(tree.children(tree.children(0)[0])[0])
    q = source.q(path_tokens(tree, tree.parents[root_kids[0]]), GREEDY)
    assert [tree.tokens[c] for c in root_kids] == torch.topk(q, 3).indices.tolist()


def test_static_budget_and_depth_cut_the_layout():
    tree = build(make_shape("static", branching=[2, 2, 2], budget=9, depth=3), ToySource(), GREEDY)
    assert tree.size == 9 and tree.max_depth == 3
    tree = build(make_shape("static", branching=[2, 2, 2], depth=2), ToySource(), GREEDY)
    assert tree.size == 6 and tree.max_depth == 2


def test_layout_shape_follows_positional_tree():
    layout = sequoia_tree([0.6, 0.3, 0.2], 10, max_depth=None)
    source = ToySource()
    tree = build(LayoutShape("sequoia", layout), source, GREEDY)
    assert [(p, r) for p, r in zip(tree.parents[1:], ranks_of(tree))] == layout
    assert len(source.calls) == tree.max_depth  # one call per layer that has children


def test_layout_shape_skips_positions_that_cannot_be_drawn():
    # 4 children wanted under the root, but q (top_k=3) has only 3 tokens: the 4th and its subtree go
    layout = static_layout([4, 1])
    tree = build(LayoutShape("static", layout), ToySource(), SAMPLE_TOPK)
    assert [tree.depths.count(d) for d in (1, 2)] == [3, 3]


def ranks_of(tree: TokenTree) -> list[int]:
    seen: dict[int, int] = {}
    ranks = []
    for p in tree.parents[1:]:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


# ------------------------------------------------------------------------------------------------
# sequoia dynamic program


def all_layouts(n: int, max_depth: int | None):
    """Every ordered tree of at most n drafted nodes, as BFS (parent, rank) layouts."""

    def forests(m: int, depth_left: int | None):
        # ordered forests of exactly m nodes: list of (subtree-children-forest) per root
        if m == 0:
            yield []
            return
        if depth_left is not None and depth_left <= 0:
            return
        for first in range(1, m + 1):
            below = None if depth_left is None else depth_left - 1
            for kids in forests(first - 1, below):
                for rest in forests(m - first, depth_left):
                    yield [kids, *rest]

    def to_layout(forest) -> list[tuple[int, int]]:
        layout, queue = [], [(0, forest)]
        while queue:
            parent, kids = queue.pop(0)
            for rank, sub in enumerate(kids):
                layout.append((parent, rank))
                queue.append((len(layout), sub))
        return layout

    for m in range(n + 1):
        for f in forests(m, max_depth):
            yield to_layout(f)


def layout_depth(layout):
    depth = [0]
    for parent, _ in layout:
        depth.append(depth[parent] + 1)
    return max(depth)


@pytest.mark.parametrize("acceptance", [[0.8, 0.4, 0.2], [0.5, 0.5, 0.5, 0.5], [0.9], [0.3, 0.0, 0.6]])
@pytest.mark.parametrize("max_depth", [None, 1, 2, 3])
def test_sequoia_dp_is_optimal(acceptance, max_depth):
    for n in range(0, 8):
        layout = sequoia_tree(acceptance, n, max_depth)
        assert len(layout) <= n
        if max_depth is not None and layout:
            assert layout_depth(layout) <= max_depth
        LayoutShape("sequoia", layout)  # BFS with contiguous ranks, or it raises
        best = max(expected_accepted(acceptance, other) for other in all_layouts(n, max_depth))
        assert expected_accepted(acceptance, layout) == pytest.approx(best, abs=1e-12)


def test_sequoia_dp_scales_to_large_budgets():
    layout = sequoia_tree([0.7, 0.3, 0.18, 0.12, 0.09, 0.07, 0.05, 0.04], 1024, max_depth=12)
    assert len(layout) == 1024 and layout_depth(layout) <= 12
    assert len(sequoia_tree([0.7, 0.3], 300)) == 300


def test_rank_weights():
    assert rank_weights([0.5, 0.5, 1.0]) == pytest.approx([0.5, 0.25, 0.25])


def simulate_selected(q: torch.Tensor, p: torch.Tensor, k: int) -> list[float]:
    """a_k from the one-hot verifier rule written out step by step."""
    cand = torch.topk(q, k).indices.tolist()
    num, den = [0.0] * k, [0.0] * k
    reach, pr = 1.0, p.double().clone()
    for j, x in enumerate(cand):
        acc = float(pr[x])
        num[j] += reach * acc
        den[j] += reach
        reach *= 1 - acc
        pr[x] = 0
        if pr.sum() > 0:
            pr = pr / pr.sum()
    return num, den


def exact_sampled(q: torch.Tensor, p: torch.Tensor, k: int):
    """a_k for the sampled rule, enumerating every candidate sequence (tiny vocab)."""
    v = q.shape[0]
    num, den = [0.0] * k, [0.0] * k
    for seq in itertools.permutations(range(v), k):
        prob, qc, pc, reach = 1.0, q.double().clone(), p.double().clone(), 1.0
        for j, x in enumerate(seq):
            prob *= float(qc[x])  # draw probability of x from the current residual q
            if prob == 0:
                break
            acc = min(1.0, float(pc[x] / qc[x]))
            num[j] += prob * reach * acc
            den[j] += prob * reach
            reach *= 1 - acc
            pc = (pc - qc).clamp(min=0)
            pc = pc / pc.sum() if pc.sum() > 0 else pc
            qc[x] = 0
            qc = qc / qc.sum()
    return num, den


def test_estimate_acceptance_selected_is_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(5, 7, generator=g) * 2, -1)
    p = torch.softmax(torch.randn(5, 7, generator=g) * 2, -1)
    est = estimate_acceptance_vector(q, p, max_rank=4, rule="selected")
    num, den = [0.0] * 4, [0.0] * 4
    for i in range(5):
        n, d = simulate_selected(q[i], p[i], 4)
        num = [a + b for a, b in zip(num, n)]
        den = [a + b for a, b in zip(den, d)]
    assert est == pytest.approx([a / b for a, b in zip(num, den)], rel=1e-5)


def test_estimate_acceptance_sampled_matches_enumeration():
    g = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(2, 4, generator=g), -1)
    p = torch.softmax(torch.randn(2, 4, generator=g), -1)
    est = estimate_acceptance_vector(q, p, max_rank=3, rule="sampled", samples=4000, generator=g)
    num, den = [0.0] * 3, [0.0] * 3
    for i in range(2):
        n, d = exact_sampled(q[i], p[i], 3)
        num = [a + b for a, b in zip(num, n)]
        den = [a + b for a, b in zip(den, d)]
    assert est == pytest.approx([a / b for a, b in zip(num, den)], abs=0.02)


def test_estimate_acceptance_identical_distributions_accept_first():
    q = torch.softmax(torch.randn(3, 9, generator=torch.Generator().manual_seed(3)), -1)
    assert estimate_acceptance_vector(q, q, max_rank=3, rule="sampled", samples=8)[0] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# dyspec


def slot_values(source: ToySource, max_depth: int, params: SamplingParams = GREEDY) -> dict[tuple, float]:
    """Every greedy node path (root excluded) up to max_depth with its DySpec estimated value:
    P(path of ancestors) * (1 - q-mass of the earlier, higher-ranked siblings)."""
    out: dict[tuple, float] = {}

    def walk(path: tuple, path_prob: float, depth: int) -> None:
        if depth == max_depth:
            return
        q = source.q(path, params).double()
        taken = 0.0
        for tok in torch.argsort(q, descending=True).tolist():
            out[path + (tok,)] = path_prob * (1 - taken)
            walk(path + (tok,), path_prob * float(q[tok]), depth + 1)
            taken += float(q[tok])

    walk((ROOT,), 1.0, 0)
    return out


def tree_paths(tree: TokenTree) -> set[tuple]:
    return {path_tokens(tree, i) for i in range(1, len(tree))}


@pytest.mark.parametrize("budget", [1, 3, 7, 12])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dyspec_greedy_is_top_budget_by_estimated_value(budget, seed):
    source = ToySource(vocab=4, scale=1.5, seed=seed)
    values = slot_values(source, max_depth=3)
    reference = set(sorted(values, key=values.get, reverse=True)[:budget])
    tree = build(DySpecShape(budget=budget, max_depth=3), source, GREEDY)
    assert tree_paths(tree) == reference


def test_dyspec_fetches_lazily_one_call_per_expanded_node():
    source = ToySource()
    tree = build(DySpecShape(budget=16), source, GREEDY)
    assert tree.size == 16
    assert all(len(c) == 1 for c in source.calls)
    assert sorted(c[0] for c in source.calls) == sorted(set(tree.parents[1:]))


@pytest.mark.parametrize("params", ALL_PARAMS, ids=["greedy", "sample", "sample-top3"])
def test_dyspec_prefetch_changes_only_the_number_of_calls(params):
    lazy, eager = ToySource(), ToySource()
    a = build(DySpecShape(budget=20), lazy, params, seed=5)
    b = build(DySpecShape(budget=20, prefetch=4), eager, params, seed=5)
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert len(eager.calls) < len(lazy.calls)


def test_dyspec_respects_max_depth_and_stops_when_support_runs_out():
    tree = build(DySpecShape(budget=50, max_depth=2), ToySource(), SAMPLE_TOPK)
    assert tree.max_depth <= 2 and tree.size == 3 + 9  # top_k=3: 3 children per node, 2 levels


def test_dyspec_sampled_first_child_follows_q():
    source = ToySource(vocab=4, scale=1.0)
    q = source.q((ROOT,), SAMPLE)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(4)
    n = 3000
    for _ in range(n):
        tree = DySpecShape(budget=1).build(CONTEXT, ROOT, source, SAMPLE, gen)
        counts[tree.tokens[1]] += 1
    assert torch.allclose(counts / n, q, atol=0.03)


# ------------------------------------------------------------------------------------------------
# dyspec threshold


@pytest.mark.parametrize("threshold", [0.3, 0.1, 0.04])
def test_dyspec_threshold_greedy_keeps_every_node_above_threshold(threshold):
    source = ToySource(vocab=4, scale=1.5)
    values = slot_values(source, max_depth=3)
    tree = build(DySpecThresholdShape(threshold=threshold, budget=1000, max_depth=3), source, GREEDY)
    assert tree_paths(tree) == {p for p, v in values.items() if v > threshold}
    assert len(source.calls) == tree.max_depth  # one call per layer with children


def test_dyspec_threshold_budget_keeps_best_of_each_layer():
    source = ToySource(vocab=6, scale=1.0)
    full = build(DySpecThresholdShape(threshold=0.01, budget=1000, max_depth=2), ToySource(vocab=6, scale=1.0), GREEDY)
    capped = build(DySpecThresholdShape(threshold=0.01, budget=4, max_depth=2), source, GREEDY)
    assert capped.size == 4 and full.size > 4
    values = slot_values(source, max_depth=1)
    assert tree_paths(capped) == set(sorted(values, key=values.get, reverse=True)[:4])


def test_dyspec_threshold_matches_dyspec_at_the_last_value():
    # Appendix A.1: a threshold just below the budget-th value reproduces Algorithm 1's tree
    source = ToySource(vocab=4, scale=1.5, seed=1)
    values = slot_values(source, max_depth=3)
    ranked = sorted(values.values(), reverse=True)
    t = (ranked[9] + ranked[10]) / 2
    a = build(DySpecThresholdShape(threshold=t, budget=1000, max_depth=3), source, GREEDY)
    b = build(DySpecShape(budget=10, max_depth=3), source, GREEDY)
    assert tree_paths(a) == tree_paths(b)


# ------------------------------------------------------------------------------------------------
# eagle


def eagle_reference(source: ToySource, depth: int, topk: int, params: SamplingParams):
    """All drafted paths with their cumulative probability, by the EAGLE-2 expansion rule."""
    cum = {(ROOT,): 1.0}
    layer = [(ROOT,)]
    drafted = {}
    for _ in range(depth):
        frontier = sorted(layer, key=lambda p: -cum[p])[:topk]
        layer = []
        for path in frontier:
            q = source.q(path, params)
            for tok in torch.topk(q, topk).indices.tolist():
                child = path + (tok,)
                cum[child] = cum[path] * float(q[tok])
                drafted[child] = cum[child]
                layer.append(child)
    return drafted


@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sample"])
def test_eagle_keeps_top_budget_by_cumulative_prob(params):
    source = ToySource(vocab=8)
    tree = build(EagleShape(budget=10, depth=4, topk=3), source, params)
    drafted = eagle_reference(source, 4, 3, params)
    kept = tree_paths(tree)
    assert kept == set(sorted(drafted, key=drafted.get, reverse=True)[:10])
    assert all(path[:-1] in kept or len(path) == 2 for path in kept)  # connected
    assert len(source.calls) == 4 and [len(c) for c in source.calls] == [1, 3, 3, 3]
    check_tree(tree, source, params, budget=10, rule="selected")
    assert tree.depths == sorted(tree.depths)  # BFS order


class SaturatedSource(ToySource):
    """One token takes all the mass: cumulative probabilities tie at 1.0 along the chain."""

    def path_logits(self, path):
        logits = torch.full((self.vocab_size,), -1e4)
        logits[len(path) % self.vocab_size] = 0.0
        return logits


def test_eagle_ties_keep_the_tree_connected():
    tree = build(EagleShape(budget=3, depth=5, topk=2), SaturatedSource(), GREEDY)
    assert tree.size == 3 and tree.parents == [-1, 0, 1, 2]


# ------------------------------------------------------------------------------------------------
# prompt lookup


def test_find_continuation_uses_most_recent_longest_match():
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert find_continuation(tokens, 3, max_ngram=2) == [9, 2, 6]  # most recent "6 7"
    assert find_continuation([1, 2, 3, 9, 2, 3, 4, 7, 3], 2, max_ngram=3) == [4, 7]  # falls back to "3"
    assert find_continuation([1, 2, 3, 1, 2], 5, max_ngram=2) == [3, 1, 2]
    assert find_continuation([1, 2, 3], 4) == []
    assert find_continuation([7], 4) == []


def test_find_continuation_prefers_longer_ngram():
    tokens = [1, 2, 3, 4, 9, 3, 5, 2, 3]
    assert find_continuation(tokens, 1, max_ngram=2) == [4]  # "2 3" beats the more recent "3"
    assert find_continuation(tokens, 1, max_ngram=1) == [5]


def test_pld_shape_builds_a_selected_chain_without_a_model():
    shape = make_shape("pld", budget=3)
    tree = shape.build([10, 11, 12, 13, 14, 10, 11], 12, None, SAMPLE, None)
    assert tree.tokens == [12, 13, 14, 10] and tree.parents == [-1, 0, 1, 2]
    assert tree.child_rule == "selected"
    assert PromptLookupShape().build([1, 2], 3, None, GREEDY, None).size == 0
    with pytest.raises(SpecwoodError):
        PromptLookupShape(max_ngram=1, min_ngram=2)


# ------------------------------------------------------------------------------------------------
# factory


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, "budget must be an integer in [1, 1024], got 0"),
        ({"budget": 1025}, "budget must be an integer in [1, 1024], got 1025"),
        ({"budget": 2.5}, "budget must be"),
        ({"threshold": 0.0}, "threshold must be in (0, 1), got 0.0"),
        ({"threshold": 1}, "threshold must be in (0, 1), got 1"),
        ({"depth": 0}, "depth must be a positive integer, got 0"),
        ({"topk": -1}, "topk must be a positive integer, got -1"),
        ({"branching": [1, 0]}, "branching must be a non-empty list of positive integers"),
        ({"acceptance": [1.5]}, "acceptance must be a non-empty list of probabilities"),
    ],
)
def test_make_shape_errors(kwargs, message):
    with pytest.raises(SpecwoodError) as err:
        make_shape("dyspec-threshold", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_make_shape_unknown_name_and_oversized_static():
    with pytest.raises(SpecwoodError, match="unknown tree shape 'medusa'; choose one of: chain, static"):
        make_shape("medusa")
    with pytest.raises(SpecwoodError, match="unknown tree shape"):
        needs_model("nope")
    with pytest.raises(SpecwoodError, match="more than 1024 nodes"):
        make_shape("static", branching=[8, 8, 8, 8])
    static = make_shape("static", branching=[8, 8, 8, 8], budget=100)
    assert static.build(CONTEXT, ROOT, ToySource(vocab=9), GREEDY, None).size == 100


def test_make_shape_defaults():
    for name in SHAPES:
        assert make_shape(name.upper().replace("-", "_")).name == name
    assert make_shape("dyspec-threshold", budget=64).threshold == pytest.approx(1 / 64)
    eagle = make_shape("eagle")
    assert (eagle.budget, eagle.depth, eagle.topk) == (16, 6, 4)
    assert len(make_shape("sequoia").layout) == 16


def test_sampled_children_are_sequential_draws_without_replacement():
    from specwood.drafting.shapes import _pick

    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    gen = torch.Generator().manual_seed(11)
    n = 4000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        pair = tuple(_pick(q, 2, True, gen))
        counts[pair] = counts.get(pair, 0) + 1
    for a in range(4):
        for b in range(4):
            expect = 0.0 if a == b else float(q[a] * q[b] / (1 - q[a]))
            assert counts.get((a, b), 0) / n == pytest.approx(expect, abs=0.025)
    assert _pick(q, 9, True, gen) and len(_pick(q, 9, True, gen)) == 4  # never a zero-probability token
