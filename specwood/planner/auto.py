"""The planner's methods, registered in the method registry: `--method auto` (PlannedShape, the
per-step choice of SD or AR and the tree size that follows a plan, and the per-request drafter
around it) and `--method prior`. The online trackers are in specwood.planner.trackers, the plans
used before a measured one in specwood.planner.starter.
"""
from __future__ import annotations

import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from specwood.drafting.base import ShapePolicy
from specwood.drafting.model_source import early_exit_model
from specwood.drafting.suffix_source import SuffixSource, suffix_cache_for
from specwood.drafting.shapes import make_shape as make_named_shape
from specwood.engine.protocols import EngineLike
from specwood.engine.request import Drafter
from specwood.engine.step import StepRecord
from specwood.errors import SpecwoodError
from specwood.methods import Method, get_method, prepare_method, register
from specwood.planner.build import get_plan, measure_draft_prefill, measure_draft_rows
from specwood.planner.decision import Decision
from specwood.planner.prior_tree import PriorScores, analytic_scores, maximal_layout, prior_shape
from specwood.planner.starter import describe_starter_plan, starter_plan, starter_plan_ready
from specwood.planner.suffix_choice import CHOICES as SUFFIX_CHOICES
from specwood.planner.suffix_choice import SuffixOrModelShape, SuffixTrust, tested_weight
from specwood.planner.store import (
    DEFAULT_METHOD,
    Plan,
    PlanKey,
    PlanWarning,
    load_plan,
    plan_key_for,
    plan_path,
    save_plan,
)
from specwood.planner.trackers import (
    LOOKUP_K,
    AcceptanceTracker,
    CostRatio,
    DraftCostTracker,
    LateDraft,
    LookupOrModelShape,
    LookupTracker,
    drafting_costs_path,
    scaled_aat,
)
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict

PLAN_RECHECK_S = 30.0  # how often a starter plan looks for a measured one in the store


class PlannedShape(ShapePolicy):
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

    watches_root_logits = True  # LateDraft learns from the target's confidence

    def __init__(self, plan: Plan, make_shape: Callable[[int], Any], adapt: bool = True, lookup: bool = False,
                 model: bool = True, draft_costs: DraftCostTracker | None = None, late: LateDraft | None = None,
                 suffix: SuffixSource | None = None, suffix_trust: SuffixTrust | None = None):
        self.plan = plan
        # with a suffix source, every step weighs model, suffix, both or none (SuffixOrModelShape)
        # in place of the n-gram lookup
        self.suffix = suffix
        self.suffix_trust = suffix_trust or SuffixTrust()
        self.sources_used = dict.fromkeys(SUFFIX_CHOICES, 0)
        self._load = 1
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
        self._predicted_draft_s = 0.0  # the plan's price of this step's drafting (DraftCostTracker)
        self.timed_alone = True  # alone, T_d scaled by the server's learnt price (repeatable() turns it off)
        self._context_len = 0
        self._step: LookupOrModelShape | SuffixOrModelShape | None = None
        self._step_x = 1  # the model's x behind self._step
        self.x_used: dict[int, int] = {}  # x -> steps, for the stats
        self.lookup_steps = 0

    def repeatable(self) -> None:
        """A seeded sampled request: alone, its trees follow the plan and its own verdicts only, not
        the server's learnt price of drafting (measured time), so the same seed repeats its answer."""
        self.timed_alone = False

    def _draft_scale(self, batch_size: int) -> float:
        return self.draft_costs.scale(batch_size) if batch_size > 1 or self.timed_alone else 1.0

    def _decision(self, context_len: int, batch_size: int, riding: int = 0, free: int = 0) -> Decision:
        return self.plan.decide(context_len, self.tracker.scale(self.plan.aat_for(context_len)), batch=batch_size,
                                draft_scale=self._draft_scale(batch_size), riding=riding, free=free)

    def choose_x(self, context_len: int, batch_size: int = 1, riding: int = 0, free: int = 0) -> int:
        if not self.model:
            return 1
        if not self.adapt:
            method, x = self.plan.choose(context_len)
            return 1 if method == "ar" else x
        d = self._decision(context_len, batch_size, riding, free)
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
        if self.late is not None and self._awaiting_draft:
            self.late.observe(logits)

    def _bring_in_draft(self, late: LateDraft, context_len: int) -> None:
        """LateDraft's question, asked before a step of this request alone."""
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

    def for_batch(self, batch_size: int, context_len: int, riding: int = 0, free: int = 0) -> Any | None:
        """The shape for a step shared by `batch_size` requests, with `riding` prefill tokens of
        newcomers in its target forward (or None: a plain step). The tree grows after `free`
        tokens of the grammar's forced run, verified in the same forward: every option pays for
        their rows and gains them (`decide`)."""
        if self.late is not None and self._awaiting_draft and batch_size == 1 and not riding:
            self._bring_in_draft(self.late, context_len)
        self._context_len = context_len
        self._step = None
        self._predicted_draft_s = 0.0
        self._load = batch_size if not riding else batch_size + 1  # requests sharing this step
        if self.suffix is not None:
            return self._suffix_step(self.suffix, batch_size, context_len, riding, free)
        if not self.lookup or batch_size > 1 or riding:  # under load the batch fills the forward already (§4f)
            x = self.choose_x(context_len, batch_size, riding, free)
            self.x_used[x] = self.x_used.get(x, 0) + 1
            if x > 1:
                self._predicted_draft_s = float(self.plan.step_costs(context_len, batch_size)[1](x))
            return self._model_shape(x)
        if self.model:
            d = self._decision(context_len, batch_size, free=free)
            x = d.x if d.method == "sd" else 1
            model_rate = d.p_eff if x > 1 else d.p_ar
        else:  # copying or plain steps only: no need to weigh every tree size each step
            x, model_rate = 1, (1.0 + free) / float(self.plan.t_v(context_len, 1 + free))
        lt = self.lookup_tracker
        copy_price = self.copy_cost.ratio / self.plain_cost.ratio

        def chain_length(longest: int) -> int:
            """The copy length with the best expected rate, if that beats the model's (else 0)."""
            rates = [((free + lt.expected_tokens(c)) / (float(self.plan.t_v(context_len, 1 + free + c)) * copy_price),
                      c) for c in range(1, longest + 1)]
            rate, best = max(rates)
            return best if rate > model_rate else 0

        self._step = LookupOrModelShape(self._model_shape(x), LOOKUP_K, chain_length)
        self._step_x = x
        return self._step

    def _suffix_step(self, suffix: SuffixSource, batch_size: int, context_len: int, riding: int,
                     free: int = 0) -> SuffixOrModelShape:
        """This step's options priced at this context and load: the model's tree of the size the
        plan picks (none if it decodes plainly or has no draft), the suffix's, both, or none."""
        x = self.choose_x(context_len, batch_size, riding, free) if self.model else 1
        aat = float(self.tracker.scale(self.plan.aat_for(context_len))(x)) if x > 1 else 1.0
        scale = self._draft_scale(batch_size)
        t_v, t_d = self.plan.step_costs(context_len, batch_size, scale, riding)
        if x > 1:  # the plan's own price, before the learnt scale
            self._predicted_draft_s = float(t_d(x)) / scale
        price = self.copy_cost.ratio / self.plain_cost.ratio if batch_size == 1 and not riding else 1.0
        self._step_x = x
        step = self._step = SuffixOrModelShape(suffix, self._model_shape(x), x, aat, t_v, t_d,
                                               lambda match, source: self.suffix_trust.ratio(self._load, match,
                                                                                             source),
                                               price, free)
        return step

    def _on_suffix_step(self, step: SuffixOrModelShape, tree: TokenTree, verdict: Verdict,
                        cost: StepRecord | None) -> None:
        step.source.observe(verdict.next_token, [tree.tokens[i] for i in verdict.accepted])
        self.sources_used[step.choice] += 1
        alone = self._load == 1 and cost is not None
        if step.choice in ("model", "both"):
            self.x_used[self._step_x] = self.x_used.get(self._step_x, 0) + 1
            if cost is not None and self._predicted_draft_s:
                self.draft_costs.record(self._predicted_draft_s, cost.draft_share_s, self._load)
        else:
            self.draft_costs.relax(self._load)
        if step.choice == "suffix" and step.part is not None:  # (a suffix step has its part)
            self.suffix_trust.record(self._load, tested_weight(step.part, verdict.accepted), len(verdict.accepted),
                                     step.part.match, step.part.source)
            if alone and cost is not None:
                self.copy_cost.record(float(self.plan.t_v(self._context_len, len(tree))), cost.verify_s)
        else:
            self.suffix_trust.relax(self._load)
            if step.choice == "none" and alone and cost is not None:
                self.plain_cost.record(float(self.plan.t_v(self._context_len, 1)), cost.verify_s)
        if step.choice == "model":
            self.tracker.record(float(self.plan.aat_for(self._context_len)(len(tree))), len(verdict.accepted) + 1)
        else:
            self.tracker.relax()
            self.copy_cost.relax(self.lookup_tracker.relax_decay)

    def close(self) -> None:
        if self.suffix is not None:
            self.suffix.close()

    def on_step(self, tree: TokenTree, verdict: Verdict, cost: StepRecord | None = None) -> None:
        step, self._step = self._step, None
        if isinstance(step, SuffixOrModelShape):
            self._on_suffix_step(step, tree, verdict, cost)
            return
        if cost is not None and self._predicted_draft_s and len(tree) > 1:
            self.draft_costs.record(self._predicted_draft_s, cost.draft_share_s, self._load)
        elif len(tree) <= 1 or (step is not None and step.copied):  # no draft forward this step
            self.draft_costs.relax(self._load)
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


def _prepare_auto(engine: EngineLike, options: dict[str, Any]) -> Callable[..., Drafter]:
    """`--method auto`: the planner's choice per request, per step and per batch size."""
    base = str(options.get("shape") or DEFAULT_METHOD)
    adapt = bool(options.get("adapt", True))
    lookup = adapt and bool(options.get("lookup", True))
    # the suffix source (the request's own text and the server's earlier answers) covers lookup
    suffix_cache = suffix_cache_for(engine, options.get("suffix_cache_tokens")) if (
        lookup and bool(options.get("suffix", True))) else None
    eos = frozenset(getattr(engine, "eos_token_ids", ()) or ())
    late_draft = lookup and bool(options.get("late_draft", True))
    late_threshold = float(options.get("late_draft_confidence", LateDraft.THRESHOLD))
    if not 0.0 <= late_threshold <= 1.0:
        raise SpecwoodError(f"late_draft_confidence must be a probability in [0, 1], got {late_threshold}")
    progress = bool(options.get("progress", True))
    base_method = get_method(base)
    if base_method.name in ("auto", "ar"):
        raise SpecwoodError(f"auto's base shape must be a tree method, not '{base}'")
    # without a draft model, auto still drafts from suffix matches (they cost no forward)
    no_draft = base_method.needs_draft and engine.draft_model is None
    if no_draft and suffix_cache is None:
        if progress:
            print(f"[plan] method auto: no draft model loaded, so '{base}' cannot draft; decoding "
                  "autoregressively (load a draft, or use --method suffix)", file=sys.stderr)
        return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(extra_stats=lambda: {"auto": "ar"})
    if no_draft and progress:
        print("[plan] method auto: no draft model loaded: drafting from suffix matches (the request's text and "
              "the server's earlier answers) where they pay, else decoding plainly", file=sys.stderr)
    plan = get_plan(engine, base, build_if_missing=False, progress=progress)
    current: dict[str, Any] = {"plan": plan, "checked": time.monotonic()}  # latest_plan's
    if plan is None:
        fresh = not starter_plan_ready(engine, base)  # timed once per process and models
        if progress and fresh:
            if getattr(engine.target, "runner", None) is not None:
                print(f"[plan] method auto on a {engine.backend} target: planning from T_v and T_d timed at start",
                      file=sys.stderr)
            else:
                print(f"[plan] no measured plan for '{base}' on this device yet: starting from T_v and T_d timed "
                      f"now, a few seconds (run `specwood plan --method {base}` once, ~6 min, to measure one)",
                      file=sys.stderr)
        plan = current["plan"] = starter_plan(engine, base)
        if progress and fresh:
            print(f"[plan] {describe_starter_plan(plan)}", file=sys.stderr)
    if all(c.method == "ar" for c in plan.choices) and plan.source == "measured" and not lookup:
        return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(extra_stats=lambda: {"auto": "ar"})
    if plan.source == "measured" and engine.draft_model is not None and (
            plan.draft_prefill_s is None
            or (not plan.draft_row_times and getattr(engine.draft_model, "backend", "torch") == "torch")):
        if plan.draft_prefill_s is None:  # a plan from before these fields
            plan.draft_prefill_s = measure_draft_prefill(engine)
        plan.draft_row_times = measure_draft_rows(engine)
        save_plan(plan.refresh())
    make_shape: Callable[[int], Any]
    if base == "prior":
        prior = plan.prior
        if prior is None:
            raise SpecwoodError("method 'prior' needs prior scores (run `specwood plan --method prior`)")
        make_shape = lambda budget: prior_shape(prior.best_layout(budget))  # noqa: E731
        draft_model = engine.draft_model
    else:
        # shapes are stateless policies: one per budget, shared by every request
        make_shape = functools.cache(
            lambda budget: prepare_method(engine, base, {"budget": budget})(_no_source, 0, 0).shape)
        draft_model = _draft_model_of(engine, base)

    told: list[bool] = []
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
        latest: Plan = current["plan"]
        return latest

    def announce_late(late: LateDraft) -> None:
        if progress and not told_late:  # once, as above
            told_late.append(True)
            print(f"[plan] method auto: the target is sure of its tokens (mean p {late.confidence:.3f} over "
                  f"{len(late.confidences)} steps): the draft model comes in at token {late.joined_at} and reads "
                  "the context in its first forward", file=sys.stderr)

    told_late: list[bool] = []

    def new_drafter(sources: Callable[[Any], Any], prompt_len: int, max_tokens: int, load: int = 1,
                    scope: str | None = "") -> Drafter:
        plan = latest_plan()
        # alone, the prefill decision follows the plan: a seeded request must make it the same every run
        scale = draft_costs.scale(load) if load > 1 else 1.0
        model = not no_draft and plan.speculation_pays(prompt_len, max_tokens, load, scale) and not (
            all(c.method == "ar" for c in plan.choices) and plan.source == "measured")
        if not model and not no_draft:
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
        # e.g. a llama.cpp draft: it prefills itself
        if late is not None and (source is None or not source.defers_prefill):
            late, source = None, None
        suffix = (SuffixSource(suffix_cache if scope is not None else None, prompt_len, max_tokens, eos_ids=eos,
                               scope=scope or "") if suffix_cache is not None else None)
        shape = PlannedShape(plan, make_shape, adapt=adapt, lookup=lookup, model=model, draft_costs=draft_costs,
                             late=late, suffix=suffix)

        def stats() -> dict[str, Any]:
            out: dict[str, Any] = {"auto": "sd" if shape.model else "ar", "auto_admission_load": load,
                                   "auto_x_steps": dict(sorted(shape.x_used.items()))}
            if suffix is not None:
                out["auto_sources"] = dict(shape.sources_used)
                out.update(suffix.stats())
            elif lookup:
                out["auto_lookup_steps"] = shape.lookup_steps
            if late is not None:
                out["auto_target_confidence"] = round(late.confidence, 4)
                out["auto_draft_from_token"] = late.joined_at
            return out

        return Drafter(source, shape, extra_stats=stats, defer_draft_prefill=late is not None)

    return new_drafter


def _auto_executor(engine: EngineLike, options: dict[str, Any], prompt_len: int) -> str:
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


def _draft_model_of(engine: EngineLike, base: str) -> Any:
    """The model a base method drafts with (None for pld; the early-exit slice of the target)."""
    if base == "early-exit":
        return early_exit_model(engine.target, max(1, engine.target_config.n_layers // 4))
    return engine.draft_model if get_method(base).needs_draft else None


def _prepare_prior(engine: EngineLike, options: dict[str, Any]) -> Callable[..., Drafter]:
    """`--method prior`: the best `budget`-node tree from the stored prior scores (plan key method
    "prior"). Without stored scores a warning is given and an analytic prior (rank-only
    acceptance model) is used. Without a budget the plan's choice at the shortest context is used
    (16 nodes when there is no plan)."""
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
    make_named_shape("chain", budget=budget)  # the same validation as every budget
    shape = prior_shape(prior.best_layout(int(budget)))
    return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(sources(engine.draft_model), shape)


register(Method("auto", "the planner's choice: SD or AR and the tree size per step, per request and per load",
                False, ("shape", "adapt", "lookup", "late_draft", "late_draft_confidence", "progress", "suffix",
                        "suffix_cache_tokens"), _prepare_auto,
                wants_draft=True, choose_executor=_auto_executor))
register(Method("prior", "seed-000 prior-score tree (top-x node positions by measured acceptance)", True,
                ("budget",), _prepare_prior))
