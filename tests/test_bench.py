"""Tests for the benchmark harness: workloads, report maths, plots, run_bench with a fake engine, the
CLI, and (when the engine and HF export exist) an end-to-end ar-vs-hf run on a tiny random model."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specwood.bench import report, workload
from specwood.bench.cli import add_bench_parser, run_bench_cli
from specwood.bench.harness import normalise_sampling, parse_methods, run_bench
from specwood.bench.workload import Prompt, Workload, load_workload, parse_lines, select
from specwood.errors import SamplingParamsError, SpecwoodError


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """Tiny models are ~50x slower with 2 threads on a shared 2-core box (spin-waiting); these
    tests check behaviour, not speed."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------- workload
def _err(lines: list[str]) -> str:
    with pytest.raises(SpecwoodError) as ei:
        parse_lines(lines, "w.jsonl")
    msg = str(ei.value)
    assert "\n" not in msg  # one line, for the CLI
    return msg


def test_parse_valid_lines() -> None:
    ps = parse_lines([
        json.dumps({"id": "a", "category": "code", "messages": [{"role": "user", "content": "hi"}]}),
        "",
        json.dumps({"id": 7, "prompt": "def f(", "extra": "ignored"}),
    ], "w.jsonl")
    assert [p.id for p in ps] == ["a", "7"]
    assert not ps[0].raw and ps[0].content == [{"role": "user", "content": "hi"}]
    assert ps[1].raw and ps[1].content == "def f(" and ps[1].category == workload.DEFAULT_CATEGORY


@pytest.mark.parametrize("line, needle", [
    ('{"id": "a", "prompt": "x"', "w.jsonl:1: invalid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"prompt": "x"}', "'id'"),
    ('{"id": "", "prompt": "x"}', "'id'"),
    ('{"id": "a"}', "exactly one of 'messages'"),
    ('{"id": "a", "prompt": "x", "messages": []}', "exactly one of 'messages'"),
    ('{"id": "a", "prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"id": "a", "messages": []}', "'messages' must be a non-empty list"),
    ('{"id": "a", "messages": [{"role": "user"}]}', "messages[0]"),
    ('{"id": "a", "category": 3, "prompt": "x"}', "'category'"),
])
def test_parse_errors_are_one_line(line: str, needle: str) -> None:
    assert needle in _err([line])


def test_duplicate_ids_and_line_numbers() -> None:
    msg = _err(['{"id": "a", "prompt": "x"}', "", '{"id": "a", "prompt": "y"}'])
    assert "w.jsonl:3" in msg and "duplicate id 'a'" in msg and "line 1" in msg


def test_load_jsonl_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecwoodError, match="not found"):
        load_workload(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SpecwoodError, match="no prompts"):
        load_workload(empty)
    good = tmp_path / "w.jsonl"
    good.write_text('{"id": "x", "category": "c", "prompt": "p"}\n')
    wl = load_workload(good)
    assert wl.source == str(good) and len(wl) == 1


def test_builtin_workload() -> None:
    wl = load_workload("builtin")
    cats = wl.categories
    for c in ("code", "chat", "math", "translation", "json-extraction", "summarisation"):
        assert sum(p.category == c for p in wl.prompts) >= 3, c
    assert len({p.id for p in wl.prompts}) == len(wl.prompts)
    # the long categories come from this Python's stdlib, which the test environment has
    assert "long-code" in cats and "long-summary" in cats, wl.notes
    for p in wl.prompts:
        text = p.content if p.raw else "".join(m["content"] for m in p.content)
        assert text.strip()
        if p.category.startswith("long-"):
            assert 2000 < len(text) < 6500  # a few thousand characters, well under ~1500 tokens
    code = next(p for p in wl.prompts if p.category == "long-code")
    assert code.raw and "def " in code.content


def test_builtin_long_prompts_skip_gracefully(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload, "_module_file", lambda m: None)
    monkeypatch.setattr(workload, "_license_text", lambda: None)
    monkeypatch.setattr(workload, "_docs_text", lambda: None)
    wl = workload.builtin_workload()
    assert "long-code" not in wl.categories and "long-summary" not in wl.categories
    assert len(wl.notes) == 4 and all("skipped built-in prompt" in n for n in wl.notes)


def test_select_categories_and_limit() -> None:
    ps = [Prompt(id=f"{c}{i}", category=c, prompt="x") for c in "abc" for i in range(3)]
    assert [p.id for p in select(ps, categories=["b"])] == ["b0", "b1", "b2"]
    # round-robin over categories, original order kept
    assert [p.id for p in select(ps, limit=4)] == ["a0", "a1", "b0", "c0"]
    assert [p.id for p in select(ps, limit=2, categories=["c", "a"])] == ["a0", "c0"]
    assert len(select(ps, limit=100)) == 9
    with pytest.raises(SpecwoodError, match="unknown category zz.*the workload has: a, b, c"):
        select(ps, categories=["zz"])
    with pytest.raises(SpecwoodError, match="--limit"):
        select(ps, limit=0)


# ----------------------------------------------------------------------------------- argument checks
def test_parse_methods_and_sampling() -> None:
    assert parse_methods("ar, hf,ar,,chain") == ["ar", "hf", "chain"]
    with pytest.raises(SpecwoodError):
        parse_methods(" , ")
    s = normalise_sampling({"temperature": 0.7, "seed": None})
    assert s == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": None}
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"nucleus": 1}):
        with pytest.raises(SamplingParamsError):
            normalise_sampling(bad)


# ------------------------------------------------------------------------------------------- report
def _rec(pid: str, cat: str, method: str, tps: float | None, **kw: Any) -> dict[str, Any]:
    r = {"id": pid, "category": cat, "method": method, "tokens_per_s": tps, "e2e_tokens_per_s": tps and tps / 2,
         "new_tokens": 10, "token_ids": kw.pop("ids", [1, 2, 3]), "ttft_s": 0.1, "tbt_ms_p50": 5.0}
    r.update(kw)
    return r


def _synthetic() -> list[dict[str, Any]]:
    return [
        _rec("c1", "code", "ar", 10.0), _rec("c1", "code", "dyspec", 30.0, mean_accepted_tokens=3.0,
                                             acceptance_rate=0.5),
        _rec("c1", "code", "hf", 20.0),
        _rec("c2", "code", "ar", 20.0), _rec("c2", "code", "dyspec", 40.0, mean_accepted_tokens=4.0,
                                             acceptance_rate=0.7, ids=[1, 2, 9]),
        _rec("c2", "code", "hf", 20.0),
        _rec("m1", "math", "ar", 10.0), _rec("m1", "math", "dyspec", 15.0, mean_accepted_tokens=2.0,
                                             acceptance_rate=0.3, ids=[1, 2, 3, 0]),
        _rec("m1", "math", "hf", None, error="boom", new_tokens=0),
        # a prompt only dyspec completed: must not enter the ratio against ar
        _rec("m2", "math", "dyspec", 1000.0, mean_accepted_tokens=5.0, acceptance_rate=0.9),
        _rec("m2", "math", "ar", None, error="context", new_tokens=0),
    ]


def test_speedup_uses_common_prompts() -> None:
    rs = _synthetic()
    assert report.speedup(rs, "dyspec", "ar", "code") == pytest.approx(35.0 / 15.0)
    assert report.speedup(rs, "dyspec", "ar", "math") == pytest.approx(1.5)  # m2 excluded
    assert report.speedup(rs, "dyspec", "ar") == pytest.approx((30 + 40 + 15) / 3 / ((10 + 20 + 10) / 3))
    assert report.speedup(rs, "hf", "ar", "math") is None  # hf failed on the only math prompt
    assert report.speedup(rs, "dyspec", "hf", "code") == pytest.approx(35.0 / 20.0)
    assert report.speedup(rs, "ar", "ar", "code") == pytest.approx(1.0)
    assert report.speedup(rs, "dyspec", "ar", "code", key="e2e_tokens_per_s") == pytest.approx(35.0 / 15.0)


def test_summary_rows_and_agreement() -> None:
    rs = _synthetic()
    rows = {(r["category"], r["method"]): r for r in report.summary_rows(rs, eos=[0])}
    assert rows[("code", "dyspec")]["mean_accepted_tokens"] == pytest.approx(3.5)
    assert rows[("code", "dyspec")]["tokens_per_s"] == pytest.approx(35.0)
    assert rows[("math", "dyspec")]["tokens_per_s"] == pytest.approx((15 + 1000) / 2)  # the mean keeps m2
    assert rows[("overall", "dyspec")]["n"] == 4
    assert rows[("math", "ar")]["errors"] == 1
    assert rows[("overall", "dyspec")]["vs_hf"] == pytest.approx(35.0 / 20.0)
    # c2 differs; m1 differs only by a trailing EOS, which does not count
    assert rows[("code", "dyspec")]["same_as_ar"] == (1, 2)
    assert rows[("math", "dyspec")]["same_as_ar"] == (1, 1)
    assert "same_as_ar" not in rows[("code", "ar")]
    assert "same_as_ar" not in {k: v for k, v in report.summary_rows(rs, greedy=False)[1].items()}


def test_markdown_report() -> None:
    rs = _synthetic()
    md = report.markdown_report(rs, {"sampling": {"temperature": 0.0}, "target": "tiny", "max_tokens": 8,
                                     "workload": {"notes": ["skipped x"]}}, plots=["/tmp/o/tokens_per_s.png"])
    header = next(line for line in md.splitlines() if line.startswith("| category"))
    for col in ("tokens/s", "speedup vs ar", "vs hf", "AAT", "accept rate", "e2e speedup", "= ar (greedy)", "errors"):
        assert col in header, col
    assert "vs hf-assisted" not in header  # only when it ran
    assert "| **overall** | dyspec |" in md
    assert "| code | dyspec | 2 | 35.0 | 2.33x | 1.75x |" in md
    assert "## speedup vs ar" in md and "note: skipped x" in md and "](tokens_per_s.png)" in md
    assert "- m1 / hf: boom" in md
    # no ar in the run: no speedup column, no crash
    md2 = report.markdown_report([r for r in rs if r["method"] != "ar"])
    assert "speedup vs ar" not in md2


def test_make_plots(tmp_path: Path) -> None:
    files = report.make_plots(_synthetic(), tmp_path)
    names = sorted(p.name for p in files)
    assert names == ["aat.png", "speedup_vs_ar.png", "tokens_per_s.png"]
    for p in files:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_ar = [r for r in _synthetic() if r["method"] == "ar"]
    sub = tmp_path / "only_ar"
    sub.mkdir()
    assert [p.name for p in report.make_plots(only_ar, sub)] == ["tokens_per_s.png"]


# ------------------------------------------------------------------------------- fake-engine harness
class FakeEngine:
    """Implements the engine API surface the harness uses; every method returns the same tokens
    except 'lossy', which changes one."""

    eos_token_ids = {0}
    draft_model = None
    target_name = "fake-target"
    draft_name = None

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.target_config = SimpleNamespace(name="fake", max_position_embeddings=512)

    def encode(self, prompt: Any, raw: bool = False) -> list[int]:
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return [1 + (ord(ch) % 50) for ch in text][:64]

    def generate(self, prompt: Any, *, max_tokens: int = 128, method: str = "ar", raw: bool = False,
                 **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "max_tokens": max_tokens, "method": method, "raw": raw, **kw})
        if isinstance(prompt, str) and "TOO LONG" in prompt:
            raise SpecwoodError("prompt has 9999 tokens but the context holds 512")
        if method == "broken":
            raise SpecwoodError("unknown method 'broken'")
        ids = self.encode(prompt, raw)[:max_tokens]
        if method == "lossy":
            ids = ids[:-1] + [7]
        time.sleep(0.001)
        stats: dict[str, Any] = {"method": method, "prompt_tokens": 64, "new_tokens": len(ids), "ttft_s": 0.001,
                                 "tokens_per_s": 100.0 if method == "ar" else 250.0, "tbt_ms_p50": 10.0}
        if method != "ar":
            stats.update(mean_accepted_tokens=2.5, acceptance_rate=0.6)
        return SimpleNamespace(text="x" * len(ids), token_ids=ids, stats=stats)


def _wl() -> Workload:
    return Workload(prompts=[
        Prompt(id="p1", category="chat", messages=({"role": "user", "content": "hello there"},)),
        Prompt(id="p2", category="code", prompt="def add(a, b):"),
        Prompt(id="p3", category="code", prompt="TOO LONG"),
    ], source="test", notes=["a note"])


def test_run_bench_fake_engine(tmp_path: Path) -> None:
    eng = FakeEngine()
    seen: list[str] = []
    recs = run_bench(eng, _wl(), "ar,dyspec,lossy", tmp_path, sampling=None,
                     method_options={"budget": 16, "depth": None}, max_tokens=8, progress=False,
                     run_info={"command": "specwood bench --test"}, on_record=lambda r: seen.append(r["method"]))
    assert len(recs) == 9 and len(seen) == 9
    # warm-up: one short untimed chat generation per method, before any timed one
    assert [c["method"] for c in eng.calls[:3]] == ["ar", "dyspec", "lossy"]
    assert all(c["max_tokens"] == 8 and isinstance(c["prompt"], list) for c in eng.calls[:3])
    # interleaved per prompt; options only for non-ar methods; greedy defaults passed through
    assert [c["method"] for c in eng.calls[3:6]] == ["ar", "dyspec", "lossy"]
    assert all("budget" not in c for c in eng.calls if c["method"] == "ar")
    assert all(c["budget"] == 16 and "depth" not in c for c in eng.calls if c["method"] == "dyspec")
    assert all(c["temperature"] == 0.0 and c["top_k"] == 0 for c in eng.calls)
    assert eng.calls[4]["raw"] is False and eng.calls[7]["raw"] is True

    by = {(r["id"], r["method"]): r for r in recs}
    r = by[("p2", "dyspec")]
    for key in ("id", "category", "method", "text", "token_ids", "new_tokens", "tokens_per_s", "ttft_s",
                "tbt_ms_p50", "prompt_tokens", "mean_accepted_tokens", "acceptance_rate", "e2e_tokens_per_s"):
        assert key in r, key
    assert r["tokens_per_s"] == 250.0 and r["mean_accepted_tokens"] == 2.5 and r["matches_ar"] is True
    assert by[("p2", "lossy")]["matches_ar"] is False
    assert by[("p3", "ar")]["error"].startswith("prompt has 9999 tokens")

    for f in ("results.json", "run.json", "report.md", "tokens_per_s.png", "speedup_vs_ar.png", "aat.png"):
        assert (tmp_path / f).is_file(), f
    assert json.loads((tmp_path / "results.json").read_text()) == recs
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"] == "specwood bench --test" and run["completed"] is True
    assert run["target"] == "fake-target" and run["methods"] == ["ar", "dyspec", "lossy"]
    assert run["machine"]["cpu_cores_logical"] >= 1 and run["machine"]["torch"]
    assert run["method_options"] == {"budget": 16} and run["n_errors"] == 3
    md = (tmp_path / "report.md").read_text()
    assert "| **overall** | dyspec | 2 | 250.0 | 2.50x |" in md
    assert "| **overall** | lossy |" in md and "0/2" in md.split("| **overall** | lossy |")[1].splitlines()[0]


def test_run_bench_repeats_keep_the_median_run(tmp_path: Path) -> None:
    """--repeats 3: every (prompt, method) runs three times, the methods in a rotated order each
    time; the record is the run with the median rate, with all three rates; a failing prompt is
    not repeated; a method whose output changes between runs is named in the report."""

    class Varying(FakeEngine):
        def generate(self, prompt: Any, **kw: Any) -> Any:
            res = super().generate(prompt, **kw)
            n = sum(c["method"] == kw["method"] and c["prompt"] == prompt for c in self.calls)
            res.stats["tokens_per_s"] = {1: 30.0, 2: 10.0, 3: 20.0}[n] * (2 if kw["method"] == "dyspec" else 1)
            if kw["method"] == "lossy" and n == 2:
                res.token_ids = res.token_ids[:-1] + [9]
            return res

    eng = Varying()
    recs = run_bench(eng, _wl(), "ar,dyspec,lossy", tmp_path, max_tokens=8, progress=False, warmup=False,
                     repeats=3)
    assert len(recs) == 9
    timed = [c["method"] for c in eng.calls if c["prompt"] == "def add(a, b):"]
    assert timed == ["ar", "dyspec", "lossy", "dyspec", "lossy", "ar", "lossy", "ar", "dyspec"]
    by = {(r["id"], r["method"]): r for r in recs}
    assert by[("p2", "ar")]["tokens_per_s"] == 20.0 and by[("p2", "ar")]["tokens_per_s_runs"] == [30.0, 10.0, 20.0]
    assert by[("p2", "ar")]["ttft_s_runs"] == [0.001] * 3
    assert by[("p2", "dyspec")]["tokens_per_s"] == 40.0 and by[("p2", "dyspec")]["same_tokens_every_run"]
    assert by[("p2", "lossy")]["same_tokens_every_run"] is False
    assert sum(c["prompt"] == "TOO LONG" for c in eng.calls) == 3  # once per method
    assert "error" in by[("p3", "ar")]
    assert json.loads((tmp_path / "run.json").read_text())["repeats"] == 3
    md = (tmp_path / "report.md").read_text()
    assert "each prompt ran 3 times" in md and "- p2 / lossy" in md.split("## outputs that changed")[1]
    assert "| **overall** | dyspec | 2 | 40.0 | 2.00x |" in md
    with pytest.raises(SpecwoodError, match="repeats must be >= 1"):
        run_bench(eng, _wl(), "ar", tmp_path, progress=False, repeats=0)


def test_run_bench_config_error_aborts_at_warmup(tmp_path: Path) -> None:
    with pytest.raises(SpecwoodError, match="unknown method 'broken'"):
        run_bench(FakeEngine(), _wl(), ["ar", "broken"], tmp_path, progress=False)
    assert not (tmp_path / "results.json").exists()


def test_run_bench_interrupt_writes_partial(tmp_path: Path) -> None:
    eng = FakeEngine()

    def stop(rec: dict[str, Any]) -> None:
        if rec["id"] == "p2":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(eng, _wl(), ["ar"], tmp_path, progress=False, warmup=False, on_record=stop)
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2
    assert json.loads((tmp_path / "run.json").read_text())["completed"] is False
    assert "incomplete run" in (tmp_path / "report.md").read_text()


def test_hf_method_without_transformers_support_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specwood.bench import hf_baseline

    monkeypatch.setattr(hf_baseline, "HAVE_TRANSFORMERS", False)
    with pytest.raises(SpecwoodError, match="need Hugging Face transformers: pip install transformers"):
        run_bench(FakeEngine(), _wl(), ["ar", "hf"], tmp_path, progress=False)


# ----------------------------------------------------------------------------------- HF timing bits
def test_timing_streamer() -> None:
    import torch

    from specwood.bench.hf_baseline import TimingStreamer

    s = TimingStreamer()
    s.t0 = 100.0
    s.put(torch.tensor([[1, 2, 3]]))  # the prompt: ignored
    for t, chunk in ((100.5, [5]), (100.6, [6]), (100.9, [7, 8, 9])):
        s.put(torch.tensor([chunk]))
        s.times[-1] = t  # deterministic clock
    assert s.sizes == [1, 1, 3]
    assert s.ttft_s() == pytest.approx(0.5)
    assert s.tbt_ms_p50() == pytest.approx(100.0)  # median of 100 ms and 300/3 ms


def test_hf_generation_config() -> None:
    pytest.importorskip("transformers")
    from specwood.bench.hf_baseline import HFBaseline

    hf = HFBaseline.__new__(HFBaseline)  # no models needed for the config
    hf.eos = [0, 5]
    g = hf.generation_config("hf", 12, {"temperature": 0.0, "top_p": 1.0, "top_k": 0})
    assert g.do_sample is False and g.max_new_tokens == 12 and g.eos_token_id == [0, 5] and not g.top_k
    g = hf.generation_config("hf-pld", 12, {"temperature": 0.8, "top_p": 0.9, "top_k": 0})
    assert g.do_sample and g.temperature == 0.8 and g.top_p == 0.9 and g.top_k == 0
    assert g.prompt_lookup_num_tokens == 10


# ---------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specwood")
    add_bench_parser(p.add_subparsers(dest="command"))
    return p


def test_cli_parses_all_options() -> None:
    a = _parser().parse_args(
        "bench --workload builtin --methods ar,hf --max-tokens 32 --temperature 0.5 --top-p 0.9 --top-k 40 "
        "--seed 3 --target t --draft d --dtype fp32 --limit 5 --categories code,math --out o --budget 16 "
        "--depth 4 --topk 2 --threshold 0.1".split())
    assert a.func is run_bench_cli and a.categories == ["code", "math"] and a.max_tokens == 32
    assert (a.budget, a.depth, a.topk, a.threshold, a.dtype, a.seed) == (16, 4, 2, 0.1, "fp32", 3)


def test_cli_errors_before_loading_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n{"id": 2,\n')
    for argv in (["bench", "--workload", str(bad)],
                 ["bench", "--categories", "nope"],
                 ["bench", "--temperature", "-1"],
                 ["bench", "--max-tokens", "0"]):
        assert run_bench_cli(_parser().parse_args(argv + ["--out", str(tmp_path / "o")])) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("specwood bench: error: ") and "\n" not in err, err


# --------------------------------------------------------------- end to end: specwood.load + HF folder
def _bench_tokenizer() -> Any:
    """A byte-level tokenizer whose only special token is the EOS, with a plain-text chat template:
    no end-of-turn marker the random model could hit after one token, so generations run long
    enough for a meaningful token-by-token comparison."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256  # the tiny models' EOS id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    return fast


def _save_pair(tmp_path: Path, tiny_pair: Any) -> tuple[Path, Path]:
    """The shared tiny target/draft pair saved as Hugging Face folders (weights + tokenizer)."""
    from specwood.models.testing import save_hf_folder

    tokenizer = _bench_tokenizer()
    paths = []
    for name, model in (("target", tiny_pair.target), ("draft", tiny_pair.draft)):
        folder = save_hf_folder(tmp_path / name, model.config, model.canonical_state_dict())
        tokenizer.save_pretrained(str(folder))
        paths.append(folder)
    return paths[0], paths[1]


E2E_PROMPTS = [
    '{"id": "chat-1", "category": "chat", "messages": [{"role": "user", "content": "Say hello to the world."}]}',
    '{"id": "code-1", "category": "code", "prompt": "def add(a, b):\\n    return a + b\\n\\ndef sub(a, b):\\n"}',
    '{"id": "chat-2", "category": "chat", "messages": [{"role": "system", "content": "Be brief."}, '
    '{"role": "user", "content": "Name three colours."}]}',
]


def test_end_to_end_ar_matches_hf(tmp_path: Path, tiny_pair: Any) -> None:
    pytest.importorskip("transformers")
    import specwood

    target, draft = _save_pair(tmp_path, tiny_pair)
    engine = specwood.load(str(target), str(draft), dtype="fp32", progress=False)
    wl_file = tmp_path / "w.jsonl"
    wl_file.write_text("\n".join(E2E_PROMPTS) + "\n")
    out = tmp_path / "out"
    recs = run_bench(engine, load_workload(wl_file), "ar,hf,hf-pld,hf-assisted", out, max_tokens=12, progress=False)

    assert len(recs) == 12 and not [r for r in recs if r.get("error")]
    by = {(r["id"], r["method"]): r for r in recs}
    assert max(by[(p, "ar")]["new_tokens"] for p in ("chat-1", "code-1", "chat-2")) >= 8  # a real comparison
    for pid in ("chat-1", "code-1", "chat-2"):
        ar = by[(pid, "ar")]
        assert ar["new_tokens"] >= 1 and ar["prompt_tokens"] == by[(pid, "hf")]["prompt_tokens"]
        for m in ("hf", "hf-pld", "hf-assisted"):
            # same weights, same ids, same EOS, fp32 greedy: token-identical
            assert by[(pid, m)]["token_ids"] == ar["token_ids"], (pid, m)
            assert by[(pid, m)]["text"] == ar["text"] and by[(pid, m)]["matches_ar"] is True
    for f in ("results.json", "run.json", "report.md", "tokens_per_s.png", "speedup_vs_ar.png", "aat.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    run = json.loads((out / "run.json").read_text())
    assert run["dtype"] == "fp32" and run["target"] == str(target) and run["draft"] == str(draft)
    assert run["completed"] and run["workload"]["categories"] == {"chat": 2, "code": 1}
    md = (out / "report.md").read_text()
    assert "vs hf" in md and "| **overall** | hf | 3 |" in md and "3/3" in md


def test_end_to_end_cli(tmp_path: Path, tiny_pair: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    target, _ = _save_pair(tmp_path, tiny_pair)
    wl_file = tmp_path / "w.jsonl"
    wl_file.write_text("\n".join(E2E_PROMPTS) + "\n")
    out = tmp_path / "cli-out"
    args = _parser().parse_args(["bench", "--workload", str(wl_file), "--methods", "ar,hf", "--max-tokens", "6",
                                 "--target", str(target), "--dtype", "fp32", "--categories", "chat",
                                 "--limit", "1", "--out", str(out), "--no-progress"])
    assert run_bench_cli(args) == 0
    printed = capsys.readouterr().out
    assert "| **overall** | hf | 1 |" in printed  # the markdown table goes to stdout too
    recs = json.loads((out / "results.json").read_text())
    assert [(r["id"], r["method"]) for r in recs] == [("chat-1", "ar"), ("chat-1", "hf")]
    assert recs[0]["token_ids"] == recs[1]["token_ids"]


def test_hf_assisted_needs_a_draft(tmp_path: Path, tiny_pair: Any) -> None:
    import specwood

    target, _ = _save_pair(tmp_path, tiny_pair)
    engine = specwood.load(str(target), None, dtype="fp32", progress=False)
    with pytest.raises(SpecwoodError, match="'hf-assisted' needs a draft model"):
        run_bench(engine, _wl(), ["hf-assisted"], tmp_path / "o", progress=False)
