"""Prior-score tree search (seed paper 000, Sec. III-C) and the width/depth baselines of its Fig. 6.

A *maximal* positional tree of x_m drafted nodes, spread evenly over `levels` levels, is drafted
at every step of greedy SD on a calibration set; every time a position's token is accepted its
score goes up by one. The best tree of n drafted nodes is then the n highest-scoring positions.

Positions are (parent, rank) pairs in BFS order (a `Layout`, as `LayoutShape` runs it): rank r
means "the r-th best draft token after the parent". Since a node can only be accepted when its
parent is, scores never increase down a path; we additionally keep ranks contiguous (rank r only
with rank r - 1) so the result is again a valid layout.

We read which nodes were accepted through the engine's per-step hook `on_step(tree, verdict)`.
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from specwood.drafting.sequoia import DEFAULT_ACCEPTANCE, Layout, rank_weights
from specwood.engine.protocols import EngineLike
from specwood.tree.token_tree import TokenTree

if TYPE_CHECKING:
    from specwood.drafting.shapes import LayoutShape


def maximal_layout(n_nodes: int = 64, levels: int = 8, acceptance: Sequence[float] = DEFAULT_ACCEPTANCE) -> Layout:
    """x_m = n_nodes drafted positions, n_nodes / levels per level (the remainder to the top levels).

    Within a level, the slots go to the (parent, next rank) pairs with the highest prior
    probability of being accepted (product of rank weights along the path, from a generic
    acceptance vector); the measured scores decide later, the prior only decides which positions
    the maximal tree offers.
    """
    if n_nodes < 1 or levels < 1:
        raise ValueError("n_nodes and levels must be positive")
    levels = min(levels, n_nodes)
    w = rank_weights(acceptance) or [0.5]
    per_level = [n_nodes // levels + (1 if i < n_nodes % levels else 0) for i in range(levels)]
    layout: Layout = []
    prior = {0: 1.0}
    layer = [0]
    for count in per_level:
        taken: dict[int, int] = {}  # parent position -> ranks given so far
        heap = [(-prior[p] * w[0], p) for p in layer]  # a parent's next rank enters after the previous
        heapq.heapify(heap)
        chosen: list[tuple[int, int]] = []
        while heap and len(chosen) < count:
            neg, p = heapq.heappop(heap)
            r = taken.get(p, 0)
            chosen.append((p, r))
            taken[p] = r + 1
            heapq.heappush(heap, (-prior[p] * _rank_weight(w, r + 1), p))
        layer = []
        for p, r in sorted(chosen):  # BFS: parents in position order, ranks ascending
            layout.append((p, r))
            pos = len(layout)
            prior[pos] = prior[p] * _rank_weight(w, r)
            layer.append(pos)
    return layout


def _rank_weight(w: Sequence[float], rank: int) -> float:
    """w[rank], halving past the end of the vector (ranks beyond it are rare but possible)."""
    return w[rank] if rank < len(w) else w[-1] * 0.5 ** (rank + 1 - len(w))


def depths_of(layout: Layout) -> list[int]:
    """Depth of every position, index 0 = root."""
    depth = [0]
    for parent, _ in layout:
        depth.append(depth[parent] + 1)
    return depth


def _children(layout: Layout) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pos, (parent, _) in enumerate(layout, start=1):
        kids.setdefault(parent, []).append(pos)
    return kids


def _renumber(layout: Layout, selected: set[int]) -> Layout:
    """The sub-layout of the selected positions (closed under parents and lower ranks), renumbered
    in the original BFS order."""
    new_index = {0: 0}
    out: Layout = []
    for pos in sorted(selected):
        parent, rank = layout[pos - 1]
        out.append((new_index[parent], rank))
        new_index[pos] = len(out)
    return out


def _select(layout: Layout, n: int, key: Callable[[int], tuple]) -> set[int]:
    """Greedily pick n positions, always among the *selectable* ones (parent picked, and the
    sibling of the previous rank picked), the smallest `key` first."""
    kids = _children(layout)
    selected: set[int] = set()
    heap = [(key(kids[0][0]), kids[0][0])] if kids.get(0) else []
    while heap and len(selected) < n:
        _, pos = heapq.heappop(heap)
        selected.add(pos)
        parent, rank = layout[pos - 1]
        siblings = kids[parent]
        if rank + 1 < len(siblings):
            heapq.heappush(heap, (key(siblings[rank + 1]), siblings[rank + 1]))
        if kids.get(pos):
            heapq.heappush(heap, (key(kids[pos][0]), kids[pos][0]))
    return selected


def top_layout(layout: Layout, scores: Sequence[float], n: int) -> Layout:
    """The best tree of n drafted nodes: highest scores first (ties: earlier position), kept
    connected. scores[i] belongs to position i + 1."""
    if len(scores) != len(layout):
        raise ValueError(f"{len(scores)} scores for a layout of {len(layout)} positions")
    return _renumber(layout, _select(layout, n, lambda pos: (-float(scores[pos - 1]), pos)))


def width_layout(layout: Layout, n: int) -> Layout:
    """Width-based baseline: fill the maximal tree level by level (its first n BFS positions)."""
    return list(layout[:n])


def depth_layout(layout: Layout, n: int) -> Layout:
    """Depth-based baseline: consecutive nodes go to consecutive levels (node k at level m, node
    k + 1 at level m + 1, wrapping to level 1 after the deepest); within a level the first
    selectable position in BFS order."""
    depth = depths_of(layout)
    n_levels = max(depth)
    kids = _children(layout)
    selected: set[int] = set()
    level = 1
    while len(selected) < min(n, len(layout)):
        placed = False
        for offset in range(n_levels):
            lv = (level - 1 + offset) % n_levels + 1
            pos = next((p for p in range(1, len(layout) + 1)
                        if depth[p] == lv and p not in selected and _selectable(layout, kids, selected, p)), None)
            if pos is not None:
                selected.add(pos)
                level = lv % n_levels + 1
                placed = True
                break
        if not placed:
            break
    return _renumber(layout, selected)


def _selectable(layout: Layout, kids: dict[int, list[int]], selected: set[int], pos: int) -> bool:
    parent, rank = layout[pos - 1]
    return (parent == 0 or parent in selected) and (rank == 0 or kids[parent][rank - 1] in selected)


def analytic_scores(layout: Layout, acceptance: Sequence[float] = DEFAULT_ACCEPTANCE) -> list[float]:
    """Expected acceptance probability of each position under a rank-only acceptance model:
    the fallback when no calibration was run."""
    w = rank_weights(acceptance)
    value = [1.0]
    for parent, rank in layout:
        value.append(value[parent] * _rank_weight(w, rank))
    return value[1:]


# ---------------------------------------------------------------------------------------------
# measuring the scores


def positions_of(tree: TokenTree, layout: Layout) -> list[int | None]:
    """Layout position of every tree node (None: not a layout position). Works for trees whose
    positions were partly skipped (a node's rank is its index among its parent's children)."""
    kids = _children(layout)
    pos: list[int | None] = [0] + [None] * (len(tree) - 1)
    seen_kids: dict[int, int] = {}
    for i in range(1, len(tree)):
        parent = tree.parents[i]
        rank = seen_kids.get(parent, 0)
        seen_kids[parent] = rank + 1
        pp = pos[parent]
        options = kids.get(pp, []) if pp is not None else []
        pos[i] = options[rank] if rank < len(options) else None
    return pos


@dataclass
class PriorScores:
    """Scores of the maximal tree's positions (scores[i] for position i + 1) and how they were
    obtained; persisted inside a plan."""

    layout: Layout
    scores: list[float]
    steps: int = 0
    aat: float = 0.0  # AAT of the maximal tree on the calibration set
    levels: int = 0
    measured: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def best_layout(self, n: int) -> Layout:
        return top_layout(self.layout, self.scores, n)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": [list(e) for e in self.layout], "scores": list(self.scores), "steps": self.steps,
                "aat": self.aat, "levels": self.levels, "measured": self.measured, "extra": self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PriorScores":
        return cls(layout=[(int(p), int(r)) for p, r in d["layout"]], scores=[float(s) for s in d["scores"]],
                   steps=int(d.get("steps", 0)), aat=float(d.get("aat", 0.0)), levels=int(d.get("levels", 0)),
                   measured=bool(d.get("measured", True)), extra=dict(d.get("extra", {})))


def prior_shape(layout: Layout, name: str = "prior") -> LayoutShape:
    from specwood.drafting.shapes import LayoutShape

    return LayoutShape(name, list(layout))


def collect_prior_scores(engine: EngineLike, prompts_ids: Sequence[Sequence[int]], max_tokens: int = 64,
                         n_nodes: int = 64, levels: int = 8) -> PriorScores:
    """Run greedy SD with the maximal tree on the calibration prompts and count acceptances per
    position."""
    from specwood.drafting.model_source import ModelDraftSource
    from specwood.errors import SpecwoodError
    from specwood.planner.profiler import run_speculative

    if engine.draft_model is None:
        raise SpecwoodError("the prior-score tree search needs a draft model (--draft)")
    layout = maximal_layout(n_nodes, levels)
    scores = [0.0] * len(layout)

    def record(tree: TokenTree, verdict: Any) -> None:
        if len(tree) < 2:
            return
        where = positions_of(tree, layout)
        for node in verdict.accepted:
            if where[node] is not None:
                scores[where[node] - 1] += 1.0

    stats = run_speculative(engine, ModelDraftSource(engine.draft_model), prior_shape(layout, "prior-maximal"),
                            prompts_ids, max_tokens, hooks=[record])
    aat = stats.as_dict()["mean_accepted_tokens"]
    return PriorScores(layout, scores, steps=stats.steps, aat=float(aat), levels=levels)


HELD_OUT_CATEGORIES = ("code", "chat", "math", "translation", "json-extraction", "summarisation")


def held_out_prompts(engine: EngineLike, categories: Sequence[str] = HELD_OUT_CATEGORIES,
                     per_category: int = 1) -> tuple[list[str], list[list[int]]]:
    """(ids, token ids) of `per_category` built-in workload prompts per category: text the prior
    scores were not collected on (they come from the planner's calibration set)."""
    from specwood.bench.workload import load_workload

    limit = len(categories) * max(1, per_category)
    prompts = load_workload("builtin", categories=list(categories), limit=limit).prompts
    return [p.id for p in prompts], [engine.encode(p.content, raw=p.raw) for p in prompts]


def compare_tree_methods(engine: EngineLike, prior: PriorScores, xs: Sequence[int],
                         prompts_ids: Sequence[Sequence[int]],
                         max_tokens: int = 48) -> list[dict[str, Any]]:
    """The paper's Fig. 6 / Table III comparison: AAT, and decode tokens/s (draft + verify time),
    of the prior-score, width-based and depth-based trees at equal verification length x (x - 1
    drafted nodes), pooled over the prompts; `<name>_per_prompt` holds each prompt's AAT for
    paired comparisons. Give prompts the scores were not collected on."""
    from specwood.drafting.model_source import ModelDraftSource
    from specwood.engine.request import SpecStats
    from specwood.errors import SpecwoodError
    from specwood.planner.profiler import run_speculative

    draft = engine.draft_model
    if draft is None:
        raise SpecwoodError("comparing draft trees needs a draft model (--draft)")

    rows = []
    builders = {"prior": prior.best_layout, "width": lambda n: width_layout(prior.layout, n),
                "depth": lambda n: depth_layout(prior.layout, n)}
    for x in xs:
        row: dict[str, Any] = {"x": int(x)}
        for name, make in builders.items():
            shape = prior_shape(make(int(x) - 1), name)
            total, per_prompt = SpecStats(), []
            for ids in prompts_ids:  # one prompt at a time, into one pooled total
                before = (total.steps, total.accepted)
                run_speculative(engine, ModelDraftSource(draft), shape, [ids], max_tokens, total)
                steps, accepted = total.steps - before[0], total.accepted - before[1]
                per_prompt.append((steps + accepted) / steps if steps else 0.0)
            row[name] = total.as_dict()["mean_accepted_tokens"]
            row[f"{name}_per_prompt"] = per_prompt
            seconds = total.draft_s + total.verify_s
            row[f"{name}_tok_s"] = (total.accepted + total.steps) / seconds if seconds > 0 else 0.0
        rows.append(row)
    return rows


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of a - b over paired samples and its standard error (0 with fewer than two pairs)."""
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    if len(diffs) < 2:
        return (diffs[0] if diffs else 0.0), 0.0
    return statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
