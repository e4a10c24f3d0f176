"""Engine-level proof that every decoding method samples exactly the autoregressive distribution.

A tiny target with a 32-token vocabulary (and a perturbed copy as its draft) runs SAMPLES
requests per method through the batched Scheduler -- prefill, drafting, ONE target forward per
step, verification, commit, the output stream -- all from the same token-id prompt, each with its
own seed. The first two emitted tokens (EOS counted as an outcome: a request whose first token is
EOS ends there) are compared by a G-test with their exact law, computed from the target's logits:
the first token ~ target_probs(logits after the prompt), the second ~ target_probs(logits after
the prompt and the first token). The same test with a verifier that accepts drafted tokens
more often (+BIAS) must fail hard, so the test has the power to see a bias.

Only the first decode step speculates here (the first token comes from the prefill), so the
second token is the one every method's drafting + verification decides; `max_tokens=2`.
Throughput matters: SAMPLES (a module constant, env SPECWOOD_STAT_SAMPLES overrides it) is sized
for the CI budget; every test prints its requests/s. Measured with one torch thread, BATCH 256:
on a 2-core Zen 4 VM ar ~2,200 req/s, pld ~1,450, the draft-model methods 680-920; on a 2-core
Zen 3 VM without AVX512 (2026-11-28, CI drew one) ar 814, pld 486, the draft-model methods 190-310,
so at 50,000 requests per case this file (18 law cases + 4 biased runs) took 69 min of one core
there, half the whole suite's time. At 50,000 the biased verifier (+0.05) gave p = 6e-43 (chain),
2e-128 (dyspec), 9e-107 (head), 0 (eagle); at 25,000, measured on that CPU: 3e-18 (chain), 4e-63
(dyspec), 6e-40 (head), 2e-190 (eagle), and 3e-26 for copied chains: 25,000 it is, for law and
biased runs alike. That is the floor, not a margin: p falls exponentially with n, and from chain's
3e-18 the G-test catches +0.05 with ~99.97% power at 25,000 but ~50% at 12,500 (tests/stat_power.py;
the smallest bias caught with 99% power is 0.045 at 25,000, docs/testing.md). The verifiers themselves
are held to >= 200,000 samples (tests/test_verify_statistics.py); the parallel executor's G-tests run
50,000 requests, sized the same way (tests/test_parallel.py).
"""
from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest

import specwood  # noqa: F401 - registers the planner's methods (auto, prior)
import specwood.engine.step as step_mod
from specwood.engine.api import Engine
from specwood.engine.scheduler import TREE_ROOM, SchedulerConfig
from specwood.methods import method_names
from specwood.sampling import SamplingParams

from conftest import (BiasedVerify, exact_first_two_law, g_test, make_tiny_model, make_tiny_tokenizer, perturbed_copy,
                      trained_tiny_head)

SAMPLES = int(os.environ.get("SPECWOOD_STAT_SAMPLES", 25_000))  # requests per method and case (see below)
BIASED_SAMPLES = SAMPLES  # the biased runs must fail at the same sample count
BATCH = 256  # max_batch of the scheduler: requests per batched step
V = 32  # vocabulary
EOS = 5  # a token of the target's likely first tokens (p ~ 0.07): it ends a request when sampled
# the target's greedy path from [20, 3], then [20, 3] again: the likely first token (4, p ~ 0.43)
# repeats the path's 3-gram, so prompt lookup (pld) drafts the path's next tokens (16, 0, 2)
PROMPT = [20, 3, 4, 16, 0, 2, 15, 17, 20, 26, 20, 3]
MAX_TOKENS = 2
BUDGET = 3  # drafted nodes per tree: small and fast, yet branching for the tree shapes
OUTCOMES = V + 1  # token ids, then EOS (index V) as "the request ended here"
P_MIN = 1e-4  # a correct engine fails a test (two p-values) with probability ~ 2 * P_MIN
P_BIASED = 1e-6  # what a biased verifier must reach

ALL_METHODS = method_names()
DEPTH = 2  # tree depth where a method takes one: only depth 1 decides the second token
OPTIONS: dict[str, dict] = {
    "ar": {},
    "auto": {"progress": False},  # a stored plan (below) makes it speculate with x = BUDGET + 1
    "prior": {"budget": BUDGET},  # the analytic prior (no stored scores: a PlanWarning)
    "eagle": {"budget": BUDGET, "depth": DEPTH, "topk": 2},
    "static": {"budget": BUDGET, "branching": [2, 1]},
    "dyspec-threshold": {"budget": BUDGET, "depth": DEPTH, "threshold": 0.05},
}


def options_for(method: str) -> dict:
    return OPTIONS.get(method, {"budget": BUDGET, "depth": DEPTH})


pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")


@pytest.fixture(scope="module")
def stat_engine():
    return make_stat_engine()


def make_stat_engine() -> Engine:
    target = make_tiny_model(vocab_size=V, seed=3)
    draft = perturbed_copy(target, 0.3, seed=4)
    # the head's draft vocabulary leaves 8 of the 32 tokens out: their mass reaches the output
    # through the verifier's residual alone
    engine = Engine(target, make_tiny_tokenizer(), draft=draft, target_name="tiny32", draft_name="tiny32-draft",
                    head=trained_tiny_head(target, 24, seed=5))
    assert engine.eos_token_ids == set()  # the tokenizer's specials are outside a 32-token vocabulary
    engine.eos_token_ids = {EOS}
    return engine


def store_auto_plan(engine: Engine, draft_price: float) -> None:
    """A stored plan that speculates at every context and batch size (flat T_v) with trees of
    BUDGET + 1 tokens, drafting priced at `draft_price` seconds a drafted token."""
    from specwood.planner.fits import DEFAULT_AAT
    from specwood.planner.store import Plan, plan_key_for, save_plan

    xs = (1, 2, BUDGET + 1)
    plan = Plan(key=plan_key_for(engine, "dyspec"), contexts=[64], verify_times={64: {x: 0.01 for x in xs}},
                draft_times={64: {x: draft_price * (x - 1) for x in xs}}, aat=DEFAULT_AAT,
                draft_prefill_s=0.0).refresh()
    assert plan.choose(len(PROMPT)) == ("dyspec", BUDGET + 1)
    save_plan(plan)


@pytest.fixture()
def private_plans(monkeypatch, tmp_path, stat_engine):
    """auto and prior read plans from a private cache; auto gets store_auto_plan's plan."""
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
    store_auto_plan(stat_engine, 1e-4)


@pytest.fixture()
def copying_plans(monkeypatch, tmp_path, stat_engine):
    """private_plans with drafting priced 100x lower (1 us a token): where a request's context
    recurs, auto drafts the model's tree with the copied chain merged in ("both") in shared steps
    as it does alone. At 1e-4 the price of shared drafting learnt in the first batch (up to 4x the
    plan's, DraftCostTracker) made the chain alone win under load ("suffix": the suffix method's
    verification path, which its own law case covers)."""
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
    store_auto_plan(stat_engine, 1e-6)


# --- the exact law ------------------------------------------------------------------------------



def exact_law(engine: Engine, params: SamplingParams, prompt: list[int] = PROMPT) -> np.ndarray:
    return exact_first_two_law(engine, prompt, params)


# --- running requests through the scheduler ----------------------------------------------------


def request_seed(stream: int, i: int) -> int:
    """A 63-bit seed for request i of a run (splitmix64 of stream and index): reproducible, and
    unrelated across requests -- runs of consecutive small seeds gave first draws with a suspect
    G-test p-value (2e-4 twice in 48 runs of 50k; reproduced with torch's sampler alone)."""
    x = (stream * 0x100000000 + i + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1


_M64 = (1 << 64) - 1


def run_requests(engine: Engine, method: str, params: SamplingParams, n: int, stream: int,
                 prompt: list[int] = PROMPT, options: dict | None = None, batch: int = BATCH,
                 one_step_prefill: bool = True):
    """`n` requests of `method` through one scheduler in batches of BATCH: the joint counts of
    the first two outcomes, the number of speculative steps and of accepted drafted tokens.
    `one_step_prefill`: a batch's prompts all in its first step; else the server's step budget
    (newcomers admitted over several steps, each beside the decode step of those before)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prior without stored scores warns (analytic prior)
        factory = engine.prepare(method, options if options is not None else options_for(method))
    # rows keep the scheduler's default tree room: draft sources need it (see test_batching)
    # a whole batch's prompts in one step: one prefill forward and one decode step a batch, not seven
    # of each for the default step budget's 512 tokens (~15% of a case's time)
    step_tokens = {"prefill_step_tokens": BATCH * len(prompt)} if one_step_prefill else {}
    sched = engine.make_scheduler(SchedulerConfig(max_batch=batch, row_len=len(prompt) + MAX_TOKENS + TREE_ROOM,
                                                  max_queue=BATCH, **step_tokens), drafts=())
    records: list = []
    sched.observers.append(records.append)  # one StepRecord a decode step
    counts = np.zeros((OUTCOMES, OUTCOMES), dtype=np.int64)
    spec_steps = accepted = copied = 0
    sources: dict[str, int] = {}
    for start in range(0, n, BATCH):
        reqs = [engine.new_request(prompt, max_tokens=MAX_TOKENS, temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p, seed=request_seed(stream, start + i),
                                   method=method, scheduler=sched, prepared=factory)
                for i in range(min(BATCH, n - start))]
        for r in reqs:
            sched.submit(r)
        sched.run_until_done(reqs)
        for r in reqs:
            assert r.error is None, f"{method}: {r.error}"
            ids, reason = r.result.token_ids, r.result.finish_reason
            assert len(ids) == MAX_TOKENS or reason == "stop", (ids, reason)
            a = ids[0] if ids else V
            b = ids[1] if len(ids) > 1 else V
            counts[a, b] += 1
            spec_steps += r.stats.steps
            accepted += r.stats.accepted
            used = r.result.stats.get("auto_sources") or {}
            copied += int(r.result.stats.get("auto_lookup_steps", 0)) + used.get("suffix", 0) + used.get("both", 0)
            for source, steps in used.items():
                sources[source] = sources.get(source, 0) + steps
    assert sched.idle and sched.executor.cache.free_rows == batch
    run_requests.decode_steps = len(records)  # the scheduler's decode steps (the last run)
    run_requests.copied = copied  # auto's steps that copied from the context (the last run)
    run_requests.sources = sources  # auto's steps by what drafted them (the suffix source's choices)
    return counts, spec_steps, accepted


BIAS = 0.05  # what the biased verifier adds to the acceptance probability




CASES = [(m, SamplingParams(temperature=1.0)) for m in ALL_METHODS]
CASES += [("dyspec", SamplingParams(temperature=0.8, top_k=12, top_p=0.9)),
          ("eagle", SamplingParams(temperature=1.2, top_p=0.95))]


# this case keeps the server's step budget: its batches are admitted over several steps, each a
# decode step of earlier requests beside newcomers' prompts (the steps every other case now skips)
STAGGERED_CASE = "dyspec_t1.0"


def case_id(case) -> str:
    method, p = case
    extra = "".join(f"_{k}{v}" for k, v in (("k", p.top_k), ("p", p.top_p)) if v not in (0, 1.0))
    return f"{method}_t{p.temperature}{extra}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_engine_samples_the_target_law(stat_engine, private_plans, case):
    method, params = case
    law = exact_law(stat_engine, params)
    t0 = time.perf_counter()
    counts, spec_steps, accepted = run_requests(stat_engine, method, params, SAMPLES, stream=CASES.index(case),
                                                one_step_prefill=case_id(case) != STAGGERED_CASE)
    dt = time.perf_counter() - t0
    p = g_test(counts, law)
    p_first = g_test(counts.sum(1), law.sum(1))
    print(f"\n{case_id(case)}: p(first)={p_first:.3g} p(first, second)={p:.3g} | {SAMPLES} requests in {dt:.1f}s "
          f"= {SAMPLES / dt:.0f} req/s | speculative steps {spec_steps}, accepted {accepted}")
    if method != "ar":
        # every request whose first token is not EOS speculated once (pld: where the context
        # matches), and drafts were accepted
        live = SAMPLES - int(counts[V].sum())
        assert spec_steps == live, (spec_steps, live)
        assert accepted > (live // 10 if method in ("pld", "suffix") else live // 3), (accepted, live)
    batches = -(-SAMPLES // BATCH)
    if case_id(case) == STAGGERED_CASE:  # admitted over several steps (42 prompts a step)
        assert run_requests.decode_steps > 4 * batches, run_requests.decode_steps
    else:  # one prefill step, then one decode step a batch
        assert run_requests.decode_steps == batches, run_requests.decode_steps
    assert min(p, p_first) > P_MIN, f"{method} does not sample the target's distribution"


# the prompt ends as it starts, so where the first sampled token continues it as at the start (16),
# auto's first step merges the tokens that followed (a "selected" chain, from the suffix source)
# into the model's sampled tree ("both"): one tree verified under two rules. The suffix source
# weighs copies at every load, so these runs share steps like the others (the n-gram lookup
# copies only in steps a request has alone: asserted below)
LOOKUP_PROMPT = [20, 3, 4, 16, 0, 2, 15, 17, 20, 3, 4]
LOOKUP_SAMPLES = SAMPLES


def test_auto_copying_from_the_context_samples_the_target_law(stat_engine, copying_plans):
    params = SamplingParams(temperature=1.0)
    law = exact_law(stat_engine, params, LOOKUP_PROMPT)
    counts, spec_steps, accepted = run_requests(stat_engine, "auto", params, LOOKUP_SAMPLES, stream=500,
                                                prompt=LOOKUP_PROMPT, options={"progress": False})
    copied, merged = run_requests.copied, run_requests.sources.get("both", 0)
    p = g_test(counts, law)
    p_first = g_test(counts.sum(1), law.sum(1))
    print(f"\nauto copying: p(first)={p_first:.3g} p(first, second)={p:.3g} | steps {spec_steps}, copied {copied} "
          f"({merged} merged into the model's tree), accepted {accepted}")
    # a step copies when the first sampled token is 16 (then the last 4 tokens recur), ~46%
    assert merged > LOOKUP_SAMPLES // 4 and accepted > LOOKUP_SAMPLES // 10
    assert min(p, p_first) > P_MIN, "auto's copied chains do not sample the target's distribution"
    # the same prompt without copying drafts with the model: the copy really was the path taken
    run_requests(stat_engine, "auto", params, 64, stream=501, prompt=LOOKUP_PROMPT,
                 options={"progress": False, "lookup": False}, batch=1)
    assert run_requests.copied == 0
    # and shared steps do not copy (the n-gram lookup's rule; the suffix source weighs them by load)
    run_requests(stat_engine, "auto", params, BATCH, stream=502, prompt=LOOKUP_PROMPT,
                 options={"progress": False, "suffix": False})
    assert run_requests.copied == 0


# sampled chain, sampled tree without replacement, selected (top-k), the draft head's (top-k) tree
BIASED = ["chain", "dyspec", "eagle", "head"]


@pytest.mark.parametrize("method", BIASED)
def test_biased_verifier_is_caught(stat_engine, private_plans, monkeypatch, method):
    """The same test, same sample count, with a verifier biased by BIAS, must fail hard."""
    params = SamplingParams(temperature=1.0)
    law = exact_law(stat_engine, params)
    biased = BiasedVerify(BIAS)
    monkeypatch.setattr(step_mod, "verify_trees", biased.trees)
    t0 = time.perf_counter()
    counts, _, _ = run_requests(stat_engine, method, params, BIASED_SAMPLES,
                                stream=1000 + BIASED.index(method))
    dt = time.perf_counter() - t0
    p = g_test(counts, law)
    print(f"\nbiased {method} (+{BIAS}): p(first, second)={p:.3g} | {BIASED_SAMPLES} requests in {dt:.1f}s "
          f"= {BIASED_SAMPLES / dt:.0f} req/s")
    assert biased.calls >= BIASED_SAMPLES // 2, \
        "the engine no longer verifies through specwood.engine.step.verify_trees"
    assert p < P_BIASED, f"the test cannot see a +{BIAS} acceptance bias"


def test_biased_verifier_is_caught_on_copied_chains(stat_engine, copying_plans, monkeypatch):
    params = SamplingParams(temperature=1.0)
    law = exact_law(stat_engine, params, LOOKUP_PROMPT)
    biased = BiasedVerify(BIAS)
    monkeypatch.setattr(step_mod, "verify_trees", biased.trees)
    counts, _, _ = run_requests(stat_engine, "auto", params, LOOKUP_SAMPLES, stream=1500, prompt=LOOKUP_PROMPT,
                                options={"progress": False})
    assert run_requests.sources.get("both", 0) > LOOKUP_SAMPLES // 4
    p = g_test(counts, law)
    print(f"\nbiased auto copying (+{BIAS}): p(first, second)={p:.3g}")
    assert p < P_BIASED, f"the test cannot see a +{BIAS} acceptance bias on copied chains"
