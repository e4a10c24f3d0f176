"""The `specwood` command as a user runs it (real subprocesses): JSON and streaming output, and
one clear line with exit code 2 — never a traceback — for every kind of bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specwood.models.testing import random_state_dict, random_tiny_config, write_gguf


def run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECWOOD_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "specwood.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specwood: error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_generate_json(tiny_folder, tmp_path):
    p = run("generate", "hello", "--target", str(tiny_folder), "--draft", "none", "--max-tokens", "6", "--json",
            "--dtype", "fp32", cache=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "token_ids", "stats"} and len(out["token_ids"]) <= 6
    for key in ("method", "new_tokens", "tokens_per_s", "ttft_s", "tbt_ms_p50"):
        assert key in out["stats"]


def test_generate_streams_text_and_prints_stats(tiny_folder, tmp_path):
    p = run("generate", "hello", "--target", str(tiny_folder), "--draft", str(tiny_folder), "--max-tokens", "8",
            "--method", "chain", "--raw", "--dtype", "fp32", cache=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "[chain]" in p.stderr and "AAT" in p.stderr


def test_auto_without_suffix_drafts_from_the_command_line(tiny_folder, tmp_path):
    """`--no-suffix`: auto as before suffix drafts; with no draft model it then decodes plainly."""
    args = ("generate", "hello", "--target", str(tiny_folder), "--draft", "none", "--max-tokens", "6", "--json",
            "--raw", "--dtype", "fp32", "--method", "auto")
    with_suffix, without = run(*args, cache=tmp_path), run(*args, "--no-suffix", cache=tmp_path)
    assert with_suffix.returncode == 0 and without.returncode == 0, (with_suffix.stderr, without.stderr)
    assert "auto_sources" in json.loads(with_suffix.stdout)["stats"]
    assert "auto_sources" not in json.loads(without.stdout)["stats"]


def test_missing_model(tmp_path):
    assert_one_line_error(run("generate", "x", "--target", str(tmp_path / "nope.gguf"), cache=tmp_path), "nope.gguf")


def test_truncated_gguf(tmp_path):
    cfg = random_tiny_config("qwen2")
    path = write_gguf(tmp_path / "t.gguf", cfg, random_state_dict(cfg), "F32")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("generate", "x", "--target", str(path), "--draft", "none", cache=tmp_path), "t.gguf")


def test_unknown_architecture(tmp_path):
    cfg = random_tiny_config("qwen2")
    path = write_gguf(tmp_path / "g.gguf", cfg, random_state_dict(cfg), "F32", arch="gemma")
    assert_one_line_error(run("generate", "x", "--target", str(path), "--draft", "none", cache=tmp_path), "gemma")


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--method", "dyspec"], "needs a draft model"),
    (["--method", "dyspec", "--draft", "SELF", "--budget", "0"], "budget"),
    (["--method", "dyspec-threshold", "--draft", "SELF", "--threshold", "2"], "threshold"),
    (["--method", "dyspec", "--draft", "SELF", "--no-suffix"], "suffix"),
])
def test_bad_generation_options(tiny_folder, tmp_path, flags, needle):
    flags = [str(tiny_folder) if f == "SELF" else f for f in flags]
    if "--draft" not in flags:
        flags += ["--draft", "none"]
    p = run("generate", "x", "--target", str(tiny_folder), "--dtype", "fp32", *flags, cache=tmp_path)
    assert_one_line_error(p, needle)


def test_prompt_longer_than_context(tiny_folder, tmp_path):
    p = run("generate", "word " * 200, "--target", str(tiny_folder), "--draft", "none", "--raw", cache=tmp_path)
    assert_one_line_error(p, "context")


def test_train_drafter_then_generate_with_the_head(tiny_folder, tmp_path):
    """`specwood train-drafter` end to end on a tiny target (answers, text, features, training),
    a rerun resumes from its caches and checkpoint, and the head drafts losslessly."""
    head = tmp_path / "head.safetensors"
    args = ["train-drafter", "--target", str(tiny_folder), "--dtype", "fp32", "--prompts", "3", "--answer-tokens", "8",
            "--text-tokens", "1500", "--window", "32", "--steps", "6", "--draft-vocab", "200",
            "--intermediate-size", "64", "--out", str(head)]
    p = run(*args, cache=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "finished; head written to" in p.stderr and head.is_file()
    again = run(*args, cache=tmp_path)  # everything cached: no answers or features computed again
    assert again.returncode == 0 and "target answers" not in again.stderr and "target features" not in again.stderr
    outs = [run("generate", "hello", "--target", str(tiny_folder), "--draft", "none", "--max-tokens", "12", "--json",
                "--dtype", "fp32", *extra, cache=tmp_path)
            for extra in ([], ["--method", "head", "--head", str(head), "--shape", "chain", "--depth", "3"])]
    assert all(o.returncode == 0 for o in outs), outs[1].stderr
    ar, spec = (json.loads(o.stdout) for o in outs)
    assert spec["token_ids"] == ar["token_ids"] and spec["stats"]["spec_steps"] > 0


def test_train_drafter_and_head_errors(tiny_folder, tmp_path):
    assert_one_line_error(run("train-drafter", "--target", str(tiny_folder), "--steps", "0", cache=tmp_path),
                          "--steps must be positive")
    assert_one_line_error(run("generate", "x", "--target", str(tiny_folder), "--draft", "none", "--dtype", "fp32",
                              "--method", "head", "--head", str(tmp_path / "none.safetensors"), cache=tmp_path),
                          "not found; train one with `specwood train-drafter`")
    assert_one_line_error(run("generate", "x", "--target", str(tiny_folder), "--draft", "none", "--dtype", "fp32",
                              "--method", "head", cache=tmp_path), "needs a draft head; pass --head")
