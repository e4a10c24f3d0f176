"""`auto`'s per-step choice among the draft model's tree, the suffix tree, both merged, or none,
by expected tokens per second of the step: each option's expected emitted tokens over T_v of its
width (plus T_d for the model), all from the plan at this context and load.

The suffix proposal's score is its expected accepted length (the path probabilities of its
nodes, best first); how far to trust it is learned (SuffixTrust: a factor per level, accepted
nodes against the nodes verification tested, per load, per request). A prefix of k nodes of
the proposal is connected (nodes come best first), so the suffix may draft any k: a strong match
(probabilities near 1 along one path) drafts deep and narrow, up to where T_v(1 + k) stops paying.
The merged tree's expected tokens treat the two sources as independent: at depth d the model's
chain is reached with alpha^d (alpha from its AAT), so the suffix adds (1 - alpha^d) times its
own reach there. The choice depends on the context and past verdicts only, never on this step's
random draws, so sampling stays lossless.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from specwood.drafting.base import Drafting, TreeShape
from specwood.drafting.hybrid import merge_suffix
from specwood.drafting.suffix_source import SuffixSource, global_allowed
from specwood.drafting.suffix_tree import SuffixDraft
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree

SUFFIX_NODES = 48  # the largest suffix proposal auto weighs
SUFFIX_DEPTH = 32
SUFFIX_MIN_PROB = 0.05
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # suffix prefixes weighed (each costs two T_v reads)
CHOICES = ("none", "model", "suffix", "both")


class SuffixTrust:
    """How often a suffix node is accepted once its parent was, against what the counts said:
    accepted nodes over the nodes verification really tested (a node is tested when its parent
    was accepted, each weighted by its conditional count ratio), decayed, per load bucket (alone,
    2-4, 5+ requests sharing a step), per source of the proposal (the request's own text, or earlier
    answers) and per match-length bucket (under 4, 4-7, 8-15, 16+ tokens matched): a continuation
    found after a long match is followed far more often than one after two tokens, and one found in
    the request's own text more often than one in another request's answer at the same match length
    (benchmarks/suffix_replay.py). Nodes past the first rejection were never tested, so a
    deep chain refused at its first token is one miss, not 32: counting the untested ones let a
    single bad step pin the trust at its floor for the rest of the request. Steps that do not
    draft from suffixes relax it towards the prior, so a bad phase is tried again later. One per
    request, like the draft's AcceptanceTracker: a request's choices depend on its own history
    only, so a seeded request repeats its answer whatever the server served before."""

    # source -> match-length bucket (its lower bound) -> prior trust, as benchmarks/suffix_replay.py
    # measured it on the workload items the benchmarks do not time (BENCHMARKS.md §22b, §23b)
    PRIORS = {"local": {0: 0.75, 4: 0.85, 8: 0.9, 16: 0.95}, "global": {0: 0.55, 4: 0.8, 8: 0.75, 16: 0.75}}

    def __init__(self, decay: float = 0.8, priors: dict[str, dict[int, float]] | None = None, weight: float = 2.0,
                 relax_decay: float = 0.95):
        self.decay, self.relax_decay = decay, relax_decay
        by_source = priors or self.PRIORS
        self.priors = {(src, m): (p * weight, weight) for src, by_match in by_source.items() for m, p in by_match.items()}
        self.buckets = {src: sorted(by_match) for src, by_match in by_source.items()}
        if any(b[0] != 0 for b in self.buckets.values()) or set(self.buckets) != {"local", "global"}:
            raise ValueError("SuffixTrust's priors need both sources, 'local' and 'global', with buckets from 0")
        self.sums = {(b, key): list(prior) for b in (1, 2, 5) for key, prior in self.priors.items()}  # -> [accepted, tested]

    @staticmethod
    def bucket(load: int) -> int:
        return 1 if load <= 1 else 2 if load <= 4 else 5

    def key(self, match: int, source: str) -> tuple[str, int]:
        return source, max(m for m in self.buckets[source] if m <= max(match, 0))

    def ratio(self, load: int, match: int = 0, source: str = "local") -> float:
        """The factor a node's conditional count ratio is multiplied by, once per level."""
        accepted, tested = self.sums[self.bucket(load), self.key(match, source)]
        return min(1.0, max(0.05, accepted / tested))

    def record(self, load: int, tested: float, accepted: int, match: int = 0, source: str = "local") -> None:
        s = self.sums[self.bucket(load), self.key(match, source)]
        s[0] = self.decay * s[0] + accepted
        s[1] = self.decay * s[1] + max(tested, 1e-3)

    def relax(self, load: int) -> None:
        r, b = self.relax_decay, self.bucket(load)
        for key, prior in self.priors.items():
            s = self.sums[b, key]
            s[0] = r * s[0] + (1 - r) * prior[0]
            s[1] = r * s[1] + (1 - r) * prior[1]


def trusted_expected(draft: SuffixDraft, trust: float) -> float:
    """The proposal's expected accepted nodes with the trust applied once per level."""
    depths = draft.tree.depths
    return sum(trust ** depths[i] * p for i, p in enumerate(draft.path_probs) if i)


def tested_weight(draft: SuffixDraft, accepted: list[int]) -> float:
    """The conditional count ratios of the nodes of `draft` that verification tested (children
    of the root and of accepted nodes): what `SuffixTrust` compares the accepted count with."""
    on_path = {0, *accepted}
    parents, probs = draft.tree.parents, draft.path_probs
    return sum(probs[i] / max(probs[parents[i]], 1e-9) for i in range(1, len(probs)) if parents[i] in on_path)


def cut(draft: SuffixDraft, k: int) -> SuffixDraft:
    """The proposal's first k nodes (best first, so connected)."""
    if k >= draft.tree.size:
        return draft
    tree = TokenTree.with_root(draft.tree.tokens[0], "selected")
    for i in range(1, k + 1):
        tree.add_node(draft.tree.parents[i], draft.tree.tokens[i], draft.tree.probs[i])
    probs = draft.path_probs[:k + 1]
    return SuffixDraft(tree, probs, sum(probs[1:]), draft.match, draft.occurrences, draft.source)


class SuffixOrModelShape(TreeShape):
    """One step of `auto` with a suffix source: proposes, weighs the four options, drafts the best.

    `t_v`, `t_d`: this request's share of a step's verify and draft time at its context and load;
    `model_x`: the model tree's size the plan chose (1: none), `model_aat`: its expected tokens;
    `trust`: SuffixTrust's factor for a proposal of a given match length and source;
    `price`: this request's measured cost of a wide verify against the plan's; `free`: tokens of
    the grammar's forced run ahead of the root, in every option's forward and gain; `probe`: the
    model drafts this step whatever the weighing says (auto's Probes), alone or with suffix nodes."""

    def __init__(self, source: SuffixSource, model_shape: Any | None, model_x: int, model_aat: float,
                 t_v: Callable[[float], float], t_d: Callable[[float], float], trust: Callable[[int, str], float],
                 price: float = 1.0,
                 free: int = 0, probe: bool = False):
        self.source = source
        self.model_shape = model_shape if model_x > 1 else None
        self.model_x, self.model_aat = model_x, model_aat
        self.t_v, self.t_d, self.trust, self.price, self.free = t_v, t_d, trust, price, free
        self.probe = probe and self.model_shape is not None
        self.name = "suffix-or-model"
        self.choice = "none"
        self.part: SuffixDraft | None = None  # the suffix nodes in the tree drafted
        self.rates: dict[str, float] = {}

    def pick(self, proposals: list[SuffixDraft]) -> SuffixDraft:
        """Of the local and the global proposal, the one with more trusted expected nodes."""
        return max(proposals, key=lambda d: trusted_expected(d, self.trust(d.match, d.source)))

    def weigh(self, draft: SuffixDraft) -> tuple[str, int]:
        """The best option and the suffix nodes it uses."""
        a, price, f = self.trust(draft.match, draft.source), self.price, self.free
        t_v = (lambda v: float(self.t_v(v + f))) if f else self.t_v
        best = ("none", 0, (1.0 + f) / max(float(t_v(1)), 1e-9))
        has_model = self.model_shape is not None
        if has_model:
            m_cost = float(t_v(self.model_x)) + float(self.t_d(self.model_x))
            model = ("model", 0, (f + self.model_aat) / max(m_cost, 1e-9))
            best = model if self.probe else max(best, model, key=lambda o: o[2])
            alpha = 1.0 - 1.0 / max(self.model_aat, 1.0)
        n = draft.tree.size
        if n:
            depths, probs = draft.tree.depths, draft.path_probs
            solo = both = 0.0
            k = 0
            for size in SIZES:
                if size > n:
                    size = n
                while k < size:
                    k += 1
                    reach = a ** depths[k] * probs[k]  # the trust applies once per level
                    solo += reach
                    if has_model:
                        both += (1.0 - alpha ** depths[k]) * reach
                rate = (f + 1.0 + solo) / max(float(t_v(1 + k)) * price, 1e-9)
                if not self.probe:
                    best = max(best, ("suffix", k, rate), key=lambda o: o[2])
                if has_model:
                    cost = float(t_v(self.model_x + k)) * price + float(self.t_d(self.model_x))
                    best = max(best, ("both", k, (f + self.model_aat + both) / max(cost, 1e-9)), key=lambda o: o[2])
                if k == n:
                    break
        return best[0], best[1]

    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        proposal = self.pick(self.source.proposals(context, root, SUFFIX_NODES, SUFFIX_DEPTH, SUFFIX_MIN_PROB,
                                                   global_allowed(params)))
        self.source.count(proposal)
        self.choice, k = self.weigh(proposal)
        part = self.part = cut(proposal, k) if k else None
        if self.choice == "suffix":
            yield from ()
            return part.tree  # rule "selected": a deterministic draft
        if self.choice == "none":
            yield from ()
            return TokenTree.with_root(root, "selected" if params.greedy else "sampled")
        tree = yield from self.model_shape.draft(context, root, params, generator)
        if self.choice == "both":
            merge_suffix(tree, part)
        return tree
