"""The planner's methods, registered in the method registry: `--method auto` (AcceptanceTracker,
PlannedShape, a starter plan when none is measured) and `--method prior`.
"""
from __future__ import annotations

import datetime
import functools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from specwood.drafting.base import ShapeBase
from specwood.drafting.ngram import copied_chain, find_continuation
from specwood.engine.request import Drafter
from specwood.engine.step import StepRecord
from specwood.errors import SpecwoodError
from specwood.methods import Method, prepare_method, register
from specwood.planner.build import get_plan, measure_draft_prefill, measure_draft_rows
from specwood.planner.decision import Decision
from specwood.planner.store import (
    _DTYPE_NAMES,
    DEFAULT_METHOD,
    Plan,
    PlanKey,
    PlanWarning,
    load_plan,
    plan_key_for,
    plan_path,
    save_plan,
    write_json_atomically,
)
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict

PLAN_RECHECK_S = 30.0  # how often a starter plan looks for a measured one in the store


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

    def relax(self) -> None:
        """A plain step: no evidence, drift back towards the plan."""
        self.observed = self.decay * self.observed + (1 - self.decay) * self.unit
        self.predicted = self.decay * self.predicted + (1 - self.decay) * self.unit

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
    """What drafting in shared steps really costs against the plan's batch model, shared by all
    requests one prepared `auto` serves (a property of the machine and the batching, not of a
    request).

    The plan times one draft forward per row count, one row per request. In a real shared step a
    request's draft call also carries the tokens it accepted last step, and the batch's draft
    rounds wait for its deepest tree: at c = 8 drafting cost 1.6x the prediction (§4g). Each
    drafting request records its fair share of the step's drafting against what the plan
    predicted for it; T_d in shared steps is scaled by the decayed ratio. Steps of one request
    are not counted: the plan's T_d was measured that way.

    With a `path` (next to the plan) the ratio survives the process: a server started again
    does not pay for learning it under load once more (its first shared steps would speculate
    at the plan's price). Delete the file to learn it afresh."""

    SAVE_EVERY = 8  # records between writes

    def __init__(self, decay: float = 0.9, path: Path | None = None):
        super().__init__(decay)
        self.path = path
        self.ratio = self._stored_ratio(path) if path is not None else 1.0
        self._unsaved = 0

    def scale(self, batch: int) -> float:
        return 1.0 if batch <= 1 else self.ratio

    def record(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s > 0:
            super().record(predicted_s, measured_s)
            self._unsaved += 1
            if self.path is not None and self._unsaved >= self.SAVE_EVERY:
                self.save()

    def save(self) -> None:
        """Write the ratio (atomically); a cache that cannot be written only means learning it again."""
        self._unsaved = 0
        try:
            write_json_atomically(self.path, {"ratio": self.ratio,
                                              "saved": datetime.datetime.now().isoformat(timespec="seconds")})
        except OSError:
            pass

    @staticmethod
    def _stored_ratio(path: Path) -> float:
        try:
            ratio = float(json.loads(path.read_text())["ratio"])
        except (OSError, ValueError, KeyError, TypeError):
            return 1.0  # none yet, or damaged: learn it
        return DraftCostTracker._clamp(ratio) if ratio == ratio else 1.0


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


class LookupOrModelShape(ShapeBase):
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


class PlannedShape:
    """A per-request tree-shape policy that follows a plan as the context grows, as acceptance is
    observed and as the load changes.

    Before each step (`for_batch`) it takes the plan's measured T_v and T_d at the current
    context length, the plan's AAT(x) for that context corrected for this request
    (AcceptanceTracker), and the number of requests sharing the step, and picks the argmax x of
    P_eff (budget x - 1) -- or None (a plain step) where AR wins. After each step (`on_step`) it
    credits the tracker with what the tree it chose really got accepted. With `adapt=False` it
    uses the plan's per-bucket choices as stored (batch of one).

    With `lookup`, a step the request has to itself copies from the context instead when an
    n-gram recurs and the copy's expected tokens per T_v(1 + chain), at the best chain length,
    beat the model's rate
    (LookupOrModelShape; LookupTracker learns how well copying does in this request). A copy's
    T_v is the plan's, corrected by what this request's copy steps measured against its plain
    steps: the plan's widest context bucket may be far shorter than the prompt, and a wide
    forward's attention grows with the context faster than a one-token one's. Shared
    steps do not copy: measured under load, the wider forward cost more than the copies earned.
    With `model=False` the draft model is not used (its prefill did not pay): the request
    copies or decodes plainly -- unless `late` (LateDraft) finds the target sure enough of its
    tokens that the draft, reading the context in its first forward, now pays.
    """

    def __init__(self, plan: Plan, make_shape: Callable[[int], Any], adapt: bool = True, lookup: bool = False,
                 model: bool = True, draft_costs: DraftCostTracker | None = None, late: LateDraft | None = None):
        self.plan = plan
        self.late = late if not model else None
        self.name = f"auto:{plan.key.method}"
        self.adapt = adapt
        self.lookup = lookup
        self.model = model
        self._make_shape = make_shape
        self._shapes: dict[int, Any] = {}
        self.tracker = AcceptanceTracker()
        self.lookup_tracker = LookupTracker()
        # measured against predicted verify time, this request's copy steps and its plain steps
        self.copy_cost, self.plain_cost = CostRatio(decay=0.7), CostRatio(decay=0.7)
        self.draft_costs = draft_costs or DraftCostTracker()
        self._predicted_draft_s = 0.0  # the plan's price of this step's drafting, in a shared step
        self._context_len = 0
        self._step: LookupOrModelShape | None = None
        self._step_x = 1  # the model's x behind self._step
        self.x_used: dict[int, int] = {}  # x -> steps, for the stats
        self.lookup_steps = 0

    def _decision(self, context_len: int, batch_size: int, riding: int = 0) -> Decision:
        return self.plan.decide(context_len, self.tracker.scale(self.plan.aat_for(context_len)), batch=batch_size,
                                draft_scale=self.draft_costs.scale(batch_size), riding=riding)

    def choose_x(self, context_len: int, batch_size: int = 1, riding: int = 0) -> int:
        if not self.model:
            return 1
        if not self.adapt:
            method, x = self.plan.choose(context_len)
            return 1 if method == "ar" else x
        d = self._decision(context_len, batch_size, riding)
        return 1 if d.method == "ar" else d.x

    def _model_shape(self, x: int) -> Any | None:
        if x <= 1:
            return None
        if x not in self._shapes:
            self._shapes[x] = self._make_shape(x - 1)
        return self._shapes[x]

    @property
    def _awaiting_draft(self) -> bool:
        """A LateDraft still deciding: no draft yet, and it could still pay."""
        return self.late is not None and not self.model and not self.late.hopeless

    def on_root_logits(self, logits: Any) -> None:
        if self._awaiting_draft:
            self.late.observe(logits)

    def _bring_in_draft(self, context_len: int) -> None:
        """LateDraft's question, asked before a step of this request alone."""
        late = self.late
        left, catch_up = late.tokens_left(context_len), context_len * (self.plan.draft_prefill_s or 0.0)
        if left * float(self.plan.t_v(context_len, 1)) <= catch_up:  # even free tokens would not earn it
            late.hopeless = True
            return
        ratio = late.ratio(self.plan, context_len)
        if ratio is None:
            return
        d = self.plan.decide(context_len, scaled_aat(self.plan.aat_for(context_len), ratio))
        if self.plan.prefill_is_earned(d, left, context_len):
            self.model = True
            self.tracker.assume(ratio)
            late.joined_at = context_len - late.prompt_len
            if late.announce is not None:
                late.announce(late)

    def for_batch(self, batch_size: int, context_len: int, riding: int = 0) -> Any | None:
        """The shape for a step shared by `batch_size` requests, with `riding` prefill tokens of
        newcomers in its target forward (or None: a plain step)."""
        if self._awaiting_draft and batch_size == 1 and not riding:
            self._bring_in_draft(context_len)
        self._context_len = context_len
        self._step = None
        self._predicted_draft_s = 0.0
        if not self.lookup or batch_size > 1 or riding:  # under load the batch fills the forward already (§4f)
            x = self.choose_x(context_len, batch_size, riding)
            self.x_used[x] = self.x_used.get(x, 0) + 1
            if x > 1 and batch_size > 1:
                self._predicted_draft_s = float(self.plan.step_costs(context_len, batch_size)[1](x))
            return self._model_shape(x)
        if self.model:
            d = self._decision(context_len, batch_size)
            x = d.x if d.method == "sd" else 1
            model_rate = d.p_eff if x > 1 else d.p_ar
        else:  # copying or plain steps only: no need to weigh every tree size each step
            x, model_rate = 1, 1.0 / float(self.plan.t_v(context_len, 1))
        lt = self.lookup_tracker
        copy_price = self.copy_cost.ratio / self.plain_cost.ratio

        def chain_length(longest: int) -> int:
            """The copy length with the best expected rate, if that beats the model's (else 0)."""
            rates = [(lt.expected_tokens(c) / (float(self.plan.t_v(context_len, 1 + c)) * copy_price), c)
                     for c in range(1, longest + 1)]
            rate, best = max(rates)
            return best if rate > model_rate else 0

        self._step = LookupOrModelShape(self._model_shape(x), LOOKUP_K, chain_length)
        self._step_x = x
        return self._step

    def on_step(self, tree: TokenTree, verdict: Verdict, cost: StepRecord | None = None) -> None:
        step, self._step = self._step, None
        if cost is not None and self._predicted_draft_s and len(tree) > 1:
            self.draft_costs.record(self._predicted_draft_s, cost.draft_share_s)
        if step is not None and step.copied:
            self.lookup_steps += 1
            self.lookup_tracker.record(step.copied, len(verdict.accepted))
            if cost is not None:
                self.copy_cost.record(float(self.plan.t_v(self._context_len, 1 + step.copied)), cost.verify_s)
            return
        if step is not None and len(tree) <= 1 and cost is not None:
            self.plain_cost.record(float(self.plan.t_v(self._context_len, 1)), cost.verify_s)
        if step is not None:
            self.x_used[self._step_x] = self.x_used.get(self._step_x, 0) + 1
            self.lookup_tracker.relax()
            self.copy_cost.relax(self.lookup_tracker.relax_decay)
        if len(tree) <= 1:
            self.tracker.relax()
        else:
            self.tracker.record(float(self.plan.aat_for(self._context_len)(len(tree))), len(verdict.accepted) + 1)


def starter_plan(engine: Any, method: str) -> Plan:
    """A plan that needs no profiling, for a device without a measured one: the analytic model of
    this CPU (seconds to measure) with the stored or default AAT curve, trees capped at 8 tokens
    (where the analytic T_v is least wrong). Each request still adapts AAT to what it sees."""
    from specwood.planner.analytic import build_analytic_plan

    if getattr(engine.target, "runner", None) is not None:
        key = plan_key_for(engine, method)
        if key not in _RUNNER_PLANS:  # timed once per process and models
            _RUNNER_PLANS[key] = runner_starter_plan(engine, method)
        return _RUNNER_PLANS[key]
    device = "local-cpu" if engine.device.type == "cpu" else "h100"
    plan = build_analytic_plan(device, str(engine.target_name), str(engine.draft_name or "none"), method=method,
                               dtype=_DTYPE_NAMES.get(str(engine.dtype), "bf16"), contexts=(128, 512, 2048),
                               x_max=8, target_config=engine.target_config, draft_config=engine.draft_config)
    plan.x_cap = 8
    plan.source = "starter"
    plan.notes.append("starter plan: used until `specwood plan` stores a measured one")
    return plan.refresh()


RUNNER_XS = (1, 2, 4, 8, 16)
_RUNNER_PLANS: dict[PlanKey, Plan] = {}


def runner_starter_plan(engine: Any, method: str, ctx: int = 128, repeats: int = 3) -> Plan:
    """A starter plan for a target on llama.cpp, where no analytic model of our
    own runtime applies: T_v(x) timed on the target's runner (one tree forward of x tokens after
    `ctx` tokens), T_d(x) timed with the method's real drafting, AAT(x) from a stored plan of the
    pair or the default curve. A few seconds at start; if even this says speculation cannot pay
    (llama.cpp's batch evaluation on a CPU can cost nearly one step per token), auto decodes
    plainly and says so."""
    from specwood.planner.profiler import measure_draft_times

    tv = runner_verify_times(engine, RUNNER_XS, (ctx,), repeats)
    td = ({ctx: {x: 0.0 for x in RUNNER_XS}} if engine.draft_model is None else
          measure_draft_times(engine, [method], xs=RUNNER_XS, contexts=(ctx,), repeats=repeats, progress=False)[method])
    plan = timed_plan(engine, method, tv, td, draft_prefill_s=0.0,
                      note="starter plan for a runner-backed target: T_v and T_d timed at start")
    plan.x_cap = max(RUNNER_XS)
    plan.source = "starter"
    return plan.refresh()


def timed_plan(engine: Any, method: str, verify_times: dict[int, dict[int, float]],
               draft_times: dict[int, dict[int, float]], *, draft_prefill_s: float | None,
               draft_row_times: dict[int, float] | None = None, note: str) -> Plan:
    """A plan from T_v and T_d timed here, with the AAT(x) of the pair's measured plan (any
    device, any weight mode) or the default curve: what a short timing can say without the
    minutes of calibration decoding `specwood plan` spends on AAT. `note` says who timed it."""
    from specwood.planner.analytic import stored_aat
    from specwood.planner.fits import DEFAULT_AAT

    found = stored_aat(str(engine.target_name), str(engine.draft_name or "none"), method)
    plan = Plan(key=plan_key_for(engine, method), contexts=sorted(verify_times), verify_times=verify_times,
                draft_times=draft_times, aat=found[0] if found else DEFAULT_AAT, draft_prefill_s=draft_prefill_s,
                draft_row_times=dict(draft_row_times or {}), mode="timed",
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                notes=[f"{note}; " + (found[1] if found else "default AAT curve")])
    return plan.refresh()


def runner_verify_times(engine: Any, xs: Sequence[int], contexts: Sequence[int], repeats: int = 3) -> dict[int, dict[int, float]]:
    """T_v(x, ctx) of a llama.cpp target: one tree forward of x tokens after ctx random tokens, on
    a context of its own over the loaded weights (a request may be decoding on the serving one)."""
    import torch

    from specwood.models.llamacpp import LlamaCppModel
    from specwood.planner.profiler import median_time, random_tree

    serving = engine.target.runner
    vocab = engine.target_config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[int, dict[int, float]] = {}
    for ctx in contexts:
        runner = LlamaCppModel(serving.weights.path, n_ctx=ctx + max(xs) + 8, n_seq_max=max(xs),
                               vocab_size=vocab, weights=serving.weights)
        runner.prefill(torch.randint(0, vocab, (ctx,), generator=g).tolist())
        out[ctx] = {}
        for x in xs:
            tree = random_tree(x, g, vocab)

            def forward() -> None:
                runner.forward_tree(tree)
                runner.rollback(ctx)

            out[ctx][x] = median_time(forward, repeats, warmup=1)
        runner.close()
    return out


def _prepare_auto(engine: Any, options: dict[str, Any]) -> Callable[..., Drafter]:
    """`--method auto`: the planner's choice per request, per step and per batch size."""
    from specwood.methods import get_method

    base = str(options.get("shape") or DEFAULT_METHOD)
    adapt = bool(options.get("adapt", True))
    lookup = adapt and bool(options.get("lookup", True))
    late_draft = lookup and bool(options.get("late_draft", True))
    late_threshold = float(options.get("late_draft_confidence", LateDraft.THRESHOLD))
    if not 0.0 <= late_threshold <= 1.0:
        raise SpecwoodError(f"late_draft_confidence must be a probability in [0, 1], got {late_threshold}")
    progress = bool(options.get("progress", True))
    base_method = get_method(base)
    if base_method.name in ("auto", "ar"):
        raise SpecwoodError(f"auto's base shape must be a tree method, not '{base}'")
    if base_method.needs_draft and engine.draft_model is None:
        if progress:
            print(f"[plan] method auto: no draft model loaded, so '{base}' cannot draft; decoding "
                  "autoregressively (load a draft, or use --method pld)", file=sys.stderr)
        return lambda sources, prompt_len, max_tokens, load=1: Drafter(extra_stats=lambda: {"auto": "ar"})
    plan = get_plan(engine, base, build_if_missing=False, progress=progress)
    current = {"plan": plan, "checked": time.monotonic()}
    if plan is None:
        if progress:
            if getattr(engine.target, "runner", None) is not None:
                print(f"[plan] method auto on a {engine.backend} target: planning from T_v and T_d timed at start",
                      file=sys.stderr)
            else:
                print(f"[plan] no measured plan for '{base}' on this device yet: starting from an analytic estimate "
                      f"(run `specwood plan --method {base}` once, ~6 min, to measure one)", file=sys.stderr)
        plan = current["plan"] = starter_plan(engine, base)
    if all(c.method == "ar" for c in plan.choices) and plan.source == "measured" and not lookup:
        return lambda sources, prompt_len, max_tokens, load=1: Drafter(extra_stats=lambda: {"auto": "ar"})
    if plan.source == "measured" and engine.draft_model is not None and (
            plan.draft_prefill_s is None
            or (not plan.draft_row_times and getattr(engine.draft_model, "backend", "torch") == "torch")):
        if plan.draft_prefill_s is None:  # a plan from before these fields
            plan.draft_prefill_s = measure_draft_prefill(engine)
        plan.draft_row_times = measure_draft_rows(engine)
        save_plan(plan.refresh())
    if base == "prior":
        if plan.prior is None:
            raise SpecwoodError("method 'prior' needs prior scores (run `specwood plan --method prior`)")
        from specwood.planner.prior_tree import prior_shape

        make_shape = lambda budget: prior_shape(plan.prior.best_layout(budget))  # noqa: E731
        draft_model = engine.draft_model
    else:
        # shapes are stateless policies: one per budget, shared by every request
        make_shape = functools.cache(lambda budget: prepare_method(engine, base, {"budget": budget})(_no_source, 0, 0).shape)
        draft_model = _draft_model_of(engine, base)

    told = []
    # one per server: every request's shared steps teach it, and it is kept for the next one
    draft_costs = DraftCostTracker(path=drafting_costs_path(plan_key_for(engine, base)))

    def latest_plan() -> Plan:
        """The starter plan until a measured one appears in the store (built in the background by
        `specwood serve`, or by the user), checked at most every PLAN_RECHECK_S seconds."""
        if current["plan"].source == "starter" and time.monotonic() - current["checked"] > PLAN_RECHECK_S:
            current["checked"] = time.monotonic()
            measured = load_plan(plan_key_for(engine, base))
            if measured is not None and not all(c.method == "ar" for c in measured.choices):
                current["plan"] = measured
                if progress:
                    print(f"[plan] method auto: now following the measured plan for '{base}'", file=sys.stderr)
        return current["plan"]

    def announce_late(late: LateDraft) -> None:
        if progress and not told_late:  # once, as above
            told_late.append(True)
            print(f"[plan] method auto: the target is sure of its tokens (mean p {late.confidence:.3f} over "
                  f"{len(late.confidences)} steps): the draft model comes in at token {late.joined_at} and reads "
                  "the context in its first forward", file=sys.stderr)

    told_late: list[bool] = []

    def new_drafter(sources: Callable[[Any], Any], prompt_len: int, max_tokens: int, load: int = 1) -> Drafter:
        plan = latest_plan()
        model = plan.speculation_pays(prompt_len, max_tokens, load, draft_costs.scale(load)) and not (
            all(c.method == "ar" for c in plan.choices) and plan.source == "measured")
        if not model:
            if progress and not told:  # once: a server would print it for every short request
                told.append(True)
                why = ("the plan decodes plainly at this context" if plan.choice_for(prompt_len).method == "ar" else
                       f"the draft's prefill would cost more than speculation saves ({load} request(s) sharing "
                       "the steps)")
                print(f"[plan] method auto: no draft model for a {prompt_len}-token prompt with {max_tokens} "
                      f"new tokens -- {why}; " + ("copying from the context where it pays, else decoding plainly"
                                                   if lookup else "decoding autoregressively"), file=sys.stderr)
            if not lookup:
                return Drafter(extra_stats=lambda: {"auto": "ar"})
        # alone on the machine, a request without the draft may still bring it in (LateDraft)
        late = (LateDraft(prompt_len, max_tokens, threshold=late_threshold, announce=announce_late)
                if not model and late_draft and load == 1 and draft_model is not None else None)
        source = sources(draft_model) if ((model or late) and draft_model is not None) else None
        if late is not None and not hasattr(source, "defer"):  # e.g. a llama.cpp draft: it prefills itself
            late, source = None, None
        shape = PlannedShape(plan, make_shape, adapt=adapt, lookup=lookup, model=model, draft_costs=draft_costs,
                             late=late)

        def stats() -> dict[str, Any]:
            out: dict[str, Any] = {"auto": "sd" if shape.model else "ar",
                                   "auto_x_steps": dict(sorted(shape.x_used.items()))}
            if lookup:
                out["auto_lookup_steps"] = shape.lookup_steps
            if late is not None:
                out["auto_target_confidence"] = round(late.confidence, 4)
                out["auto_draft_from_token"] = late.joined_at
            return out

        return Drafter(source, shape, extra_stats=stats, defer_draft_prefill=late is not None)

    return new_drafter


def _auto_executor(engine: Any, options: dict[str, Any], prompt_len: int) -> str:
    """auto's executor: parallel (DuoDecoding) where the measured plan found it faster than both
    sequential SD and AR at this context, sequential everywhere else."""
    base = str(options.get("shape") or DEFAULT_METHOD)
    plan = _stored_plan(plan_key_for(engine, base))
    if plan is None or plan.parallel is None or plan.source != "measured":
        return "sequential"
    executor = plan.executor_for(prompt_len)
    if executor == "parallel" and options.get("progress", True) and not _told_parallel:
        _told_parallel.append(True)
        c = plan.choice_for(prompt_len)
        print(f"[plan] method auto: the parallel executor (DuoDecoding) measured fastest here "
              f"({c.p_parallel:.1f} vs {max(c.p_ar, c.p_eff):.1f} tok/s sequential)", file=sys.stderr)
    return executor


_told_parallel: list[bool] = []
_plans_read: dict[Path, tuple[tuple[int, int], Plan | None]] = {}


def _stored_plan(key: PlanKey) -> Plan | None:
    """load_plan for a per-request decision: the file is parsed again only when it changed."""
    path = plan_path(key)
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    seen = _plans_read.get(path)
    if seen is None or seen[0] != stamp:
        seen = _plans_read[path] = (stamp, load_plan(key, path))
    return seen[1]


def _no_source(model: Any) -> None:
    return None


def _draft_model_of(engine: Any, base: str) -> Any:
    """The model a base method drafts with (None for pld; the early-exit slice of the target)."""
    from specwood.methods import get_method

    if base == "early-exit":
        from specwood.drafting.model_source import early_exit_model

        return early_exit_model(engine.target, max(1, engine.target_config.n_layers // 4))
    return engine.draft_model if get_method(base).needs_draft else None


def _prepare_prior(engine: Any, options: dict[str, Any]) -> Callable[..., Drafter]:
    """`--method prior`: the best `budget`-node tree from the stored prior scores (plan key method
    "prior"). Without stored scores a warning is given and an analytic prior (rank-only
    acceptance model) is used. Without a budget the plan's choice at the shortest context is used
    (16 nodes when there is no plan)."""
    from specwood.drafting.shapes import make_shape
    from specwood.planner.prior_tree import PriorScores, analytic_scores, maximal_layout, prior_shape

    plan = load_plan(plan_key_for(engine, "prior"))
    if plan is not None and plan.prior is not None:
        prior = plan.prior
    else:
        warnings.warn("no prior-score plan for this engine; using an analytic prior "
                      "(run `specwood plan --method prior` to measure one)", PlanWarning, stacklevel=3)
        layout = maximal_layout(64, 8)
        prior = PriorScores(layout, analytic_scores(layout), measured=False)
    budget = options.get("budget")
    if budget is None:
        sd = [c for c in plan.choices if c.method != "ar"] if plan is not None else []
        budget = sd[0].budget if sd else 16
    make_shape("chain", budget=budget)  # the same validation as every budget
    shape = prior_shape(prior.best_layout(int(budget)))
    return lambda sources, prompt_len, max_tokens, load=1: Drafter(sources(engine.draft_model), shape)


register(Method("auto", "the planner's choice: SD or AR and the tree size per step, per request and per load",
                False, ("shape", "adapt", "lookup", "late_draft", "late_draft_confidence", "progress"), _prepare_auto,
                wants_draft=True, choose_executor=_auto_executor))
register(Method("prior", "seed-000 prior-score tree (top-x node positions by measured acceptance)", True,
                ("budget",), _prepare_prior))
