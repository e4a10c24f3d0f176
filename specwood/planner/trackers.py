"""What `--method auto` learns online while it decodes: acceptance against the plan's AAT(x)
(AcceptanceTracker), real against planned costs (CostRatio, DraftCostTracker), how well copying
from the context does (LookupTracker, LookupOrModelShape), and when a request started without
its draft should bring it in (LateDraft).
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Callable

from specwood.drafting.base import TreeShape
from specwood.drafting.ngram import copied_chain, find_continuation
from specwood.planner.store import Plan, PlanKey, plan_path, write_json_atomically
from specwood.tree.token_tree import TokenTree


class AcceptanceTracker:
    """How much better (or worse) than the plan's AAT(x) the draft does in this request.

    AAT depends on the text as much as on the hardware: a code continuation accepts far deeper
    than an open-ended chat answer, and P_eff(x) is flat enough near its maximum that the
    calibration curve alone can pick a tree half the best size. We keep exponentially decayed
    sums of accepted drafted tokens (observed) and of what the plan's curve predicted for the
    trees used, and scale the curve's drafted part by their ratio r:
        AAT_req(x) = 1 + min(x - 1, r * (AAT(x) - 1)).
    Both sums start from `prior_steps` steps of agreement, so a request starts on the plan. On
    plain (AR) steps nothing is observed and r relaxes towards 1, so a request that fell back
    to AR tries speculation again after a few tokens instead of staying stuck.
    """

    def __init__(self, decay: float = 0.75, prior_steps: float = 2.0, unit: float = 2.0):
        self.decay = decay
        self.unit = unit  # one step's worth of evidence, in accepted drafted tokens
        self.observed = self.predicted = prior_steps * unit

    @property
    def ratio(self) -> float:
        return min(4.0, max(0.05, self.observed / self.predicted))

    def record(self, predicted_aat: float, emitted: int) -> None:
        """A speculative step the plan expected to emit `predicted_aat` tokens emitted `emitted`
        (accepted + bonus)."""
        self.observed = self.decay * self.observed + max(0, emitted - 1)
        self.predicted = self.decay * self.predicted + max(predicted_aat - 1.0, 1e-3)

    def relax(self, decay: float | None = None) -> None:
        """A plain step: no evidence, drift back towards the plan (by `decay`, default the
        tracker's own; auto with probes drifts slower: its probes bring the evidence)."""
        d = self.decay if decay is None else decay
        self.observed = d * self.observed + (1 - d) * self.unit
        self.predicted = d * self.predicted + (1 - d) * self.unit

    def scale(self, aat: Callable[[float], float]) -> Callable[[float], float]:
        """The curve corrected for this request."""
        return scaled_aat(aat, self.ratio)

    def assume(self, ratio: float) -> None:
        """Start from an estimate of the ratio instead of the plan's (auto's late draft)."""
        self.observed = ratio * self.predicted


def scaled_aat(aat: Callable[[float], float], ratio: float) -> Callable[[float], float]:
    """AAT(x) with its drafted part scaled by `ratio`: 1 + min(x - 1, ratio * (AAT(x) - 1))."""
    return lambda x: 1.0 if x <= 1 else 1.0 + min(x - 1.0, ratio * (float(aat(x)) - 1.0))


class CostRatio:
    """A decayed ratio of what something measured to cost against what the plan predicted."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.ratio = 1.0

    def record(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s > 0:
            self.ratio = self.decay * self.ratio + (1 - self.decay) * self._clamp(measured_s / predicted_s)

    def relax(self, decay: float) -> None:
        """Drift back towards the plan's price, so one bad phase is tried again later."""
        self.ratio = decay * self.ratio + (1 - decay)

    @staticmethod
    def _clamp(ratio: float) -> float:
        """One step's (or a stored) ratio, within what a real step can make of the plan's price."""
        return min(4.0, max(0.5, ratio))


class DraftCostTracker(CostRatio):
    """What drafting really costs against the plan's price, shared by all requests one prepared
    `auto` serves (a property of the machine and the batching, not of a request), in two parts:
    steps of one request alone (`alone`) and shared steps (`ratio`).

    The plan times a draft of x tokens with nothing accepted, one row per request. In a real step
    the draft also reads the tokens it accepted last step, and a tree of confident drafts is a
    deep chain, one draft forward per level: alone on the 2-core CPU, dyspec's trees of 8 cost
    2.6x the plan's price (BENCHMARKS.md §18). In a shared step the batch's draft rounds also
    wait for its deepest tree: at c = 8 drafting cost 1.6x the prediction (§4g). Each drafting
    request records its share of the step's drafting against what the plan predicted for it;
    T_d is scaled by the decayed ratio of its part. (A choice of tree that depends on measured
    time, not only on the request's own verdicts, would let a seeded sampled request draft
    different trees from one run to the next, so such a request alone does not use the `alone`
    part: `PlannedShape.repeatable`. Under load its trees follow the shared ratio.)

    Each part drifts back towards the plan's price on steps that do not draft with the model
    (`relax`): a price learnt on deep chains of copying requests would otherwise keep the model
    out for good, since it is only measured where it is used.

    With a `path` (next to the plan) the ratios survive the process: a server started again
    does not pay for learning them once more. Delete the file to learn them afresh."""

    RELAX_DECAY = 0.98  # per step without the model: a price's excess halves in ~35 such steps

    SAVE_EVERY = 8  # records between writes

    def __init__(self, decay: float = 0.9, path: Path | None = None):
        super().__init__(decay)
        self.path = path
        self.alone = CostRatio(decay)
        if path is not None:
            self.ratio, self.alone.ratio = self._stored_ratios(path)
        self._unsaved = 0

    def scale(self, batch: int) -> float:
        return self.alone.ratio if batch <= 1 else self.ratio

    def record(self, predicted_s: float, measured_s: float, batch: int = 2) -> None:
        """A step's drafting share against the plan's price, for steps of `batch` requests."""
        if predicted_s > 0:
            (self.alone if batch <= 1 else super()).record(predicted_s, measured_s)
            self._unsaved += 1
            if self.path is not None and self._unsaved >= self.SAVE_EVERY:
                self.save()

    def relax(self, batch: int = 2) -> None:
        """A step of `batch` requests that did not draft with the model: its part drifts to 1."""
        (self.alone if batch <= 1 else super()).relax(self.RELAX_DECAY)

    def save(self) -> None:
        """Write the ratios (atomically); a cache that cannot be written only means learning them again."""
        self._unsaved = 0
        try:
            write_json_atomically(self.path, {"ratio": self.ratio, "ratio_alone": self.alone.ratio,
                                              "saved": datetime.datetime.now().isoformat(timespec="seconds")})
        except OSError:
            pass

    @staticmethod
    def _stored_ratios(path: Path) -> tuple[float, float]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return 1.0, 1.0  # none yet, or damaged: learn them
        out = []
        for key in ("ratio", "ratio_alone"):
            try:
                ratio = float(data[key])
            except (KeyError, TypeError, ValueError):
                ratio = 1.0
            out.append(DraftCostTracker._clamp(ratio) if ratio == ratio else 1.0)
        return out[0], out[1]


def drafting_costs_path(key: PlanKey) -> Path:
    """Where the learnt price of batched drafting is kept: beside the plan it corrects."""
    path = plan_path(key)
    return path.with_name(path.stem + ".drafting.json")


class LookupTracker:
    """How well copying from the context (prompt lookup) does in this request: the chance `a` that
    a copied token is accepted given the one before it was, from decayed counts of accepted copied
    tokens and of rejections (a chain stops at its first). A chain of c tokens is then expected to
    emit 1 + a + a^2 + ... + a^c tokens, so where copies fail, long chains are worth far less
    than short ones. The counts start at a prior (a recurring 3- or 4-gram is a strong signal: a
    chain of 10 is first worth 4.6 tokens) and drift back to it on steps that do not copy, so a
    request where copying failed tries again later."""

    def __init__(self, prior: float = 0.8, weight: float = 2.0, decay: float = 0.7, relax_decay: float = 0.95):
        self.prior_accepted, self.prior_rejected = prior * weight, (1 - prior) * weight
        self.accepted, self.rejected = self.prior_accepted, self.prior_rejected
        self.decay, self.relax_decay = decay, relax_decay

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def expected_tokens(self, chain: int) -> float:
        """Tokens a lookup step with a copied chain of `chain` tokens is expected to emit."""
        a = self.acceptance
        return 1.0 + sum(a ** i for i in range(1, chain + 1))

    def record(self, chain: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1.0 if accepted < chain else 0.0)

    def relax(self) -> None:
        r = self.relax_decay
        self.accepted = r * self.accepted + (1 - r) * self.prior_accepted
        self.rejected = r * self.rejected + (1 - r) * self.prior_rejected


class LateDraft:
    """A second look at a request that started without its draft model because the draft's
    prefill of the prompt would cost more than the plan's average acceptance saves (a near tie
    for a prompt of a few hundred tokens and a short answer).

    The evidence is free: the target's probability of its top token after each step's context.
    Where the target is nearly sure of its next tokens (extracting fields into JSON, restating a
    text), the draft agrees with it nearly always too; below that, confidence overstates the
    draft's agreement (measured on the built-in workload, BENCHMARKS.md §7r). So from `steps`
    observations on, while their mean a is at least `threshold`, each step asks whether a draft
    whose tokens are each accepted with probability a -- a chain of x tokens then emits
    1 + a + ... + a^(x-1) -- would save more over the tokens left than its catch-up over the
    context costs; the first yes brings the draft in, once. The choice depends on the context
    only, never on a step's random draws, so sampling stays lossless."""

    REFERENCE_X = 8  # the tree size at which a's chain is compared with the plan's AAT curve
    STEPS, THRESHOLD = 6, 0.95

    def __init__(self, prompt_len: int, max_tokens: int, steps: int = STEPS, threshold: float = THRESHOLD,
                 announce: Callable[["LateDraft"], None] | None = None):
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.steps, self.threshold = steps, threshold
        self.announce = announce
        self.confidences: list[float] = []
        self.joined_at: int | None = None  # tokens generated when the draft came in
        self.hopeless = False  # too few tokens left to earn the catch-up back at any acceptance

    @property
    def confidence(self) -> float:
        return sum(self.confidences) / max(1, len(self.confidences))

    def observe(self, logits: Any) -> None:
        import torch

        self.confidences.append(float(torch.softmax(logits.float(), -1).max()))

    def ratio(self, plan: Plan, context_len: int) -> float | None:
        """The AcceptanceTracker ratio a's chain implies for the plan's curve at this context
        (None: not enough evidence yet, or the target is not sure enough)."""
        if len(self.confidences) < self.steps or self.confidence < self.threshold:
            return None
        a, x = min(self.confidence, 1.0 - 1e-6), self.REFERENCE_X
        chain = (1.0 - a ** x) / (1.0 - a)
        return max(1e-3, (chain - 1.0) / max(float(plan.aat_for(context_len)(x)) - 1.0, 1e-3))

    def tokens_left(self, context_len: int) -> int:
        return self.max_tokens - (context_len - self.prompt_len)


class LookupOrModelShape(TreeShape):
    """One step's tree: a chain copied from the context where an n-gram of it recurs, cut to the
    length `chain_length(longest)` picks (0: do not copy; e.g. the copy would emit tokens slower
    than the model's tree), else the model's shape (None: a plain step). Copying needs no draft
    forward, so a step costs T_v(1 + chain) only. The choice depends on the context alone, never
    on this step's random draws, so sampling stays lossless: each tree carries its own rule
    (copied chains are "selected", i.e. a one-hot q)."""

    def __init__(self, model_shape: Any | None, k: int, chain_length: Callable[[int], int]):
        self.model_shape = model_shape
        self.k = k
        self.chain_length = chain_length
        self.name = f"lookup+{getattr(model_shape, 'name', 'ar')}"
        self.copied = 0  # the chain length of the last draft (0: the model drafted)

    def draft(self, context: list[int], root: int, params: Any, generator: Any) -> Any:
        chain = find_continuation([*context, root], self.k, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)
        length = self.chain_length(len(chain)) if chain else 0
        if length:
            self.copied = length
            yield from ()  # no draft calls
            return copied_chain(root, chain[:length])
        self.copied = 0
        if self.model_shape is None:
            yield from ()
            return TokenTree.with_root(root, "selected" if params.greedy else "sampled")
        return (yield from self.model_shape.draft(context, root, params, generator))


LOOKUP_K = 10  # the longest chain copied from the context
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 4, 3  # shorter matches are too weak a signal to pay a wide verify
