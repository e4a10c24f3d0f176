"""The planner's choice of runtime configuration (backend x weight mode of target and draft):
`specwood plan --choose-config` times each candidate and stores the fastest; `--backend auto`
loads it. Real tiny models on disk, real timing, a real CLI process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specwood
from specwood.engine.backends import RuntimeConfig, resolve_runtime
from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder
from specwood.planner.configs import (
    ConfigChoice,
    ConfigScore,
    choice_path,
    choose_config,
    format_choice,
    load_config_choice,
)
from specwood.planner.store import device_id, load_plan, plan_key_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CANDIDATES = [RuntimeConfig(dtype="fp32"), RuntimeConfig(dtype="int8")]


@pytest.fixture(scope="module")
def tiny_pair_folders(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("configs")
    cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=256)
    target = save_hf_folder(root / "target", cfg, random_state_dict(cfg, seed=1))
    draft = save_hf_folder(root / "draft", cfg, random_state_dict(cfg, seed=2))
    for folder in (target, draft):
        tiny_tokenizer.save_pretrained(folder)
    return str(target), str(draft)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_every_candidate_is_timed_and_the_fastest_is_stored(tiny_pair_folders, cache):
    target, draft = tiny_pair_folders
    choice = choose_config(target, draft, "dyspec", candidates=CANDIDATES, contexts=(32, 96), repeats=1,
                           progress=False)
    assert [s.config for s in choice.scores] == CANDIDATES
    for s in choice.scores:
        assert not s.error
        assert sorted(s.ar_tok_s) == sorted(s.best_tok_s) == [32, 96]
        # the best of plain and speculative decoding is never below plain decoding
        assert all(s.best_tok_s[c] >= s.ar_tok_s[c] > 0 for c in s.ar_tok_s)
        assert all(s.choice[c] == "ar" or s.choice[c].startswith("dyspec x") for c in s.choice)
    assert choice.best.score == max(s.score for s in choice.scores)
    stored = load_config_choice(target, draft)
    assert stored is not None and stored.to_dict() == choice.to_dict()
    assert "(chosen)" in format_choice(choice)
    # each configuration's timings became that configuration's plan, so `--method auto` starts from them
    for config in CANDIDATES:
        engine = specwood.load(target, draft, dtype=config.dtype, progress=False)
        plan = load_plan(plan_key_for(engine, "dyspec"))
        assert plan is not None and plan.mode == "timed" and plan.contexts == [32, 96]


def _store(target: str, draft: str, best: RuntimeConfig, other: RuntimeConfig) -> None:
    scores = [ConfigScore(other, {128: 10.0}, {128: 12.0}, {128: "dyspec x4"}),
              ConfigScore(best, {128: 20.0}, {128: 30.0}, {128: "dyspec x6"})]
    choice = ConfigChoice(device_id("cpu"), target, draft, "dyspec", scores, created="2026-11-23 12:00:00")
    path = choice_path(choice.device, target, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice.to_dict()))


def test_backend_auto_loads_the_stored_choice(tiny_pair_folders, cache):
    target, draft = tiny_pair_folders
    # nothing stored: auto resolves each backend alone (torch for an HF folder), dtypes untouched
    runtime, note = resolve_runtime(RuntimeConfig(backend="auto"), target, draft)
    assert note is None and runtime == RuntimeConfig()
    _store(target, draft, best=RuntimeConfig(dtype="int8", draft_dtype="fp32"), other=RuntimeConfig(dtype="fp32"))
    runtime, note = resolve_runtime(RuntimeConfig(backend="auto"), target, draft)
    assert runtime == RuntimeConfig(dtype="int8", draft_dtype="fp32") and "--choose-config" in note
    engine = specwood.load(target, draft, backend="auto", progress=False)
    assert engine.target.weight_mode == "int8" and engine.draft_model.dtype == torch.float32
    # an explicit dtype that disagrees with the choice wins, and the choice is not half applied
    runtime, note = resolve_runtime(RuntimeConfig(backend="auto", dtype="fp32"), target, draft)
    assert note is None and runtime == RuntimeConfig(dtype="fp32")
    # an explicit backend never consults the choice
    runtime, note = resolve_runtime(RuntimeConfig(backend="torch"), target, draft)
    assert note is None and runtime == RuntimeConfig()
    # the choice belongs to the pair: the target alone has none
    runtime, note = resolve_runtime(RuntimeConfig(backend="auto"), target, None)
    assert note is None and runtime == RuntimeConfig()


def test_a_damaged_choice_file_is_ignored(tiny_pair_folders, cache):
    target, draft = tiny_pair_folders
    path = choice_path(device_id("cpu"), target, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert load_config_choice(target, draft) is None
    runtime, note = resolve_runtime(RuntimeConfig(backend="auto"), target, draft)
    assert note is None and runtime == RuntimeConfig()


def test_cli_choose_config_then_generate_with_backend_auto(tiny_pair_folders, tmp_path):
    target, draft = tiny_pair_folders
    env = dict(os.environ, SPECWOOD_CACHE=str(tmp_path / "cache"))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specwood.cli", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    p = cli("plan", "--choose-config", "--target", target, "--draft", draft, "--contexts", "32,96")
    assert p.returncode == 0, p.stderr
    from specwood.models.w4a8 import q4_available

    # torch bf16, int8 and (with the AVX512-VNNI kernel) q4 targets, q4 also with a q4 draft
    n = 4 if q4_available() else 2
    assert "`--backend auto` now loads:" in p.stdout and f"configuration {n}/{n}" in p.stderr
    chosen = p.stdout.strip().splitlines()[-1].split("now loads: ", 1)[1]
    g = cli("generate", "hello", "--target", target, "--draft", draft, "--backend", "auto", "--method", "dyspec",
            "--max-tokens", "4", "--json")
    assert g.returncode == 0, g.stderr
    assert f"[load] --backend auto: {chosen}" in g.stderr
    assert Path(tmp_path / "cache" / "plans" / "configs").is_dir()
