"""What a step costs where requests run: T_v and T_d learnt online from the server's own steps,
with the plan as the prior (issue 58).

A starter plan times T_v at two contexts and T_d at one, on a machine that may be busier or
quieter than when it was timed. Every step the engine runs says what a forward of its rows cost
at its context and batch: `OnlineCosts` keeps the log of measured over prior time in decayed sums
at three levels -- per batch bucket, per (batch, context) bucket, per (batch, context, rows)
cell. The first level reads as its mean; each next one's mean is shrunk towards the level above
by a few steps' worth of prior weight. So one step's evidence moves a cell a little, a cell with
no steps borrows its context's correction (a step of 4 rows at 1,500 tokens is dearer than the
plan said if a step of 1 row there was), a context with none borrows its batch's, and where every
step fell in one cell every level reads the same. Each step is clipped to a factor of CLIP of the
current estimate before it is counted (another tenant's burst).

The plan's own prior is made a function of context: its T_v rows are interpolated linearly
between the timed contexts and extrapolated past the last one (attention grows linearly with
the context), where the plan took the nearest bucket; T_d, timed at one context, grows as the
target's plain step does. A uniform change of speed (a loaded machine) scales every cost alike:
the plain step's correction at this context and batch (`machine`) also scales the price of
drafting and of the draft's prefill, so it moves no decision by itself. What drafting costs
beyond that is DraftCostTracker's ratio (one per load, bounded to [0.5, 4] of the price), times
what the steps at this context measured beyond that bound (`draft_excess`: a draft at 3,000
tokens of context may cost 10x its price at 128).

Decisions made from these costs are lossless like any tree choice; a seeded sampled request
alone uses the prior only (`prior_only`): its trees must not depend on measured time.
"""
from __future__ import annotations

import bisect
import math
from typing import Callable

from specwood.planner.decision import Decision, decide, interpolate, nearest_context
from specwood.planner.store import BATCH_MARGIN, BucketChoice, Plan

# A step is counted with its log-ratio to the estimate clipped to within this factor of it
CLIP = 2.0
PRIOR_WEIGHT = 3.0  # steps' worth of evidence each level below the first starts from (its parent's estimate)
DECAY = 0.95  # per step recorded at a level: what a machine's load can change within
ROWS_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65)  # lower bounds: 1, 2, 3-4, 5-8, 9-16, ...
BATCH_BUCKETS = (1, 2, 3, 5, 9)
TRACKED = (math.log(0.5), math.log(4.0))  # DraftCostTracker's bounds (CostRatio._clamp)


def bucket(value: float, bounds: tuple[int, ...]) -> int:
    """The largest of the ascending `bounds` at most `value` (the first below them all)."""
    return bounds[max(bisect.bisect_right(bounds, value) - 1, 0)]


def context_bucket(ctx: float) -> int:
    """Half-octave buckets from 64 tokens: a context's attention share of a step changes little within one."""
    return round(2.0 * math.log2(max(ctx, 64.0)))


def prior_t_v(plan: Plan, ctx: float, x: float) -> float:
    """The plan's T_v(x) at context ctx: linear in the context between its timed buckets and past
    the last one (never below it), its first bucket's below it."""
    contexts = sorted(plan.verify_times)
    if len(contexts) == 1 or ctx <= contexts[0]:
        return plan.t_v(contexts[0], x)
    i = min(bisect.bisect_left(contexts, ctx), len(contexts) - 1)  # the first at least ctx, or the last
    lo, hi = contexts[max(0, i - 1)], contexts[i]
    t_lo, t_hi = plan.t_v(lo, x), plan.t_v(hi, x)
    value = t_lo + (t_hi - t_lo) * (ctx - lo) / (hi - lo)
    return max(value, t_hi) if ctx > hi else value


def prior_t_d(plan: Plan, ctx: float, x: float, t_v: Callable[[float, float], float] | None = None) -> float:
    """The plan's T_d(x) at context ctx: its nearest timed context's, grown with the context as the
    target's plain step grows where the plan timed drafting at one context only. `t_v(ctx, x)`:
    prior_t_v of this plan (a remembering one)."""
    if x <= 1 or not plan.draft_times:
        return 0.0
    timed = nearest_context(list(plan.draft_times), ctx)
    base = plan.t_d(timed, x)
    if len(plan.draft_times) > 1:
        return base
    t_v = t_v or (lambda c, v: prior_t_v(plan, c, v))
    return base * t_v(ctx, 1) / max(t_v(timed, 1), 1e-12)


class LogRatios:
    """Decayed sums of log(measured / prior) at levels of keys, read as the first level's mean and
    each next level's mean shrunk towards the one before (module docstring). `decay` applies at
    each level per unit of weight recorded there."""

    def __init__(self, prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY, clip: float = CLIP):
        self.k, self.decay, self.clip = prior_weight, decay, math.log(clip)
        self.sums: dict[tuple, list[float]] = {}  # key -> [weight, weighted log-ratio]
        self.version = 0  # bumped by every record (for caches of estimates)

    def log_ratio(self, *levels: tuple) -> float:
        """The estimate at the last of `levels` (each a key extending the one before); 0 where
        nothing was recorded."""
        estimate = 0.0
        for i, key in enumerate(levels):
            w, s = self.sums.get(key, (0.0, 0.0))
            if w > 0:
                estimate += (s - w * estimate) / (w + (self.k if i else 0.0))
        return estimate

    def record(self, log_ratio: float, weight: float, *levels: tuple) -> None:
        """One step's log-ratio, clipped near the estimate at the last level, counted at every
        level with `weight` (a batch's requests each count 1/B of their shared step: decay^weight)."""
        lo = self.log_ratio(*levels)
        value = min(lo + self.clip, max(lo - self.clip, log_ratio))
        keep = self.decay ** weight
        for key in levels:
            s = self.sums.setdefault(key, [0.0, 0.0])
            s[0] = keep * s[0] + weight
            s[1] = keep * s[1] + weight * value
        self.version += 1


class OnlineCosts:
    """T_v(rows, ctx, batch), T_d(x, ctx, batch) and the draft's prefill, from `plan` corrected by
    what this server's steps measured (module docstring). One per process and plan: every
    request's steps teach it. `prior_only()` gives a view that ignores the measurements."""

    def __init__(self, plan: Plan, measured: bool = True):
        self.plan = plan
        self.measured = measured
        self.verify = LogRatios()
        self.draft = LogRatios()  # drafting's share against its price (prior x machine), per context
        self._prior_view: OnlineCosts | None = None
        self._memo: dict[tuple, float] = {}
        self._memo_version: tuple[int, int] = (-1, -1)
        self._priors: dict[tuple[float, float], float] = {}
        self._plan_prices: dict[tuple[float, float, int], float] = {}  # draft_price's plan part, remembered

    def prior_only(self) -> "OnlineCosts":
        if not self.measured:
            return self
        if self._prior_view is None:
            self._prior_view = OnlineCosts(self.plan, measured=False)
        return self._prior_view

    # --- the costs --------------------------------------------------------------------------

    @staticmethod
    def _levels(batch: int, ctx: float, rows: float) -> tuple[tuple, ...]:
        b = bucket(batch, BATCH_BUCKETS)
        c = context_bucket(ctx)
        return (b,), (b, c), (b, c, bucket(rows, ROWS_BUCKETS))

    def _fresh_memo(self) -> dict[tuple, float]:
        """Estimates remembered until the next step is recorded (a decision asks for the same few
        many times: every candidate tree's price scales with the plain step's)."""
        version = (self.verify.version, self.draft.version)
        if self._memo_version != version or len(self._memo) > 4096:
            self._memo.clear()
            self._memo_version = version
        return self._memo

    def _prior_t_v(self, ctx: float, rows: float) -> float:
        """prior_t_v, remembered (the plan does not change)."""
        key = (ctx, rows)
        value = self._priors.get(key)
        if value is None:
            if len(self._priors) > 4096:
                self._priors.clear()
            value = self._priors[key] = prior_t_v(self.plan, ctx, rows)
        return value

    def _cell(self, ctx: float, rows: float, batch: int) -> float:
        """prior x this cell's correction."""
        memo, key = self._fresh_memo(), ("cell", ctx, rows, batch)
        if key not in memo:
            memo[key] = self._prior_t_v(ctx, rows) * math.exp(self.verify.log_ratio(*self._levels(batch, ctx, rows)))
        return memo[key]

    def t_v(self, ctx: float, rows: float, batch: int = 1) -> float:
        """One target forward of `rows` rows (all the batch's) for a batch of `batch` at context ctx:
        never less than a forward of fewer rows (a cell's noise must not make a wider tree look
        cheaper than a narrower one)."""
        if not self.measured:
            return prior_t_v(self.plan, ctx, rows)
        own = bucket(rows, ROWS_BUCKETS)
        memo, key = self._fresh_memo(), ("floor", ctx, batch, own)
        floor = memo.get(key)
        if floor is None:  # the widest forward of each narrower bucket
            floor = memo[key] = max((self._cell(ctx, b - 1, batch) for b in ROWS_BUCKETS[1:] if b <= own), default=0.0)
        return max(floor, self._cell(ctx, rows, batch))

    def machine(self, ctx: float, batch: int = 1) -> float:
        """How much slower (above 1) or faster than the plan timed this machine runs a plain step
        of `batch` requests at this context: what drafting and the draft's prefill are scaled by
        too (a busy machine slows every forward; a batch's attention over every request's
        context, which the plan's one-request timings miss, slows the draft's batched forward as
        it slows the target's). So a change of speed alone moves no decision."""
        if not self.measured:
            return 1.0
        memo, key = self._fresh_memo(), ("machine", ctx, batch)
        if key not in memo:
            memo[key] = self.t_v(ctx, batch, batch) / max(self._prior_t_v(ctx, batch), 1e-12)
        return memo[key]

    def draft_price(self, ctx: float, x: float, batch: int = 1) -> float:
        """A drafting request's share of a step's drafting as priced before what drafting itself
        measured: the plan's T_d(x) at this context, grown by batching as `batch_share` grows
        it (by the draft's own forward of `batch` rows, or, untimed, the target's), times the
        machine's speed. What DraftCostTracker compares a step's drafting with."""
        key = (ctx, x, batch)
        t_d = self._plan_prices.get(key)
        if t_d is None:  # the plan's part (it does not change): asked several times a request and step
            t_d = prior_t_d(self.plan, ctx, x, self._prior_t_v)
            if batch > 1:
                rows = ((lambda v: interpolate(self.plan.draft_row_times, v)) if len(self.plan.draft_row_times) >= 2
                        else (lambda v: self._prior_t_v(ctx, v)))
                t_d *= float(rows(batch)) / (batch * float(rows(1)))
            if len(self._plan_prices) > 4096:
                self._plan_prices.clear()
            self._plan_prices[key] = t_d
        return t_d * self.machine(ctx, batch)

    def draft_excess(self, ctx: float, batch: int = 1) -> float:
        """What drafting at this context measured beyond DraftCostTracker's bounds (1 within them)."""
        if not self.measured:
            return 1.0
        memo, key = self._fresh_memo(), ("excess", ctx, batch)
        if key not in memo:
            b = bucket(batch, BATCH_BUCKETS)
            log_ratio = self.draft.log_ratio((b,), (b, context_bucket(ctx)))
            memo[key] = math.exp(log_ratio - min(TRACKED[1], max(TRACKED[0], log_ratio)))
        return memo[key]

    def t_d_share(self, ctx: float, x: float, batch: int = 1) -> float:
        """A drafting request's share of a step's drafting before DraftCostTracker's ratio."""
        return self.draft_price(ctx, x, batch) * self.draft_excess(ctx, batch)

    def prefill_s(self, tokens: int) -> float:
        """The draft's prefill of `tokens` prompt tokens (0: unknown)."""
        return self.plan.draft_prefill_seconds(tokens) * self.machine(tokens)

    def step_costs(self, ctx: float, batch: int = 1, draft_scale: float = 1.0, riding: int = 0
                   ) -> tuple[Callable[[float], float], Callable[[float], float]]:
        """Per-request T_v(x) and T_d(x) at context ctx when `batch` requests share each step, each
        verifying x tokens, with `riding` prefill tokens in its forward (Plan.step_costs, measured)."""
        def whole(rows: float) -> float:
            return self.t_v(ctx, rows, batch)

        if not riding:
            t_v = (lambda x: whole(batch * x) / batch) if batch > 1 else whole
        else:
            own, start = whole(batch), whole(riding + batch)
            t_v = lambda x: (own + whole(riding + batch * x) - start) / batch  # noqa: E731
        return t_v, (lambda x: draft_scale * self.t_d_share(ctx, x, batch))

    # --- what they decide --------------------------------------------------------------------

    def decide(self, ctx: float, aat: Callable[[float], float] | None = None, batch: int = 1,
               draft_scale: float = 1.0, riding: int = 0, free: int = 0) -> Decision:
        """Plan.decide with these costs."""
        t_v, t_d = self.step_costs(ctx, batch, draft_scale, riding)
        return decide(t_v, t_d, aat or self.plan.aat_for(int(ctx)), self.plan.candidate_xs(int(ctx)),
                      margin=BATCH_MARGIN if batch > 1 or riding else 0.0, free=free)

    def prefill_is_earned(self, d: Decision | BucketChoice, tokens: int, context_len: int) -> bool:
        """Whether `tokens` tokens at d's speculative rate instead of its plain one save more than
        the draft's prefill of `context_len` tokens costs (Plan.prefill_is_earned, measured)."""
        if d.method == "ar" or d.p_eff <= 0:
            return False
        return tokens * (1.0 / d.p_ar - 1.0 / d.p_eff) > self.prefill_s(context_len)

    def speculation_pays(self, prompt_len: int, max_tokens: int, load: int = 1, draft_scale: float = 1.0) -> bool:
        """Plan.speculation_pays at the costs measured here: whether the draft's prefill of this
        prompt is earned back over `max_tokens` new tokens, at the context the answer will average
        (the prompt and half the answer). Alone, the plan's choice for the prompt's bucket with its
        rates re-priced: scaled by the bucket's own times over the measured ones there; shared by
        `load` requests, the batch decision at the measured costs."""
        choice = self.plan.choice_for(prompt_len)
        if choice.method == "ar" or choice.p_eff <= 0:
            return False
        ctx = prompt_len + max_tokens / 2
        if load > 1:
            d = self.decide(ctx, batch=load, draft_scale=draft_scale)
        else:
            c, x = choice.context, choice.x
            plain = self.plan.t_v(c, 1) / self.t_v(ctx, 1)
            tree = ((self.plan.t_v(c, x) + self.plan.t_d(c, x))
                    / (self.t_v(ctx, x) + draft_scale * self.t_d_share(ctx, x)))
            d = Decision("sd", x, 0.0, choice.p_eff * tree, choice.p_ar * plain, x)
        return self.prefill_is_earned(d, max_tokens, prompt_len)

    # --- what the steps measured -------------------------------------------------------------

    def observe_verify(self, ctx: float, rows: int, batch: int, seconds: float, weight: float = 1.0) -> None:
        """A target forward of `rows` rows for `batch` requests, seen by one of them at context ctx."""
        prior = prior_t_v(self.plan, ctx, rows)
        if self.measured and seconds > 0 and prior > 0:
            self.verify.record(math.log(seconds / prior), weight, *self._levels(batch, ctx, rows))

    def observe_draft(self, ctx: float, x: int, batch: int, seconds: float) -> None:
        """A request's share of a step's drafting (a tree of x tokens), against its price here."""
        price = self.draft_price(ctx, x, batch)
        if self.measured and seconds > 0 and price > 0:
            b = bucket(batch, BATCH_BUCKETS)
            self.draft.record(math.log(seconds / price), 1.0, (b,), (b, context_bucket(ctx)))
