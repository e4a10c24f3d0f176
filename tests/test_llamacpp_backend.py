"""The llama.cpp backend inside the engine (specwood/engine/backends.py, engine/runner.py,
drafting/llamacpp_source.py): every method on a llama.cpp target and/or draft emits exactly that
backend's own `ar` output; the CLI and bench wiring; bad input as one line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specwood.engine.api import Engine
from specwood.models.testing import byte_level_tokens, write_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread", "llama_cpp_required")
VOCAB = 264
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
TREE_METHODS = ["chain", "static", "sequoia", "eagle", "dyspec", "dyspec-threshold", "pld", "duo", "auto"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory, tiny_pair: Any) -> SimpleNamespace:
    """The tiny torch pair (a target and a perturbed draft that agrees often) as F32 GGUF files."""
    d = tmp_path_factory.mktemp("llamacpp-backend")
    tokens = byte_level_tokens(VOCAB)
    return SimpleNamespace(
        target=write_gguf(d / "target.gguf", tiny_pair.target.config, tiny_pair.target.canonical_state_dict(),
                          "F32", tokens=tokens),
        draft=write_gguf(d / "draft.gguf", tiny_pair.draft.config, tiny_pair.draft.canonical_state_dict(),
                         "F32", tokens=tokens),
    )


def _engine(target: Any, draft: Any, tokenizer: Any) -> Engine:
    e = Engine(target, tokenizer, draft=draft, target_name="tiny", draft_name="tiny-draft")
    e.eos_token_ids = set()  # long outputs: the tiny model would end most of them at once
    return e


@pytest.fixture(scope="module")
def lc_models(ggufs: SimpleNamespace) -> SimpleNamespace:
    from specwood.engine.backends import LlamaCppDraft, LlamaCppTarget

    return SimpleNamespace(target=LlamaCppTarget(ggufs.target, 256), draft=LlamaCppDraft(ggufs.draft, 256))


@pytest.mark.parametrize("pair", ["llama.cpp+llama.cpp", "llama.cpp+torch", "torch+llama.cpp"])
def test_every_method_equals_the_backends_ar(pair: str, lc_models: SimpleNamespace, tiny_pair: Any,
                                             tiny_tokenizer: Any) -> None:
    target = lc_models.target if pair.startswith("llama.cpp") else tiny_pair.target
    draft = lc_models.draft if pair.endswith("llama.cpp") else tiny_pair.draft
    engine = _engine(target, draft, tiny_tokenizer)
    ar = engine.generate(PROMPT, max_tokens=40, method="ar").token_ids
    assert len(ar) == 40
    accepted = 0.0
    for method in TREE_METHODS:
        res = engine.generate(PROMPT, max_tokens=40, method=method, **({"progress": False} if method == "auto" else {}))
        assert res.token_ids == ar, method
        accepted = max(accepted, res.stats.get("mean_accepted_tokens") or 0.0)
    assert accepted > 2.0  # the drafts were accepted, so trees were committed, not just roots


def test_llama_cpp_ar_equals_torch_ar(lc_models: SimpleNamespace, tiny_pair: Any, tiny_tokenizer: Any) -> None:
    """F32 weights: both runtimes decode the same tokens (rounding apart)."""
    ours = _engine(tiny_pair.target, None, tiny_tokenizer).generate(PROMPT, max_tokens=30).token_ids
    theirs = _engine(lc_models.target, None, tiny_tokenizer).generate(PROMPT, max_tokens=30).token_ids
    assert ours == theirs


def test_self_draft_accepts_deep_trees(ggufs: SimpleNamespace, lc_models: SimpleNamespace, tiny_tokenizer: Any) -> None:
    """The target as its own draft: every drafted token is right, so long paths are committed
    through both runners' commit (llama.cpp seq_keep/seq_cp) again and again."""
    from specwood.engine.backends import LlamaCppDraft

    engine = _engine(lc_models.target, LlamaCppDraft(ggufs.target, 256), tiny_tokenizer)
    ar = engine.generate(PROMPT, max_tokens=60, method="ar").token_ids
    for method, options in (("chain", {"budget": 6}), ("eagle", {}), ("duo", {})):
        res = engine.generate(PROMPT, max_tokens=60, method=method, **options)
        assert res.token_ids == ar, method
        assert res.stats["mean_accepted_tokens"] > 3.0, method


def test_runner_scheduler_on_torch_equals_the_batched_scheduler(tiny_pair: Any, tiny_tokenizer: Any) -> None:
    """The ModelRunner seam is backend-neutral: the same requests through TorchRunner."""
    from specwood.engine.runner import RunnerExecutor, TorchRunner
    from specwood.engine.scheduler import Scheduler, SchedulerConfig

    engine = _engine(tiny_pair.target, tiny_pair.draft, tiny_tokenizer)
    serial = Scheduler(RunnerExecutor(TorchRunner(tiny_pair.target, 256)), SchedulerConfig(max_batch=1))
    for method in ("ar", "dyspec", "eagle"):
        ref = engine.generate(PROMPT, max_tokens=30, method=method)
        req = engine.new_request(PROMPT, max_tokens=30, method=method, scheduler=serial)
        other = engine.new_request(PROMPT[:5], max_tokens=10, method=method, scheduler=serial)
        serial.submit(req)
        serial.submit(other)  # waits for the first: one sequence at a time
        serial.run_until_done([req, other])
        assert req.result.token_ids == ref.token_ids, method
        assert other.result.token_ids == engine.generate(PROMPT[:5], max_tokens=10, method=method).token_ids


def test_sampling_on_llama_cpp_matches_the_target_law(lc_models: SimpleNamespace, tiny_tokenizer: Any) -> None:
    """A statistical sanity check: with chain SD sampling at T=0.5 the second token (the first one a
    verification step emits) follows the target's own distribution given the first (G-test)."""
    import numpy as np
    from conftest import g_test

    from specwood.sampling import SamplingParams, target_probs

    engine = _engine(lc_models.target, lc_models.draft, tiny_tokenizer)
    pairs = [engine.generate(PROMPT, max_tokens=2, method="chain", temperature=0.5, seed=seed, budget=3).token_ids
             for seed in range(400)]
    first = max(set(p[0] for p in pairs), key=lambda t: sum(p[0] == t for p in pairs))
    counts = np.bincount([p[1] for p in pairs if p[0] == first], minlength=VOCAB)
    assert counts.sum() >= 50
    runner = lc_models.target.runner
    runner.reset()
    runner.prefill(PROMPT)
    law = target_probs(runner.decode_one(first), SamplingParams(temperature=0.5)).double().numpy()
    assert g_test(counts, law) > 1e-3


# ------------------------------------------------------------------------------------------- CLI


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from specwood.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip()


def test_cli_generate_on_llama_cpp(ggufs: SimpleNamespace, tiny_folder: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer of the tiny HF folder goes with the GGUF weights (same ids)."""
    import specwood.models.loader as loader

    tok = loader.load_tokenizer(tiny_folder)
    monkeypatch.setattr(loader, "load_tokenizer", lambda name: tok)
    outs = {}
    for method, backends in (("ar", ["--backend", "llama.cpp"]),
                             ("dyspec", ["--backend", "llama.cpp", "--draft-backend", "llama.cpp"]),
                             ("chain", ["--backend", "auto", "--draft-backend", "torch"])):
        rc, out, err = _run_cli(["generate", "hi", "--raw", "--json", "--max-tokens", "12", "--method", method,
                                 "--target", str(ggufs.target), "--draft", str(ggufs.draft), *backends], capsys)
        assert rc == 0, err
        outs[method] = json.loads(out)
    assert outs["dyspec"]["token_ids"] == outs["ar"]["token_ids"] == outs["chain"]["token_ids"]


@pytest.mark.parametrize("argv, says", [
    (["--backend", "llama.cpp", "--dtype", "int8"], "--dtype int8 applies to the torch backend"),
    (["--draft-backend", "llama.cpp", "--draft-dtype", "int4"], "--draft-dtype int4 applies to the torch backend"),
    (["--backend", "llama.cpp", "--executor", "parallel", "--method", "duo"], "parallel executor runs torch models"),
    (["--backend", "llama.cpp", "--device", "cuda"], None),  # cuda: refused (no CUDA here, or llama.cpp is CPU)
])
def test_cli_refuses_unsupported_combinations(argv: list[str], says: str | None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run_cli(["generate", "hi", "--max-tokens", "2", *argv], capsys)
    assert rc == 2 and err.startswith("specwood: error: ") and "\n" not in err
    if says:
        assert says in err


def test_cli_hf_folder_on_llama_cpp_is_one_line(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run_cli(["generate", "hi", "--target", str(tiny_folder), "--draft", "none", "--backend", "llama.cpp"],
                          capsys)
    assert rc == 2 and "not Hugging Face folders" in err and "\n" not in err


def test_cli_without_the_extra_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for cmd in (["generate", "hi", "--backend", "llama.cpp"], ["serve", "--draft-backend", "llama.cpp"]):
        rc, _, err = _run_cli(cmd, capsys)
        assert rc == 2 and "pip install 'specwood[llamacpp]'" in err and "\n" not in err
    from specwood.engine.backends import resolve_backend

    assert resolve_backend("auto", "qwen2.5-coder-1.5b-instruct") == "torch"  # auto falls back quietly


def test_bench_rows_per_backend(ggufs: SimpleNamespace, tiny_pair: Any, tiny_tokenizer: Any, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """'NAME@llama.cpp' rows run on a llama.cpp engine beside the torch rows and the llama.cpp
    baseline; each is checked against its own backend's ar."""
    import specwood.engine.api as engine_api
    from specwood.bench.harness import run_bench
    from specwood.bench.workload import Prompt
    from specwood.engine.backends import LlamaCppDraft, LlamaCppTarget

    def fake_load(target: Any, draft: Any, *, backend: str, draft_backend: str, **kw: Any) -> Engine:
        assert backend == draft_backend == "llama.cpp"
        return Engine(LlamaCppTarget(target, 256), tiny_tokenizer, draft=LlamaCppDraft(draft, 256),
                      target_name=str(target), draft_name=str(draft))

    monkeypatch.setattr(engine_api, "load", fake_load)  # what the harness loads a backend's engine with
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.draft, target_name=str(ggufs.target),
                    draft_name=str(ggufs.draft))
    prompts = [Prompt("code-1", "code", prompt="def add(a, b):\n    return"),
               Prompt("chat-1", "chat", messages=({"role": "user", "content": "Say hello."},))]
    recs = run_bench(engine, prompts, "ar,dyspec,llama.cpp,ar@llama.cpp,dyspec@llama.cpp,chain@llama.cpp",
                     tmp_path / "out", max_tokens=10, progress=False)
    assert not [r for r in recs if r.get("error")]
    for r in recs:
        if r["method"] in ("dyspec", "dyspec@llama.cpp", "chain@llama.cpp", "llama.cpp"):
            assert r["matches_ar"] is True, r["method"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "dyspec@llama.cpp" in report and "vs llama.cpp" in report
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["backend"] == "torch"


def test_bench_refuses_bad_backend_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from specwood.bench.cli import add_bench_parser, run_bench_cli

    parser = argparse.ArgumentParser(prog="specwood")
    add_bench_parser(parser.add_subparsers(dest="command"))
    for methods, extra, says in (("ar,duo@parallel@llama.cpp", [], "parallel executor runs torch models"),
                                 ("ar,hf", ["--backend", "llama.cpp"], "Hugging Face baselines")):
        args = parser.parse_args(["bench", "--methods", methods, "--out", str(tmp_path), "--no-progress", *extra])
        assert run_bench_cli(args) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err


# -------------------------------------------------------------------------------- the real pair


def test_real_pair_on_llama_cpp_is_lossless() -> None:
    """The shipped Q4_K_M pair, target and draft on llama.cpp, the target in exact mode (its batch
    kernels round as its one-row kernel; see specwood.models.llamacpp): every method's greedy
    output equals ar's, token for token."""
    import specwood
    from specwood.engine.backends import LlamaCppTarget

    engine = specwood.load(backend="llama.cpp", draft_backend="llama.cpp", max_context=1024, draft="auto")
    engine.target.runner.close()
    engine.target = LlamaCppTarget("qwen2.5-coder-1.5b-instruct", 1024, exact=True)
    engine._scheduler = None
    for prompt in ("Explain what a hash map is in two sentences.", "def fibonacci(n):"):
        ar = engine.generate(prompt, max_tokens=24, method="ar").token_ids
        for method in ("chain", "dyspec", "duo", "pld"):
            assert engine.generate(prompt, max_tokens=24, method=method).token_ids == ar, (prompt, method)


def test_auto_on_a_llama_cpp_target_times_the_runner(lc_models: SimpleNamespace, tiny_pair: Any,
                                                     tiny_tokenizer: Any) -> None:
    """auto's starter plan on llama.cpp comes from T_v(x) timed on the runner and T_d(x) of the
    real drafting, not from the analytic model of the torch runtime."""
    from specwood.planner.starter import RUNNER_XS, runner_starter_plan

    engine = _engine(lc_models.target, lc_models.draft, tiny_tokenizer)
    runner = lc_models.target.runner
    runner.reset()
    runner.prefill(PROMPT)
    plan = runner_starter_plan(engine, "dyspec")
    (ctx,) = plan.contexts
    assert sorted(plan.verify_times[ctx]) == list(RUNNER_XS) and all(t > 0 for t in plan.verify_times[ctx].values())
    assert plan.draft_times[ctx][1] == 0.0 and plan.draft_times[ctx][8] > 0
    assert "llama.cpp" in plan.key.dtype and plan.source == "starter"
    assert runner.n_past == len(PROMPT)  # timed on a context of its own: a running request keeps its KV
