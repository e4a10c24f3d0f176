"""Tree shapes: small policies that ask a DraftSource for distributions and decide which nodes to add.

Child rules (what the verifier must assume about how children were chosen):

| shape            | greedy params | sampling params              | source.logits calls per tree             |
| ---------------- | ------------- | ---------------------------- | ---------------------------------------- |
| chain            | selected      | sampled                      | k (one per token)                        |
| static           | selected      | sampled, without replacement | one per layer that has children          |
| sequoia          | selected      | sampled, without replacement | one per layer that has children          |
| eagle            | selected      | selected (top-k of q)        | depth (one per layer)                    |
| dyspec           | selected      | sampled, without replacement | one per expanded node (fewer: prefetch)  |
| dyspec-threshold | selected      | sampled, without replacement | one per layer that has children          |
| pld              | selected      | selected                     | none (needs no model)                    |

"selected" under greedy params means: take the top tokens of the (residual) draft distribution,
in rank order. "sampled" means: draw the children of a node one after another from its draft
distribution q with the already drawn siblings removed (renormalised); `tree.child_dists[node]` is
that node's *original* q, from which the verifier re-derives the same residuals in sibling order.
Tokens with q = 0 (cut by top-k/top-p) are never drafted.

Every shape returns the tree the source was asked about, except `eagle`, which drafts a larger
tree and returns a new, pruned, BFS-ordered copy (node indices differ from the drafted tree).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch

from specwood.drafting.base import MAX_BUDGET, DraftCall, Drafting, TreeShape, draft_probs
from specwood.drafting.ngram import PromptLookupShape
from specwood.drafting.sequoia import DEFAULT_ACCEPTANCE, Layout, sequoia_tree
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams, sample_index
from specwood.tree.token_tree import ChildRule, TokenTree

SPECINFER_BRANCHING: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)


# ---------------------------------------------------------------------------------------------
# shared helpers


def _rule(params: SamplingParams) -> ChildRule:
    return "selected" if params.greedy else "sampled"


def _dists(tree: TokenTree, nodes: list[int],
           params: SamplingParams) -> Generator[DraftCall, torch.Tensor, torch.Tensor]:
    """One draft call (`yield from` it): the proposal q after each of `nodes`, [len(nodes), V]."""
    return draft_probs((yield tree, nodes), params)


def _draw(residual: torch.Tensor, sample: bool, generator: torch.Generator | None) -> tuple[int, float, float]:
    """One token from an unnormalised residual (a draw, or its argmax under greedy params), its
    residual value R[y] (its q while each token is drawn, and zeroed, once) and its share of the
    residual mass, i.e. R[y] after renormalisation. Needs mass > 0."""
    y = sample_index(residual, generator) if sample else int(residual.argmax())
    value = float(residual[y])
    return y, value, min(1.0, value / float(residual.double().sum()))


def _pick(q: torch.Tensor, count: int, sample: bool, generator: torch.Generator | None) -> list[int]:
    """`count` distinct tokens from q: drawn one after another without replacement (each from q
    with the earlier ones removed, renormalised), or q's top tokens in rank order."""
    count = min(count, int((q > 0).sum()))
    if count <= 0:
        return []
    if not sample:
        return torch.topk(q, count).indices.tolist()
    residual = q.clone() if count > 1 else q  # (a single draw changes nothing)
    tokens = []
    for k in range(count):
        y = sample_index(residual, generator)
        tokens.append(y)
        if k + 1 < count:
            residual[y] = 0.0
    return tokens


# ---------------------------------------------------------------------------------------------
# positional shapes: chain, static, sequoia


def chain_layout(k: int) -> Layout:
    return [(i, 0) for i in range(k)]


def static_layout(branching: Sequence[int], limit: int = MAX_BUDGET) -> Layout:
    """BFS layout where every node at depth d gets branching[d] children; at most `limit` nodes
    (a BFS prefix, so it stays connected with contiguous ranks)."""
    layout: Layout = []
    layer = [0]
    for b in branching:
        nxt = []
        for parent in layer:
            for rank in range(b):
                if len(layout) == limit:
                    return layout
                layout.append((parent, rank))
                nxt.append(len(layout))
        layer = nxt
    return layout


@dataclass
class LayoutShape(TreeShape):
    """Drafts a fixed positional tree layer by layer: one draft call per layer for all of its
    parents. Greedy: children are the parent's top tokens ("selected"); sampling: children are drawn
    without replacement from q ("sampled"). A position that cannot be filled (q ran out of tokens)
    is skipped together with its subtree."""

    name: str
    layout: Layout
    _kids: dict[int, list[int]] = field(init=False, repr=False)  # position -> child positions

    def __post_init__(self) -> None:
        self._kids = {}
        for pos, (parent, rank) in enumerate(self.layout, start=1):
            if not 0 <= parent < pos or rank != len(self._kids.get(parent, [])):
                raise ValueError(f"layout entry {pos} = {(parent, rank)} is not BFS with contiguous ranks")
            self._kids.setdefault(parent, []).append(pos)

    @property
    def max_nodes(self) -> int:
        return len(self.layout)

    def draft(
        self,
        context: list[int],
        root: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafting:
        sample = not params.greedy
        tree = TokenTree.with_root(root, _rule(params))
        node_of = {0: 0}  # layout position -> tree node (absent: could not be drafted)
        layer = [0]
        while layer:
            parents = [p for p in layer if p in self._kids]
            if not parents:
                break
            qs = yield from _dists(tree, [node_of[p] for p in parents], params)
            layer = []
            for p, q in zip(parents, qs):
                tokens = _pick(q, len(self._kids[p]), sample, generator)
                if sample and tokens:
                    tree.child_dists[node_of[p]] = q
                for pos, token in zip(self._kids[p], tokens):
                    node_of[pos] = tree.add_node(node_of[p], token, float(q[token]))
                    layer.append(pos)
        return tree


def chain_shape(k: int) -> LayoutShape:
    return LayoutShape("chain", chain_layout(k))


def static_shape(branching: Sequence[int] = SPECINFER_BRANCHING, budget: int | None = None) -> LayoutShape:
    return LayoutShape("static", static_layout(branching, budget if budget is not None else MAX_BUDGET))


def sequoia_shape(
    budget: int = 32, max_depth: int | None = None, acceptance: Sequence[float] = DEFAULT_ACCEPTANCE
) -> LayoutShape:
    return LayoutShape("sequoia", sequoia_tree(list(acceptance), budget, max_depth))


# ---------------------------------------------------------------------------------------------
# EAGLE-2: expand the best frontier nodes, then rerank everything by cumulative probability


@dataclass
class EagleShape(TreeShape):
    """For `depth` layers, the `topk` newest nodes with the highest cumulative draft probability
    (product of q along the path) each propose their top-`topk` tokens; then all drafted nodes are
    reranked by cumulative probability and the best `budget` kept. Rule "selected" always.
    Ties rank shallower (then earlier) nodes first, so every kept node's parent is kept too
    (a child's cumulative probability never exceeds its parent's)."""

    budget: int = 32
    depth: int = 6
    topk: int = 8
    name: str = "eagle"

    @property
    def max_nodes(self) -> int:
        return self.budget

    def draft(
        self,
        context: list[int],
        root: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafting:
        tree = TokenTree.with_root(root, "selected")
        cum = [1.0]
        layer = [0]
        for _ in range(self.depth):
            frontier = sorted(layer, key=lambda i: (-cum[i], i))[: self.topk]
            if not frontier:
                break
            qs = yield from _dists(tree, frontier, params)
            values, tokens = torch.topk(qs, min(self.topk, qs.shape[-1]), dim=-1)
            layer = []
            for parent, vals, toks in zip(frontier, values.tolist(), tokens.tolist()):
                for prob, token in zip(vals, toks):
                    if prob <= 0.0:
                        break  # sorted: the rest are outside q's support too
                    layer.append(tree.add_node(parent, token, prob))
                    cum.append(cum[parent] * prob)
        ranked = sorted(range(1, len(tree)), key=lambda i: (-cum[i], tree.depths[i], i))
        return prune(tree, set(ranked[: self.budget]))


def prune(tree: TokenTree, keep: set[int]) -> TokenTree:
    """A new BFS-ordered tree of the root and the nodes in `keep` (must be closed under parents);
    siblings keep their order."""
    kids: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        if i in keep:
            if tree.parents[i] != 0 and tree.parents[i] not in keep:
                raise ValueError(f"node {i} kept without its parent {tree.parents[i]}")
            kids.setdefault(tree.parents[i], []).append(i)
    out = TokenTree.with_root(tree.tokens[0], tree.child_rule, tree.without_replacement)
    layer = [(0, 0)]  # (old index, new index)
    while layer:
        nxt = []
        for old, new in layer:
            if old in tree.child_dists and old in kids:
                out.child_dists[new] = tree.child_dists[old]
            for child in kids.get(old, []):
                nxt.append((child, out.add_node(new, tree.tokens[child], tree.probs[child])))
        layer = nxt
    return out


# ---------------------------------------------------------------------------------------------
# DySpec


@dataclass
class DySpecShape(TreeShape):
    """DySpec Algorithm 1: greedy heap expansion under a node budget.

    The heap holds one *slot* per node: "draw the next child of this node", valued by the
    estimated probability that this draw is reached by verification,
    v = P(path to the node accepted) * (1 - q-mass of the siblings already drawn),
    with draft probabilities standing in for acceptance rates (the paper's Hypothesis 1). Popping the best slot draws
    y from the node's residual R (sampled; argmax under greedy params), adds y, and pushes the
    sibling slot v * (1 - R[y]) and y's child slot v * R[y]. The distribution after y needs a draft
    forward, fetched lazily when y's slot is first popped (leaves never cost one); `prefetch` > 0
    also fetches that many other pending slots (best first) in the same call, which never changes
    the tree, only the number of calls.
    """

    budget: int = 32
    max_depth: int | None = None
    prefetch: int = 0
    name: str = "dyspec"

    @property
    def max_nodes(self) -> int:
        return self.budget

    def draft(
        self,
        context: list[int],
        root: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafting:
        sample = not params.greedy
        tree = TokenTree.with_root(root, _rule(params))
        dists: dict[int, torch.Tensor] = {}  # node -> original q
        residual: dict[int, torch.Tensor] = {}  # node -> q with drawn children zeroed (unnormalised)
        left: dict[int, int] = {}  # node -> tokens of q not drawn yet: whether any is, without a tensor op
        order = itertools.count()
        heap: list[tuple[float, int, int]] = [(-1.0, next(order), 0)]  # (-v, push order, node)
        while heap and tree.size < self.budget:
            neg_v, _, node = heapq.heappop(heap)
            if node not in dists:
                yield from self._fetch(tree, node, heap, dists, residual, params)
            if node not in left:  # (a prefetch may have brought its q before)
                left[node] = int((dists[node] > 0).sum())
            if not left[node]:
                continue  # q's support is used up below this node
            r = residual[node]
            y, q_y, share = _draw(r, sample, generator)
            child = tree.add_node(node, y, q_y)
            if sample:
                tree.child_dists[node] = dists[node]
            r[y] = 0.0
            left[node] -= 1
            v = -neg_v
            if v * (1.0 - share) > 0.0:
                heapq.heappush(heap, (-v * (1.0 - share), next(order), node))
            if v * share > 0.0 and (self.max_depth is None or tree.depths[child] < self.max_depth):
                heapq.heappush(heap, (-v * share, next(order), child))
        return tree

    def _fetch(
        self,
        tree: TokenTree,
        node: int,
        heap: list[tuple[float, int, int]],
        dists: dict[int, torch.Tensor],
        residual: dict[int, torch.Tensor],
        params: SamplingParams,
    ) -> Generator[DraftCall, torch.Tensor, None]:
        nodes = [node]
        if self.prefetch > 0:
            pending = (e for e in heap if e[2] not in dists and e[2] != node)
            nodes += [e[2] for e in heapq.nsmallest(self.prefetch, pending)]
        for n, q in zip(nodes, (yield from _dists(tree, nodes, params))):
            dists[n] = q
            residual[n] = q.clone()


@dataclass
class DySpecThresholdShape(TreeShape):
    """DySpec Algorithm 2: layer by layer, one draft call per layer for every frontier node whose
    value exceeds the threshold; each such node keeps drawing children while its value
    v > threshold (child value v * R[y]; v *= 1 - R[y]; y removed from R, renormalised).
    Capped at `budget` nodes and `max_depth`: within a layer the highest-valued draws come first,
    so a binding budget keeps the best ones.
    """

    threshold: float = 1.0 / 32
    budget: int = 32
    max_depth: int | None = None
    name: str = "dyspec-threshold"

    @property
    def max_nodes(self) -> int:
        return self.budget

    def draft(
        self,
        context: list[int],
        root: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafting:
        sample = not params.greedy
        tree = TokenTree.with_root(root, _rule(params))
        frontier: list[tuple[int, float]] = [(0, 1.0)]  # (node, value of drawing its first child)
        while tree.size < self.budget:
            frontier = [
                (n, v) for n, v in frontier
                if v > self.threshold and (self.max_depth is None or tree.depths[n] < self.max_depth)
            ]
            if not frontier:
                break
            qs = yield from _dists(tree, [n for n, _ in frontier], params)
            frontier = self._expand_layer(tree, frontier, qs, sample, generator)
        return tree

    def _expand_layer(
        self,
        tree: TokenTree,
        frontier: list[tuple[int, float]],
        qs: torch.Tensor,
        sample: bool,
        generator: torch.Generator | None,
    ) -> list[tuple[int, float]]:
        residual = [q.clone() for q in qs]
        heap = [(-v, i) for i, (_, v) in enumerate(frontier)]
        heapq.heapify(heap)
        children: list[tuple[int, float]] = []
        while heap and tree.size < self.budget:
            neg_v, i = heapq.heappop(heap)
            node, r = frontier[i][0], residual[i]
            if not bool((r > 0).any()):
                continue  # q's support is used up below this node
            y, q_y, share = _draw(r, sample, generator)
            v = -neg_v
            children.append((tree.add_node(node, y, q_y), v * share))
            if sample:
                tree.child_dists[node] = qs[i]
            r[y] = 0.0
            if v * (1.0 - share) > self.threshold:
                heapq.heappush(heap, (-v * (1.0 - share), i))
        return children


# ---------------------------------------------------------------------------------------------
# factory


def _check_int(what: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        bound = f"an integer in [{low}, {high}]" if high is not None else "a positive integer"
        raise SpecwoodError(f"{what} must be {bound}, got {value!r}")


# the shapes `make_shape` builds, by name, and the class of each: the one place that says which
# shapes need a draft model (TreeShape.needs_model)
SHAPE_CLASSES: dict[str, type[TreeShape]] = {
    "chain": LayoutShape, "static": LayoutShape, "sequoia": LayoutShape, "eagle": EagleShape,
    "dyspec": DySpecShape, "dyspec-threshold": DySpecThresholdShape, "pld": PromptLookupShape}
SHAPES: list[str] = list(SHAPE_CLASSES)
MODEL_SHAPES: list[str] = [name for name, cls in SHAPE_CLASSES.items() if cls.needs_model]  # all but pld


def canonical_shape(name: str) -> str:
    """A shape's registered name for any spelling ("Chain", "dyspec_threshold"); unknown: a one-line error."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in SHAPES:
        raise SpecwoodError(f"unknown tree shape {name!r}; choose one of: {', '.join(SHAPES)}")
    return key


def needs_model(name: str) -> bool:
    """Whether the shape asks a draft source for distributions (pld does not)."""
    return SHAPE_CLASSES[canonical_shape(name)].needs_model


def make_shape(
    name: str,
    *,
    budget: int | None = None,
    depth: int | None = None,
    topk: int | None = None,
    threshold: float | None = None,
    branching: list[int] | None = None,
    acceptance: list[float] | None = None,
) -> TreeShape:
    """Build a tree shape by name. Options a shape does not use are ignored.

    chain:            k = min(budget, depth) of those given, default 5 tokens.
    static:           `branching` per depth (default SpecInfer's 1,1,3,1,1,1,1,1), cut to `depth`
                      layers and the first `budget` BFS nodes.
    sequoia:          DP tree of `budget` nodes (default 16), max depth `depth` (default none),
                      acceptance vector `acceptance` (default DEFAULT_ACCEPTANCE).
    eagle:            `budget` nodes kept (default 16), `depth` layers (default 6), `topk` (default 4).
    dyspec:           `budget` nodes (default 12), max depth `depth` (default none).
    dyspec-threshold: `threshold` (default 1/budget), at most `budget` nodes (default 16), max depth.

    The default budgets suit a CPU, where every draft forward and every verified node costs real
    time; `--method auto` (the planner) picks the budget from measurements instead.
    pld:              k = min(budget, depth) of those given, default 8 tokens; no model.
    """
    key = canonical_shape(name)
    if budget is not None:
        _check_int("budget", budget, 1, MAX_BUDGET)
    if depth is not None:
        _check_int("depth", depth, 1)
    if topk is not None:
        _check_int("topk", topk, 1)
    if threshold is not None and not (
        isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0.0 < threshold < 1.0
    ):
        raise SpecwoodError(f"threshold must be in (0, 1), got {threshold!r}")
    if branching is not None and (
        not branching or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in branching)
    ):
        raise SpecwoodError(f"branching must be a non-empty list of positive integers, got {branching!r}")
    if acceptance is not None and (
        not acceptance
        or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a <= 1.0 for a in acceptance)
    ):
        raise SpecwoodError(f"acceptance must be a non-empty list of probabilities in [0, 1], got {acceptance!r}")

    given = [x for x in (budget, depth) if x is not None]
    if key == "chain":
        return chain_shape(min(given) if given else 5)
    if key == "pld":
        return PromptLookupShape(k=min(given) if given else 8)
    if key == "static":
        levels = list(branching if branching is not None else SPECINFER_BRANCHING)[: depth or None]
        if budget is None and len(static_layout(levels, MAX_BUDGET + 1)) > MAX_BUDGET:
            raise SpecwoodError(
                f"static branching {levels} makes a tree of more than {MAX_BUDGET} nodes; pass a budget"
            )
        return static_shape(levels, budget)
    if key == "sequoia":
        return sequoia_shape(budget or 16, depth, acceptance if acceptance is not None else DEFAULT_ACCEPTANCE)
    if key == "eagle":
        return EagleShape(budget=budget or 16, depth=depth or 6, topk=topk or 4)
    if key == "dyspec":
        return DySpecShape(budget=budget or 12, max_depth=depth)
    # dyspec-threshold
    size = budget or 16
    return DySpecThresholdShape(threshold=threshold if threshold is not None else 1.0 / size, budget=size,
                                max_depth=depth)
