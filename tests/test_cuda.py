"""The CUDA paths: every method on a CUDA target and draft (greedy, fp32) emits what `ar` on the
same GPU emits, mixed in one continuous batch; sampling on the GPU follows the target's law (a
G-test) and a biased verifier fails the same test. Runs where a CUDA GPU is present (the CPU-only
CI skips this file; the GPU runs are recorded in BENCHMARKS.md)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

import specwood  # noqa: F401 - registers the planner's methods (auto, prior)
import specwood.engine.step as step_mod
from specwood.engine.api import Engine
from specwood.engine.scheduler import SchedulerConfig
from specwood.methods import method_names
from specwood.sampling import SamplingParams

import test_engine_statistics as stats_mod
from conftest import BiasedVerify, g_test, make_tiny_tokenizer
from test_batching import TINY_OPTIONS, Job, assert_like_ar, assert_pools_free, random_prompt, run_jobs, store_auto_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="runs where a CUDA GPU is present")
CUDA_SAMPLES = 20_000  # per run: each GPU step costs its kernel launches, however small the batch


def on_cuda(model):
    return copy.deepcopy(model).to("cuda")


@pytest.fixture()
def cuda_engine(tiny_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
    return Engine(on_cuda(tiny_pair.target), make_tiny_tokenizer(), draft=on_cuda(tiny_pair.draft),
                  target_name="tiny", draft_name="tiny-draft", head=on_cuda(tiny_pair.head))


def test_every_method_in_one_cuda_batch_equals_ar(cuda_engine):
    engine = cuda_engine
    assert engine.device.type == "cuda"
    store_auto_plan(engine)
    names = method_names()
    assert set(TINY_OPTIONS) == set(names)
    rnd = random.Random(7)
    jobs = [Job(m, random_prompt(rnd, rnd.randint(2, 60)), max_tokens=rnd.randint(8, 32),
                start_step=0 if i < 5 else 2 * i) for i, m in enumerate(names + names[::-1])]
    sched = engine.make_scheduler(SchedulerConfig(max_batch=6, prefill_chunk_tokens=16), drafts=())
    assert sched.executor.cache.k.device.type == "cuda"
    run_jobs(engine, sched, jobs)
    assert_like_ar(engine, jobs)
    spec = [j for j in jobs if j.method not in ("ar", "pld")]
    assert all(j.request.result.stats.get("spec_steps", 0) > 0 for j in spec), "a method did not speculate"
    assert_pools_free(sched)


def test_single_request_generate_on_cuda(cuda_engine):
    """Engine.generate (a batch of one) on the GPU: speculative greedy output equals ar's."""
    prompt = "def fib(n):"
    ref = cuda_engine.generate(prompt, max_tokens=24, raw=True)
    for method, options in (("dyspec", {"budget": 6}), ("eagle", {"budget": 8, "depth": 3, "topk": 3})):
        out = cuda_engine.generate(prompt, max_tokens=24, raw=True, method=method, **options)
        assert out.token_ids == ref.token_ids, method


@pytest.fixture(scope="module")
def cuda_stat_engines():
    """The statistics module's tiny 32-token pair, on the CPU (for the exact law) and on the GPU."""
    cpu = stats_mod.make_stat_engine()
    gpu = Engine(on_cuda(cpu.target), make_tiny_tokenizer(), draft=on_cuda(cpu.draft_model), target_name="tiny32",
                 draft_name="tiny32-draft")
    gpu.eos_token_ids = set(cpu.eos_token_ids)
    return cpu, gpu


@pytest.mark.parametrize("method", ["dyspec"])
def test_cuda_sampling_follows_the_target_law(cuda_stat_engines, method):
    cpu, gpu = cuda_stat_engines
    params = SamplingParams(temperature=1.0)
    law = stats_mod.exact_law(cpu, params)
    counts, spec_steps, accepted = stats_mod.run_requests(gpu, method, params, CUDA_SAMPLES, stream=77)
    p = g_test(counts, law)
    print(f"\ncuda {method}: p(first, second)={p:.3g} | {CUDA_SAMPLES} requests, {spec_steps} spec steps")
    assert accepted > spec_steps // 3
    assert p > stats_mod.P_MIN

    biased = BiasedVerify(stats_mod.BIAS)
    mp = pytest.MonkeyPatch()
    mp.setattr(step_mod, "verify_trees", biased.trees)
    try:
        counts, _, _ = stats_mod.run_requests(gpu, method, params, CUDA_SAMPLES, stream=78)
    finally:
        mp.undo()
    p_biased = g_test(counts, law)
    print(f"cuda biased {method}: p={p_biased:.3g}")
    assert biased.calls >= CUDA_SAMPLES // 2 and p_biased < stats_mod.P_BIASED


def test_cuda_graphs_replay_and_match_eager(cuda_engine):
    """Decode steps replay CUDA graphs (target and draft pools), with the eager scheduler's output."""
    engine = cuda_engine
    outputs = {}
    for graphs in (False, True):
        jobs = [Job(m, random_prompt(rnd := random.Random(11 + i), rnd.randint(2, 40)), max_tokens=20)
                for i, m in enumerate(["ar", "dyspec", "chain", "eagle", "ar", "dyspec"])]
        sched = engine.make_scheduler(SchedulerConfig(max_batch=4, prefill_chunk_tokens=16, cuda_graphs=graphs),
                                      drafts=())
        run_jobs(engine, sched, jobs)
        outputs[graphs] = [j.request.result.token_ids for j in jobs]
        if graphs:
            assert sched.executor.cache.graphs.replays > 0
            assert all(pool.graphs.replays > 0 for _, pool in sched.executor._draft_pools.values())
        else:
            assert getattr(sched.executor.cache, "graphs", None) is None
    assert outputs[True] == outputs[False]


def test_pipeline_stages_on_cuda_match_ar(cuda_engine):
    """SpecPipe with its stage ranks on the GPU (two ranks on one GPU talk over gloo through host
    memory; one GPU per rank would use NCCL), several requests in flight."""
    from specwood.engine.specpipe.launch import PipelineExecutor

    prompts = [[40 + i, 50, 60 + i, 70] * (2 + i) for i in range(3)]
    want = [cuda_engine.generate(p, max_tokens=20).token_ids for p in prompts]
    with PipelineExecutor(cuda_engine, 2, width=4, topk=4, threads=1, max_lanes=3) as ex:
        got = [r.token_ids for r in ex.generate_many(prompts, max_tokens=20)]
        single = ex.generate(prompts[0], max_tokens=20).token_ids
    assert got == want and single == want[0]


def test_constrained_and_suffix_methods_on_cuda_equal_ar(cuda_engine):
    """Grammar masks, penalties and bias (specwood.constrain) on CUDA logits, and the suffix drafts:
    every method's greedy output equals `ar`'s on the same GPU."""
    from test_constrain import GRAMMARS, SHAPING

    store_auto_plan(cuda_engine)
    prompt = "def add(a, b):"
    for extra in ({"grammar": GRAMMARS["json"]}, {"grammar": GRAMMARS["forced"]}, SHAPING[0], SHAPING[1]):
        ref = cuda_engine.generate(prompt, max_tokens=40, raw=True, **extra)
        for method in ("chain", "dyspec", "eagle", "pld", "suffix", "auto"):
            out = cuda_engine.generate(prompt, max_tokens=40, raw=True, method=method, **extra)
            assert out.token_ids == ref.token_ids, (method, sorted(extra))
    ref = cuda_engine.generate("1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=32, raw=True)
    for _ in range(2):  # the second run drafts from the first's answer in the global suffix cache
        out = cuda_engine.generate("1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=32, raw=True, method="suffix")
        assert out.token_ids == ref.token_ids
