"""The planner's methods, registered in the method registry: `--method auto` (PlannedShape, the
per-step choice of SD or AR and the tree size that follows a plan, and the per-request drafter
around it) and `--method prior`. The online trackers are in specwood.planner.trackers, the plans
used before a measured one in specwood.planner.starter.
"""
from __future__ import annotations

import functools
import itertools
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
from specwood.planner.batch_choice import BatchChoice
from specwood.planner.decision import Decision
from specwood.planner.online import OnlineCosts
from specwood.planner.probes import Probes
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

    Before each step (`for_batch`) it takes T_v and T_d at the current context length and load
    as this server measures them (`costs`, OnlineCosts: the plan corrected by the server's own
    steps), the plan's AAT(x) for that context corrected for this request (AcceptanceTracker),
    and picks the argmax x of P_eff (budget x - 1) -- or None (a plain step) where AR wins. In a
    step shared with other requests the batch decides as a whole (`batch`, BatchChoice). Where
    the decision is plain but the model could draft, `probes` (Probes) drafts the best tree now
    and then, so a draft that starts to pay is found. After each step (`on_step`) it credits
    the tracker with what the tree it chose really got accepted, and the costs with what the
    step took. With `adapt=False` it uses the plan's per-bucket choices as stored (batch of one).

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
    tokens that the draft, reading the context in its first forward, now pays. `planned_model`:
    what the plan alone decided about the draft (a seeded sampled request follows it, not the
    measured costs; None: the same as `model`).
    """

    watches_root_logits = True  # LateDraft learns from the target's confidence
    RELAX_WITH_PROBES = 0.95  # a plain step's drift of the acceptance evidence back to the plan, where probes run

    def __init__(self, plan: Plan, make_shape: Callable[[int], Any], adapt: bool = True, lookup: bool = False,
                 model: bool = True, draft_costs: DraftCostTracker | None = None, late: LateDraft | None = None,
                 suffix: SuffixSource | None = None, suffix_trust: SuffixTrust | None = None,
                 costs: OnlineCosts | None = None, probes: Probes | None = None, batch: BatchChoice | None = None,
                 planned_model: bool | None = None):
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
        self.planned_model = model if planned_model is None else planned_model
        self._make_shape = make_shape
        self._shapes: dict[int, Any] = {}
        self.tracker = AcceptanceTracker()
        self.lookup_tracker = LookupTracker()
        # measured against predicted verify time, this request's copy steps and its plain steps (lookup)
        self.copy_cost, self.plain_cost = CostRatio(decay=0.7), CostRatio(decay=0.7)
        self.draft_costs = draft_costs or DraftCostTracker()
        self.costs = costs or OnlineCosts(plan)
        self.probes = probes
        self.batch = batch or BatchChoice()
        self._predicted_draft_s = 0.0  # this step's drafting price (OnlineCosts.draft_price)
        self._probing = False  # this step is a probe's
        self._behind = 1  # tokens the draft has not read: the root, and what steps without it emitted
        self.timed_alone = True  # alone, costs as measured (repeatable() turns it off)
        self._context_len = 0
        self._step: LookupOrModelShape | SuffixOrModelShape | None = None
        self._step_x = 1  # the model's x behind self._step
        self.x_used: dict[int, int] = {}  # x -> steps, for the stats
        self.lookup_steps = 0

    def repeatable(self) -> None:
        """A seeded sampled request: alone, its trees follow the plan and its own verdicts only, not
        the server's measured costs, and it uses the draft as the plan decided, so the same seed
        repeats its answer."""
        self.timed_alone = False
        if self.probes is not None:
            self.probes.reseed(0)
        if self.model != self.planned_model:
            self.model = self.planned_model
            if self.model:
                self.late = None

    def _draft_scale(self, batch_size: int) -> float:
        return self.draft_costs.scale(batch_size) if batch_size > 1 or self.timed_alone else 1.0

    def _costs(self, batch_size: int = 1, riding: int = 0) -> OnlineCosts:
        """The server's measured costs; for a seeded sampled request, the plan's (its trees follow
        the plan and its own verdicts wherever the batch lets them: under load, the learnt price
        of batched drafting still scales them, as before these costs)."""
        return self.costs if self.timed_alone else self.costs.prior_only()

    def request_aat(self, context_len: int) -> Callable[[float], float]:
        """The plan's AAT(x) at this context as this request accepts (BatchChoice asks it)."""
        return self.tracker.scale(self.plan.aat_for(context_len))

    def _decision(self, context_len: int, batch_size: int, riding: int = 0, free: int = 0) -> Decision:
        return self._costs(batch_size, riding).decide(context_len, self.request_aat(context_len), batch=batch_size,
                                                      draft_scale=self._draft_scale(batch_size), riding=riding,
                                                      free=free)

    def choose_x(self, context_len: int, batch_size: int = 1, riding: int = 0, free: int = 0) -> int:
        """The model's tree size for a step (1: plain), as decided (no probe)."""
        if not self.model:
            return 1
        if not self.adapt:
            method, x = self.plan.choose(context_len)
            return 1 if method == "ar" else x
        d = self._decision(context_len, batch_size, riding, free)
        return 1 if d.method == "ar" else d.x

    def _tree_size(self, context_len: int, batch_size: int, riding: int, free: int) -> tuple[int, Decision | None]:
        """This step's tree size: the batch's choice in a shared step, else this request's own
        decision or, where that is plain, a probe's tree (and the decision, None where the batch
        or the stored plan chose)."""
        if not self.adapt:
            return self.choose_x(context_len), None
        if batch_size > 1 or riding:  # a request without its draft counts in the batch's choice too
            return self.batch.x_for(self, context_len, batch_size, riding, self._costs(batch_size, riding),
                                    self._draft_scale(batch_size)), None
        if not self.model:
            return 1, None
        d = self._decision(context_len, batch_size, free=free)
        self._probing = self.probes is not None and d.x_best_sd >= 2 and self.probes.step(d.method == "sd")
        if self._probing:
            return d.x_best_sd, d
        return (d.x if d.method == "sd" else 1), d

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
        costs = self._costs(1)
        left, catch_up = late.tokens_left(context_len), costs.prefill_s(context_len)
        if left * costs.t_v(context_len, 1) <= catch_up:  # even free tokens would not earn it
            late.hopeless = True
            return
        ratio = late.ratio(self.plan, context_len)
        if ratio is None:
            return
        d = costs.decide(context_len, scaled_aat(self.plan.aat_for(context_len), ratio))
        if costs.prefill_is_earned(d, left, context_len):
            self.model = True
            self._behind = context_len  # its first forward reads the whole context
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
        self._probing = False
        self._load = batch_size if not riding else batch_size + 1  # requests sharing this step
        if self.suffix is not None:
            return self._suffix_step(self.suffix, batch_size, context_len, riding, free)
        if not self.lookup or batch_size > 1 or riding:  # under load the batch fills the forward already (§4f)
            x, _ = self._tree_size(context_len, batch_size, riding, free)
            self.x_used[x] = self.x_used.get(x, 0) + 1
            self._step_x = x
            if x > 1:
                self._predicted_draft_s = self.costs.draft_price(context_len, x, batch_size)
            return self._model_shape(x)
        # rates relative to this context's plain step, so the model's measured costs and the
        # copies' plan prices (corrected by what this request's copies measured) compare
        plain_s = float(self.plan.t_v(context_len, 1 + free)) / (1.0 + free)
        x, d = self._tree_size(context_len, batch_size, 0, free)
        model_rate = (d.p_eff / d.p_ar if d is not None and x > 1 and d.p_eff > 0 and x == d.x
                      else 1.0)
        lt = self.lookup_tracker
        # a seeded sampled request prices copies as the plan does: its measured ratio would tie its trees to the clock
        copy_price = self.copy_cost.ratio / self.plain_cost.ratio if self.timed_alone else 1.0

        def chain_length(longest: int) -> int:
            """The copy length with the best expected rate, if that beats the model's (else 0)."""
            rates = [((free + lt.expected_tokens(c)) * plain_s / (float(self.plan.t_v(context_len, 1 + free + c))
                                                                   * copy_price), c)
                     for c in range(1, longest + 1)]
            rate, best = max(rates)
            return best if rate > model_rate else 0

        self._step = LookupOrModelShape(self._model_shape(x), LOOKUP_K, chain_length)
        self._step_x = x
        if x > 1:
            self._predicted_draft_s = self.costs.draft_price(context_len, x, 1)
        return self._step

    def _suffix_step(self, suffix: SuffixSource, batch_size: int, context_len: int, riding: int,
                     free: int = 0) -> SuffixOrModelShape:
        """This step's options priced at this context and load: the model's tree of the size
        decided (none if it decodes plainly or has no draft), the suffix's, both, or none. A
        probe's tree is drafted (model or both) whatever the weighing says."""
        x, d = self._tree_size(context_len, batch_size, riding, free)
        probe = d is not None and x > 1 and (d.method == "ar" or x != d.x)
        aat = float(self.request_aat(context_len)(x)) if x > 1 else 1.0
        scale = self._draft_scale(batch_size)
        t_v, t_d = self._costs(batch_size, riding).step_costs(context_len, batch_size, scale, riding)
        if x > 1:
            self._predicted_draft_s = self.costs.draft_price(context_len, x, batch_size)
        self._step_x = x
        step = self._step = SuffixOrModelShape(suffix, self._model_shape(x), x, aat, t_v, t_d,
                                               lambda match, source: self.suffix_trust.ratio(self._load, match,
                                                                                             source),
                                               free=free, probe=probe)
        return step

    def _observe(self, drafted: bool, x: int, emitted: int, cost: StepRecord | None) -> None:
        """What the step cost, for the server's costs and its drafting price: the target forward
        (unless newcomers' prompt rode in it) and the drafting of a model's tree, less the draft's
        catch-up on the tokens steps without it emitted (priced as its prefill: the steps that
        follow do not pay it). A step without the draft relaxes the server's price of drafting
        towards the plan's where this request cannot probe (without probes, or without the
        model): a request that probes measures the price instead. A probe hears whether it
        emitted tokens faster than a plain step would have."""
        if cost is not None and not cost.prefill_tokens and cost.verify_s > 0:
            self.costs.observe_verify(self._context_len, cost.tokens, cost.batch_size, cost.verify_s,
                                      weight=1.0 / max(cost.batch_size, 1))
        drafting = 0.0
        if drafted and cost is not None:
            catch_up = self.costs.prefill_s(self._context_len) * (self._behind - 1) / max(self._context_len, 1)
            drafting = max(cost.draft_share_s - catch_up, 0.25 * cost.draft_share_s)
            if self._predicted_draft_s:
                self.draft_costs.record(self._predicted_draft_s, drafting, self._load)
                self.costs.observe_draft(self._context_len, x, cost.batch_size, drafting)
        elif not drafted and (self.probes is None or not self.model):
            self.draft_costs.relax(self._load)
        self._behind = 1 if drafted else self._behind + emitted
        if self._probing and self.probes is not None:
            if self.timed_alone:
                took = cost.verify_s + drafting if cost is not None else 0.0
            else:  # a seeded sampled request: whether its probe goes on drafting follows the plan's prices
                t_v, t_d = self._costs(1).step_costs(self._context_len)
                took = t_v(x) + t_d(x)
            self.probes.result(took > 0 and emitted / took > 1.0 / self._costs(1).t_v(self._context_len, 1))

    def _relax_acceptance(self) -> None:
        self.tracker.relax(self.RELAX_WITH_PROBES if self.probes is not None else None)

    def _on_suffix_step(self, step: SuffixOrModelShape, tree: TokenTree, verdict: Verdict,
                        cost: StepRecord | None) -> None:
        step.source.observe(verdict.next_token, [tree.tokens[i] for i in verdict.accepted])
        self.sources_used[step.choice] += 1
        drafted = step.choice in ("model", "both")
        if drafted:
            self.x_used[self._step_x] = self.x_used.get(self._step_x, 0) + 1
        self._observe(drafted, self._step_x, len(verdict.accepted) + 1, cost)
        if step.choice == "suffix" and step.part is not None:  # (a suffix step has its part)
            self.suffix_trust.record(self._load, tested_weight(step.part, verdict.accepted), len(verdict.accepted),
                                     step.part.match, step.part.source)
        else:
            self.suffix_trust.relax(self._load)
        if step.choice == "model":
            self.tracker.record(float(self.plan.aat_for(self._context_len)(len(tree))), len(verdict.accepted) + 1)
        else:  # "both": whose the accepted tokens were is not known
            self._relax_acceptance()

    def close(self) -> None:
        self.batch.forget(self)
        if self.suffix is not None:
            self.suffix.close()

    def on_step(self, tree: TokenTree, verdict: Verdict, cost: StepRecord | None = None) -> None:
        step, self._step = self._step, None
        if isinstance(step, SuffixOrModelShape):
            self._on_suffix_step(step, tree, verdict, cost)
            return
        copied = step.copied if step is not None else 0
        self._observe(len(tree) > 1 and not copied, self._step_x, len(verdict.accepted) + 1, cost)
        if step is not None and copied:
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
            self._relax_acceptance()
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
    batch = BatchChoice(Probes(seed=1))  # one decision for the requests that share a step
    requests = itertools.count()  # each request's probes get their own seed: 0, 1, 2, ...

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
    last_costs: list[Any] = []  # [plan, its OnlineCosts]: what the last request got

    def new_drafter(sources: Callable[[Any], Any], prompt_len: int, max_tokens: int, load: int = 1,
                    scope: str | None = "") -> Drafter:
        plan = latest_plan()
        if not last_costs or last_costs[0] is not plan:  # its key (the model's weight mode) once per plan
            last_costs[:] = [plan, online_costs(engine, plan)]
        costs = last_costs[1]
        # the draft's prefill against what its trees save over max_tokens, at the costs measured
        # here; alone, a seeded sampled request follows the plan's own answer (`planned`)
        scale = draft_costs.scale(load)
        never = no_draft or (all(c.method == "ar" for c in plan.choices) and plan.source == "measured")
        planned = not never and plan.speculation_pays(prompt_len, max_tokens, load, scale if load > 1 else 1.0)
        model = not never and costs.speculation_pays(prompt_len, max_tokens, load, scale) if adapt else planned
        if not model and not no_draft:
            if progress and not told:  # once: a server would print it for every short request
                told.append(True)
                why = ("the plan decodes plainly at this context" if plan.choice_for(prompt_len).method == "ar" else
                       f"the draft's prefill would cost more than speculation saves ({load} request(s) sharing "
                       "the steps)")
                print(f"[plan] method auto: no draft model for a {prompt_len}-token prompt with {max_tokens} "
                      f"new tokens -- {why}; " + ("copying from the context where it pays, else decoding plainly"
                                                   if lookup else "decoding autoregressively"), file=sys.stderr)
            if not lookup and not (planned and load == 1):
                return Drafter(extra_stats=lambda: {"auto": "ar"})
        # alone on the machine, a request without the draft may still bring it in (LateDraft), and
        # a seeded sampled one uses it where the plan says so: the draft reads the context in its
        # first forward (no prefill unless it drafts)
        late = (LateDraft(prompt_len, max_tokens, threshold=late_threshold, announce=announce_late)
                if not model and late_draft and load == 1 and draft_model is not None else None)
        deferred = not model and (late is not None or (planned and load == 1)) and draft_model is not None
        source = sources(draft_model) if ((model or deferred) and draft_model is not None) else None
        if deferred and (source is None or not source.defers_prefill):  # e.g. a llama.cpp draft: it prefills itself
            late, source, deferred = None, None, False
        suffix = (SuffixSource(suffix_cache if scope is not None else None, prompt_len, max_tokens, eos_ids=eos,
                               scope=scope or "") if suffix_cache is not None else None)
        shape = PlannedShape(plan, make_shape, adapt=adapt, lookup=lookup, model=model, draft_costs=draft_costs,
                             late=late, suffix=suffix, costs=costs, probes=Probes(seed=next(requests)), batch=batch,
                             planned_model=planned and (model or deferred))

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
            if shape.probes is not None and shape.probes.probes:
                out["auto_probes"] = shape.probes.probes
            return out

        return Drafter(source, shape, extra_stats=stats, defer_draft_prefill=deferred)

    return new_drafter


_ONLINE: dict[tuple[PlanKey, Path], OnlineCosts] = {}


def online_costs(engine: EngineLike, plan: Plan) -> OnlineCosts:
    """The costs this process has measured for the plan's key, kept across prepared `auto`s (each
    in-process `generate` prepares its own): what earlier requests measured is not learnt again.
    Another plan (a measured one replacing the starter plan) starts afresh: the corrections were
    against the old one's times. (Keyed by the plan's place too: another cache is another server.)"""
    key = (plan_key_for(engine, plan.key.method), plan_path(plan.key))
    known = _ONLINE.get(key)
    if known is None or (known.plan is not plan and _plan_times(known.plan) != _plan_times(plan)):
        known = _ONLINE[key] = OnlineCosts(plan)
    return known


def _plan_times(plan: Plan) -> tuple:
    return (plan.source, plan.created, repr(plan.verify_times), repr(plan.draft_times), plan.draft_prefill_s)


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
