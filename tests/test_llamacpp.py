"""The llama.cpp backend (specwood/models/llamacpp.py) and the `llama.cpp` bench baseline: a tiny GGUF
written here with the `gguf` package, and a few tokens on the real default target."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.llamacpp import LlamaCppModel, greedy_decode, import_llama_cpp
from specwood.models.testing import byte_level_tokens, random_state_dict, random_tiny_config, write_gguf
from specwood.tree.token_tree import TokenTree

pytestmark = pytest.mark.usefixtures("llama_cpp_required")
VOCAB = 264  # the tiny tokenizer's ids: 256 bytes, <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-3) -> bool:
    """Equal to rounding: fp32 weights, but an f16 KV cache written by batches of different sizes."""
    return float((a - b).abs().max()) <= rel * max(1.0, float(b.abs().max()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    cfg = random_tiny_config("qwen2", vocab_size=VOCAB, eos_token_ids=[256], bos_token_id=None,
                             max_position_embeddings=512)
    sd = random_state_dict(cfg, seed=3)
    path = write_gguf(tmp_path_factory.mktemp("llamacpp") / "tiny.gguf", cfg, sd, "F32",
                      tokens=byte_level_tokens(VOCAB))
    return SimpleNamespace(cfg=cfg, sd=sd, path=path)


@pytest.fixture(scope="module")
def runner(tiny: SimpleNamespace) -> Any:
    with LlamaCppModel(tiny.path, n_ctx=512, n_threads=1, n_seq_max=8) as m:
        yield m


def _tree() -> TokenTree:
    """root - a - c - f, a - d, root - b - e, b - g: 8 nodes, 4 leaves, coupled sequences."""
    t = TokenTree.with_root(11)
    a, b = t.add_node(0, 20), t.add_node(0, 21)
    c, _ = t.add_node(a, 30), t.add_node(a, 31)
    t.add_node(b, 32)
    t.add_node(c, 40)
    t.add_node(b, 33)
    return t


def _path_logits(m: LlamaCppModel, prefix_len: int, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens` fed one at a time on top of the first `prefix_len` committed tokens."""
    m.rollback(prefix_len)
    for t in tokens:
        out = m.decode_one(t)
    return out


def _fresh(m: LlamaCppModel, ids: list[int], nxt: int) -> torch.Tensor:
    m.reset()
    m.prefill(ids)
    return m.decode_one(nxt)


def _assert_kv_is_one_sequence(m: LlamaCppModel) -> None:
    lc = import_llama_cpp()
    assert lc.llama_memory_seq_pos_max(m._mem, 0) == m.n_past - 1
    for s in range(1, m.n_seq_max):
        assert lc.llama_memory_seq_pos_max(m._mem, s) == -1, s


# -------------------------------------------------------------------------------------- the runner
def test_tree_logits_equal_one_token_forwards(runner: LlamaCppModel) -> None:
    tree = _tree()
    runner.reset()
    first = runner.prefill(PROMPT)
    assert first.shape == (VOCAB,) and first.dtype == torch.float32
    got = runner.forward_tree(tree)
    assert got.shape == (len(tree), VOCAB)
    assert got.std() > 0.1  # a model whose logits say something
    for i in range(len(tree)):
        ref = _path_logits(runner, len(PROMPT), [tree.tokens[j] for j in tree.path_to(i)])
        assert close(got[i], ref), i
        assert int(got[i].argmax()) == int(ref.argmax())


@pytest.mark.parametrize("path", [[0], [0, 1, 3, 6], [0, 2, 5], [0, 2, 7]])
def test_commit_equals_a_fresh_run(runner: LlamaCppModel, path: list[int]) -> None:
    tree = _tree()
    runner.reset()
    runner.prefill(PROMPT)
    runner.forward_tree(tree)
    runner.commit(path)  # [0, 2, 7] ends on the 4th leaf's sequence: the seq_cp-to-0 branch
    kept = [tree.tokens[j] for j in path]
    assert runner.n_past == len(PROMPT) + len(kept)
    _assert_kv_is_one_sequence(runner)
    after = runner.decode_one(77)
    assert close(after, _fresh(runner, PROMPT + kept, 77))
    assert not close(after, _fresh(runner, PROMPT + kept[:-1] + [kept[-1] + 1], 77))  # the check can fail

    # a second tree on the committed state sees the accepted path, not the dropped branches
    runner.reset()
    runner.prefill(PROMPT)
    runner.forward_tree(tree)
    runner.commit(path)
    base = runner.n_past
    got = runner.forward_tree(tree)
    for i in (0, 3, 5, 6):
        ref = _path_logits(runner, base, [tree.tokens[j] for j in tree.path_to(i)])
        assert close(got[i], ref), i


def test_rollback_equals_a_fresh_run(runner: LlamaCppModel) -> None:
    tree = _tree()
    runner.reset()
    runner.prefill(PROMPT)
    runner.forward_tree(tree)
    runner.commit([0, 1, 3])
    runner.forward_tree(tree)  # an uncommitted tree is dropped by the rollback too
    runner.rollback(len(PROMPT) - 2)
    _assert_kv_is_one_sequence(runner)
    got = runner.decode_one(99)
    assert close(got, _fresh(runner, PROMPT[:-2], 99))


def test_bad_calls_are_specwood_errors(runner: LlamaCppModel) -> None:
    runner.reset()
    runner.prefill(PROMPT)
    with pytest.raises(SpecwoodError, match="forward_tree"):
        runner.commit([0])
    runner.forward_tree(_tree())
    with pytest.raises(SpecwoodError, match="root-to-node path"):
        runner.commit([0, 3])  # node 3 is a grandchild of the root
    with pytest.raises(SpecwoodError, match="cannot roll back"):
        runner.rollback(len(PROMPT) + 100)
    wide = TokenTree.with_root(1)
    for k in range(9):
        wide.add_node(0, 10 + k)
    with pytest.raises(SpecwoodError, match="n_seq_max"):
        runner.forward_tree(wide)


def test_runner_greedy_equals_llama_cpp_generate(tiny: SimpleNamespace, runner: LlamaCppModel) -> None:
    lc = import_llama_cpp()
    ours = greedy_decode(runner, PROMPT, 24, eos=[256])
    llm = lc.Llama(str(tiny.path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    theirs: list[int] = []
    for tok in llm.generate(PROMPT, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if tok == 256 or len(theirs) == 24:
            break
        theirs.append(int(tok))
    llm.close()
    assert len(ours) >= 8 and ours == theirs


def test_llama_cpp_matches_the_torch_model(tiny: SimpleNamespace, runner: LlamaCppModel) -> None:
    """Same weights through both backends (the GGUF writer, vocabulary and RoPE layout agree)."""
    from specwood.models.transformer import build_model

    model = build_model(tiny.cfg, tiny.sd, torch.float32, max_positions=64)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0, -1]
    runner.reset()
    got = runner.prefill(PROMPT)
    assert (got - ref.float()).abs().max() < 1e-3 * max(1.0, float(ref.abs().max()))


# --------------------------------------------------------------------------------------- bad input
def test_missing_extra_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees without the extra
    with pytest.raises(SpecwoodError) as ei:
        import_llama_cpp()
    msg = str(ei.value)
    assert "pip install 'specwood[llamacpp]'" in msg and "CMAKE_ARGS" in msg and "\n" not in msg


def test_bench_without_the_extra_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from specwood.bench.cli import add_bench_parser, run_bench_cli

    parser = argparse.ArgumentParser(prog="specwood")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--methods", "ar,llama.cpp", "--out", str(tmp_path), "--no-progress"])
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert run_bench_cli(args) == 2  # before any model is loaded
    err = capsys.readouterr().err.strip()
    assert err.startswith("specwood bench: error: ") and "\n" not in err and "specwood[llamacpp]" in err


def test_unreadable_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelFileError, match="llama.cpp cannot load"):
        LlamaCppModel(bad, n_threads=1)
    with pytest.raises(ModelFileError, match="no such GGUF file"):
        LlamaCppModel(tmp_path / "nope.gguf", n_threads=1)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="not Hugging Face folders"):
        LlamaCppModel.open(tmp_path / "hf")


# ---------------------------------------------------------------------------------- bench baseline
def test_bench_baseline_on_the_tiny_model(tmp_path: Path, tiny: SimpleNamespace, tiny_tokenizer: Any) -> None:
    from specwood.bench.harness import run_bench
    from specwood.bench.workload import Prompt
    from specwood.engine.api import Engine
    from specwood.models.transformer import build_model

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models spin-wait with 2 threads on a shared box
    try:
        model = build_model(tiny.cfg, tiny.sd, torch.float32, max_positions=512)
        engine = Engine(model, tiny_tokenizer, target_name=str(tiny.path))
        prompts = [Prompt("chat-1", "chat", messages=({"role": "user", "content": "Say hello."},)),
                   Prompt("code-1", "code", prompt="def add(a, b):\n    return")]
        recs = run_bench(engine, prompts, "ar,llama.cpp", tmp_path / "out", max_tokens=12, progress=False)
    finally:
        torch.set_num_threads(torch_threads)
    assert not [r for r in recs if r.get("error")]
    by = {(r["id"], r["method"]): r for r in recs}
    for pid in ("chat-1", "code-1"):
        ar, lc = by[(pid, "ar")], by[(pid, "llama.cpp")]
        assert lc["prompt_tokens"] == ar["prompt_tokens"]  # identical input ids
        assert lc["new_tokens"] >= 2 and lc["tokens_per_s"] > 0 and lc["ttft_s"] > 0
        assert lc["matches_ar"] is True, (lc["token_ids"], ar["token_ids"])  # fp32 both sides
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["llama.cpp"]["n_threads"] == 1 and run["llama.cpp"]["gguf"] == str(tiny.path)
    assert "vs llama.cpp" in (tmp_path / "out" / "report.md").read_text()


# ---------------------------------------------------------------------------------- the real target
def test_real_target_tree_and_greedy() -> None:
    """A few tokens on the shipped Q4_K_M target. llama.cpp multiplies Q4_K weights with other
    kernels for batches of 4+ rows than for one row (|logit difference| ~0.3-0.5 of a scale of
    ~20 on this CPU), so a tree's logits equal the one-token ones to that rounding, and their
    argmax wherever the top two are not nearly tied."""
    lc = import_llama_cpp()
    m = LlamaCppModel.open("qwen2.5-coder-1.5b-instruct", n_ctx=256)
    try:
        assert m.vocab_size == m.n_vocab == 151936  # the tokenizer's tokens = token_embd rows here
        ids = [151644, 872, 198, 750, 15801, 1445, 1648, 151645, 198, 151644, 77091, 198]
        greedy = greedy_decode(m, ids, 6)
        tree = TokenTree.with_root(greedy[0])  # the greedy path plus a runner-up at each depth
        m.reset()
        m.prefill(ids)
        parent = 0
        for tok in greedy[1:4]:
            logits = _path_logits(m, len(ids), [tree.tokens[j] for j in tree.path_to(parent)])
            tree.add_node(parent, int(torch.topk(logits, 2).indices[1]))
            parent = tree.add_node(parent, tok)
        m.rollback(len(ids))
        got = m.forward_tree(tree)
        for i in range(len(tree)):
            ref = _path_logits(m, len(ids), [tree.tokens[j] for j in tree.path_to(i)])
            assert close(got[i], ref, rel=0.05), (i, float((got[i] - ref).abs().max()))
            top2 = torch.topk(ref, 2).values
            if top2[0] - top2[1] > 1.0:
                assert int(got[i].argmax()) == int(ref.argmax()), i
        m.rollback(len(ids))
        m.forward_tree(tree)
        m.commit([0, 2, 4])  # the greedy path: root, then the second child at each depth
        assert m.n_past == len(ids) + 3
        assert close(m.decode_one(greedy[3]), _fresh(m, ids + greedy[:3], greedy[3]), rel=0.05)
    finally:
        m.close()
    # Flash attention as our runner has it (llama.cpp's default, "auto"): llama-cpp-python turns it off,
    # and its other attention path decoded garbage here on an AVX2-only build (Zen 3: 95456, 0, ...).
    llm = lc.Llama(str(m.path), n_ctx=256, n_threads=m.n_threads, n_threads_batch=m.n_threads,
                   flash_attn=True, verbose=False)
    theirs = []
    for tok in llm.generate(ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        theirs.append(int(tok))
        if len(theirs) == 6:
            break
    llm.close()
    assert greedy == theirs
