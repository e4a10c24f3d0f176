"""Per-path logits processors (specwood.constrain): every method's constrained greedy output is
token-identical to constrained `ar` (fp32 tiny models), with grammars that force long runs, that
allow only a few tokens and that end the output, and with penalties and logit_bias; requests with
and without processors share a step; logprobs match `ar`'s; bad input is one line."""
from __future__ import annotations

import llguidance
import pytest
import torch

from specwood.constrain.processors import Processors, tree_paths
from specwood.engine.api import Engine
from specwood.engine.scheduler import TREE_ROOM, SchedulerConfig
from specwood.errors import GrammarError, SamplingParamsError
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

METHODS = ["chain", "static", "sequoia", "eagle", "dyspec", "dyspec-threshold", "pld", "early-exit", "head", "auto"]
LARK = llguidance.LLMatcher.grammar_from_lark

GRAMMARS = {
    # a long forced run, a short free part, then the end (EOS is the only token left)
    "forced": LARK('start: "The quick brown fox jumps over the lazy dog: " /[a-z]{2,6}/ "."'),
    # a handful of tokens allowed at every step, then the end
    "few": LARK('start: /[01]{4,24}/ ";"'),
    # JSON with fixed keys (forced) and free values
    "json": llguidance.LLMatcher.grammar_from_json_schema({
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "green", "blue"]},
                                         "name": {"type": "string", "maxLength": 6}},
        "required": ["id", "tag", "name"], "additionalProperties": False},
        overrides={"whitespace_flexible": False}),
}
SHAPING = [dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.3),
           dict(logit_bias={101: 6.0, 32: -100.0}, repetition_penalty=0.8)]


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_constrained_greedy_is_identical_to_ar(tiny_engine, name):
    grammar = GRAMMARS[name]
    for prompt in ("def add(a, b):", "Once upon a time"):
        ref = tiny_engine.generate(prompt, max_tokens=60, raw=True, grammar=grammar)
        assert ref.finish_reason == "stop", ref.text  # the grammar ends the output
        _check_text(name, ref.text)
        for method in METHODS:
            out = tiny_engine.generate(prompt, max_tokens=60, raw=True, grammar=grammar, method=method)
            assert out.token_ids == ref.token_ids, (method, prompt, out.text, ref.text)
            assert out.finish_reason == "stop"
            if name == "forced":  # the forced run is verified as free candidates, not drafted
                assert out.stats["grammar_forced_tokens"] >= 30, (method, out.stats)


def _check_text(name: str, text: str) -> None:
    import json
    import re

    if name == "forced":
        assert re.fullmatch(r"The quick brown fox jumps over the lazy dog: [a-z]{2,6}\.", text), text
    elif name == "few":
        assert re.fullmatch(r"[01]{4,24};", text), text
    else:
        obj = json.loads(text)
        assert set(obj) == {"id", "tag", "name"} and obj["tag"] in ("red", "green", "blue"), text


@pytest.mark.parametrize("shaping", SHAPING, ids=["penalties", "bias"])
def test_penalties_and_bias_are_identical_to_ar(tiny_engine, shaping):
    plain = tiny_engine.generate("1, 2, 3, 4, 5, 1, 2, 3,", max_tokens=40, raw=True)
    ref = tiny_engine.generate("1, 2, 3, 4, 5, 1, 2, 3,", max_tokens=40, raw=True, **shaping)
    assert ref.token_ids != plain.token_ids  # the processors change the output
    for method in METHODS:
        out = tiny_engine.generate("1, 2, 3, 4, 5, 1, 2, 3,", max_tokens=40, raw=True, method=method, **shaping)
        assert out.token_ids == ref.token_ids, method


def test_sampled_output_always_follows_the_grammar(tiny_engine):
    """Sampling through every tree shape (masked draft q, processed target rows): the text is in
    the grammar's language and ends where it does; seeded runs repeat."""
    for name in ("few", "json"):
        for method in ("ar", "chain", "static", "dyspec", "eagle", "pld"):
            for seed in (1, 2):
                kw = dict(max_tokens=60, raw=True, grammar=GRAMMARS[name], method=method, temperature=1.0,
                          top_p=0.95, seed=seed, presence_penalty=0.4)
                out = tiny_engine.generate("Once upon a time", **kw)
                assert out.finish_reason == "stop", (name, method, out.text)
                _check_text(name, out.text)
                assert tiny_engine.generate("Once upon a time", **kw).token_ids == out.token_ids


def test_draft_equal_to_target_with_a_grammar_accepts_long_paths(tiny_pair, tiny_tokenizer):
    """Accepted paths run through the forced parts and into the end (EOS inside a tree)."""
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.target)
    for grammar in GRAMMARS.values():
        ref = engine.generate("x", max_tokens=60, raw=True, grammar=grammar, frequency_penalty=0.3)
        for method in ("chain", "dyspec", "eagle"):
            out = engine.generate("x", max_tokens=60, raw=True, grammar=grammar, frequency_penalty=0.3,
                                  method=method, budget=16)
            assert out.token_ids == ref.token_ids and out.finish_reason == "stop", method
            assert out.stats["mean_accepted_tokens"] > 2.0, (method, out.stats)


def test_the_drafter_goes_on_from_the_end_of_a_forced_run(tiny_pair, tiny_tokenizer, monkeypatch):
    """A forced run and the draft after it are verified in ONE target forward (the drafter starts
    from the run's last token, its source reading the run in the same draft forward), and the
    output stays token-identical to `ar`. A step whose tree is the run alone would take one more."""
    import specwood.engine.sequential as sequential

    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.target)
    real, grafted = sequential.commit, []

    def watch(cache, request, tree, verdict, cost, forced=0):  # an observer around the real commit
        if forced and len(tree) > forced + 1:  # a tree that starts with a forced run of `forced` nodes
            grafted.append((forced, len(tree)))
        return real(cache, request, tree, verdict, cost, forced)

    monkeypatch.setattr(sequential, "commit", watch)
    for grammar in (GRAMMARS["forced"], GRAMMARS["json"]):
        ref = engine.generate("x", max_tokens=60, raw=True, grammar=grammar)
        for method in ("chain", "dyspec", "pld", "auto"):
            grafted.clear()
            budget = {} if method == "auto" else {"budget": 8}
            out = engine.generate("x", max_tokens=60, raw=True, grammar=grammar, method=method, **budget)
            assert out.token_ids == ref.token_ids, (method, out.text, ref.text)
            if method != "auto":  # auto may judge a plain step after the run the better buy
                assert grafted, method
            if method == "chain":  # draft == target: the drafted part after a run is accepted
                assert out.stats["mean_accepted_tokens"] > 2.0, out.stats


def test_constrained_and_plain_requests_share_a_step(tiny_engine):
    grammar = GRAMMARS["json"]
    cases = [("ar", {}), ("dyspec", dict(grammar=grammar)), ("chain", {}), ("eagle", dict(grammar=GRAMMARS["few"])),
             ("pld", dict(frequency_penalty=1.0)), ("dyspec", dict(logit_bias={101: 5.0}))]
    prompts = ["def add(a, b):", "Once upon a time", "1, 2, 3,", "x = [", "hello hello", "abc"]
    refs = [tiny_engine.generate(p, max_tokens=30, raw=True, **kw).token_ids for p, (_, kw) in zip(prompts, cases)]
    sched = tiny_engine.make_scheduler(SchedulerConfig(max_batch=len(cases), row_len=256 + TREE_ROOM))
    reqs = [tiny_engine.new_request(p, max_tokens=30, raw=True, method=m, scheduler=sched, **kw)
            for p, (m, kw) in zip(prompts, cases)]
    assert reqs[0].processors is None and reqs[2].processors is None  # plain requests pay nothing
    for r in reqs:
        sched.submit(r)
    sched.run_until_done(reqs)
    assert [r.result.token_ids for r in reqs] == refs


def test_logprobs_match_ar_whichever_method(tiny_engine):
    kw = dict(max_tokens=30, raw=True, grammar=GRAMMARS["json"], frequency_penalty=0.5, logprobs=3)
    ref = tiny_engine.generate("Once upon a time", **kw)
    assert len(ref.logprobs) == len(ref.token_ids)
    for lp, t in zip(ref.logprobs, ref.token_ids):
        assert lp.token == t and len(lp.top) <= 3 and lp.top[0][1] >= lp.logprob - 1e-6
    for method in ("dyspec", "eagle", "pld"):
        out = tiny_engine.generate("Once upon a time", method=method, **kw)
        assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert tiny_engine.generate("Once upon a time", max_tokens=5, raw=True).logprobs is None


def test_streamed_logprobs_grow_with_the_text(tiny_engine):
    seen: list[tuple[str, int]] = []
    req = tiny_engine.new_request("abc", max_tokens=12, raw=True, logprobs=0, method="dyspec",
                                  on_text=lambda text: seen.append((text, len(req.out.logprobs))))
    result = tiny_engine.run(req)
    assert seen and seen[-1][1] == len(result.token_ids) == len(result.logprobs)
    assert all(lp.top == [] for lp in result.logprobs)


def test_tree_paths_and_pruning_keep_only_allowed_nodes(tiny_tokenizer):
    from specwood.constrain.drafting import prune_refused
    from specwood.constrain.matcher import grammar_matcher, ll_tokenizer

    ll = ll_tokenizer(tiny_tokenizer, 264, {256})
    matcher = grammar_matcher(ll, LARK('start: "ab" /[cd]+/'))
    proc = Processors(SamplingParams(grammar="x"), [1, 2], 264, matcher, {256})
    a, b, c, d = (tiny_tokenizer.convert_tokens_to_ids(ch) for ch in "abcd")
    proc.commit([a])  # the root: "a" emitted
    tree = TokenTree.with_root(a)
    n1 = tree.add_node(0, b)  # "ab": allowed
    tree.add_node(0, c)  # "ac": refused
    n3 = tree.add_node(n1, d)  # "abd"
    tree.add_node(n3, a)  # "abda": refused
    assert tree_paths(tree) == [(), (b,), (c,), (b, d), (b, d, a)]
    pruned = prune_refused(tree, proc)
    assert pruned.tokens == [a, b, d] and pruned.parents == [-1, 0, 1] and proc.pruned == 2
    rows = proc.tree_rows(pruned, torch.zeros(3, 264))
    allowed = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in rows]
    assert allowed[0] == {b} and allowed[1] == {c, d} and allowed[2] == {c, d, 256}
    assert not matcher.is_error() and proc.valid([()]) == [True]


def test_bad_input_is_one_line(tiny_engine):
    with pytest.raises(GrammarError, match="grammar"):
        tiny_engine.generate("x", max_tokens=4, grammar="start: nothing_here")
    with pytest.raises(SamplingParamsError, match="logit_bias token id 9999"):
        tiny_engine.generate("x", max_tokens=4, logit_bias={9999: 1.0})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        tiny_engine.generate("x", max_tokens=4, logit_bias={3: 101})
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(min_p=1.5), dict(logprobs=21), dict(logprobs=-1)):
        name = next(iter(bad))
        with pytest.raises(SamplingParamsError, match=name):
            tiny_engine.generate("x", max_tokens=4, **bad)
    with pytest.raises(SamplingParamsError, match="not both"):
        tiny_engine.generate("x", max_tokens=4, grammar=GRAMMARS["few"], json_schema={"type": "object"})


def test_cli_grammar_and_json_schema(tiny_folder, tmp_path):
    import json
    import re

    from test_cli import assert_one_line_error, run

    (tmp_path / "g.lark").write_text('start: "answer: " /[0-9]{1,3}/ "!"\n')
    base = ("generate", "hi", "--target", str(tiny_folder), "--draft", str(tiny_folder), "--dtype", "fp32", "--raw",
            "--json", "--max-tokens", "40")
    p = run(*base, "--grammar", str(tmp_path / "g.lark"), "--method", "dyspec", "--logprobs", "2", cache=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert re.fullmatch(r"answer: [0-9]{1,3}!", out["text"]) and out["finish_reason"] == "stop"
    assert len(out["logprobs"]) == len(out["token_ids"])
    (tmp_path / "bad.json").write_text("{not json")
    assert_one_line_error(run(*base, "--json-schema", str(tmp_path / "bad.json"), cache=tmp_path), "--json-schema")


def test_json_schema_argument(tiny_engine):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    for method in ("ar", "dyspec"):
        out = tiny_engine.generate("x", max_tokens=30, raw=True, json_schema=schema, method=method)
        assert json.loads(out.text).keys() == {"ok"} and out.finish_reason == "stop"
    with pytest.raises(SamplingParamsError, match="json_schema"):
        tiny_engine.generate("x", max_tokens=4, json_schema="not a dict")


def test_forced_control_token_text_is_written_as_text(tiny_engine, tiny_tokenizer):
    """A grammar that forces the text of a control token (<|im_end|>, 258 in the tiny vocabulary)
    writes it in text tokens: llguidance's forced tokens come from our tokenizer, which reads
    added tokens' text as text (its own turned it into token 258, which the grammar refuses)."""
    import json

    schema = {"type": "object", "properties": {"t": {"enum": ["<|im_end|>"]}}, "required": ["t"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    ref = tiny_engine.generate("x", max_tokens=40, raw=True, json_schema=schema)
    assert json.loads(ref.text) == {"t": "<|im_end|>"} and ref.finish_reason == "stop", ref.text
    assert 258 not in ref.token_ids
    for method in ("dyspec", "chain"):  # lossless through the forced run
        assert tiny_engine.generate("x", max_tokens=40, raw=True, json_schema=schema, method=method).token_ids \
            == ref.token_ids, method


def test_penalties_follow_openai_and_hf_semantics():
    """Presence/frequency count generated tokens (committed + path), repetition every token of
    prompt + output; bias is added first (reference written densely, one row at a time)."""
    V, prompt = 12, [1, 2, 2, 9]
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.6,
                            logit_bias=((4, 2.0), (5, -1.0)))
    proc = Processors(params, prompt, V)
    proc.commit([3, 4, 3])
    paths = [(), (5,), (5, 3), (1, 1, 7)]
    logits = torch.randn(len(paths), V, generator=torch.Generator().manual_seed(0)) * 3
    got = proc.rows(logits, paths)
    for i, path in enumerate(paths):
        generated = [3, 4, 3] + list(path)
        want = logits[i].clone()
        want[4] += 2.0
        want[5] -= 1.0
        for t in set(prompt + generated):
            want[t] = want[t] / 1.6 if want[t] > 0 else want[t] * 1.6
        for t in set(generated):
            want[t] -= 0.7 * generated.count(t) + 0.3
        torch.testing.assert_close(got[i], want)
