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
import threading
import time

import numpy as np
import pytest
import torch

from specwood.engine.api import Engine
from specwood.engine.pipeline import Job, stage_ranges, tree_nodes
from specwood.engine.pipeline_launch import PipelineExecutor, PipelineFailure
from specwood.errors import SpecwoodError
from specwood.models.prefill import prefill
from specwood.sampling import SamplingParams, target_probs

from conftest import g_test, make_tiny_model, make_tiny_tokenizer, perturbed_copy
from pipeline_local import run_local

PROMPTS = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 5, 1, 2, 3,"]
DEADLINE_S = 60


@pytest.fixture(autouse=True)
def deadline(request):
    def expired(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past its deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(DEADLINE_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair():
    target = make_tiny_model(seed=0, n_layers=3)
    draft = perturbed_copy(target, 0.3, seed=1)
    tok = make_tiny_tokenizer()
    return Engine(target, tok, draft=draft, target_name="tiny", draft_name="tiny-draft")


def ar_ids(engine: Engine, prompt_ids: list[int], n: int) -> list[int]:
    return engine.generate(prompt_ids, max_tokens=n, method="ar").token_ids


def jobs_for(engine: Engine, mode: str, w: int, k: int, n: int = 40) -> list[tuple[Job, None]]:
    return [(Job(engine.encode(p, raw=True), n, SamplingParams(), mode, w, k), None) for p in PROMPTS]


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


SPECINFER_TREES = [{"name": "static"}, {"name": "chain", "budget": 4}, {"name": "dyspec", "budget": 8}]


def specinfer_job(prompt: list[int], n: int, tree: dict, params: SamplingParams | None = None) -> Job:
    return Job(prompt, n, params or SamplingParams(), "specinfer", tree=tree, tree_nodes=tree_nodes(tree))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("tree", SPECINFER_TREES, ids=lambda t: t["name"])
def test_local_specinfer_greedy_matches_ar(pair, stages, tree):
    """PP + SpecInfer: a whole tree per full pass (m steps), verified at the last stage."""
    jobs = [(specinfer_job(pair.encode(p, raw=True), 40, tree), None) for p in PROMPTS]
    results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages)
    for (job, _), res in zip(jobs, results):
        assert res.token_ids == ar_ids(pair, job.prompt, job.max_tokens)
        s = res.stats
        # the prompt pass, then m steps per tree; each tree emits its accepted path and one more token
        assert s["pipeline_steps"] == stages * (s["trees"] + 1)
        assert s["new_tokens"] <= 1 + s["trees"] + s["accepted"]
        assert s["hits"] == s["misses"] == 0
    assert sum(r.stats["accepted"] for r in results) > 0


def test_specinfer_with_the_target_as_draft_accepts_whole_chains(pair):
    tree = {"name": "chain", "budget": 5}
    jobs = [(specinfer_job(pair.encode(PROMPTS[0], raw=True), 37, tree), None)]
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


@pytest.mark.parametrize("stages,w,k", [(2, 4, 3), (3, 6, 2), (4, 3, 3), (2, 0, 0), (3, 0, 0)])
def test_pruning_keeps_each_stage_cache_exact(pair, stages, w, k):
    """After every step, stage r's cache = (verified prefix + its surviving nodes' paths) run plainly.
    w = 0: PP + SpecInfer (the whole tree in flight; its accepted path kept on every stage)."""
    tree_mode = w == 0
    if stages > pair.target.config.n_layers:
        deep = make_tiny_model(seed=0, n_layers=5)
        pair = Engine(deep, pair.tokenizer, draft=perturbed_copy(deep, 0.3, seed=1))
    snaps = []
    lock = threading.Lock()
    ranges = stage_ranges(pair.target.config, stages)

    def on_step(rank, step):
        kv, m = rank.kv, rank.mirror
        n = kv.committed + len(kv.spec)
        if tree_mode:  # a tree's nodes sit below its root, which is in the stage's spec part too
            paths = {x: [m.token[a] for a in m.path(x)] for x in kv.spec}
        else:
            paths = {x: [m.token[a] for a in reversed(m.ancestors(x))] + [m.token[x]] for x in kv.spec}
        with lock:
            snaps.append((rank.rank, step, kv.committed, list(kv.spec), paths,
                          kv.cache.k[:, 0, :, :n].clone(), kv.cache.v[:, 0, :, :n].clone()))

    prompt = pair.encode(PROMPTS[0], raw=True)
    jobs = [(specinfer_job(prompt, 24, {"name": "static"}) if tree_mode else
             Job(prompt, 24, SamplingParams(), "specpipe", w, k), None)]
    results, _ = run_local(pair.target, pair.draft_model, pair.tokenizer, pair.eos_token_ids, jobs, stages,
                           on_step=on_step)
    seq = prompt + results[0].token_ids
    full_k, full_v = reference_kv(pair.target, seq)
    checked_spec = 0
    for r, step, committed, spec, paths, k_, v_ in snaps:
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
    # with 2 stages a level is verified in the step after it enters: no speculative KV survives a step
    # (a whole tree waits on every stage before the last for its verdict)
    assert checked_spec > 20 if stages > 2 or tree_mode else checked_spec == 0


@pytest.mark.parametrize("mode", ["specpipe", "specinfer"])
def test_local_sampling_follows_ar_distribution(mode):
    """First two emitted tokens (V = 32): counts against the exact joint of the target."""
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
                               SamplingParams(temperature=1.0, seed=s)), None) for s in range(1500)]
    else:
        jobs = [(Job(prompt, 2, SamplingParams(temperature=1.0, seed=s), "specpipe", 3, 2), None) for s in range(1500)]
    results, _ = run_local(target, draft, Tok(), set(), jobs, 2)
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
    if mode == "specinfer":
        assert 0 < sum(r.stats["accepted"] for r in results) < 1500
    else:
        assert sum(r.stats["hits"] for r in results) > 0 and sum(r.stats["misses"] for r in results) > 0
    assert g_test(counts, joint.double().numpy()) > 1e-3


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


def test_killed_rank_ends_every_rank(pair, capfd):
    ex = PipelineExecutor(pair, 3, width=4, topk=4, threads=1)
    victim = ex.procs[1]

    def kill():
        time.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(PipelineFailure, match=r"pipeline rank 1 \(pid \d+\) was killed by SIGKILL"):
        for _ in range(1000):
            ex.generate(PROMPTS[0], raw=True, max_tokens=200)
    assert time.monotonic() - t0 < 30
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
    (["--pipeline-mode", "specinfer", "--method", "pld"],
     "--pipeline-mode specinfer drafts a tree shape (chain, static, sequoia, eagle, dyspec, dyspec-threshold), not "
     "method 'pld'"),
    (["--pipeline-mode", "specinfer", "--budget", "0"], "budget must be an integer in [1, 1024], got 0"),
])
def test_cli_bad_input_one_line(flags, line):
    out = _run([sys.executable, "-m", "specwood.cli", "generate", "hi", "--executor", "pipeline"] + flags)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"specwood: error: {line}"]


def test_torchrun_stage_count_must_match_world_size():
    """Ranks as torchrun starts them (env://): --stages 3 with 2 launched ranks."""
    procs = [subprocess.Popen([sys.executable, "-m", "specwood.engine.pipeline", "hi", "--stages", "3"],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert outs[0][1].strip().splitlines() == [
        "specwood: error: --stages 3 does not match the 2 launched ranks (torchrun --nproc-per-node 3, or drop --stages)"]
    assert outs[1][1].strip() == ""


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
