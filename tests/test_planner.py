"""The roofline planner: fits, decision rule, plan persistence, analytic devices, prior-score trees,
and a quick end-to-end plan on the tiny engine."""
from __future__ import annotations

import json
from dataclasses import asdict
import math
import warnings

import numpy as np
import pytest
import torch

from specwood.errors import SpecwoodError
from specwood.planner import devices as dev
from specwood.planner.fits import DEFAULT_AAT, AATFit, fit_aat, fit_roofline
from specwood.planner.analytic import build_analytic_plan
from specwood.planner.auto import PlannedShape
from specwood.planner.trackers import AcceptanceTracker, DraftCostTracker, LateDraft, scaled_aat
from specwood.planner.build import build_plan, get_plan
from specwood.planner.decision import ParallelProfile, decide
from specwood.planner.store import (
    BATCH_MARGIN,
    SCHEMA_VERSION,
    BucketChoice,
    Plan,
    PlanKey,
    PlanWarning,
    load_plan,
    plan_key_for,
    plan_path,
    save_plan,
)
from specwood.planner.prior_tree import (
    PriorScores,
    analytic_scores,
    collect_prior_scores,
    depth_layout,
    depths_of,
    maximal_layout,
    positions_of,
    top_layout,
    width_layout,
)

RAW_PROMPTS = ["def fibonacci(n):\n    a, b = 0, 1\n", "The quick brown fox jumps over the lazy dog. The"]


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(one_thread_private_cache):
    """Every test here: tiny models on one thread, plans in a private cache (conftest)."""


# ---------------------------------------------------------------------------------------------
# fits


def roofline_points(a: float, b: float, ridge: float, xs) -> np.ndarray:
    xs = np.asarray(xs, dtype=float)
    return np.where(xs < ridge, a * xs + b, a * ridge + b)


def test_roofline_fit_recovers_known_parameters():
    xs = [1, 2, 4, 8, 12, 16, 24, 32, 64, 128]
    p = roofline_points(100.0, 50.0, 20.0, xs)
    fit = fit_roofline(xs, times=np.asarray(xs) / p)
    assert fit.a == pytest.approx(100.0, rel=1e-6) and fit.b == pytest.approx(50.0, rel=1e-6)
    assert fit.p_max == pytest.approx(2050.0, rel=1e-6)
    assert fit.x_ridge == pytest.approx(20.0, rel=1e-6)  # where the line meets the roof
    assert fit.rel_error < 1e-9
    assert fit.t_v(1) == pytest.approx(1 / 150.0)


def test_roofline_fit_with_noise_reports_its_error():
    rng = np.random.default_rng(0)
    xs = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    p = roofline_points(40.0, 10.0, 30.0, xs) * (1 + 0.02 * rng.standard_normal(len(xs)))
    fit = fit_roofline(xs, throughputs=p)
    assert fit.a == pytest.approx(40.0, rel=0.1)
    assert 24 <= fit.x_ridge <= 36
    assert 0.003 < fit.rel_error < 0.05


def test_roofline_degenerate_cases():
    xs = [1, 2, 4, 8, 16]
    memory = fit_roofline(xs, throughputs=[10.0 * x for x in xs])  # no roof in range
    assert math.isinf(memory.x_ridge) and memory.a == pytest.approx(10.0)
    flat = fit_roofline(xs, throughputs=[5.0] * 5)  # compute-bound from x = 1
    assert flat.x_ridge == 1 and flat.p_max == pytest.approx(5.0) and flat.a == 0.0
    assert flat(64) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        fit_roofline([1], throughputs=[1.0])


def test_aat_fit_recovers_known_parameters():
    xs = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    truth = AATFit(1.3, 0.8, 0.4)
    fit = fit_aat(xs, [1.3 + 0.8 * math.log(x - 0.4) for x in xs])
    assert (fit.A, fit.B, fit.C) == pytest.approx((truth.A, truth.B, truth.C), abs=1e-3)
    assert fit.r2 > 0.99999 and fit.n_points == len(xs)


def test_aat_fit_noisy_and_clipped():
    rng = np.random.default_rng(1)
    xs = np.array([2, 4, 8, 16, 32, 64], dtype=float)
    ys = 1.1 + 0.7 * np.log(xs - 0.5) + 0.03 * rng.standard_normal(xs.size)
    fit = fit_aat(xs, ys)
    assert fit.C < xs.min() and fit.r2 > 0.98
    grid = np.array([2.0, 10.0, 50.0])
    assert np.allclose(fit(grid), 1.1 + 0.7 * np.log(grid - 0.5), atol=0.12)
    # the physical range 1 <= AAT(x) <= x is enforced
    assert AATFit(5.0, 1.0, 0.0)(2) == 2.0 and AATFit(-3.0, 0.1, 0.0)(4) == 1.0


def test_aat_fit_two_points_is_exact():
    fit = fit_aat([2, 8], [1.6, 2.9])
    assert fit(2) == pytest.approx(1.6) and fit(8) == pytest.approx(2.9)


# ---------------------------------------------------------------------------------------------
# decision rule


def test_compute_bound_everywhere_chooses_autoregressive():
    t1 = 0.01
    d = decide(lambda x: x * t1, lambda x: 0.05 * t1 * x, DEFAULT_AAT, range(1, 129))
    assert d.method == "ar" and d.x == 1 and d.speedup < 1
    assert d.p_ar == pytest.approx(100.0)


def test_memory_bound_chooses_largest_x():
    d = decide(lambda x: 0.01, lambda x: 0.0, DEFAULT_AAT, range(1, 65))
    assert d.method == "sd" and d.x == 64
    assert d.speedup == pytest.approx(float(DEFAULT_AAT(64)))


def test_ridge_is_optimal_between_the_two_regimes():
    # Eq. 13-15: below the ridge speedup = AAT(x) (grows), above it x_R / x * AAT(x) (falls)
    ridge, t1 = 8, 0.02
    d = decide(lambda x: t1 * max(1.0, x / ridge), lambda x: 0.0, DEFAULT_AAT, range(1, 65))
    assert d.method == "sd" and d.x == ridge
    assert d.speedup == pytest.approx(float(DEFAULT_AAT(ridge)))


def test_draft_cost_can_flip_the_decision():
    cheap = decide(lambda x: 0.01, lambda x: 0.0005 * (x - 1), DEFAULT_AAT, range(1, 33))
    costly = decide(lambda x: 0.01, lambda x: 0.02 * (x - 1), DEFAULT_AAT, range(1, 33))
    assert cheap.method == "sd" and costly.method == "ar"


# ---------------------------------------------------------------------------------------------
# plan persistence


def synthetic_plan(key: PlanKey, contexts=(64, 4096)) -> Plan:
    """Memory-bound at short context, compute-bound (SD loses) at long context."""
    tv = {64: {x: 0.01 for x in (1, 2, 4, 8, 16)}, 4096: {x: 0.01 * x for x in (1, 2, 4, 8, 16)}}
    td = {64: {x: 0.0001 * (x - 1) for x in (1, 2, 4, 8, 16)}}
    plan = Plan(key=key, contexts=list(contexts), verify_times={c: tv[c] for c in contexts}, draft_times=td,
                aat=DEFAULT_AAT, aat_points={2: 1.7, 8: 2.7}, created="2025-01-01T00:00:00+00:00")
    return plan.refresh()


KEY = PlanKey("cpu:test/1t", "tiny", "tiny-draft", "fp32", "dyspec")


def test_plan_choices_and_context_switching():
    plan = synthetic_plan(KEY)
    assert plan.choose(50) == ("dyspec", 16)
    assert plan.choose(100000) == ("ar", 1)
    assert plan.choose(300) == ("dyspec", 16)  # nearer to 64 than to 4096 on a log scale
    assert plan.choose(2000)[0] == "ar"
    assert plan.choices[0].budget == 15


def cost_plan(aat: AATFit) -> Plan:
    """T_v grows with x (a compute-limited CPU) and each drafted node costs 20% of a step, so the
    best x depends on how deep the draft is accepted."""
    xs = (1, 2, 4, 8, 16, 32)
    plan = Plan(key=KEY, contexts=[128], verify_times={128: {x: 0.1 * (1 + 0.05 * (x - 1)) for x in xs}},
                draft_times={128: {x: 0.02 * (x - 1) for x in xs}}, aat=aat)
    return plan.refresh()


def test_acceptance_tracker_scales_the_plan_curve():
    aat = AATFit(1.0, 1.0, 0.0)
    tracker = AcceptanceTracker()
    assert tracker.ratio == pytest.approx(1.0) and tracker.scale(aat)(8) == pytest.approx(aat(8))
    assert tracker.scale(aat)(1) == 1.0
    for _ in range(20):  # every drafted token accepted on trees of 8
        tracker.record(aat(8), 8)
    assert tracker.ratio > 3.0 and 7.9 < tracker.scale(aat)(8) <= 8.0 and tracker.scale(aat)(4) == 4.0  # capped
    for _ in range(20):  # nothing accepted
        tracker.record(aat(8), 1)
    assert tracker.ratio < 0.1 and tracker.scale(aat)(8) < 1.2
    for _ in range(30):  # plain steps carry no evidence: relax back to the plan
        tracker.relax()
    assert tracker.ratio == pytest.approx(1.0, abs=0.02)


def test_planned_shape_follows_observed_acceptance():
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    static = PlannedShape(plan, lambda b: f"shape{b}", adapt=False)
    adaptive = PlannedShape(plan, lambda b: f"shape{b}")
    planned = plan.choose(128)[1]
    assert static.choose_x(128) == adaptive.choose_x(128) == planned
    for _ in range(12):  # deep acceptance: the request asks for bigger trees
        adaptive.tracker.record(plan.aat(planned), planned)
    deep = adaptive.choose_x(128)
    assert deep > planned and static.choose_x(128) == planned
    for _ in range(12):  # the draft is never right: plain decoding
        adaptive.tracker.record(plan.aat(deep), 1)
    assert adaptive.choose_x(128) == 1 and adaptive.for_batch(1, 128) is None
    for _ in range(12):  # after some plain steps it tries speculation again
        adaptive.tracker.relax()
    assert adaptive.choose_x(128) == planned


def peaked_logits(p_top: float, vocab: int = 64) -> torch.Tensor:
    """Logits whose softmax gives the first token probability p_top (the rest shared equally)."""
    probs = torch.full((vocab,), (1.0 - p_top) / (vocab - 1))
    probs[0] = p_top
    return probs.log()


def test_late_draft_comes_in_when_the_target_is_sure():
    """A request that started without the draft (its prefill would not pay at the plan's AAT)
    brings it in once the target's mean confidence over 6 steps is >= the threshold and the chain
    that confidence implies saves more over the tokens left than the catch-up costs."""
    plan = cost_plan(AATFit(0.5, 1.0, 0.0))
    prompt, max_tokens = 100, 200
    start = plan.choice_for(prompt)
    per_token = 1 / start.p_ar - 1 / start.p_eff
    plan.draft_prefill_s = 1.5 * max_tokens * per_token / prompt  # the plan's own AAT: no draft
    assert not plan.speculation_pays(prompt, max_tokens)

    def shape(p_top: float, threshold: float = 0.95) -> tuple[PlannedShape, LateDraft]:
        late = LateDraft(prompt, max_tokens, threshold=threshold)
        s = PlannedShape(plan, lambda b: f"shape{b}", lookup=True, model=False, late=late)
        for k in range(8):
            assert s.model is (k > 6 and p_top >= threshold)
            s.for_batch(1, prompt + k)
            s.on_root_logits(peaked_logits(p_top))
        return s, late

    sure, late = shape(0.995)
    assert sure.model and late.joined_at == 6 and late.confidence == pytest.approx(0.995)
    ratio = late.ratio(plan, prompt + 6)
    assert sure.tracker.ratio == pytest.approx(min(4.0, ratio)) and ratio > 2
    assert sure.choose_x(prompt + 6) > plan.choose(prompt)[1]  # the evidence asks for deeper trees
    unsure, late = shape(0.9)
    assert not unsure.model and late.joined_at is None and late.ratio(plan, prompt + 8) is None
    # a lower threshold accepts a less sure target
    assert shape(0.9, threshold=0.85)[0].model
    # under load, or with tokens too few to earn the catch-up back at any acceptance: never
    late = LateDraft(prompt, max_tokens)
    loaded = PlannedShape(plan, lambda b: f"shape{b}", lookup=True, model=False, late=late)
    for k in range(8):
        loaded.for_batch(2, prompt + k)
        loaded.on_root_logits(peaked_logits(1.0))
    assert not loaded.model
    late = LateDraft(prompt, 12)
    short = PlannedShape(plan, lambda b: f"shape{b}", lookup=True, model=False, late=late)
    for k in range(8):
        short.for_batch(1, prompt + k)
        short.on_root_logits(peaked_logits(1.0))
    assert not short.model and late.hopeless and len(late.confidences) < 8
    # the curve a ratio gives: the drafted part scaled, capped at x
    curve = scaled_aat(plan.aat, 2.0)
    assert curve(1) == 1.0 and curve(4) == pytest.approx(min(4.0, 1 + 2 * (plan.aat(4) - 1)))


def test_late_draft_is_lossless_end_to_end(tiny_pair, tiny_tokenizer):
    """Through the engine: a target sure of its tokens brings the draft in mid-request (it reads
    the prompt and the tokens so far in its first forward); greedy output equals ar's, and
    sampling with a seed is reproduced token for token."""
    from specwood.engine.api import Engine
    from specwood.models.transformer import build_model

    sd = tiny_pair.target.canonical_state_dict()
    sd["output.weight"] = sd["output.weight"] * 25.0  # a target sure of its tokens
    target = build_model(tiny_pair.target.config, sd, torch.float32, max_positions=tiny_pair.target.max_positions)
    engine = Engine(target, tiny_tokenizer, draft=target, target_name="tiny", draft_name="tiny-draft")
    engine.eos_token_ids = set()  # so sure a target would otherwise stop at once
    ids = engine.encode(RAW_PROMPTS[0], raw=True)
    max_tokens = 40
    xs = (1, 2, 4, 8, 16)
    plan = Plan(key=plan_key_for(engine, "dyspec"), contexts=[32], verify_times={32: {x: 0.01 for x in xs}},
                draft_times={32: {x: 0.001 * (x - 1) for x in xs}}, aat=AATFit(0.3, 1.0, 0.0),
                draft_row_times={1: 0.001, 2: 0.001}, created="2025-01-01T00:00:00+00:00").refresh()
    start = plan.choice_for(len(ids))
    assert start.method == "dyspec"
    plan.draft_prefill_s = 1.5 * max_tokens * (1 / start.p_ar - 1 / start.p_eff) / len(ids)
    save_plan(plan)
    ar = engine.generate(ids, max_tokens=max_tokens, method="ar")
    # suffix=False: the late draft alone (the global suffix cache's state would move the step it joins at)
    res = engine.generate(ids, max_tokens=max_tokens, method="auto", progress=False, suffix=False)
    assert res.token_ids == ar.token_ids
    # 8 plain steps after the first token (7 before padding ids were masked: the greedy text changed)
    assert res.stats["auto"] == "sd" and res.stats["auto_draft_from_token"] == 9
    assert res.stats["auto_target_confidence"] > 0.95 and res.stats["mean_accepted_tokens"] > 2
    off = engine.generate(ids, max_tokens=max_tokens, method="auto", progress=False, late_draft=False)
    assert off.token_ids == ar.token_ids and off.stats["auto"] == "ar" and "auto_draft_from_token" not in off.stats
    sampled = [engine.generate(ids, max_tokens=max_tokens, method=m, temperature=0.8, seed=3, progress=False)
               for m in ("auto", "auto")]
    assert sampled[0].token_ids == sampled[1].token_ids
    with pytest.raises(SpecwoodError, match="late_draft_confidence"):
        engine.generate(ids, max_tokens=4, method="auto", late_draft_confidence=1.5)


def test_copy_steps_are_priced_by_what_they_measured():
    """A copied chain is verified as a tree; where such steps cost more than the plan's T_v says
    (a prompt longer than the plan's widest bucket), the request stops copying, and after some
    plain steps it tries again. The same acceptance at the plan's price keeps copying."""
    from types import SimpleNamespace

    from specwood.engine.step import StepRecord
    from specwood.verify import Verdict

    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    context, root = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 5, 6, 7], 8

    def step(shape):
        drafter = shape.for_batch(1, 128)
        gen = drafter.draft(context, root, SimpleNamespace(greedy=True), None)
        try:
            next(gen)
        except StopIteration as done:
            return drafter, done.value
        raise AssertionError("copying and plain steps need no draft forward")

    copied = {}
    for price in (1, 4):
        shape = PlannedShape(plan, lambda budget: ("tree", budget), lookup=True, model=False)
        drafter, tree = step(shape)
        assert drafter.copied > 0 and len(tree) == 1 + drafter.copied  # at the plan's price a copy pays
        for _ in range(20):  # copies accept half their tokens; each costs `price` x its T_v
            shape.on_step(tree, Verdict(list(range(1, drafter.copied // 2 + 1)), 0),
                          StepRecord(1, len(tree), 0.0, verify_s=price * float(plan.t_v(128, len(tree)))))
            drafter, tree = step(shape)
            if not drafter.copied:
                break
        copied[price] = drafter.copied
    assert copied[1] > 0 and copied[4] == 0 and len(tree) == 1 and shape.copy_cost.ratio > 1.5
    for _ in range(60):  # plain steps at the plan's price: the copy price drifts back, copying resumes
        shape.on_step(tree, Verdict([], 0), StepRecord(1, 1, 0.0, verify_s=float(plan.t_v(128, 1))))
        drafter, tree = step(shape)
        if drafter.copied:
            break
    assert drafter.copied > 0


def test_copied_chains_are_cut_to_what_the_request_accepts():
    """Where copied tokens are rarely accepted, a long chain costs a wide verify for nothing:
    the chain is cut short (or not copied); where they are, the whole chain is copied."""
    from specwood.planner.trackers import LookupTracker

    # T_v grows with the chain: 1 + 10% a token
    plan = Plan(key=KEY, contexts=[128], verify_times={128: {x: 0.1 * (1 + 0.1 * (x - 1)) for x in (1, 2, 4, 8, 16)}},
                draft_times={128: {x: 0.02 * (x - 1) for x in (1, 2, 4, 8, 16)}}, aat=AATFit(1.0, 1.0, 0.0)).refresh()
    lengths = {}
    for name, (accepted, of) in {"good": (10, 10), "poor": (0, 10)}.items():
        shape = PlannedShape(plan, lambda budget: ("tree", budget), lookup=True, model=False)
        for _ in range(6):
            shape.lookup_tracker.record(of, accepted)
        shape.for_batch(1, 128)
        lengths[name] = shape._step.chain_length(10)
    assert lengths["good"] == 10 and lengths["poor"] < 3
    tracker = LookupTracker()
    assert LookupTracker(prior=0.3).expected_tokens(10) < 2.0 < 4.0 < tracker.expected_tokens(10)


def test_batch_aware_decision_shrinks_trees_under_load():
    """Requests sharing a step share the target forward: T_v of the whole batch's tokens decides."""
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    alone = plan.decide(128)
    assert alone.method == "sd"
    xs = [plan.decide(128, batch=b).x for b in (1, 2, 4, 8, 16, 64)]
    assert xs == sorted(xs, reverse=True) and xs[0] == alone.x
    assert plan.decide(128, batch=64).method == "ar"  # a full machine: speculation cannot pay
    shape = PlannedShape(plan, lambda b: f"shape{b}")
    assert shape.for_batch(1, 128) == f"shape{alone.x - 1}" and shape.for_batch(64, 128) is None


def test_prefill_riding_in_the_step_makes_trees_pay_their_compute():
    """Newcomers' prefill chunks in the step's forward make it compute-bound: below the ridge a
    tree costs little more than one token, but with 64 prompt tokens riding each tree token
    costs its compute, so the decision shrinks the tree or decodes plainly."""
    xs = (1, 2, 4, 8, 16, 32, 64, 128)
    plan = Plan(key=KEY, contexts=[128], verify_times={128: {x: max(0.1, 0.01 * x) for x in xs}},
                draft_times={128: {x: 0.005 * (x - 1) for x in xs}}, aat=AATFit(1.0, 1.0, 0.0)).refresh()
    alone, riding = plan.decide(128), plan.decide(128, riding=64)
    assert alone.method == "sd" and alone.x >= 8
    assert riding.method == "ar" or riding.x < alone.x
    t_v = plan.step_costs(128, riding=64)[0]
    assert t_v(1) == pytest.approx(0.1) and t_v(9) == pytest.approx(0.1 + 8 * 0.01)  # own step + tree compute
    shared = plan.step_costs(128, batch=4, riding=64)[0]
    assert shared(1) == pytest.approx(0.1 / 4) and shared(3) == pytest.approx((0.1 + 8 * 0.01) / 4)
    assert plan.step_costs(128, batch=4)[0](2) == pytest.approx(0.1 / 4)  # no riding: below the ridge, free
    assert shared(2) == pytest.approx((0.1 + 4 * 0.01) / 4)
    shape = PlannedShape(plan, lambda b: f"shape{b}")
    assert shape.for_batch(1, 128) == f"shape{alone.x - 1}"
    assert shape.for_batch(1, 128, riding=64) == (None if riding.method == "ar" else f"shape{riding.x - 1}")


def test_batched_drafting_grows_as_the_draft_does():
    """Under load a request's drafting costs what the draft's own forward of B rows costs per row
    (an int4 draft switches kernels above 3 rows), not the target's growth."""
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    target_growth = plan.decide(128, batch=8)
    plan.draft_row_times = {1: 0.01, 16: 0.01}  # a flat draft: batching makes drafting nearly free
    flat = plan.decide(128, batch=8)
    plan.draft_row_times = {1: 0.01, 16: 0.16}  # one row at a time: no saving from batching
    linear = plan.decide(128, batch=8)
    assert flat.p_eff >= target_growth.p_eff >= linear.p_eff and flat.p_eff > linear.p_eff
    assert linear.method == "ar" or linear.x <= flat.x
    assert plan.decide(128, batch=1) == cost_plan(AATFit(1.0, 1.0, 0.0)).decide(128)  # alone: unchanged
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.draft_row_times == {1: 0.01, 16: 0.16} and back.to_dict() == plan.to_dict()


def test_shared_steps_learn_what_drafting_costs():
    """Each request in a shared step records its share of the step's drafting against the plan's
    price; when drafting costs 3x the price, shared steps stop speculating (or shrink their trees)
    and a request alone decides as before, until steps alone teach their own part."""
    from specwood.engine.step import StepRecord
    from specwood.tree.token_tree import TokenTree
    from specwood.verify import Verdict

    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    costs = DraftCostTracker()
    shape = PlannedShape(plan, lambda budget: ("tree", budget), draft_costs=costs)
    first = shape.for_batch(4, 128)
    assert first is not None and shape._predicted_draft_s > 0
    before = plan.decide(128, batch=4)
    tree = TokenTree.with_root(1)
    tree.add_node(0, 2)
    for _ in range(30):
        assert shape.for_batch(4, 128) is not None or costs.ratio > 1.5
        price = shape._predicted_draft_s or plan.step_costs(128, 4)[1](before.x)
        shape.on_step(tree, Verdict([1], 3), StepRecord(4, 8, draft_s=4 * 3 * price, verify_s=0.1, drafting=4))
    assert 2.5 < costs.ratio <= 3.0  # learnt until the shared steps stopped drafting
    after = plan.decide(128, batch=4, draft_scale=costs.scale(4))
    assert after.method == "ar" or (after.x <= before.x and after.p_eff < before.p_eff)
    assert costs.scale(1) == 1.0 and shape.choose_x(128, 1) == plan.decide(128).x  # alone: as measured
    shape.for_batch(1, 128)
    learnt = costs.ratio
    assert shape._predicted_draft_s > 0  # alone, the plan drafts here too
    shape.on_step(tree, Verdict([1], 3), StepRecord(1, 2, draft_s=100.0, verify_s=0.1, drafting=1))  # alone
    assert costs.ratio == learnt and costs.scale(1) > 1.2  # its own part, not the shared steps'
    assert costs.scale(4) == learnt


def test_a_high_drafting_price_drifts_back_on_steps_without_the_model():
    """The price is measured only where the model drafts, so once it is high enough that the model
    loses, nothing would ever bring it down: steps without the model relax it towards the plan's
    price until the model is tried again (issue 41: one copying request's deep chains could keep
    the draft out of every later request of the server, and of the next server)."""
    from specwood.engine.step import StepRecord
    from specwood.tree.token_tree import TokenTree
    from specwood.verify import Verdict

    plan = cost_plan(AATFit(0.5, 1.0, 0.0))  # the model wins at the plan's price, loses at 1.5x it
    costs = DraftCostTracker()
    for _ in range(30):  # what earlier requests of the server measured, alone: 4x the price
        costs.record(0.01, 0.04, batch=1)
    shape = PlannedShape(plan, lambda budget: ("tree", budget), draft_costs=costs)
    assert plan.decide(128).method == "sd" and shape.choose_x(128, 1) == 1 and costs.scale(1) > 3.5
    plain = TokenTree.with_root(1)
    for steps in range(1, 400):  # noqa: B007 (read after the loop) plain steps: nothing drafted, nothing to measure
        assert shape.for_batch(1, 128) is None
        shape.on_step(plain, Verdict([], 3), StepRecord(1, 1, draft_s=0.0, verify_s=0.1))
        if shape.choose_x(128, 1) > 1:
            break
    assert shape.choose_x(128, 1) > 1 and steps < 200, "the model is never tried again"
    assert costs.scale(4) == 1.0  # the shared part saw nothing and stays


def test_learnt_drafting_price_is_kept_for_the_next_server(tmp_path):
    """The learnt ratio is written beside the plan every SAVE_EVERY records and read back by the
    next tracker (a restarted server); a damaged or absurd file is a fresh start or clamped."""
    path = tmp_path / "plans" / "p.drafting.json"
    costs = DraftCostTracker(path=path)
    assert costs.ratio == 1.0 and not path.exists()
    for _ in range(DraftCostTracker.SAVE_EVERY):
        costs.record(0.01, 0.03)
    assert path.exists() and DraftCostTracker(path=path).ratio == pytest.approx(costs.ratio)
    assert costs.ratio > 1.5 and DraftCostTracker(path=path).scale(8) > 1.5
    path.write_text("{not json")
    assert DraftCostTracker(path=path).ratio == 1.0
    path.write_text('{"ratio": 99}')
    assert DraftCostTracker(path=path).ratio == 4.0 and DraftCostTracker(path=path).scale(1) == 1.0
    alone = DraftCostTracker(path=path)
    for _ in range(DraftCostTracker.SAVE_EVERY):
        alone.record(0.01, 0.03, batch=1)
    assert DraftCostTracker(path=path).scale(1) == pytest.approx(alone.scale(1)) and alone.scale(1) > 1.5


def test_shared_steps_speculate_only_by_a_margin():
    """In a shared step speculation must beat plain decoding by BATCH_MARGIN (the batch model's
    known error); alone, any gain counts."""
    t_v = lambda x: 0.1 * (1 + 0.05 * (x - 1))  # noqa: E731
    aat = lambda x: 1.0 if x <= 1 else 1.1 * t_v(x) / t_v(1)  # P_eff(x) = 1.1 P_AR for every x  # noqa: E731
    assert decide(t_v, lambda x: 0.0, aat, [1, 2, 4]).method == "sd"
    assert decide(t_v, lambda x: 0.0, aat, [1, 2, 4], margin=BATCH_MARGIN).method == "ar"


def test_speculation_must_earn_back_the_draft_prefill():
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    d = plan.decide(128)
    assert d.method == "sd"
    saving_per_token = 1 / d.p_ar - 1 / d.p_eff
    assert plan.speculation_pays(128, 64)  # prefill cost unknown: speculate
    plan.draft_prefill_s = 0.001
    assert plan.speculation_pays(128, 64)
    long_prompt = int(64 * saving_per_token / 0.001) + 10  # its prefill outweighs 64 tokens of saving
    assert not plan.speculation_pays(long_prompt, 64)
    assert plan.speculation_pays(long_prompt, 64 * 4)  # a longer answer earns it back
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.draft_prefill_s == 0.001


def test_draft_prefill_is_weighed_against_the_load():
    """Under load a tree saves less machine time per token (the batch already fills the forward),
    while the draft's prefill costs as much as ever: a prompt worth a draft alone is not worth one
    in a full batch, and a batch where plain decoding wins never drafts."""
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    plan.draft_prefill_s = 0.001
    alone, loaded = plan.decide(128), plan.decide(128, batch=4)
    assert loaded.method == "sd"
    save_alone = 64 * (1 / alone.p_ar - 1 / alone.p_eff)
    save_loaded = 64 * (1 / loaded.p_ar - 1 / loaded.p_eff)
    assert 0 < save_loaded < save_alone
    prompt = int((save_alone + save_loaded) / 2 / 0.001)  # its prefill: between the two savings
    assert plan.speculation_pays(prompt, 64) and plan.speculation_pays(prompt, 64, load=1)
    assert not plan.speculation_pays(prompt, 64, load=4)
    assert plan.decide(128, batch=64).method == "ar"
    assert not plan.speculation_pays(16, 10_000, load=64)


def test_plan_uses_the_aat_curve_of_the_nearest_bucket():
    plan = cost_plan(AATFit(1.0, 1.0, 0.0))
    plan.contexts = [128, 1024]
    plan.verify_times[1024] = plan.verify_times[128]
    plan.aat_by_context = {128: AATFit(1.0, 0.3, 0.0), 1024: AATFit(1.0, 3.0, 0.0)}
    plan.refresh()
    low, high = plan.choose(100)[1], plan.choose(2000)[1]
    assert high > low  # deeper acceptance at long context -> bigger trees there
    assert plan.aat_for(900) is plan.aat_by_context[1024]
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.aat_by_context == plan.aat_by_context and back.choose(2000) == plan.choose(2000)


def test_plan_json_round_trip():
    plan = synthetic_plan(KEY)
    plan.prior = PriorScores(maximal_layout(8, 2), [3.0, 1.0, 0, 0, 2.0, 0, 0, 0], steps=4, aat=2.0, levels=2)
    path = save_plan(plan)
    assert path.parent.name == "plans" and path == plan_path(KEY)
    back = load_plan(KEY)
    assert back is not None and back.to_dict() == plan.to_dict()
    assert back.choose(64) == plan.choose(64)
    assert back.prior.best_layout(3) == plan.prior.best_layout(3)
    assert math.isinf(back.rooflines[64].x_ridge)  # inf survives JSON as null


@pytest.mark.parametrize("content, reason", [
    ("{not json", "corrupt"),
    ("[1, 2, 3]", "corrupt"),
    (json.dumps({"schema": SCHEMA_VERSION, "key": KEY.to_dict()}), "corrupt"),
    (json.dumps({"schema": 0, "key": KEY.to_dict()}), "stale"),
])
def test_bad_plan_files_warn_and_return_none(content, reason):
    path = plan_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(PlanWarning, match=reason):
        assert load_plan(KEY) is None


def test_plan_for_another_key_is_stale():
    other = PlanKey("cpu:other/1t", "tiny", "tiny-draft", "fp32", "dyspec")
    save_plan(synthetic_plan(other), plan_path(KEY))  # e.g. copied by hand
    with pytest.warns(PlanWarning, match="stale"):
        assert load_plan(KEY) is None
    assert load_plan(PlanKey("cpu:none", "x", "y", "fp32", "dyspec")) is None  # missing: quietly None


def test_corrupt_plan_is_replanned_not_a_crash(tiny_engine, monkeypatch):
    import specwood.planner.build as build_mod

    key = plan_key_for(tiny_engine, "dyspec")
    plan_path(key).parent.mkdir(parents=True)
    plan_path(key).write_text('{"schema": 1, "key": ')  # truncated
    monkeypatch.setattr(build_mod, "build_plan", lambda engine, method, **kw: synthetic_plan(key))
    with pytest.warns(PlanWarning):
        plan = get_plan(tiny_engine, "dyspec", build_if_missing=True, progress=False)
    assert plan is not None and plan.key == key
    assert load_plan(key).to_dict() == plan.to_dict()  # the re-plan replaced the bad file


# ---------------------------------------------------------------------------------------------
# analytic device models


def test_pe_array_utilisation_has_ceiling_effects():
    u280 = dev.PROFILES["u280"]  # 64 x 48
    assert u280.utilisation(1, 4800) == 1.0  # a GEMV spreads K-slices over all rows
    assert u280.utilisation(48, 4800) == pytest.approx(0.75)
    assert u280.utilisation(65, 4800) == pytest.approx(65 / 128)
    assert u280.utilisation(64, 50) == pytest.approx(50 / 96)
    assert dev.PROFILES["h100"].utilisation(3, 7) == 1.0


def test_analytic_tv_is_memory_bound_then_compute_bound():
    cfg = dev.PRESETS["llama3.1-8b"]
    v80 = dev.PROFILES["v80"]
    t1, t2 = v80.predict_tv(cfg, 1, 256), v80.predict_tv(cfg, 2, 256)
    assert t2 == pytest.approx(t1, rel=0.02)  # memory-bound: two tokens cost one weight read
    assert v80.predict_tv(cfg, 128, 256) > 4 * t1  # far past the ridge: compute-bound
    assert v80.predict_tv(cfg, 1, 16384) > t1  # the KV cache read grows with context
    # paper Table IV: ~39 tokens/s AR on the V80 at 256 tokens of context (we model ~44)
    assert 30 < 1 / t1 < 50


def test_higher_compute_to_bandwidth_ratio_gives_larger_x_and_speedup():
    results = {}
    for board in ("u280", "vhk158", "v80", "u250"):
        plan = build_analytic_plan(board, "llama3.1-8b", "one-layer", method="prior", contexts=(1024,))
        results[board] = plan.choices[0]
    order = ["u280", "vhk158", "v80", "u250"]  # increasing compute / bandwidth (paper Table IV)
    assert all(results[b].method == "prior" for b in order)
    xs = [results[b].x for b in order]
    speedups = [results[b].speedup for b in order]
    assert xs == sorted(xs) and xs[0] < xs[-1]
    assert speedups == sorted(speedups) and speedups[-1] > 1.5


def test_compute_starved_device_rejects_sd():
    starved = dev.DeviceModel("starved", "cpu", peak_flops=2e10, mem_bw=1e12, bw_efficiency=1.0)
    cfg = dev.PRESETS["llama2-7b"]
    draft = dev.PRESETS["llama-68m"]
    d = decide(lambda x: starved.predict_tv(cfg, x, 512), lambda x: starved.predict_td(draft, x, 512, "sequoia"),
               DEFAULT_AAT, range(1, 65))
    assert d.method == "ar" and d.speedup < 1
    gpu = dev.PROFILES["h100"]
    d = decide(lambda x: gpu.predict_tv(cfg, x, 512), lambda x: gpu.predict_td(draft, x, 512, "sequoia"),
               DEFAULT_AAT, range(1, 65))
    assert d.method == "sd" and d.x >= 32


def test_analytic_plan_uses_a_stored_local_aat():
    local = synthetic_plan(PlanKey("cpu:here/1t", "qwen2.5-1.5b", "qwen2.5-0.5b", "bf16", "dyspec"))
    local.aat = AATFit(1.5, 0.9, 0.5, r2=0.99, n_points=5)
    save_plan(local)
    plan = build_analytic_plan("a100", "qwen2.5-1.5b", None, contexts=(512,))
    assert plan.key.draft == "qwen2.5-0.5b" and plan.aat.A == 1.5
    assert any("measured plan" in n for n in plan.notes)


def test_local_cpu_profile_is_measured():
    cpu = dev.measure_local_cpu("fp32")
    assert cpu.kind == "cpu" and cpu.mem_bw > 1e8 and cpu.peak_flops > 1e8


# ---------------------------------------------------------------------------------------------
# prior-score tree search


def valid_layout(layout) -> bool:
    from specwood.drafting.shapes import LayoutShape

    LayoutShape("check", layout)  # raises unless BFS with contiguous ranks
    return True


def test_maximal_layout_spreads_nodes_evenly_over_levels():
    layout = maximal_layout(64, 8)
    depth = depths_of(layout)
    assert len(layout) == 64 and valid_layout(layout)
    assert [depth.count(d) for d in range(1, 9)] == [8] * 8


def test_top_layout_is_connected_and_takes_the_best_scores():
    layout = maximal_layout(32, 4)
    scores = analytic_scores(layout)  # like counts: never larger than the parent's
    for n in (1, 5, 12, 32):
        best = top_layout(layout, scores, n)
        assert len(best) == n and valid_layout(best)
        order = sorted(range(1, 33), key=lambda p: (-scores[p - 1], p))
        chosen_scores = sorted((scores[p - 1] for p in order[:n]), reverse=True)
        assert sum(chosen_scores) == pytest.approx(sum(sorted(scores, reverse=True)[:n]))


def test_top_layout_keeps_connectivity_with_adversarial_scores():
    layout = maximal_layout(16, 4)
    rng = np.random.default_rng(3)
    scores = rng.random(16).tolist()  # not path-monotone: a child may outscore its parent
    for n in range(1, 17):
        assert len(top_layout(layout, scores, n)) == n and valid_layout(top_layout(layout, scores, n))


def test_width_and_depth_baselines():
    layout = maximal_layout(64, 8)
    wide, deep = width_layout(layout, 12), depth_layout(layout, 12)
    assert len(wide) == len(deep) == 12 and valid_layout(wide) and valid_layout(deep)
    assert max(depths_of(deep)) > max(depths_of(wide))
    assert max(depths_of(depth_layout(layout, 8))) == 8  # one node per level first


def test_positions_of_maps_tree_nodes_to_layout_positions():
    from specwood.tree.token_tree import TokenTree

    layout = maximal_layout(10, 3)
    tree = TokenTree.with_root(0)
    for i, (parent, _) in enumerate(layout, start=1):
        tree.add_node(parent, i)
    assert positions_of(tree, layout) == list(range(11))


def test_calibration_set_has_windows_of_the_bucket_length(tiny_engine):
    from specwood.planner.calibration import CALIBRATION_PROMPTS, calibration_set, calibration_texts

    texts = calibration_texts()
    assert len(texts) >= 2 and not any("def _wrap_chunks" in t for t in texts)  # not the eval prompts
    ids = calibration_set(tiny_engine, 48, 2, n_chat=1)
    keep = max(8, tiny_engine.max_context // 2)  # long chat prompts keep their last half-context tokens
    assert len(ids) == 3 and ids[0] == tiny_engine.encode(CALIBRATION_PROMPTS[0])[-keep:]
    assert [len(w) for w in ids[1:]] == [48, 48] and ids[1] != ids[2]
    chat_only = calibration_set(tiny_engine, 48, 0, n_chat=2)
    assert len(chat_only) == 2 and chat_only[0] == ids[0]  # no windows asked, none given


def test_calibration_prompts_mix_kinds_and_avoid_the_workload():
    from specwood.bench.workload import load_workload
    from specwood.planner.calibration import CALIBRATION_PROMPTS

    def text(content):  # a raw string or a list of chat messages
        return content if isinstance(content, str) else " ".join(m["content"] for m in content)

    workload = " ".join(text(p.content) for p in load_workload("builtin").prompts).lower()
    for prompt in CALIBRATION_PROMPTS:
        assert prompt[:60].lower() not in workload
    first = " ".join(CALIBRATION_PROMPTS[:6]).lower()
    assert all(word in first for word in ("python", "explain", "translate", "json", "summarise"))


def test_prior_scores_on_tiny_engine(tiny_engine):
    prompts = [tiny_engine.encode(p, raw=True) for p in RAW_PROMPTS]
    prior = collect_prior_scores(tiny_engine, prompts, max_tokens=12, n_nodes=12, levels=3)
    assert prior.steps > 0 and len(prior.scores) == 12 and min(prior.scores) >= 0
    assert sum(prior.scores) == pytest.approx((prior.aat - 1) * prior.steps, abs=1e-2 * prior.steps)
    assert valid_layout(prior.best_layout(5))
    from specwood.planner.prior_tree import compare_tree_methods

    from specwood.planner.prior_tree import HELD_OUT_CATEGORIES, held_out_prompts

    names, held_out = held_out_prompts(tiny_engine)
    assert len(names) == len(held_out) == len(HELD_OUT_CATEGORIES)
    assert {n.split("-")[0] for n in names} == {"code", "chat", "math", "translate", "json", "summary"}
    names3, _ = held_out_prompts(tiny_engine, per_category=3)
    assert len(names3) == 3 * len(HELD_OUT_CATEGORIES) == len(set(names3)) and set(names) <= set(names3)
    rows = compare_tree_methods(tiny_engine, prior, [3, 6], prompts, max_tokens=8)
    assert [r["x"] for r in rows] == [3, 6]
    for r in rows:
        for name in ("prior", "width", "depth"):
            assert 1.0 <= r[name] <= r["x"] and r[f"{name}_tok_s"] > 0
            per_prompt = r[f"{name}_per_prompt"]
            assert len(per_prompt) == len(prompts) and min(per_prompt) <= r[name] <= max(per_prompt)


def test_paired_difference():
    from specwood.planner.prior_tree import paired_difference

    mean, se = paired_difference([3.0, 4.0, 5.0], [2.0, 4.0, 3.0])
    assert mean == pytest.approx(1.0) and se == pytest.approx(1.0 / 3 ** 0.5)
    assert paired_difference([2.0], [1.5]) == (0.5, 0.0) and paired_difference([], []) == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# profiler and end to end


def test_bend_points_find_the_ridge():
    from specwood.planner.profiler import bend_points

    times = {x: 0.01 * max(1.0, x / 16) for x in (1, 2, 4, 8, 32, 64, 128)}
    extra = bend_points(times)
    assert extra[0] == 16  # the segment 8..32 holds the ridge
    assert all(4 < x < 64 for x in extra)
    assert bend_points({x: 0.01 for x in (1, 2, 4, 8)}) == []


def test_profilers_on_tiny_models(tiny_engine):
    from specwood.planner.profiler import measure_draft_times, measure_verify_times

    tv = measure_verify_times(tiny_engine.target, (1, 2, 4, 8), (16, 64, 10**6), repeats=1, progress=False)
    assert set(tv) == {16, 64}  # the context beyond the model's positions is skipped
    assert all(t > 0 for row in tv.values() for t in row.values())
    td = measure_draft_times(tiny_engine, ["dyspec", "chain"], (1, 2, 8), (32,), repeats=1, progress=False)
    assert td["dyspec"][32][1] == 0.0 and td["chain"][32][8] > 0


def test_build_plan_end_to_end_on_tiny_engine(tiny_engine, tmp_path):
    from specwood.planner.cli import format_plan
    from specwood.planner.plots import plot_plan

    plan = build_plan(tiny_engine, "dyspec", quick=True, calibration_prompts=RAW_PROMPTS, raw_prompts=True,
                      contexts=(32, 96), xs=(1, 2, 4, 8, 16), aat_xs=(2, 4, 8, 16), max_tokens=16, repeats=2,
                      progress=False, parallel=False)
    assert plan.parallel is None
    assert plan.contexts == [32, 96] and set(plan.aat_points) == {2, 4, 8, 16}
    assert plan.aat.n_points == 4 and len(plan.choices) == 2
    for c in plan.choices:
        assert (c.method == "ar") == (c.p_eff < c.p_ar) and 1 <= c.x <= 16
    assert "P_eff(x)" in format_plan(plan)
    assert all(p.stat().st_size > 1000 for p in plot_plan(plan, tmp_path / "plots"))
    save_plan(plan)
    assert load_plan(plan.key).to_dict() == plan.to_dict()

    # --method auto: the plan drives the tree size; output is exactly the AR output
    plan.choices = [BucketChoice(32, "dyspec", 6, 2.0, 1.0, 0.5, 6), BucketChoice(96, "ar", 1, 0.5, 1.0, 2.0, 4)]
    save_plan(plan)
    ids = tiny_engine.encode(RAW_PROMPTS[0], raw=True)
    sources = tiny_engine.scheduler.draft_source
    fixed = tiny_engine.prepare("auto", {"adapt": False, "progress": False})(sources, len(ids), 24).shape
    assert isinstance(fixed, PlannedShape)
    assert fixed.for_batch(1, 30).budget == 5 and fixed.for_batch(1, 200) is None
    ar = tiny_engine.generate(ids, max_tokens=24, method="ar").token_ids
    # through the API: lossless, and a prompt whose draft prefill outweighs the saving runs as AR
    assert plan.draft_prefill_s is not None and plan.draft_prefill_s > 0
    plan.draft_prefill_s = 0.0
    save_plan(plan)
    res = tiny_engine.generate(ids, max_tokens=24, method="auto")
    assert res.token_ids == ar and res.stats["auto"] == "sd" and "mean_accepted_tokens" in res.stats
    plan.draft_prefill_s = 10.0
    save_plan(plan)
    res = tiny_engine.generate(ids, max_tokens=24, method="auto", lookup=False)
    assert res.token_ids == ar and res.stats["auto"] == "ar" and "mean_accepted_tokens" not in res.stats
    # with copying from the context (the default) it still never drafts with the model
    res = tiny_engine.generate(ids, max_tokens=24, method="auto")
    assert res.token_ids == ar and res.stats["auto"] == "ar" and res.stats["auto_x_steps"].keys() <= {1}
    # an all-AR plan means: just decode autoregressively
    plan.choices = [BucketChoice(c.context, "ar", 1, 0.5, 1.0, 2.0, 4) for c in plan.choices]
    save_plan(plan)
    res = tiny_engine.generate(ids, max_tokens=24, method="auto", progress=False, lookup=False)
    assert res.token_ids == ar and res.stats["auto"] == "ar" and "mean_accepted_tokens" not in res.stats


def test_executor_choice_follows_the_parallel_model():
    plan = synthetic_plan(KEY)
    best = max(plan.choices[0].p_eff, plan.choices[0].p_ar)
    # T_v(x) = 10 ms at ctx 64: an iteration of max(4 x 2 ms, 1.5 x 10 ms) + 1 ms = 16 ms
    fast = ParallelProfile(gamma=4, t_draft_token_s=0.002, target_slowdown=1.5, verify_tokens=3,
                           tokens_per_iteration=16e-3 * best * 1.2, comm_s=0.001, tokens_per_s=0.0, context=64)
    assert fast.iteration_s(lambda x: plan.t_v(64, x)) == pytest.approx(0.016)
    plan.parallel = fast
    plan.refresh()
    assert plan.executor_for(64) == "parallel" and plan.choices[0].p_parallel == pytest.approx(1.2 * best)
    assert plan.choices[1].p_parallel < plan.choices[0].p_parallel / 2  # T_v(3) is 3x longer at 4096
    plan.parallel = ParallelProfile(**{**asdict(fast), "tokens_per_iteration": 16e-3 * best * 0.9})
    plan.refresh()
    assert plan.executor_for(64) == "sequential"
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()


def test_plan_measures_the_parallel_executor_and_auto_follows_it(tiny_engine):
    from specwood.planner.cli import format_plan

    plan = build_plan(tiny_engine, "dyspec", quick=True, calibration_prompts=RAW_PROMPTS, raw_prompts=True,
                      contexts=(32,), xs=(1, 2, 4, 8), aat_xs=(2, 4, 8), max_tokens=12, repeats=2, progress=False)
    pp = plan.parallel
    assert pp is not None and pp.tokens_per_s > 0 and pp.gamma >= 1 and pp.tokens_per_iteration >= 1
    assert pp.t_draft_token_s > 0 and pp.target_slowdown > 0
    assert all(c.p_parallel > 0 for c in plan.choices) and "parallel executor (DuoDecoding)" in format_plan(plan)
    ids = tiny_engine.encode(RAW_PROMPTS[0], raw=True)
    ar = tiny_engine.generate(ids, max_tokens=16, method="ar").token_ids
    for executor in ("parallel", "sequential"):
        for c in plan.choices:
            c.executor = executor
        save_plan(plan)
        res = tiny_engine.generate(ids, max_tokens=16, method="auto", progress=False)
        assert res.token_ids == ar and (res.stats.get("executor") == "parallel") == (executor == "parallel")
    # an explicit executor wins over the plan
    for c in plan.choices:
        c.executor = "parallel"
    save_plan(plan)
    res = tiny_engine.generate(ids, max_tokens=16, method="auto", executor="sequential", progress=False)
    assert res.token_ids == ar and "executor" not in res.stats


def test_prior_plan_and_components(tiny_engine):
    def prior_shape_for(options):
        return tiny_engine.prepare("prior", options)(tiny_engine.scheduler.draft_source, 8, 8).shape

    with pytest.warns(PlanWarning, match="analytic prior"):
        shape = prior_shape_for({"budget": 6})
    assert len(shape.layout) == 6
    plan = build_plan(tiny_engine, "prior", quick=True, calibration_prompts=RAW_PROMPTS, raw_prompts=True,
                      contexts=(32,), xs=(1, 2, 4, 8), aat_xs=(2, 4, 8), max_tokens=12, repeats=1,
                      prior_nodes=12, prior_levels=3, progress=False)
    assert plan.prior is not None and plan.x_cap == 13 and plan.prior.measured
    save_plan(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)
        shape = prior_shape_for({"budget": 4})
    assert shape.layout == plan.prior.best_layout(4)


def test_cli_analytic_device(tmp_path, capsys):
    import argparse

    from specwood.planner.cli import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--device", "v80", "--target", "llama2-7b", "--draft", "llama-68m",
                              "--method", "sequoia", "--contexts", "256,4096", "--out", str(tmp_path / "p")])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "P_eff(x)" in text and "model:v80" in text and "sequoia" in text
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["aat.png", "p_eff.png", "roofline.png"]
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--contexts", "a,b"])


def test_cli_local_plans_once_then_reuses(tiny_engine, monkeypatch, tmp_path, capsys):
    import argparse

    import specwood.engine.api as engine_api
    from specwood.planner.cli import add_plan_parser

    monkeypatch.setattr(engine_api, "load", lambda *a, **k: tiny_engine)  # what the plan command loads with
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    argv = ["plan", "--quick", "--contexts", "32", "--method", "prior", "--no-plots", "--compare-trees"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    first = capsys.readouterr()
    assert "prior" in first.out and "width" in first.out and "saved" in first.err
    args = parser.parse_args(argv[:-1])
    assert args.func(args) == 0
    assert "using the stored quick plan" in capsys.readouterr().err
    args = parser.parse_args(["plan", "--contexts", "32", "--method", "prior", "--no-plots"])  # full mode now
    monkeypatch.setattr("specwood.planner.build.build_plan", lambda engine, method, **kw: synthetic_plan(
        plan_key_for(engine, method)))
    assert args.func(args) == 0
    assert "re-measuring" in capsys.readouterr().err


def test_plan_key_names_the_weight_modes():
    from types import SimpleNamespace

    from specwood.planner.store import weight_mode_name

    def engine(target_mode, draft_mode=None):
        draft = SimpleNamespace(weight_mode=draft_mode) if draft_mode else None
        return SimpleNamespace(dtype=torch.bfloat16, target=SimpleNamespace(weight_mode=target_mode), draft_model=draft)

    assert weight_mode_name(engine("bf16")) == "bf16"
    assert weight_mode_name(engine("bf16", "int4")) == "bf16/draft-int4"  # int4 and bf16 drafts differ in T_d
    assert weight_mode_name(engine("int8", "int8")) == "bf16+int8/draft-int8"
    assert weight_mode_name(engine("bf16", "bf16")) == "bf16"


def test_the_starter_plan_is_described_in_one_line():
    """What auto prints at start: the timed step costs and the choice at each context."""
    from specwood.planner.starter import describe_starter_plan

    line = describe_starter_plan(cost_plan(AATFit(0.5, 1.0, 0.0)))
    assert "\n" not in line and "T_v(1) 100.0" in line and "T_d(2) 20.0" in line
    assert f"at 128: {KEY.method} x = 4" in line
    assert "at 128: plain" in describe_starter_plan(cost_plan(AATFit(0.3, 1.0, 0.0)))
