"""The pipeline executor (SpecPipe): the target split into stages, one tree level per step.

* in-process (the real rank loop on threads, `pipeline_local.py`): greedy output token-identical
  to `ar` for 2 and 3 stages and several (w, k), plain PP and PP + SpecInfer (static, chain and
  dyspec trees) too; after EVERY step each stage's KV cache equals a non-speculative recomputation
  of the verified prefix plus its surviving nodes (SpecPipe levels, or the whole tree in flight);
  sampling: a G-test that the first two tokens follow `ar`'s distribution (V = 32);
* spawned ranks over gloo on 127.0.0.1 (`PipelineExecutor`): 2 and 3 stages token-identical to
  `ar` with hits and misses, plain PP, EOS inside the tree, a killed rank (every other rank exits
  within 30 s naming it, nothing left behind), bad input (one line, exit 2, nothing hangs).
Every test has a deadline (SIGALRM).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from specwood.engine.api import Engine
from specwood.engine.specpipe.jobs import Job, stage_ranges, tree_nodes
from specwood.engine.specpipe.launch import PipelineExecutor, PipelineFailure
from specwood.errors import SpecwoodError
from specwood.models.prefill import prefill
from specwood.sampling import SamplingParams, target_probs

from conftest import g_test, make_tiny_model, make_tiny_tokenizer, perturbed_copy
from pipeline_local import run_local

PROMPTS = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 5, 1, 2, 3,"]
DEADLINE_S = 60
SLOW_DEADLINE_S = 600  # the sampling G-tests, 20,000 requests each: up to 242 s on the 2-core Zen 3 (a hang guard)


@pytest.fixture(autouse=True)
def deadline(request):
    def expired(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past its deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(SLOW_DEADLINE_S if request.node.get_closest_marker("slow_deadline") else DEADLINE_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")


@pytest.fixture(scope="module")
def pair():
    target = make_tiny_model(seed=0, n_layers=3)
    draft = perturbed_copy(target, 0.3, seed=1)
    tok = make_tiny_tokenizer()
    return Engine(target, tok, draft=draft, target_name="tiny", draft_name="tiny-draft")


def ar_ids(engine: Engine, prompt_ids: list[int], n: int) -> list[int]:
    return engine.generate(prompt_ids, max_tokens=n, method="ar").token_ids


def greedy(engine: Engine) -> SamplingParams:
    """Greedy params as the engine makes them: padding ids past the tokenizer's never emitted."""
    return SamplingParams(emit_limit=engine.emit_limit)


def jobs_for(engine: Engine, mode: str, w: int, k: int, n: int = 40) -> list[tuple[Job, None]]:
    return [(Job(engine.encode(p, raw=True), n, greedy(engine), mode, w, k), None) for p in PROMPTS]


# ------------------------------------------------------------------------------ in-process


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode,w,k", [("specpipe", 4, 4), ("specpipe", 1, 1), ("specpipe", 8, 2), ("pp", 1, 1)])
def test_local_greedy_matches_ar(pair, stages, mode, w, k):
    jobs = jobs_for(pair, mode, w, k)
    results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages)
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, job.max_tokens)
    s = [r.stats for r in results]
    if mode == "pp":  # one token per full pass: m steps per token
        assert all(x["hits"] == 0 and x["pipeline_steps"] == stages * x["new_tokens"] for x in s)
    else:
        assert sum(x["hits"] for x in s) > 0 and sum(x["misses"] for x in s) > 0
        # a miss refills the whole pipeline (m - 1 idle steps); a hit whose subtree has no deeper
        # level leaves a bubble too. Every step after the fill verifies one token or stalls.
        for x in s:
            assert x["stall_steps"] >= (stages - 1) * x["misses"]
            assert x["pipeline_steps"] == x["new_tokens"] + x["stall_steps"] + stages - 1


DB_PROMPTS = PROMPTS + ["import os\nimport", "The quick brown fox"]
DB_LENGTHS = [40, 9, 27, 3, 33]  # requests of different lengths: some leave early, queued ones join


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("mode,w,k", [("specpipe", 4, 4), ("specpipe", 2, 1), ("pp", 1, 1), ("specinfer", 1, 1)])
def test_local_db_concurrent_requests_match_ar(pair, stages, mode, w, k):
    """SpecPipe-DB: five requests, at most three in flight: each one's output = its own `ar`."""
    jobs = [(Job(pair.encode(p, raw=True), n, greedy(pair), mode, w, k, tree={"name": "static"},
                 tree_nodes=tree_nodes({"name": "static"})), None) for p, n in zip(DB_PROMPTS, DB_LENGTHS)]
    in_flight = []

    def on_step(rank, step):
        if rank.rank == 0:
            in_flight.append(len(rank.lanes))

    results, ranks = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages,
                               on_step=on_step, concurrent=len(jobs), max_lanes=3)
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, job.max_tokens)
        assert len(res.stats["per_stage"]) == stages
    assert max(in_flight) == 3 and in_flight[-1] == 0  # the last step is the last request leaving
    for rank in ranks:  # every request left: every cache row is free again
        assert not rank.lanes and rank.pool.cache.free_rows == rank.pool.cache.rows <= 3
    if mode == "specpipe":
        s = [r.stats for r in results]
        assert sum(x["hits"] for x in s) > 0 and sum(x["misses"] for x in s) > 0
        for x in s:  # a lane's steps are its own: the single-request accounting holds per request
            assert x["pipeline_steps"] == x["new_tokens"] + x["stall_steps"] + stages - 1
    # sharing steps: far fewer steps than the requests one after another
    assert len(in_flight) < sum(r.stats["pipeline_steps"] for r in results)


def test_local_db_cancel_in_flight(pair):
    """A request cancelled mid-flight leaves at the next step with what it had; the others go on."""
    ids = [pair.encode(p, raw=True) for p in PROMPTS[:2]]
    jobs = [(Job(x, 40, greedy(pair), "specpipe", 4, 4), None) for x in ids]

    def on_step(rank, step):
        if rank.rank == 0 and step == 8:
            rank.cancel(0)

    results, ranks = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, 2,
                               on_step=on_step, concurrent=2)
    assert results[0].finish_reason == "cancelled" and 0 < len(results[0].token_ids) < 40
    assert results[0].token_ids == ar_ids(pair, ids[0], 40)[:len(results[0].token_ids)]
    assert results[1].token_ids == ar_ids(pair, ids[1], 40)
    assert all(not r.lanes for r in ranks)


SPECINFER_TREES = [{"name": "static"}, {"name": "chain", "budget": 4}, {"name": "dyspec", "budget": 8}]


def specinfer_job(prompt: list[int], n: int, tree: dict, params: SamplingParams) -> Job:
    return Job(prompt, n, params, "specinfer", tree=tree, tree_nodes=tree_nodes(tree))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("tree", SPECINFER_TREES, ids=lambda t: t["name"])
def test_local_specinfer_greedy_matches_ar(pair, stages, tree):
    """PP + SpecInfer: a whole tree per full pass (m steps), verified at the last stage."""
    jobs = [(specinfer_job(pair.encode(p, raw=True), 40, tree, greedy(pair)), None) for p in PROMPTS]
    results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages)
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, job.max_tokens)
        s = res.stats
        # the prompt pass, then m steps per tree; each tree emits its accepted path and one more token
        assert s["pipeline_steps"] == stages * (s["trees"] + 1)
        assert s["new_tokens"] <= 1 + s["trees"] + s["accepted"]
        assert s["hits"] == s["misses"] == 0
    assert sum(r.stats["accepted"] for r in results) > 0


def test_specinfer_drafts_the_trees_of_every_lane_together(pair):
    """Rank 0 drafts the trees of all lanes refilling in a step in one draft forward per round (and
    prefills their prompts together): far fewer draft forwards than the same requests one by one,
    the same tokens."""
    tree = {"name": "static"}
    jobs = [(specinfer_job(pair.encode(p, raw=True), 24, tree, greedy(pair)), None) for p in PROMPTS]
    forwards = []
    hook = pair.draft_model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        alone = []
        for job in jobs:
            forwards.clear()
            results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, [job], 2)
            alone.append(len(forwards))
            assert results[0].token_ids == ar_ids(pair, job[0].prompt, 24)
        forwards.clear()
        results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, 2,
                               concurrent=len(jobs))
    finally:
        hook.remove()
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, 24)
    assert len(forwards) < 0.6 * sum(alone), (len(forwards), alone)


def test_specinfer_with_the_target_as_draft_accepts_whole_chains(pair):
    tree = {"name": "chain", "budget": 5}
    jobs = [(specinfer_job(pair.encode(PROMPTS[0], raw=True), 37, tree, greedy(pair)), None)]
    results, _ = run_local(pair.target, pair.target, pair.tokenizer, pair.eos_token_ids, jobs, 2)
    s = results[0].stats
    assert results[0].token_ids == ar_ids(pair, jobs[0][0].prompt, 37)
    assert s["trees"] == 6 and s["accepted"] == 30  # 1 + 6 trees x (5 accepted + 1)


def test_draft_equal_to_target_always_hits(pair):
    # k = 1: the tree is the draft's greedy chain, i.e. the target's (a wider beam may bubble: its
    # w best paths by cumulative probability need not contain the greedy one)
    jobs = jobs_for(pair, "specpipe", 3, 1, n=30)
    results, _ = run_local(pair.target, pair.target, pair.tokenizer, pair.eos_token_ids, jobs, 3)
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, job.max_tokens)
        assert res.stats["misses"] == 0 and res.stats["stall_steps"] == 0
        assert res.stats["pipeline_steps"] == res.stats["new_tokens"] + 2  # fill once, then a token per step


def reference_kv(target, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [layers, H, len, D] of a plain causal run over `tokens`."""
    cache = target.new_cache(len(tokens) + 1)
    with torch.inference_mode():
        prefill(target, cache, tokens)
    return cache.k[:, 0, :, :len(tokens)], cache.v[:, 0, :, :len(tokens)]


@pytest.mark.parametrize("stages,w,k,lanes", [(2, 4, 3, 1), (3, 6, 2, 1), (4, 3, 3, 1), (2, 0, 0, 1), (3, 0, 0, 1),
                                               (3, 4, 3, 3), (3, 0, 0, 2)])
def test_pruning_keeps_each_stage_cache_exact(pair, stages, w, k, lanes):
    """After every step, stage r's cache = (verified prefix + its surviving nodes' paths) run plainly.
    w = 0: PP + SpecInfer (the whole tree in flight; its accepted path kept on every stage).
    lanes > 1: SpecPipe-DB, every request's own cache row checked."""
    tree_mode = w == 0
    if stages > pair.target.config.n_layers:
        deep = make_tiny_model(seed=0, n_layers=5)
        pair = Engine(deep, pair.tokenizer, draft=perturbed_copy(deep, 0.3, seed=1))
    snaps = []
    lock = threading.Lock()
    ranges = stage_ranges(pair.target.config, stages)

    def on_step(rank, step):
        for lane in rank.lanes.values():
            kv, m = lane.kv, lane.mirror
            n = kv.committed + len(kv.spec)
            if tree_mode:  # a tree's nodes sit below its root, which is in the stage's spec part too
                paths = {x: [m.token[a] for a in m.path(x)] for x in kv.spec}
            else:
                paths = {x: [m.token[a] for a in reversed(m.ancestors(x))] + [m.token[x]] for x in kv.spec}
            with lock:
                snaps.append((lane.id, rank.rank, step, kv.committed, list(kv.spec), paths,
                              kv.cache.k[:, kv.row, :, :n].clone(), kv.cache.v[:, kv.row, :, :n].clone()))

    prompts = [pair.encode(p, raw=True) for p in PROMPTS[:lanes]]
    jobs = [(specinfer_job(prompt, 24, {"name": "static"}, greedy(pair)) if tree_mode else
             Job(prompt, 24, greedy(pair), "specpipe", w, k), None) for prompt in prompts]
    results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages,
                           on_step=on_step, concurrent=lanes)
    seqs = [prompt + res.token_ids for prompt, res in zip(prompts, results)]
    full = [reference_kv(pair.target, seq) for seq in seqs]
    checked_spec = 0
    for lane, r, _step, committed, spec, paths, k_, v_ in snaps:
        seq, (full_k, full_v) = seqs[lane], full[lane]
        layers = ranges[r]
        lo, hi = layers.start, layers.stop
        assert committed <= len(seq)
        torch.testing.assert_close(k_[:, :, :committed], full_k[lo:hi, :, :committed], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_[:, :, :committed], full_v[lo:hi, :, :committed], atol=1e-4, rtol=1e-4)
        if r == stages - 1:
            assert not spec  # the last stage only ever computes verified tokens
        for j, x in enumerate(spec):
            path = seq[:committed] + paths[x]
            rk, rv = reference_kv(pair.target, path)
            torch.testing.assert_close(k_[:, :, committed + j], rk[lo:hi, :, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v_[:, :, committed + j], rv[lo:hi, :, -1], atol=1e-4, rtol=1e-4)
            checked_spec += 1
    assert {s[0] for s in snaps} == set(range(lanes))
    # with 2 stages a level is verified in the step after it enters: no speculative KV survives a step
    # (a whole tree waits on every stage before the last for its verdict)
    assert checked_spec > 20 if stages > 2 or tree_mode else checked_spec == 0


PIPE_SAMPLES = int(os.environ.get("SPECWOOD_PIPE_STAT_SAMPLES", 20_000))  # requests per sampling case
PIPE_LANES = 64  # requests in flight per batch (SpecPipe-DB): the in-process ranks step them together


def sampled_pipeline_counts(mode: str, n: int, seed0: int = 0) -> tuple[np.ndarray, np.ndarray, list]:
    """First two emitted tokens (V = 32) of `n` sampled requests on 2 in-process stages, and the
    target's exact joint law of the two."""
    target = make_tiny_model(vocab_size=32, seed=3, n_layers=2)
    draft = perturbed_copy(target, 0.5, seed=4)

    class Tok:  # OutputStream only decodes
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(65 + i % 26) for i in ids)

    params = SamplingParams(temperature=1.0, seed=None)
    prompt = [5, 9, 17]
    if mode == "specinfer":  # sampled children: the draft's distributions travel to the last stage
        # 3 tokens: the first tree (after the prompt pass) is cut to depth 1 by the token limit; the
        # second token is its verdict (an accepted child or the correction)
        jobs = [(specinfer_job(prompt, 3, {"name": "static", "branching": [2, 2]},
                               SamplingParams(temperature=1.0, seed=seed0 + s)), None) for s in range(n)]
    else:
        jobs = [(Job(prompt, 2, SamplingParams(temperature=1.0, seed=seed0 + s), "specpipe", 3, 2), None)
                for s in range(n)]
    results, _ = run_local(target, draft, Tok(), set(), jobs, 2, concurrent=PIPE_LANES, max_lanes=PIPE_LANES)
    counts = np.zeros((32, 32))
    for res in results:
        a, b = res.token_ids[:2]
        counts[a, b] += 1
    with torch.inference_mode():
        cache = target.new_cache(8)
        p1 = target_probs(prefill(target, cache, prompt), params)
        joint = torch.zeros(32, 32)
        for a in range(32):
            c2 = target.new_cache(8)
            joint[a] = p1[a] * target_probs(prefill(target, c2, prompt + [a]), params)
    return counts, joint.double().numpy(), results


@pytest.mark.slow_deadline
@pytest.mark.parametrize("mode", ["specpipe", "specinfer"])
def test_local_sampling_follows_ar_distribution(mode):
    """Engine-level G-test of the pipeline's sampling: the joint law of the first two emitted
    tokens against the target's exact one (with hits and misses / accepted and rejected children)."""
    t0 = time.perf_counter()
    counts, law, results = sampled_pipeline_counts(mode, PIPE_SAMPLES)
    p = g_test(counts, law)
    print(f"\n{mode}: p={p:.3g}, {PIPE_SAMPLES} requests in {time.perf_counter() - t0:.1f}s")
    if mode == "specinfer":
        assert 0 < sum(r.stats["accepted"] for r in results) < PIPE_SAMPLES
    else:
        assert sum(r.stats["hits"] for r in results) > 0 and sum(r.stats["misses"] for r in results) > 0
    assert p > 1e-4


@pytest.mark.slow_deadline
@pytest.mark.parametrize("mode", ["specpipe", "specinfer"])
def test_local_sampling_biased_verifier_is_caught(mode, monkeypatch):
    """The same test with a verifier that accepts drafted tokens 0.05 too often must fail hard."""
    import specwood.engine.specpipe.ranks as pipeline_mod
    from conftest import BiasedVerify

    biased = BiasedVerify(0.05)
    monkeypatch.setattr(pipeline_mod, "verify_trees", biased.trees)
    counts, law, _ = sampled_pipeline_counts(mode, PIPE_SAMPLES, seed0=10**6)
    p = g_test(counts, law)
    print(f"\nbiased {mode}: p={p:.3g}")
    assert biased.calls >= PIPE_SAMPLES // 2 and p < 1e-6


# ------------------------------------------------------------------------------ spawned ranks


@pytest.fixture(scope="module")
def executors(pair):
    made = {}

    def get(stages):
        if stages not in made:
            made[stages] = PipelineExecutor(pair, stages, width=4, topk=4, threads=1)
        return made[stages]

    yield get
    for ex in made.values():
        ex.close()


@pytest.mark.parametrize("stages", [2, 3])
def test_spawned_greedy_matches_ar(pair, executors, stages):
    ex = executors(stages)
    # the split weighs the draft's measured time on rank 0 (timed, so not fixed here): contiguous, all layers
    assert [x for r in ex.layers for x in r] == list(range(pair.target.config.n_layers))
    assert len(ex.layers) == stages and all(len(r) for r in ex.layers)
    hits = misses = accepted = 0
    for p in PROMPTS:
        ids = pair.encode(p, raw=True)
        ref = ar_ids(pair, ids, 40)
        res = ex.generate(ids, max_tokens=40)
        assert res.token_ids == ref
        hits, misses = hits + res.stats["hits"], misses + res.stats["misses"]
        assert len(res.stats["per_stage"]) == stages
        plain = ex.generate(ids, max_tokens=12, mode="pp")
        assert plain.token_ids == ref[:12] and plain.stats["pipeline_steps"] == 12 * stages
        si = ex.generate(ids, max_tokens=40, mode="specinfer")  # SpecInfer's static tree by default
        assert si.token_ids == ref and si.stats["pipeline_steps"] == stages * (si.stats["trees"] + 1)
        accepted += si.stats["accepted"]
    assert hits > 0 and misses > 0 and accepted > 0


def test_spawned_eos_inside_the_tree(pair):
    ids = pair.encode(PROMPTS[1], raw=True)
    ref = ar_ids(pair, ids, 40)
    eos = ref[10]
    engine = Engine(pair.target, pair.tokenizer, draft=pair.draft_model)
    engine.eos_token_ids = {eos}
    want = ar_ids(engine, ids, 40)
    assert want == ref[:ref.index(eos)]
    with PipelineExecutor(engine, 2, width=4, topk=4, threads=1) as ex:
        res = ex.generate(ids, max_tokens=40)
        si = ex.generate(ids, max_tokens=40, mode="specinfer", tree={"name": "chain", "budget": 6})
    assert res.token_ids == want and res.finish_reason == "stop"
    assert si.token_ids == want and si.finish_reason == "stop"


@pytest.mark.parametrize("stages", [2, 3])
def test_spawned_db_concurrent_requests_match_ar(pair, stages):
    """SpecPipe-DB on spawned ranks: five requests of different lengths (and modes), at most three
    in flight, so queued ones join as others leave; one ends at an EOS inside its tree."""
    ids = [pair.encode(p, raw=True) for p in DB_PROMPTS]
    eos = ar_ids(pair, ids[1], 40)[6]
    engine = Engine(pair.target, pair.tokenizer, draft=pair.draft_model)
    engine.eos_token_ids = {eos}
    modes = ["specpipe", "specpipe", "pp", "specpipe", "specinfer"]
    refs = [ar_ids(engine, x, n) for x, n in zip(ids, DB_LENGTHS)]
    texts = {}
    with PipelineExecutor(engine, stages, width=4, topk=4, threads=1, max_lanes=3) as ex:
        reqs = [{"prompt": x, "max_tokens": n, "mode": m, "on_text": lambda t, i=i: texts.setdefault(i, []).append(t)}
                for i, (x, n, m) in enumerate(zip(ids, DB_LENGTHS, modes))]
        results = ex.generate_many(reqs)
        # a request that joins while another is in flight
        first = ex.submit(ids[0], max_tokens=30)
        late = ex.submit(ids[2], max_tokens=12, width=2, topk=2)
        assert late.wait(30).token_ids == ar_ids(engine, ids[2], 12)
        assert first.wait(30).token_ids == refs[0][:30]
        long = ex.submit(ids[3], max_tokens=150)
        ex.cancel(long)  # (queued or just joined: a tiny request would end before a later cancel)
        cancelled = long.wait(30)
        assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 150
        assert ex.generate(ids[4], max_tokens=5).token_ids == refs[4][:5]  # the pipeline goes on
        procs = ex.procs
    assert all(p.exitcode == 0 for p in procs)
    for i, (res, ref, m) in enumerate(zip(results, refs, modes)):
        assert res.token_ids == ref and res.stats["method"] == m
        assert "".join(texts.get(i, [])) == res.text
    assert results[1].finish_reason == "stop" and len(results[1].token_ids) == 6
    spec = [r.stats for r, m in zip(results, modes) if m == "specpipe"]
    assert sum(s["hits"] for s in spec) > 0 and sum(s["misses"] for s in spec) > 0


def test_serve_on_the_pipeline(pair):
    """`serve --executor pipeline`: concurrent HTTP requests (more than the lanes, so some queue
    and join later; one streamed, one plain PP) each get their own `ar` output."""
    import httpx

    from specwood.serve.app import create_app
    from specwood.engine.scheduler import Scheduler, SchedulerConfig
    from test_server import ServerThread

    ex = PipelineExecutor(pair, 2, width=4, topk=4, threads=1, max_lanes=2)
    sched = Scheduler(ex, SchedulerConfig(max_batch=2, max_queue=8))
    app = create_app(pair, sched)
    srv = ServerThread(app).start()
    jobs = [(PROMPTS[0], None, 30), (PROMPTS[1], "pp", 12), (PROMPTS[2], "specpipe", 25), (DB_PROMPTS[3], None, 18)]
    out: dict[int, Any] = {}
    try:
        assert app.state.methods.default == "specpipe"

        def run(i, prompt, method, n):
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": i == 2,
                    **({"method": method} if method else {})}
            with httpx.Client(base_url=srv.url, timeout=50, trust_env=False) as c:
                r = c.post("/v1/completions", json=body)
                out[i] = (r.status_code, r.text if i == 2 else r.json())

        threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(55)
        with httpx.Client(base_url=srv.url, timeout=10, trust_env=False) as c:
            bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "method": "pld"})
            assert bad.status_code == 400 and "not method 'pld'" in bad.json()["error"]["message"]
    finally:
        srv.stop()
    assert all(p.exitcode is not None for p in ex.procs)  # the lifespan closed the pipeline
    for i, (prompt, method, n) in enumerate(jobs):
        status, body = out[i]
        ref = pair.generate(prompt, raw=True, max_tokens=n, method="ar")
        assert status == 200
        if i == 2:
            chunks = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref.text
        else:
            assert body["choices"][0]["text"] == ref.text
            assert body["specwood_stats"]["method"] == (method or "specpipe")


def test_specwood_serve_executor_pipeline_command(tiny_folder, tmp_path):
    """`specwood serve --executor pipeline` as a user runs it: ranks spawned, requests served,
    SIGTERM ends the server and every rank."""
    import httpx

    from test_server import serve_command

    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--executor", "pipeline", "--stages", "2", "--target",
           str(tiny_folder), "--draft", str(tiny_folder), "--dtype", "fp32", "--draft-dtype", "fp32", "--port", "0",
           "--max-batch", "2", "--width", "2"]
    with serve_command(cmd, tmp_path, start_timeout_s=50) as (url, _, proc):
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            stats = r.json()["specwood_stats"]
            assert stats["executor"] == "pipeline" and stats["method"] == "specpipe" and stats["width"] == 2
    deadline = time.monotonic() + 15  # ranks exit on the launcher's close (or die with it)
    while True:
        left = subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True, text=True).stdout.strip()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


def test_width_auto_is_the_planners_choice(pair, tmp_path, monkeypatch):
    """--width auto: w = argmin E(T) from measured t(w) and P(w), stored, reused, reported."""
    from specwood.planner.pipeline_sim import AUTO_WIDTHS, choose_width

    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path))
    first = choose_width(pair, 2, 4, threads=1, tokens=12)
    assert first["source"] == "measured" and first["width"] in AUTO_WIDTHS
    assert first["tbt_ms"][str(first["width"])] <= min(first["tbt_ms"].values()) + 0.01
    assert set(first["p"]) == {str(w) for w in AUTO_WIDTHS} and all(0 <= v <= 1 for v in first["p"].values())
    ids = pair.encode(PROMPTS[0], raw=True)
    with PipelineExecutor(pair, 2, width="auto", topk=4, threads=1) as ex:
        assert ex.width == first["width"] and ex.width_choice["source"] == "stored"
        res = ex.generate(ids, max_tokens=20)
    assert res.token_ids == ar_ids(pair, ids, 20)
    assert res.stats["width"] == first["width"] and res.stats["width_choice"]["width"] == first["width"]


def test_killed_rank_ends_every_rank(pair, capfd):
    ex = PipelineExecutor(pair, 3, width=4, topk=4, threads=1)
    victim = ex.procs[1]

    def kill():
        time.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(PipelineFailure, match=r"pipeline rank 1 \(pid \d+\) was killed by SIGKILL"):
        for _ in range(1000):
            ex.generate(PROMPTS[0], raw=True, max_tokens=200)
    assert all(p.exitcode not in (None, 0) for p in ex.procs)
    err = capfd.readouterr().err
    for r in (0, 2):
        assert f"specwood: error: pipeline rank {r}: pipeline rank 1 is gone" in err
    with pytest.raises(PipelineFailure, match="pipeline is down"):
        ex.generate(PROMPTS[0], raw=True, max_tokens=4)
    ex.close()


@pytest.mark.parametrize("kwargs,msg", [
    ({"stages": 4}, "more than the target's 3 layers"),
    ({"stages": 1}, "at least 2 stages"),
    ({"stages": 2, "width": 0}, "--width must be a positive integer"),
    ({"stages": 2, "topk": 0}, "--topk must be a positive integer"),
])
def test_bad_input_fails_before_spawning(pair, kwargs, msg):
    stages = kwargs.pop("stages")
    with pytest.raises(SpecwoodError, match=msg):
        PipelineExecutor(pair, stages, **kwargs)


def _run(cmd, env=None, timeout=60):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags,line", [
    (["--width", "0"], "--width must be a positive integer, got 0"),
    (["--topk", "0"], "--topk must be a positive integer, got 0"),
    (["--stages", "0"], "--stages must be a positive integer, got 0"),
    (["--pipeline-mode", "specinfer", "--method", "pld"],
     "--pipeline-mode specinfer drafts a tree shape (chain, static, sequoia, eagle, dyspec, dyspec-threshold), not "
     "method 'pld'"),
    (["--pipeline-mode", "specinfer", "--budget", "0"], "budget must be an integer in [1, 1024], got 0"),
])
def test_cli_bad_input_one_line(flags, line):
    out = _run([sys.executable, "-m", "specwood.cli", "generate", "hi", "--executor", "pipeline"] + flags)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"specwood: error: {line}"]


@pytest.mark.parametrize("flags,line", [
    (["--width", "0"], "--width must be a positive integer, got 0"),
    (["--pipeline-mode", "specinfer", "--method", "pld"],
     "--pipeline-mode specinfer drafts a tree shape (chain, static, sequoia, eagle, dyspec, dyspec-threshold), not "
     "method 'pld'"),
])
def test_cli_serve_bad_input_one_line(flags, line):
    out = _run([sys.executable, "-m", "specwood.cli", "serve", "--executor", "pipeline", "--port", "0"] + flags)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"specwood: error: {line}"]


def test_torchrun_stage_count_must_match_world_size():
    """Ranks as torchrun starts them (env://): --stages 3 with 2 launched ranks."""
    procs = [subprocess.Popen([sys.executable, "-m", "specwood.engine.specpipe.torchrun", "hi", "--stages", "3"],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert outs[0][1].strip().splitlines() == [
        "specwood: error: --stages 3 does not match the 2 launched ranks "
        "(torchrun --nproc-per-node 3, or drop --stages)"]
    assert outs[1][1].strip() == ""


def _torchrun_like(argv_per_rank: list[list[str]], timeout: float = 50) -> list[tuple[int, str]]:
    """Start one `python -m specwood.engine.specpipe.torchrun` per rank as torchrun would (env://); every
    rank's (exit code, stderr). A rank still running at `timeout` is killed (the test then fails)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(argv_per_rank)
    procs = [subprocess.Popen([sys.executable, "-m", "specwood.engine.specpipe.torchrun", *argv],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, argv in enumerate(argv_per_rank)]
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("flags,world,line", [
    (["--stages", "3"], 3, "--stages 3 is more than the target's 2 layers (use 2..2)"),
    (["--width", "0"], 2, "--width must be a positive integer, got 0"),
    (["--topk", "0"], 2, "--topk must be a positive integer, got 0"),
])
def test_torchrun_bad_input_one_line(tiny_folder, flags, world, line):
    """Bad input under torchrun: one line on rank 0, every rank exits non-zero, nothing hangs."""
    argv = ["hi", "--target", str(tiny_folder), "--mode", "pp", "--dtype", "fp32"] + flags
    outs = _torchrun_like([argv] * world)
    assert [rc for rc, _ in outs] == [2] * world
    assert outs[0][1].strip().splitlines() == [f"specwood: error: {line}"]
    assert all(err.strip() == "" for _, err in outs[1:])


def test_torchrun_ranks_with_different_models(tiny_folder, tmp_path):
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=128)
    other = save_hf_folder(tmp_path / "other", cfg, random_state_dict(cfg, seed=7))
    make_tiny_tokenizer().save_pretrained(other)
    common = ["hi", "--mode", "pp", "--dtype", "fp32", "--max-tokens", "4"]
    outs = _torchrun_like([common + ["--target", str(tiny_folder)], common + ["--target", str(other)]])
    assert [rc for rc, _ in outs] == [2, 2]
    lines = outs[0][1].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specwood: error: pipeline ranks disagree on the target: rank 0 "
                                                   "has") and "launch every rank with the same model" in lines[0]
    assert outs[1][1].strip() == ""


def test_torchrun_two_ranks_generate(tiny_folder):
    """The torchrun entry point itself: two ranks, one request, rank 0 prints it."""
    argv = ["hi", "--target", str(tiny_folder), "--mode", "pp", "--dtype", "fp32", "--max-tokens", "5", "--json"]
    outs = _torchrun_like([argv, argv])
    assert [rc for rc, _ in outs] == [0, 0], outs


# ------------------------------------------------------------------------------ Engine.generate / bench


def test_engine_generate_routes_to_the_pipeline(pair, executors):
    ex = executors(2)
    ids = pair.encode(PROMPTS[0], raw=True)
    ref = ar_ids(pair, ids, 24)
    for method, mode in (("specpipe", "specpipe"), ("ar", "pp"), ("specinfer", "specinfer"), ("chain", "specinfer")):
        res = pair.generate(ids, max_tokens=24, method=method, executor=ex, budget=4)
        assert res.token_ids == ref and res.stats["method"] == mode and res.stats["executor"] == "pipeline"
    assert pair.generate(ids, max_tokens=24, method="chain", executor=ex, budget=4).stats["tree"] == \
        {"name": "chain", "budget": 4}
    with pytest.raises(SpecwoodError, match="not method 'pld'"):
        pair.generate(ids, max_tokens=4, method="pld", executor=ex)
    # a string starts a pipeline for the call
    res = pair.generate(ids, max_tokens=24, method="specpipe", executor="pipeline", stages=3, width=2, threads=1)
    assert res.token_ids == ref and res.stats["stages"] == 3 and res.stats["width"] == 2


def test_bench_runs_the_pipeline_methods(tiny_folder, tmp_path):
    import json

    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps({"id": f"p{i}", "category": "raw", "prompt": p})
                            for i, p in enumerate(PROMPTS[:2])))
    p = _run([sys.executable, "-m", "specwood.cli", "bench", "--workload", str(wl), "--methods",
              "ar,specpipe@pipeline,pp@pipeline,specinfer@pipeline", "--target", str(tiny_folder), "--draft",
              str(tiny_folder), "--dtype", "fp32", "--draft-dtype", "fp32", "--max-tokens", "12", "--width", "2",
              "--out", str(tmp_path / "out"), "--no-progress"], env={"SPECWOOD_CACHE": str(tmp_path)}, timeout=110)
    assert p.returncode == 0, p.stderr
    by = {(r["id"], r["method"]): r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    for i in range(2):
        ar = by[f"p{i}", "ar"]["token_ids"]
        for m in ("specpipe@pipeline", "pp@pipeline", "specinfer@pipeline"):
            assert by[f"p{i}", m]["token_ids"] == ar and by[f"p{i}", m]["engine_stats"]["executor"] == "pipeline"
    assert by["p0", "specpipe@pipeline"]["engine_stats"]["width"] == 2


def _listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses of every listening TCP socket (IPv4 and IPv6) the processes hold."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                address = cols[1].split(":")[0]
                found.append(address)
    return found


def test_ranks_listen_on_loopback_only(pair):
    """Nothing of a single-machine pipeline listens beyond loopback: the rendezvous store is a file
    in a private directory and gloo is bound to the loopback interface."""
    with PipelineExecutor(pair, 2, width=4, topk=4, threads=1) as ex:
        ids = pair.encode(PROMPTS[0], raw=True)
        assert ex.generate(ids, max_tokens=8).token_ids == ar_ids(pair, ids, 8)
        store_dir = ex._store_dir
        assert os.stat(store_dir).st_mode & 0o077 == 0  # this user's alone
        addresses = _listening_addresses([os.getpid(), *ex.pids])
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert addresses and set(addresses) <= loopback, addresses
    assert not os.path.exists(store_dir)


def test_a_dead_rank_turns_health_503_and_ends_the_server(pair, tiny_folder, tmp_path):
    """A rank killed under a running server: /health answers 503 naming it (in-process app), and
    `specwood serve --executor pipeline` exits non-zero with one line, leaving no rank behind."""
    import re

    import httpx

    from specwood.engine.scheduler import Scheduler, SchedulerConfig
    from specwood.serve.app import create_app
    from test_server import ServerThread, _alive

    ex = PipelineExecutor(pair, 2, width=4, topk=4, threads=1, max_lanes=2)
    srv = ServerThread(create_app(pair, Scheduler(ex, SchedulerConfig(max_batch=2, max_queue=8)))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as c:
            assert c.get("/health").status_code == 200
            os.kill(ex.procs[1].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (r := c.get("/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert r.status_code == 503 and "pipeline rank 1" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()

    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--executor", "pipeline", "--stages", "2", "--target",
           str(tiny_folder), "--draft", "none", "--pipeline-mode", "pp", "--dtype", "fp32", "--port", "0",
           "--max-batch", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, SPECWOOD_CACHE=str(tmp_path)))
    try:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 50
        while not any("listening on" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.05)
        ranks = subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "spawn_main"], capture_output=True,
                               text=True).stdout.split()  # the spawned ranks (not the resource tracker)
        ranks = [int(p) for p in ranks]
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 2
        time.sleep(0.5)
        out = "".join(lines)
        errors = [ln for ln in out.splitlines() if ln.startswith("specwood: error:")]
        assert "Traceback" not in out and any(re.search(r"executor went down .*start it again", e) for e in errors), out
        session = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        left = [int(p) for p in session if _alive(int(p))]  # (zombies await a reaper; they hold nothing)
        assert not left, f"processes left behind: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
