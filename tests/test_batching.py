"""The batched engine core: continuous batching through the Scheduler.

* every method, mixed in one batch (different prompt lengths, start times, stop strings, EOS),
  emits exactly what the request run alone with `ar` emits (greedy, fp32), on tiny models and on
  the real default pair;
* the KV cache pools survive 1,000 requests admitted, finished, cancelled and failed;
* a request whose drafting (or its tree, or its prompt) is broken fails alone;
* bad input is refused with a SpecwoodError before anything runs.
"""
from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

import specwood  # noqa: F401 - registers the planner's methods (auto, prior)
from specwood.drafting.base import TreeShape
from specwood.drafting.shapes import make_shape
from specwood.engine.api import Engine
from specwood.engine.request import Drafter, Request, State
from specwood.engine.scheduler import TREE_ROOM, Scheduler, SchedulerConfig
from specwood.engine.sequential import SequentialExecutor
from specwood.errors import ContextLengthError, SamplingParamsError, SpecwoodError
from specwood.methods import method_names
from specwood.tree.token_tree import TokenTree

# small trees: cheap steps, and every shape still branches
TINY_OPTIONS: dict[str, dict[str, Any]] = {
    "ar": {},
    "chain": {"budget": 4},
    "static": {"budget": 6, "branching": [2, 2, 1]},
    "sequoia": {"budget": 8},
    "eagle": {"budget": 8, "depth": 3, "topk": 3},
    "dyspec": {"budget": 6},
    "dyspec-threshold": {"budget": 6, "threshold": 0.05},
    "pld": {"budget": 4},
    "suffix": {"budget": 6},
    "early-exit": {"budget": 4},
    "head": {"budget": 6, "depth": 3, "topk": 2},
    "auto": {"progress": False},
    "prior": {"budget": 6},
    "duo": {"budget": 6},
}


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(one_thread_private_cache):
    """Every test here: tiny models on one thread, plans in a private cache (conftest)."""


def store_auto_plan(engine: Engine, x: int = 8) -> None:
    """A stored plan for `auto` (base dyspec) that speculates with trees of x tokens at every
    context and batch size (a flat T_v): the tiny engine's name is no model the analytic
    starter plan knows, and this keeps the test independent of the machine."""
    from specwood.planner.fits import DEFAULT_AAT
    from specwood.planner.store import Plan, plan_key_for, save_plan

    xs = (1, 2, x)
    plan = Plan(key=plan_key_for(engine, "dyspec"), contexts=[64], verify_times={64: {v: 0.01 for v in xs}},
                draft_times={64: {v: 1e-4 * (v - 1) for v in xs}}, aat=DEFAULT_AAT, draft_prefill_s=0.0).refresh()
    assert plan.choose(64) == ("dyspec", x)
    save_plan(plan)


def quiet_prepare(engine: Engine, method: str, options: dict[str, Any]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prior without stored scores: an analytic prior (PlanWarning)
        return engine.prepare(method, options)


def random_prompt(rnd: random.Random, n: int) -> list[int]:
    """Byte tokens; a repeated phrase in longer prompts gives prompt lookup something to copy."""
    ids = [rnd.randrange(32, 127) for _ in range(n)]
    if n >= 12:
        phrase = ids[:5]
        for at in range(n // 2, n - 5, 7):
            ids[at:at + 5] = phrase
    return ids


@dataclass
class Job:
    """One request of a mixed batch, and how to run it alone with `ar`."""

    method: str
    prompt: list[int]
    max_tokens: int
    start_step: int = 0  # the scheduler step after which it is submitted
    stop: list[str] | None = None
    eos: set[int] | None = None  # the engine's EOS ids while the request is built (None: as is)
    request: Request | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, engine: Engine, sched: Scheduler, factories: dict[str, Callable]) -> Request:
        saved = engine.eos_token_ids
        if self.eos is not None:
            engine.eos_token_ids = self.eos
        try:
            self.request = engine.new_request(self.prompt, max_tokens=self.max_tokens, method=self.method,
                                              stop=self.stop, scheduler=sched, prepared=factories[self.method])
        finally:
            engine.eos_token_ids = saved
        return self.request

    def reference(self, engine: Engine):
        saved = engine.eos_token_ids
        if self.eos is not None:
            engine.eos_token_ids = self.eos
        try:
            return engine.generate(self.prompt, max_tokens=self.max_tokens, stop=self.stop, method="ar")
        finally:
            engine.eos_token_ids = saved


def run_jobs(engine: Engine, sched: Scheduler, jobs: list[Job], options: dict[str, dict] | None = None,
             max_steps: int = 10_000) -> None:
    """Submit each job after its start step; step until all are done (joiners enter mid-stream)."""
    options = {**TINY_OPTIONS, **(options or {})}
    factories = {m: quiet_prepare(engine, m, options[m]) for m in {j.method for j in jobs}}
    pending = sorted(jobs, key=lambda j: j.start_step)
    step = 0
    while pending or not sched.idle:
        while pending and pending[0].start_step <= step:
            sched.submit(pending.pop(0).build(engine, sched, factories))
        sched.step()
        step += 1
        assert step < max_steps, "the scheduler does not finish"
    for j in jobs:
        assert j.request.done.is_set()


def assert_like_ar(engine: Engine, jobs: list[Job]) -> None:
    for j in jobs:
        ref = j.reference(engine)
        r = j.request
        assert r.error is None, (j.method, r.error)
        got = r.result
        assert got.token_ids == ref.token_ids, (j.method, len(j.prompt), got.token_ids, ref.token_ids)
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason), j.method


def assert_pools_free(sched: Scheduler) -> None:
    assert sched.idle and not sched.running and not sched.waiting
    assert sched.executor.cache.free_rows == sched.max_batch
    assert sorted(sched.executor.cache._free) == list(range(sched.max_batch))
    assert all(n == 0 for n in sched.executor.cache.lengths)
    for model, pool in sched.executor._draft_pools.values():
        assert pool.free_rows == sched.max_batch, model
        assert sorted(pool._free) == list(range(sched.max_batch))


# ---------------------------------------------------------------------------------------------
# 1. every method, mixed in one batch, equals ar run alone (tiny models, greedy fp32)


def test_all_methods_mixed_in_one_batch_equal_ar_alone(tiny_engine):
    engine = tiny_engine
    store_auto_plan(engine)
    names = method_names()
    assert set(TINY_OPTIONS) == set(names), "a new method: give it options here"
    rnd = random.Random(1234)
    lengths = [2, 60, 7, 33, 3, 48, 12, 26, 5, 55, 19, 41, 9, 60, 2, 30, 15, 37, 4, 52, 22, 11]
    jobs = []
    for i, method in enumerate(names + names[::-1]):
        start = 0 if i < 6 else 2 + 3 * (i - 6)  # the first six start together, the rest join mid-stream
        jobs.append(Job(method, random_prompt(rnd, lengths[i % len(lengths)]), max_tokens=rnd.randint(8, 32),
                        start_step=start))
    # a stop string and an EOS, each in a speculative request (often inside an accepted path)
    for job, kind in ((jobs[1], "stop"), (jobs[8], "eos"), (jobs[12], "stop"), (jobs[16], "eos")):
        job.max_tokens = 32
        ref = job.reference(engine)
        n = len(ref.token_ids)  # the tiny model's own EOS may end it early, as it does some others
        assert n >= 12 and len(ref.text) >= 10, "pick another prompt: the reference stops too early"
        if kind == "stop":
            job.stop = [ref.text[6:8]]
        else:
            k = next(k for k in range(6, n) if ref.token_ids[k] not in ref.token_ids[:k])
            job.eos = {ref.token_ids[k]}
    # newcomers prefill in chunks
    sched = engine.make_scheduler(SchedulerConfig(max_batch=6, prefill_chunk_tokens=16), drafts=())
    run_jobs(engine, sched, jobs)
    assert_like_ar(engine, jobs)
    reasons = {(j.method, j.request.result.finish_reason) for j in jobs if j.stop or j.eos}
    assert {r for _, r in reasons} == {"stop"}
    spec = [j for j in jobs if j.method not in ("ar", "pld")]
    assert all(j.request.result.stats.get("spec_steps", 0) > 0 for j in spec), "a method did not speculate"
    assert all(j.request.result.stats.get("auto") == "sd" for j in jobs if j.method == "auto")
    assert_pools_free(sched)


def test_auto_copies_from_the_context_and_stays_lossless(tiny_engine):
    """auto copies a chain from the context where an n-gram recurs (no draft forward) and drafts
    with the model elsewhere; greedy, fp32, the output is ar's, and copied tokens are accepted."""
    engine = tiny_engine
    store_auto_plan(engine)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14] * 3 + [30, 31, 32, 33, 7, 8, 9]
    ar = engine.generate(prompt, max_tokens=40, method="ar").token_ids
    res = engine.generate(prompt, max_tokens=40, method="auto", progress=False, suffix=False)
    assert res.token_ids == ar
    assert res.stats["auto_lookup_steps"] >= 1 and res.stats["mean_accepted_tokens"] > 1
    # by default the suffix source (which covers the lookup) drafts the copies
    res = engine.generate(prompt, max_tokens=40, method="auto", progress=False)
    assert res.token_ids == ar
    assert res.stats["auto_sources"]["suffix"] + res.stats["auto_sources"]["both"] >= 1
    plain = engine.generate(prompt, max_tokens=40, method="auto", progress=False, lookup=False)
    assert plain.token_ids == ar and "auto_lookup_steps" not in plain.stats


def test_small_tree_room_scheduler_serves_draft_model_methods(tiny_engine):
    """A scheduler sized for small trees (tree_room, row_len as room_for asks) must serve the
    draft-model methods whose trees fit it."""
    engine = tiny_engine
    rnd = random.Random(7)
    tree_room, max_tokens = 16, 16
    jobs = [Job(m, random_prompt(rnd, n), max_tokens) for m, n in
            (("ar", 20), ("chain", 30), ("dyspec", 12), ("eagle", 25), ("early-exit", 18), ("pld", 22))]
    config = SchedulerConfig(max_batch=4, row_len=40 + max_tokens + tree_room, tree_room=tree_room)
    sched = engine.make_scheduler(config, drafts=())
    run_jobs(engine, sched, jobs, {"eagle": {"budget": 4, "depth": 2, "topk": 2}})  # drafts <= 6 nodes
    assert_like_ar(engine, jobs)
    assert_pools_free(sched)


def test_requests_near_the_context_end_in_a_batch(tiny_engine):
    """Requests whose trees would cross the model's last position stop at 'length' exactly as ar
    does (drafting must shrink or skip the tree), next to other requests and alone."""
    engine = tiny_engine
    rnd = random.Random(11)
    near = engine.max_context - 10
    jobs = [Job("ar", random_prompt(rnd, 20), 16)]
    jobs += [Job(m, random_prompt(rnd, near), 50) for m in ("chain", "static", "eagle", "early-exit", "dyspec", "pld")]
    sched = engine.make_scheduler(SchedulerConfig(max_batch=8), drafts=())
    run_jobs(engine, sched, jobs)
    assert_like_ar(engine, jobs)
    assert all(j.request.result.finish_reason == "length" for j in jobs)
    assert_pools_free(sched)
    for job in jobs[1:]:  # a batch of one (Engine.generate)
        alone = engine.generate(job.prompt, max_tokens=50, method=job.method, **TINY_OPTIONS[job.method])
        assert alone.token_ids == job.reference(engine).token_ids, job.method


def test_newcomers_share_the_prefill(tiny_engine):
    """With nobody decoding, newcomers share one chunk of PREFILL_CHUNK tokens equally (short
    prompts get their first token at once, a long one keeps prefilling); while others decode,
    each newcomer's target advances prefill_chunk_tokens a step, in the decode step's own forward
    (one pass over the weights a step). A draft model reads its prompt only after the first
    token, in chunks of the same share (a short one in the next step, which it drafts in);
    output is ar's."""
    from specwood.models.prefill import PREFILL_CHUNK

    engine = tiny_engine
    rnd = random.Random(5)
    sched = engine.make_scheduler(SchedulerConfig(max_batch=6, prefill_chunk_tokens=16), drafts=())
    passes, records = [], []  # target forwards (passes over its first layer), step records
    hook = engine.target.layers[0].register_forward_pre_hook(lambda *_: passes.append(1))
    sched.observers.append(records.append)
    assert sched.executor.prefill_share(4, decoding=False) == (PREFILL_CHUNK // 4, PREFILL_CHUNK)
    assert sched.executor.prefill_share(64, decoding=False) == (16, PREFILL_CHUNK)
    assert sched.executor.prefill_share(3, decoding=True) == (16, PREFILL_CHUNK)
    # a step budget of the caller's (vLLM's max_num_batched_tokens): shared out the same way
    wide = engine.make_scheduler(SchedulerConfig(max_batch=2, prefill_chunk_tokens=16, prefill_step_tokens=2048),
                                 drafts=())
    assert wide.executor.prefill_share(4, decoding=False) == (512, 2048)
    assert wide.executor.prefill_share(3, decoding=True) == (16, 2048)
    with pytest.raises(SpecwoodError, match="prefill_step_tokens must be an integer >= 1"):
        SchedulerConfig(prefill_step_tokens=0)
    jobs = [Job("ar", random_prompt(rnd, 10), 12), Job("dyspec", random_prompt(rnd, 9), 12),
            Job("ar", random_prompt(rnd, 11), 12), Job("chain", random_prompt(rnd, 200), 12)]
    factories = {m: quiet_prepare(engine, m, TINY_OPTIONS[m]) for m in ("ar", "dyspec", "chain")}
    for job in jobs:
        sched.submit(job.build(engine, sched, factories))
    long, dyspec = jobs[-1].request, jobs[1].request
    sched.step()
    assert all(j.request.state is State.DECODE for j in jobs[:3])
    assert (dyspec.draft_prefilled, len(dyspec.out.token_ids)) == (0, 1)  # its first token did not wait
    assert (long.state, long.prefilled, long.draft_prefilled) == (State.PREFILL, 128, 0)
    assert len(passes) == 1  # four prompts' chunks (10, 9, 11, 128 tokens): one forward
    sched.step()  # now others decode: 16 tokens of the long prompt; dyspec's draft reads its 9 and drafts
    assert (long.prefilled, long.draft_prefilled) == (144, 0)
    assert dyspec.draft_prefilled == 9 and records[-1].drafting == 1
    assert len(passes) == 2 and records[-1].prefill_tokens == 16  # rode in the decode step's forward
    late = [Job("ar", random_prompt(rnd, 60), 8), Job("chain", random_prompt(rnd, 60), 8)]
    for job in late:
        sched.submit(job.build(engine, sched, factories))
    sched.step()
    assert (long.prefilled, long.draft_prefilled) == (160, 0)
    assert [j.request.prefilled for j in late] == [16, 16] and late[1].request.draft_prefilled == 0
    assert len(passes) == 3 and records[-1].prefill_tokens == 48
    sched.run_until_done([j.request for j in jobs + late])
    hook.remove()
    assert_like_ar(engine, jobs + late)
    assert_pools_free(sched)


def test_the_first_token_never_waits_for_the_draft(tiny_engine):
    """A draft model reads its prompt after its request's first token (issue 58 item 3): alone,
    all of it in the next step, which the request drafts in; beside others decoding,
    prefill_chunk_tokens a step while the request decodes plainly, then it drafts. auto with its
    draft model too. Greedy, fp32: every output is ar's. A seeded sampled request still has its
    draft read the prompt first (its trees must not depend on the batch)."""
    engine = tiny_engine
    store_auto_plan(engine)
    rnd = random.Random(9)
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4, prefill_chunk_tokens=16))
    records = []
    sched.observers.append(records.append)
    options = {**TINY_OPTIONS, "auto": {"progress": False, "lookup": False}}  # auto drafts with its model
    factories = {m: quiet_prepare(engine, m, options[m]) for m in ("ar", "dyspec", "auto")}
    done = []
    for method in ("dyspec", "auto"):  # alone
        job = Job(method, random_prompt(rnd, 40), 16, eos=set())
        req = sched.submit(job.build(engine, sched, factories))
        sched.step()
        assert (req.state, len(req.out.token_ids), req.draft_prefilled) == (State.DECODE, 1, 0), method
        sched.step()
        assert req.draft_prefilled == 40 and records[-1].drafting == 1, method
        sched.run_until_done([req])
        done.append(job)
    running = Job("ar", random_prompt(rnd, 10), 60, eos=set())  # beside a request that decodes
    sched.submit(running.build(engine, sched, factories))
    sched.step()
    job = Job("dyspec", random_prompt(rnd, 60), 24, eos=set())
    req = sched.submit(job.build(engine, sched, factories))
    while req.state is not State.DECODE:
        sched.step()
    assert (req.draft_prefilled, len(req.out.token_ids)) == (0, 1)
    seen = []
    while req.draft_behind:
        sched.step()
        seen.append((req.draft_prefilled, records[-1].drafting, len(req.out.token_ids)))
    # plain steps (a token each) while the draft reads 16 tokens a step; it drafts in the step it is done
    assert seen == [(16, 0, 2), (32, 0, 3), (48, 0, 4), (60, 1, seen[-1][2])]
    sched.run_until_done([running.request, req])
    assert req.result.stats["spec_steps"] > 0
    assert_like_ar(engine, done + [running, job])
    seeded = sched.submit(engine.new_request(random_prompt(rnd, 30), max_tokens=4, method="dyspec", seed=5,
                                             temperature=0.8, scheduler=sched, prepared=factories["dyspec"]))
    sched.step()
    assert seeded.draft_first and (len(seeded.out.token_ids), seeded.draft_prefilled) == (1, 30)
    sched.run_until_done([seeded])
    assert_pools_free(sched)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_engine):
    """Each request owns its random streams: a seeded sampled request emits the same tokens alone
    and in a batch with others (that join, finish and sample around it)."""
    engine = tiny_engine
    rnd = random.Random(3)
    methods = ["ar", "chain", "dyspec", "eagle", "pld", "early-exit", "static"]
    prompts = [random_prompt(rnd, n) for n in (5, 40, 17, 2, 28, 11, 50)]
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95)
    alone = [engine.generate(p, method=m, seed=100 + i, **kw, **TINY_OPTIONS[m]).token_ids
             for i, (m, p) in enumerate(zip(methods, prompts))]
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4, prefill_chunk_tokens=16), drafts=())
    reqs = []
    for i, (m, p) in enumerate(zip(methods, prompts)):
        reqs.append(sched.submit(engine.new_request(p, method=m, seed=100 + i, scheduler=sched, **kw,
                                                    **TINY_OPTIONS[m])))
        sched.step()  # each joins a running batch
    sched.run_until_done(reqs)
    for m, r, ref in zip(methods, reqs, alone):
        assert r.error is None and r.result.token_ids == ref, m
    assert_pools_free(sched)


def test_first_tokens_of_a_shared_prefill_are_each_requests_own(tiny_engine):
    """Requests whose prompts end in the same step draw their first tokens together (one
    `target_probs` per sampling law): each gets the token it gets alone, from its own seed --
    beside a greedy one, one with logprobs and one with another temperature."""
    engine = tiny_engine
    rnd = random.Random(4)
    asks = [dict(temperature=0.9, seed=s) for s in range(6)] + [dict(temperature=0.7, seed=9), dict(),
                                                                 dict(temperature=0.9, seed=2, logprobs=2)]
    prompts = [random_prompt(rnd, 7) for _ in asks]
    alone = [engine.generate(p, max_tokens=3, **kw).token_ids for p, kw in zip(prompts, asks)]
    sched = engine.make_scheduler(SchedulerConfig(max_batch=len(asks)), drafts=())
    reqs = [sched.submit(engine.new_request(p, max_tokens=3, scheduler=sched, **kw)) for p, kw in zip(prompts, asks)]
    sched.run_until_done(reqs)
    assert [r.result.token_ids for r in reqs] == alone
    assert len({tuple(a[:1]) for a in alone[:6]}) > 1  # the shared law's draws differ by seed
    assert_pools_free(sched)


# ---------------------------------------------------------------------------------------------
# 2. the real default pair: the methods that were never compared with ar on it in a batch


CHAT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers greater than 100."}],
]


def test_real_pair_mixed_batch_equals_ar(real_pair_engine_fp32):
    engine = real_pair_engine_fp32
    t0 = time.perf_counter()
    prompts = [engine.encode(p) for p in CHAT_PROMPTS]
    refs = [engine.generate(ids, max_tokens=32, method="ar").token_ids for ids in prompts]
    t_ar = time.perf_counter() - t0
    plan = [("ar", 0, 24, 0), ("dyspec", 1, 32, 0), ("chain", 2, 28, 0), ("eagle", 0, 32, 0), ("pld", 1, 24, 0),
            ("prior", 2, 32, 0), ("auto", 0, 28, 4)]  # auto joins after 4 steps
    options = {"dyspec": {"budget": 8}, "eagle": {"budget": 8, "depth": 4, "topk": 3}, "prior": {"budget": 8},
               "auto": {"progress": False}}
    # auto follows a stored plan: its starter plan would time the fp32 1.5B target on trees of up to
    # 48 tokens first (~50 s here, most of this test); the starter plan is timed on real files elsewhere
    # (test_gemma_real, test_cli_sweep)
    store_auto_plan(engine)
    factories = {m: quiet_prepare(engine, m, options.get(m, {})) for m, *_ in plan}
    # rows: prompt + 32 tokens + the default tree room (1025; draft sources ask for it, see above)
    sched = engine.make_scheduler(SchedulerConfig(max_batch=len(plan), row_len=1280), drafts=())
    reqs, pending, step = {}, list(plan), 0
    while pending or not sched.idle:
        for item in [p for p in pending if p[3] <= step]:
            method, i, n, _ = item
            reqs[item] = sched.submit(engine.new_request(prompts[i], max_tokens=n, method=method, scheduler=sched,
                                                         prepared=factories[method]))
            pending.remove(item)
        sched.step()
        step += 1
    t_batch = time.perf_counter() - t0 - t_ar
    lines = []
    for (method, i, n, _), r in reqs.items():
        assert r.error is None, (method, r.error)
        st = r.result.stats
        lines.append(f"{method}: AAT {st.get('mean_accepted_tokens', 1.0)} {st.get('auto', '')}".rstrip())
        assert r.result.token_ids == refs[i][:n], (method, i, engine.tokenizer.decode(r.result.token_ids),
                                                   engine.tokenizer.decode(refs[i][:n]))
    for (method, *_), r in reqs.items():
        if method in ("dyspec", "chain", "eagle", "prior"):
            assert r.result.stats["mean_accepted_tokens"] > 1.5, (method, r.result.stats)
    print(f"\nreal pair: ar references {t_ar:.1f}s, batch of {len(plan)} in {step} steps {t_batch:.1f}s; "
          + "; ".join(lines))
    assert_pools_free(sched)


# ---------------------------------------------------------------------------------------------
# 3. the cache pools after 1,000 requests admitted, finished, cancelled and failed


class RaisingShape(TreeShape):
    """Drafts like `inner` for `good_steps` steps, then raises (after a draft call, so the
    failure comes from the request's own drafting code, not from a shared forward)."""

    name = "raising"

    def __init__(self, inner, good_steps: int):
        self.inner, self.good_steps, self.steps = inner, good_steps, 0

    def draft(self, context, root, params, generator):
        self.steps += 1
        if self.steps > self.good_steps:
            yield TokenTree.with_root(root), [0]
            raise RuntimeError("drafting exploded")
        return (yield from self.inner.draft(context, root, params, generator))


def test_a_newcomer_sees_the_load_it_joins(tiny_engine):
    """The drafter factory learns how many requests will share the newcomer's steps (running and
    queued, itself included, capped by the batch): `auto` weighs the draft's prefill by it."""
    engine = tiny_engine
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4, max_queue=16), drafts=())
    seen: list[int] = []

    def factory(sources, prompt_len, max_tokens, load=1, scope=""):
        seen.append(load)
        return Drafter()

    reqs = []
    for _ in range(6):
        reqs.append(engine.new_request([3, 4, 5], max_tokens=2, scheduler=sched, prepared=factory))
        sched.submit(reqs[-1])
    assert seen == [1, 2, 3, 4, 4, 4] and sched.admission_load == 4
    sched.run_until_done(reqs)
    assert sched.idle and sched.admission_load == 1


def test_run_here_steps_in_the_calling_thread_until_stopped(tiny_engine):
    """`specwood serve` decodes on its main thread (run_here) while HTTP threads submit and stop:
    requests submitted from another thread finish with ar's tokens, start() is then a no-op,
    stop() from another thread ends the loop, and the scheduler can be started again after."""
    import threading

    engine = tiny_engine
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4, max_queue=16), drafts=())
    prompts = [[3, 4, 5], [7, 1, 2, 9]]
    refs = [engine.generate(p, max_tokens=4).token_ids for p in prompts]
    results: list = []

    def client() -> None:
        try:
            sched.start()  # the app's lifespan does this: the loop is already running here
            reqs = [engine.new_request(p, max_tokens=4, scheduler=sched) for p in prompts]
            for r in reqs:
                sched.submit(r)
            for r in reqs:
                if r.done.wait(60):
                    results.append(r.result.token_ids)
        finally:
            sched.stop()  # even on a failure here, or run_here would never return

    ran_in: list[threading.Thread] = []
    worker = threading.Thread(target=client)
    sched.run_here(then=lambda: (ran_in.append(threading.current_thread()), worker.start()))
    worker.join(10)
    assert ran_in == [threading.current_thread()] and not worker.is_alive()
    assert results == refs and sched.num_running == 0
    assert sched._thread is None  # the loop is released: it can start again
    sched.start()
    late = engine.new_request([3, 4, 5], max_tokens=2, scheduler=sched)
    sched.submit(late)
    try:
        assert late.done.wait(60) and late.error is None
    finally:
        sched.stop()


def test_a_server_scheduler_has_its_draft_pool_before_any_request(tiny_engine):
    """The draft model's KV pool is allocated when the scheduler is built (a server builds it on the
    thread that steps it), so a draft method's request made on another thread (the HTTP one)
    allocates no cache: a large torch op there gives the process a second OpenMP team, which
    slowed every later decode step of `specwood serve` by ~30% (BENCHMARKS.md §9d)."""
    import threading

    engine = tiny_engine
    sched = engine.make_scheduler(SchedulerConfig(max_batch=2, row_len=256 + TREE_ROOM))
    pools = dict(sched.executor._draft_pools)
    assert list(pools) == [id(engine.draft_model), id(engine.draft_head)]
    made: list = []
    client = threading.Thread(target=lambda: made.append(
        engine.new_request([3, 4, 5], max_tokens=4, method="dyspec", scheduler=sched)))
    client.start()
    client.join(30)
    assert len(made) == 1 and sched.executor._draft_pools == pools
    assert made[0].drafter.source.pool is pools[id(engine.draft_model)][1]
    sched.submit(made[0])
    sched.run_until_done(made)
    assert made[0].result.token_ids == engine.generate([3, 4, 5], max_tokens=4).token_ids


def test_cache_pools_survive_a_thousand_requests(tiny_engine):
    engine = tiny_engine
    B, N = 8, 1000
    rnd = random.Random(99)
    prompts = [random_prompt(rnd, n) for n in (2, 9, 17, 30, 45, 60)]
    refs = [engine.generate(p, max_tokens=3).token_ids for p in prompts]
    methods = ["ar", "chain", "dyspec", "early-exit", "pld", "eagle"]
    factories = {m: quiet_prepare(engine, m, TINY_OPTIONS[m]) for m in methods}
    chain = make_shape("chain", budget=3)
    factories["raising"] = lambda sources, n, m, load=1, scope="": Drafter(sources(engine.draft_model),
                                                                           RaisingShape(chain, 1))
    sched = engine.make_scheduler(SchedulerConfig(max_batch=B, max_queue=N, prefill_chunk_tokens=16), drafts=())
    kinds = rnd.choices(["finish", "cancel-waiting", "cancel-decode", "cancel-prefill", "fail"],
                        weights=[60, 12, 15, 6, 7], k=N)
    jobs: list[tuple[str, int, Request]] = []
    marked: list[tuple[str, Request]] = []  # to cancel once they reach their stage
    cancelled_in: dict[Request, State] = {}

    def advance() -> None:
        sched.step()
        for k, r in list(marked):
            if r.done.is_set():
                marked.remove((k, r))
            elif (k == "cancel-decode" and r.state is State.DECODE and r.out.token_ids) or (
                    k == "cancel-prefill" and (r.prefilled > 0 or r.state is State.DECODE)):
                cancelled_in[r] = r.state
                r.cancel()
                marked.remove((k, r))

    t0 = time.perf_counter()
    for kind in kinds:
        method = "raising" if kind == "fail" else rnd.choice(methods)
        i = 5 if kind == "cancel-prefill" else rnd.randrange(len(prompts))  # a 60-token prompt: 4 chunks
        n = rnd.randint(1, 3) if kind == "finish" else 20
        req = sched.submit(engine.new_request(prompts[i], max_tokens=n, method=method, scheduler=sched,
                                              prepared=factories[method]))
        if kind == "cancel-waiting":
            req.cancel()
        elif kind.startswith("cancel"):
            marked.append((kind, req))
        jobs.append((kind, i, req))
        while sched.num_waiting >= B:  # about one batch waiting: newcomers join a running batch
            advance()
    while not all(r.done.is_set() for _, _, r in jobs):
        advance()
    assert not sched.step()  # nothing left: a no-op
    dt = time.perf_counter() - t0
    seen = {k: 0 for k in set(kinds)}
    for kind, i, r in jobs:
        assert r.done.is_set() and r.state is State.FINISHED
        seen[kind] += 1
        if kind == "fail":
            assert r.error is not None and "drafting exploded" in r.error and r.result is None
            continue
        assert r.error is None, (kind, r.method, r.error)
        out = r.result.token_ids
        assert out[:3] == refs[i][:min(3, len(out))], (kind, r.method)
        if kind == "finish":
            assert out == refs[i][:r.max_tokens] and r.result.finish_reason == "length"
        else:
            assert r.result.finish_reason == "cancelled", (kind, r.result.finish_reason)
            assert (out == []) if kind == "cancel-waiting" else (len(out) < 20)
            if kind == "cancel-decode":
                assert out
    in_prefill = sum(s is State.PREFILL for s in cancelled_in.values())
    print(f"\n{N} requests {seen} ({in_prefill} cancelled mid-prefill) in {dt:.1f}s, {sched.steps} steps")
    assert min(seen.values()) > 20 and in_prefill > 10
    assert_pools_free(sched)
    # and the pools still serve: a request of each method after the churn
    after = [Job(m, prompts[3], 12) for m in methods]
    run_jobs(engine, sched, after)
    assert_like_ar(engine, after)
    assert_pools_free(sched)


# ---------------------------------------------------------------------------------------------
# 4. one request's failure stays its own


class BadTreeShape(TreeShape):
    """Drafts like `inner` for `good_steps` steps, then breaks in the way `how` says."""

    name = "bad"

    def __init__(self, inner, how: str, good_steps: int = 2):
        self.inner, self.how, self.good_steps, self.steps = inner, how, good_steps, 0

    def for_batch(self, batch_size, context_len, riding=0, free=0):
        if self.how == "choose" and self.steps >= self.good_steps:
            raise RuntimeError("choosing a shape exploded")
        return self

    def draft(self, context, root, params, generator):
        self.steps += 1
        if self.steps <= self.good_steps:
            return (yield from self.inner.draft(context, root, params, generator))
        tree = TokenTree.with_root(root)
        if self.how == "start":  # raises before its first draft call
            raise RuntimeError("drafting exploded at the start")
        if self.how == "after-call":  # raises with the logits of a (batched) draft call in hand
            yield tree, [0]
            raise RuntimeError("drafting exploded after a call")
        if self.how == "draft-forward":  # a draft call the shared draft forward cannot run
            tree.add_node(0, 10**6)
            yield tree, [1]
            return tree
        if self.how == "target-forward":  # a tree the shared target forward cannot run
            tree.add_node(0, 10**6)
            return tree
        raise AssertionError(self.how)


def failing_hook(tree, verdict):
    raise RuntimeError("a step hook exploded")


FAILURES = ["start", "after-call", "choose", "target-forward", "hook", "prompt", "draft-forward"]


@pytest.mark.parametrize("how", FAILURES)
def test_a_failing_request_fails_alone(tiny_engine, how):
    engine = tiny_engine
    rnd = random.Random(5)
    good = [Job(m, random_prompt(rnd, n), 16) for m, n in (("chain", 14), ("ar", 6), ("dyspec", 25), ("eagle", 9),
                                                            ("early-exit", 30))]
    prompt = random_prompt(rnd, 12)
    chain = make_shape("chain", budget=3)
    if how == "hook":
        factory = lambda sources, n, m, load=1, scope="": Drafter(sources(engine.draft_model), chain,  # noqa: E731
                                                                  hooks=[failing_hook])
    elif how == "prompt":  # the batched prefill fails for it alone (set below, past new_request's checks)
        factory = lambda sources, n, m, load=1, scope="": Drafter(sources(engine.draft_model), chain)  # noqa: E731
    else:
        factory = lambda sources, n, m, load=1, scope="": Drafter(sources(engine.draft_model), BadTreeShape(chain, how))  # noqa: E731
    sched = engine.make_scheduler(SchedulerConfig(max_batch=8), drafts=())
    factories = {m: quiet_prepare(engine, m, TINY_OPTIONS[m]) for m in {j.method for j in good}}
    reqs = [j.build(engine, sched, factories) for j in good]
    bad = engine.new_request(prompt, max_tokens=16, method="bad", scheduler=sched, prepared=factory)
    if how == "prompt":
        bad.prompt_ids[3] = 10**6  # a token the embedding does not have
    reqs.insert(2, bad)  # in the middle of the batch
    for r in reqs:
        sched.submit(r)
    sched.run_until_done(reqs)
    assert bad.error is not None and bad.result is None, how
    if how != "prompt":
        assert "exploded" in bad.error or how.endswith("forward"), bad.error
    assert_like_ar(engine, good)
    assert_pools_free(sched)


# ---------------------------------------------------------------------------------------------
# 5. bad input: a SpecwoodError before anything runs


BAD_INPUT = [
    (dict(method="medusa"), SpecwoodError, "unknown method"),
    (dict(method="chain", topk=2), SpecwoodError, "does not use option"),
    (dict(method="auto", budget=4), SpecwoodError, "does not use option"),
    (dict(method="pld", threshold=0.1), SpecwoodError, "does not use option"),
    (dict(method="dyspec", budget=0), SpecwoodError, "budget"),
    (dict(method="early-exit", exit_layer=99), SpecwoodError, "early-exit layer"),
    (dict(temperature=-1.0), SamplingParamsError, "temperature"),
    (dict(top_p=0.0), SamplingParamsError, "top_p"),
    (dict(top_k=-1), SamplingParamsError, "top_k"),
    (dict(seed=-3), SamplingParamsError, "seed"),
    (dict(max_tokens=0), SpecwoodError, "max_tokens"),
    (dict(stop=[3]), SpecwoodError, "stop"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_INPUT,
                         ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw, _, _ in BAD_INPUT])
def test_bad_input_is_a_specwood_error(tiny_engine, kwargs, error, match):
    sched = tiny_engine.make_scheduler(SchedulerConfig(max_batch=2), drafts=())
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        tiny_engine.new_request([1, 2, 3], scheduler=sched, **kwargs)
    with pytest.raises(error, match=match):
        tiny_engine.generate([1, 2, 3], **kwargs)
    assert_pools_free(sched)
    assert_pools_free(tiny_engine.scheduler)


@pytest.mark.parametrize("method", [m for m in method_names()
                                    if m not in ("ar", "pld", "suffix", "early-exit", "auto", "head")])
def test_methods_that_need_a_draft_refuse_without_one(tiny_pair, tiny_tokenizer, method):
    engine = Engine(tiny_pair.target, tiny_tokenizer)
    with pytest.raises(SpecwoodError, match="needs a draft model"):
        engine.generate([1, 2, 3], max_tokens=4, method=method)
    # auto without a draft decodes plainly (its base shape cannot draft); ar, pld, suffix, early-exit need none
    for other in ("ar", "pld", "suffix", "early-exit", "auto"):
        out = engine.generate([1, 2, 3], max_tokens=4, method=other, **({"progress": False} if other == "auto" else {}))
        assert len(out.token_ids) == 4 or out.finish_reason == "stop"


def test_prompt_longer_than_the_context_or_the_rows(tiny_engine):
    engine = tiny_engine
    with pytest.raises(ContextLengthError, match="context holds"):
        engine.generate([i % 256 for i in range(engine.max_context)], max_tokens=4)
    with pytest.raises(ContextLengthError, match="context holds"):
        engine.new_request("y" * (engine.max_context + 3), raw=True, max_tokens=4, method="chain")
    # rows hold 48 context tokens
    sched = engine.make_scheduler(SchedulerConfig(max_batch=2, row_len=64, tree_room=16), drafts=())
    with pytest.raises(ContextLengthError, match="cache rows hold"):
        engine.new_request(list(range(40)), max_tokens=16, scheduler=sched)
    with pytest.raises(SpecwoodError, match="prompt is empty"):
        engine.new_request("", raw=True, scheduler=sched)
    assert_pools_free(sched)


@pytest.mark.parametrize("prompt", [[10**6], [-1], [5, 6, 300], []], ids=["huge", "negative", "past-vocab", "empty"])
def test_bad_token_id_prompts_are_a_specwood_error(tiny_engine, prompt):
    """Token ids the model does not have (or no tokens at all) are the caller's mistake: a
    SpecwoodError from new_request, not an internal error of the step."""
    sched = tiny_engine.make_scheduler(SchedulerConfig(max_batch=2), drafts=())
    with pytest.raises(SpecwoodError):
        tiny_engine.new_request(prompt, max_tokens=4, scheduler=sched)
    assert_pools_free(sched)


def test_static_shape_forwards_equal_eager_for_every_method(tiny_engine, monkeypatch):
    """The CUDA-graph path's padding (batch and tokens to power-of-two buckets, masks to the full
    row) run eagerly on the CPU: every method's greedy output is unchanged (graphs on CUDA replay
    exactly these forwards; tests/test_cuda.py runs them captured)."""
    from specwood.models.cuda_graphs import GraphedForward

    engine = tiny_engine
    store_auto_plan(engine)
    rnd = random.Random(99)
    names = method_names()
    jobs = [Job(m, random_prompt(rnd, rnd.randint(2, 50)), max_tokens=rnd.randint(6, 24), start_step=i // 3)
            for i, m in enumerate(names)]
    refs = [j.reference(engine).token_ids for j in jobs]
    made: list[GraphedForward] = []

    def static_pool(self, model):
        cache = model.new_cache(self.row_len, self.max_batch)
        cache.graphs = GraphedForward(model, cache, capture=False)
        made.append(cache.graphs)
        return cache

    monkeypatch.setattr(SequentialExecutor, "_pool", static_pool)
    sched = engine.make_scheduler(SchedulerConfig(max_batch=5, prefill_chunk_tokens=16), drafts=())
    run_jobs(engine, sched, jobs)
    for j, ref in zip(jobs, refs):
        assert j.request.error is None and j.request.result.token_ids == ref, j.method
    assert len(made) >= 2 and all(g._static for g in made), "the static path did not run for target and draft"
    assert_pools_free(sched)
