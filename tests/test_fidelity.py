"""`specwood bench --fidelity` (specwood/bench/fidelity.py): the metrics on hand-made logits, the
teacher-forced forward against a plain causal forward, the stdlib texts, and an end-to-end run on
a tiny GGUF model (fp32, bf16, llama.cpp when installed, an unknown mode) through the CLI."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from specwood.bench import fidelity as fid
from specwood.bench.cli import add_bench_parser, run_bench_cli
from specwood.errors import SpecwoodError
from specwood.models.testing import byte_level_tokens, random_state_dict, random_tiny_config, write_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 264  # the tiny tokenizer's ids: 256 bytes, then <|endoftext|>, <|im_start|>, <|im_end|>
TOKENS = 40


# ----------------------------------------------------------------------------------------- metrics
def test_identical_logits_have_zero_kl_and_full_agreement() -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 50, generator=g)
    tokens = [1, 7, 3, 3, 49, 0]
    m = fid.fidelity_metrics(logits, logits.clone(), tokens)
    assert m["kl"] == 0.0 and m["kl_max"] == 0.0 and m["top1"] == 1.0 and m["positions"] == 5
    nll = -torch.log_softmax(logits.double(), -1)[torch.arange(5), torch.tensor(tokens[1:])].mean()
    assert m["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-12)


def test_two_token_vocabulary_by_hand() -> None:
    """Position 0: reference (0.25, 0.75), mode (0.6, 0.4), next token 1; position 1: both
    (0.9, 0.1), next token 0; the last row predicts nothing and is ignored."""
    ln = math.log
    ref = torch.tensor([[ln(0.25), ln(0.75)], [ln(0.9), ln(0.1)], [5.0, -5.0]])
    mode = torch.tensor([[ln(0.6), ln(0.4)], [ln(0.9), ln(0.1)], [-5.0, 5.0]])
    m = fid.fidelity_metrics(ref, mode, [0, 1, 0])
    kl0 = 0.25 * ln(0.25 / 0.6) + 0.75 * ln(0.75 / 0.4)
    assert m["kl"] == pytest.approx(kl0 / 2, rel=1e-6) and m["kl_max"] == pytest.approx(kl0, rel=1e-6)
    assert m["kl_max_position"] == 0 and m["kl_first"] == pytest.approx(kl0, rel=1e-6)
    assert m["top1"] == 0.5  # position 0: argmax 1 vs 0; position 1: both 0
    assert m["ppl"] == pytest.approx(math.exp((-ln(0.4) - ln(0.9)) / 2), rel=1e-6)  # = 1 / 0.6
    assert m["ppl"] == pytest.approx(1 / 0.6, rel=1e-6) and m["positions"] == 2


def test_blocks_do_not_change_the_figures() -> None:
    g = torch.Generator().manual_seed(1)
    ref, mode = torch.randn(9, 30, generator=g), torch.randn(9, 30, generator=g)
    tokens = list(range(9))
    a, b = fid.fidelity_metrics(ref, mode, tokens, block=2), fid.fidelity_metrics(ref, mode, tokens, block=64)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-12) for k in a)
    assert a["kl_max_position"] == b["kl_max_position"]
    assert a["kl"] > 0 and 0 <= a["top1"] <= 1


def test_metrics_refuse_bad_shapes() -> None:
    with pytest.raises(SpecwoodError):
        fid.fidelity_metrics(torch.zeros(1, 4), torch.zeros(1, 4), [3])
    with pytest.raises(ValueError):
        fid.fidelity_metrics(torch.zeros(3, 4), torch.zeros(3, 5), [0, 1, 2])


def test_parse_modes() -> None:
    assert fid.parse_modes(" fp32, q4,,llama.cpp,q4 ") == ["fp32", "q4", "llama.cpp"]
    with pytest.raises(SpecwoodError, match="empty"):
        fid.parse_modes(" , ")


# ------------------------------------------------------------------------------------------- texts
def test_texts_ship_with_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, prose = fid.stdlib_texts()
    assert code.path.endswith("decoder.py") and "class JSONDecoder" in code.text
    assert prose.text.strip() and Path(prose.path).is_file()
    # without LICENSE.txt: the Zen of Python, decoded, and nothing printed
    monkeypatch.setattr(fid.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    zen = fid.prose_text()
    assert "Beautiful is better than ugly." in zen.text and "Zen" in zen.source


def test_teacher_forced_logits_equal_a_plain_causal_forward(tiny_model_factory: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import specwood.models.prefill as prefill

    model = tiny_model_factory(seed=2)
    ids = [int(x) for x in torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0))]
    with torch.inference_mode():
        plain = model(torch.tensor([ids]), torch.arange(len(ids)))[0]
    monkeypatch.setattr(prefill, "PREFILL_CHUNK", 8)  # three chunks through the KV cache
    ours = fid.teacher_forced_logits(model, ids)
    assert ours.shape == plain.shape == (23, model.config.vocab_size)
    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------- end to end
def _llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = random_tiny_config("qwen2", vocab_size=VOCAB, eos_token_ids=[256], bos_token_id=None,
                             max_position_embeddings=512)
    return write_gguf(tmp_path_factory.mktemp("fidelity") / "tiny.gguf", cfg, random_state_dict(cfg, seed=3), "F32",
                      tokens=byte_level_tokens(VOCAB))


@pytest.fixture()
def tiny_tokenizer_loaded(monkeypatch: pytest.MonkeyPatch, tiny_tokenizer: Any) -> None:
    """transformers' GGUF tokenizer conversion is not what is tested here: the tiny byte tokenizer."""
    import specwood.models.loader as loader

    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tiny_tokenizer)


def test_fp32_twice_is_identical(tiny_gguf: Path, tiny_tokenizer_loaded: None) -> None:
    ids = list(range(60, 60 + TOKENS))
    (a,), _ = fid.torch_mode_logits(str(tiny_gguf), "fp32", [ids], "cpu")
    (b,), info = fid.torch_mode_logits(str(tiny_gguf), "fp32", [ids], "cpu")
    assert info["activation_dtype"] == "float32"
    m = fid.fidelity_metrics(a, b, ids)
    assert m["kl"] == 0.0 and m["top1"] == 1.0


def test_end_to_end_cli(tiny_gguf: Path, tiny_tokenizer_loaded: None, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    lc = _llama_cpp_installed()
    out = tmp_path / "fid"
    p = argparse.ArgumentParser(prog="specwood")
    add_bench_parser(p.add_subparsers(dest="command"))
    modes = "fp32,bf16,llama.cpp,no-such-mode"
    args = p.parse_args(["bench", "--fidelity", "--target", str(tiny_gguf), "--fidelity-tokens", str(TOKENS),
                         "--fidelity-modes", modes, "--out", str(out)])
    assert run_bench_cli(args) == 1  # the unknown mode's row failed; the others ran
    printed = capsys.readouterr()
    assert "| mode | code: KL | code: top-1 | code: ppl | prose: KL | prose: top-1 | prose: ppl |" in printed.out
    assert "no-such-mode: error: unknown dtype 'no-such-mode'" in printed.err

    res = json.loads((out / "fidelity.json").read_text())
    for key in ("date", "command", "argv", "target", "reference", "modes", "tokens_requested", "texts", "git",
                "machine", "rows", "elapsed_s", "outputs"):
        assert key in res, key
    assert res["modes"] == modes.split(",") and res["git"].keys() == {"head", "status_short_specwood_models"}
    for name in ("code", "prose"):
        t = res["texts"][name]
        assert t["tokens"] == TOKENS and t["positions"] == TOKENS - 1 and t["file_tokens"] > TOKENS
        assert t["sha256"] and Path(t["path"]).is_file()
    rows = {r["mode"]: r for r in res["rows"]}
    assert list(rows) == ["fp32", "bf16", "llama.cpp", "no-such-mode"]
    ref = rows["fp32"]
    assert ref["reference"] and ref["activation_dtype"] == "float32"
    for name in ("code", "prose"):
        assert ref["texts"][name]["kl"] == 0.0 and ref["texts"][name]["top1"] == 1.0
        assert set(ref["texts"][name]) >= {"kl", "kl_max", "top1", "ppl", "positions", "forward_s"}
        bf = rows["bf16"]["texts"][name]
        assert 0 < bf["kl"] < 0.05 and bf["top1"] > 0.8 and bf["ppl"] > 1
    assert "unknown dtype" in rows["no-such-mode"]["error"]
    if lc:  # F32 weights, f16 KV cache: llama.cpp sits close to the reference
        for name in ("code", "prose"):
            f = rows["llama.cpp"]["texts"][name]
            assert f["kl"] < 1e-3 and f["top1"] > 0.9, f
    else:
        assert "pip install" in rows["llama.cpp"]["skipped"]

    md = (out / "fidelity.md").read_text()
    assert "| fp32 (reference) | 0 | 1.0000 |" in md and "| bf16 |" in md and "unknown dtype" in md
    assert (out / "fidelity.png").stat().st_size > 0 and "fidelity.png" in res["outputs"]


def test_cli_refuses_too_few_tokens(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = argparse.ArgumentParser(prog="specwood")
    add_bench_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--fidelity", "--fidelity-tokens", "1", "--out", str(tmp_path)])
    assert run_bench_cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specwood bench: error: --fidelity-tokens must be >= 2 (got 1)"]


def test_llama_cpp_missing_is_a_skipped_row(monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path,
                                            tiny_tokenizer_loaded: None) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees without the extra
    texts = [fid.Text("code", "test", "-", "def f(x):\n    return x + 1\n" * 4)]
    res = fid.run_fidelity(str(tiny_gguf), "llama.cpp", 16, None, progress=False, texts=texts)
    assert [r["mode"] for r in res["rows"]] == ["fp32", "llama.cpp"]
    assert "llamacpp" in res["rows"][1]["skipped"] and "texts" not in res["rows"][1]
    assert "| llama.cpp | — |" in fid.markdown_table(res)
