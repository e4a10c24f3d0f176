"""`auto`'s online cost model, its probes and its batch decision (issue 58): pure Python on
synthetic costs -- a request decoded step by step against a known machine -- and greedy token
identity through the new decision paths on the tiny models."""
from __future__ import annotations

import math

import pytest

from specwood.engine.step import StepRecord
from specwood.planner.auto import PlannedShape
from specwood.planner.batch_choice import BatchChoice
from specwood.planner.fits import AATFit
from specwood.planner.online import CLIP, OnlineCosts, prior_t_d, prior_t_v
from specwood.planner.probes import FIRST, JITTER, LONGEST, Probes
from specwood.planner.store import BATCH_MARGIN, Plan, PlanKey
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict

KEY = PlanKey("cpu:test/1t", "tiny", "tiny-draft", "fp32", "dyspec")


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    """Plans go to a private cache, not the user's."""
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
XS = (1, 2, 4, 8, 16)


def starter_like_plan(td_per_node: float = 0.004) -> Plan:
    """T_v timed at 128 and 1,024 tokens (attention: +10% of a step per 1,000 tokens; each tree row
    +5%), T_d at 128 only, AAT(x) = 1 + 0.9 ln x: drafting wins at both contexts."""
    tv = {c: {x: 0.04 * (1 + 0.1 * c / 1000) * (1 + 0.05 * (x - 1)) for x in XS} for c in (128, 1024)}
    td = {128: {x: td_per_node * (x - 1) for x in XS}}
    return Plan(key=KEY, contexts=[128, 1024], verify_times=tv, draft_times=td, aat=AATFit(1.0, 0.9, 0.0),
                draft_prefill_s=0.0).refresh()


def test_the_prior_is_a_function_of_context():
    plan = starter_like_plan()
    mid = prior_t_v(plan, 576, 4)
    assert mid == pytest.approx((plan.t_v(128, 4) + plan.t_v(1024, 4)) / 2)
    assert prior_t_v(plan, 2048, 1) == pytest.approx(0.04 * 1.2048)  # extrapolated past the last bucket
    assert prior_t_v(plan, 64, 1) == plan.t_v(128, 1)  # not below the first
    # T_d timed at one context grows as the target's plain step does
    assert prior_t_d(plan, 2048, 4) == pytest.approx(plan.t_d(128, 4) * prior_t_v(plan, 2048, 1) / plan.t_v(128, 1))
    costs = OnlineCosts(plan)
    assert costs.t_v(2048, 4) == prior_t_v(plan, 2048, 4) and costs.machine(2048) == 1.0  # nothing measured yet


def test_online_costs_learn_per_context_and_rows_deterministically():
    plan = starter_like_plan()

    def fed() -> OnlineCosts:
        costs = OnlineCosts(plan)
        for _ in range(30):
            costs.observe_verify(1500, 1, 1, 1.3 * prior_t_v(plan, 1500, 1))  # long context: 30% dearer
            costs.observe_verify(200, 1, 1, prior_t_v(plan, 200, 1))  # short: as timed
            costs.observe_verify(1500, 4, 1, 2.0 * prior_t_v(plan, 1500, 4))  # a 4-row forward there: 2x
        return costs

    costs = fed()
    assert costs.t_v(1500, 1) / prior_t_v(plan, 1500, 1) == pytest.approx(1.3, rel=0.05)
    assert costs.t_v(200, 1) / prior_t_v(plan, 200, 1) == pytest.approx(1.0, abs=0.05)
    assert costs.t_v(1500, 4) / prior_t_v(plan, 1500, 4) == pytest.approx(2.0, rel=0.05)
    # a cell with no steps borrows its context's correction, which lies between its cells'
    ratio_8 = costs.t_v(1500, 8) / prior_t_v(plan, 1500, 8)
    assert 1.3 < ratio_8 < 2.0
    assert costs.machine(1500) == pytest.approx(1.3, rel=0.05)  # drafting and prefill scale with the plain step
    # deterministic: the same steps, the same costs
    again = fed()
    assert ([again.t_v(c, x) for c in (200, 1500, 3000) for x in XS]
            == [costs.t_v(c, x) for c in (200, 1500, 3000) for x in XS])
    # never cheaper for more rows, whatever a cell learnt
    assert all(costs.t_v(c, a) <= costs.t_v(c, b) for c in (200, 1500) for a, b in zip(range(1, 40), range(2, 41)))
    # one outlier moves an estimate by at most CLIP's share of a step, not 100x
    before = costs.t_v(200, 1)
    costs.observe_verify(200, 1, 1, 100 * prior_t_v(plan, 200, 1))
    assert before < costs.t_v(200, 1) < before * CLIP
    # the prior-only view ignores what was measured (a seeded sampled request alone)
    assert costs.prior_only().t_v(1500, 4) == prior_t_v(plan, 1500, 4)


def test_a_uniform_change_of_speed_moves_no_decision():
    plan = starter_like_plan()
    costs = OnlineCosts(plan)
    before = costs.decide(1024)
    for _ in range(20):
        costs.observe_verify(1024, 1, 1, 3.0 * prior_t_v(plan, 1024, 1))  # the machine got 3x busier
    after = costs.decide(1024)
    assert (after.method, after.x) == (before.method, before.x) and after.speedup == pytest.approx(before.speedup)
    assert costs.machine(1024) == pytest.approx(3.0, rel=0.05)  # the first steps were clipped a little
    assert costs.t_d_share(1024, 4) == pytest.approx(costs.machine(1024) * prior_t_d(plan, 1024, 4))


def test_the_draft_prefill_is_weighed_at_the_measured_costs():
    """Alone, the plan's choice for the prompt re-priced at the costs measured at the answer's
    context: earned at the plan's costs, not where its trees measured dearer, still where the
    whole machine got slower (the prefill slows with it)."""
    plan = starter_like_plan()
    choice = plan.choice_for(1500)
    assert choice.method == "dyspec"
    prompt, new_tokens = 1500, 128
    plan.draft_prefill_s = 0.8 * new_tokens * (1 / choice.p_ar - 1 / choice.p_eff) / prompt
    ctx = prompt + new_tokens / 2

    def fed(plain: float, tree: float) -> OnlineCosts:
        costs = OnlineCosts(plan)
        for _ in range(20):
            costs.observe_verify(ctx, 1, 1, plain * prior_t_v(plan, ctx, 1))
            costs.observe_verify(ctx, choice.x, 1, tree * prior_t_v(plan, ctx, choice.x))
        return costs

    assert OnlineCosts(plan).speculation_pays(prompt, new_tokens)
    assert not fed(1.0, 1.6).speculation_pays(prompt, new_tokens)
    assert fed(2.0, 2.0).speculation_pays(prompt, new_tokens)
    assert not OnlineCosts(plan).speculation_pays(prompt, new_tokens // 2)  # half the answer: not earned


def test_probes_are_bounded_and_deterministic_under_a_seed():
    steps = 2000

    def probe_steps(seed: int) -> list[int]:
        probes = Probes(seed)
        return [t for t in range(steps) if probes.step(False)]

    at = probe_steps(7)
    assert at == probe_steps(7) and at != probe_steps(8)
    bound = math.log2(LONGEST / FIRST) + steps / ((1 - JITTER) * LONGEST) + 1
    assert len(at) <= bound
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert max(gaps) <= (1 + JITTER) * LONGEST + 1 and at[0] <= (1 + JITTER) * FIRST
    # a decision that drafts on its own starts the waits short again
    probes = Probes(7)
    for _ in range(200):
        probes.step(False)
    probes.step(True)
    assert next(t for t in range(100) if probes.step(False)) < (1 + JITTER) * FIRST


# --- a request decoded against a synthetic machine ---------------------------------------------


def chain(x: int) -> TokenTree:
    tree = TokenTree.with_root(1, "selected")
    for i in range(1, x):
        tree.add_node(i - 1, 1 + i)
    return tree


def decode(shape: PlannedShape, t_v, t_d, accepted, start: int, steps: int) -> list[tuple[int, int]]:
    """Run `steps` steps of one request from context `start`: each asks the shape for its tree,
    "verifies" it (the first accepted(x, ctx, step) nodes of a chain of x) and reports what the
    machine took (t_v(rows, ctx), t_d(x, ctx)). Returns (context, tree size) per step."""
    ctx, out = start, []
    for step in range(steps):
        drafter = shape.for_batch(1, ctx)
        x = 1 if drafter is None else drafter[1] + 1
        n = min(x - 1, accepted(x, ctx, step))
        shape.on_step(chain(x), Verdict(list(range(1, n + 1)), 0),
                      StepRecord(1, x, t_d(x, ctx, step) if x > 1 else 0.0, t_v(x, ctx), drafting=int(x > 1)))
        out.append((ctx, x))
        ctx += n + 1
    return out


def shape_for(plan: Plan, seed: int = 0) -> PlannedShape:
    return PlannedShape(plan, lambda budget: ("tree", budget), probes=Probes(seed))


def true_rate(x: int, ctx: int, t_v, t_d, a: int) -> float:
    return (1 + min(x - 1, a)) / (t_v(x, ctx) + (t_d(x, ctx, 0) if x > 1 else 0.0))


def test_a_draft_that_stops_paying_at_some_context_is_dropped_there():
    """The plan timed drafting at 128 tokens only; really the draft's attention makes it dearer with
    the context (11x at 1,000 tokens), so past ~1,000 tokens plain decoding wins. The request
    drafts below, decodes plainly above, probing now and then."""
    plan = starter_like_plan()

    def t_v(x, ctx):
        return prior_t_v(plan, ctx, x)

    def t_d(x, ctx, step):
        return plan.t_d(128, x) * (1 + 10 * ctx / 1000)

    def accepted(x, ctx, step):
        return 2  # the draft's first two tokens are right

    best = {c: max(XS, key=lambda x: true_rate(x, c, t_v, t_d, 2)) for c in range(128, 3000, 64)}
    crossing = min(c for c, x in best.items() if x == 1)
    assert 600 < crossing < 1400 and best[128] > 1 and plan.decide(2000).method == "sd"  # the plan drafts everywhere
    runs = [decode(shape_for(plan, seed=3), t_v, t_d, accepted, 128, 1100) for _ in range(2)]
    assert runs[0] == runs[1]  # deterministic under the seed
    early = [x for c, x in runs[0] if c < 0.8 * crossing]
    late = [x for c, x in runs[0] if c > 1.25 * crossing]
    assert len(early) > 50 and len(late) > 300
    assert sum(x > 1 for x in early) / len(early) > 0.9
    assert sum(x > 1 for x in late) / len(late) < 0.08  # probes only
    # without probes or online costs (the plan alone) it would draft all the way
    assert plan.decide(2500, shape_for(plan).request_aat(2500)).method == "sd"


@pytest.mark.parametrize("change", ["cheaper drafts", "better acceptance"])
def test_a_draft_that_starts_paying_is_picked_up_within_a_bounded_number_of_steps(change):
    """Plain decoding wins at first (the draft costs 5x what the plan says, or is always wrong); at
    step 150 it starts to pay. The request drafts again within a probe's longest wait plus a few
    steps."""
    plan = starter_like_plan(td_per_node=0.012)
    switch = 150

    def t_v(x, ctx):
        return prior_t_v(plan, ctx, x)

    def t_d(x, ctx, step):
        dear = change == "cheaper drafts" and step < switch
        return plan.t_d(128, x) * (5.0 if dear else 1.0)

    def accepted(x, ctx, step):
        if change == "better acceptance":
            return 0 if step < switch else x
        return 1

    steps = decode(shape_for(plan, seed=5), t_v, t_d, accepted, 128, 400)
    before = [x for _, x in steps[20:switch]]
    assert sum(x > 1 for x in before) / len(before) < 0.15  # plain, bar the probes
    picked = next(i for i in range(switch, len(steps)) if all(x > 1 for _, x in steps[i:i + 10]))
    assert picked - switch <= (1 + JITTER) * LONGEST + 10


# --- the batch's one decision -----------------------------------------------------------------


class Member:
    def __init__(self, model: bool, scale: float):
        self.model, self.scale = model, scale

    def request_aat(self, context_len):
        return lambda x: 1.0 if x <= 1 else 1.0 + self.scale * (x - 1) / x


def test_the_batch_decides_once_per_step_from_its_requests():
    plan = starter_like_plan()
    costs = OnlineCosts(plan)
    like_plan = BatchChoice()
    alike = Member(True, 1.0)
    # one request alone in the choice: Plan.decide for a batch of B, with its margin
    d = plan.decide(128, alike.request_aat(128), batch=4)
    assert like_plan.x_for(alike, 128, 4, 0, costs, 1.0) == (d.x if d.method == "sd" else 1)
    # four requests: the first asked decides for the step; the others get its answer
    choice = BatchChoice()
    good, poor = [Member(True, 3.0) for _ in range(2)], [Member(True, 0.0), Member(False, 1.0)]
    members = good + poor
    xs = [choice.x_for(m, 128, 4, 0, costs, 1.0) for m in members]  # the first step knows only the first
    xs = [choice.x_for(m, 128, 4, 0, costs, 1.0) for m in members]  # now all four
    assert xs[:3] == [xs[0]] * 3 and xs[3] == 1  # no draft model: plain
    mixed = choice.decision
    # with every request accepting well the batch drafts bigger trees than with half of them poor
    rich, members = BatchChoice(), [Member(True, 3.0) for _ in range(4)]
    for _ in range(2):
        xs_rich = [rich.x_for(m, 128, 4, 0, costs, 1.0) for m in members]
    assert rich.decision.p_eff / rich.decision.p_ar > mixed.p_eff / mixed.p_ar
    assert xs_rich[0] >= xs[0] > 1
    # a batch where drafting loses decodes plainly, and its probes try it now and then
    probing = BatchChoice(Probes(1))
    bad = [Member(True, 0.0) for _ in range(8)]
    steps = [[probing.x_for(m, 128, 8, 0, costs, 1.0) for m in bad] for _ in range(200)]
    assert probing.decision.method == "ar" and probing.decision.speedup < 1 + BATCH_MARGIN
    drafted = [s[0] for s in steps if s[0] > 1]
    assert 0 < len(drafted) <= math.log2(LONGEST / FIRST) + 200 / ((1 - JITTER) * LONGEST) + 1
    assert all(len(set(s)) == 1 for s in steps)  # one answer per step


# --- greedy token identity through the new paths ----------------------------------------------


def unrelated_draft_engine(tiny_tokenizer) -> tuple:
    """A tiny target and an unrelated draft of its size (nearly always wrong), with a stored plan
    that prices a draft forward as a target forward and expects deep acceptance (AAT(8) ~ 6.2), so
    it drafts until the verdicts say otherwise. Returns (engine, plan)."""
    from conftest import make_tiny_model
    from specwood.engine.api import Engine
    from specwood.planner.store import plan_key_for, save_plan

    engine = Engine(make_tiny_model(seed=0), tiny_tokenizer, draft=make_tiny_model(seed=11), target_name="tiny",
                    draft_name="unrelated")
    plan = Plan(key=plan_key_for(engine, "dyspec"), contexts=[64], verify_times={64: {1: 0.01, 2: 0.01, 8: 0.012}},
                draft_times={64: {1: 0.0, 2: 0.01, 8: 0.04}}, aat=AATFit(A=1.0, B=2.5, C=0.0, r2=1.0, n_points=0),
                draft_prefill_s=0.0).refresh()
    save_plan(plan)
    return engine, plan


@pytest.mark.usefixtures("one_thread_private_cache")
def test_auto_probing_and_batch_choice_stay_greedy_identical(tiny_tokenizer):
    """A draft that is nearly always wrong (an unrelated model): auto soon decodes plainly and
    probes now and then, alone and with four requests sharing steps (the batch's one decision and
    its probes). Every answer equals ar's.

    The plan prices a draft forward as a target forward (the two tiny models are the same size),
    so the measured costs agree with it from the first step: with the draft priced at 1% of a
    forward the decision came back to 2-token trees by itself on some machines while the learnt
    price caught up, and never waited long enough to probe (CI, 2026-11-29)."""
    import random

    from specwood.engine.scheduler import SchedulerConfig

    engine, plan = unrelated_draft_engine(tiny_tokenizer)
    assert plan.choose(64) == ("dyspec", 5)
    rnd = random.Random(5)
    prompts = [[rnd.randrange(32, 127) for _ in range(n)] for n in (5, 17, 30, 9)]
    refs = [engine.generate(p, max_tokens=48, method="ar").token_ids for p in prompts]
    alone = engine.generate(prompts[0], max_tokens=48, method="auto", progress=False, suffix=False, lookup=False)
    assert alone.token_ids == refs[0]
    assert alone.stats["auto_x_steps"].get(1, 0) > 10 and alone.stats.get("auto_probes", 0) >= 1
    factory = engine.prepare("auto", {"progress": False, "suffix": False})
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4), drafts=())
    reqs = [sched.submit(engine.new_request(p, max_tokens=48, method="auto", scheduler=sched, prepared=factory))
            for p in prompts]
    while not sched.idle:
        sched.step()
    for r, ref in zip(reqs, refs):
        assert r.error is None and r.result.token_ids == ref
    steps = [r.result.stats["auto_x_steps"] for r in reqs]
    assert all(s.get(1, 0) > 0 for s in steps) and any(x > 1 for s in steps for x in s)


def test_the_drafts_prefill_grows_with_the_prompt_and_decides_at_long_context():
    """Timed at two lengths, a token of the draft's prefill costs more in a longer prompt (its
    attention reads every earlier token): a 4k-token prompt's catch-up is priced ~1.4x its
    512-token rate, and a request whose saving covers the flat price but not the grown one
    runs without the draft (BENCHMARKS §35: a late draft reading 4.3k tokens in one 7.4 s forward)."""
    plan = starter_like_plan()
    plan.draft_prefill_s = 0.8e-3
    assert plan.draft_prefill_seconds(4096) == pytest.approx(4096 * 0.8e-3)  # one length: flat
    plan.draft_prefill_by_length = {512: 0.8e-3, 2048: 0.96e-3}  # +0.16 ms a token per 1,536 tokens
    assert plan.draft_prefill_seconds(256) == pytest.approx(256 * 0.8e-3)  # never below the shortest
    assert plan.draft_prefill_seconds(1280) == pytest.approx(1280 * 0.88e-3)
    assert plan.draft_prefill_seconds(4096) == pytest.approx(4096 * (0.8e-3 + 0.16e-3 * 3584 / 1536))
    assert Plan.from_dict(plan.to_dict()).draft_prefill_seconds(4096) == pytest.approx(plan.draft_prefill_seconds(4096))
    d = OnlineCosts(plan).decide(4096)
    assert d.method == "sd"
    saving = 4096 * 0.8e-3 * 1.2 / (1.0 / d.p_ar - 1.0 / d.p_eff)  # tokens whose saving is 1.2x the flat price
    tokens = int(saving)
    assert OnlineCosts(plan).prefill_is_earned(d, tokens, 4096) is False
    plan.draft_prefill_by_length = {}
    assert OnlineCosts(plan).prefill_is_earned(d, tokens, 4096) is True


@pytest.mark.usefixtures("one_thread_private_cache")
def test_a_seeded_sampled_answer_does_not_depend_on_the_clock(tiny_tokenizer, monkeypatch):
    """A seeded sampled request's trees follow the plan and its own verdicts, never measured time:
    with every step's measured times skewed (copies of the context 100x dearer than other steps
    and drafting 100x cheaper, then the reverse), its answer is the same token for token. Two choices
    read the clock for a request timed alone: the price of a copy against a plain step (lookup)
    and whether a probe that drafted went on drafting (its tokens against the time it took)."""
    import dataclasses

    from specwood.planner.trackers import LookupOrModelShape
    from specwood.sampling import SamplingParams

    engine, _ = unrelated_draft_engine(tiny_tokenizer)
    prompt = [40 + (i % 7) for i in range(42)]  # its n-grams recur: the request copies from its context
    step_seen = PlannedShape.on_step

    def answer(copy_factor: float, plain_factor: float, draft_factor: float) -> tuple[list[int], dict]:
        def skewed(self, tree, verdict, cost=None):
            if cost is not None:
                copying = isinstance(self._step, LookupOrModelShape) and self._step.copied > 0
                cost = dataclasses.replace(cost, verify_s=cost.verify_s * (copy_factor if copying else plain_factor),
                                           draft_s=cost.draft_s * draft_factor)
            step_seen(self, tree, verdict, cost)

        monkeypatch.setattr(PlannedShape, "on_step", skewed)
        out = engine.generate(prompt, SamplingParams(temperature=0.3, seed=7), max_tokens=64, method="auto",
                              progress=False, suffix=False, lookup=True)
        return out.token_ids, out.stats

    first, stats = answer(100.0, 1.0, 0.01)
    auto_stats = {k: v for k, v in stats.items() if k.startswith("auto")}
    assert stats["auto_lookup_steps"] > 0 and stats.get("auto_probes", 0) > 0, auto_stats  # both choices were made
    for factors in ((1.0, 100.0, 100.0), (1.0, 1.0, 1.0)):
        assert answer(*factors)[0] == first, factors
