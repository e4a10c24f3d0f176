"""Every speculative method is lossless under greedy decoding (token-identical to our AR, fp32),
stops exactly where AR stops, and reaches near-perfect acceptance when draft == target."""
import pytest

from specwood.engine.api import Engine
from specwood.errors import SpecwoodError

METHODS = ["chain", "static", "sequoia", "eagle", "dyspec", "dyspec-threshold", "pld", "early-exit"]
PROMPTS = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 5, 1, 2, 3,"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_to_autoregressive(tiny_engine, method):
    for prompt in PROMPTS:
        ref = tiny_engine.generate(prompt, max_tokens=40, raw=True)
        out = tiny_engine.generate(prompt, max_tokens=40, raw=True, method=method)
        assert out.token_ids == ref.token_ids, (method, prompt)
        assert out.text == ref.text
        s = out.stats
        assert s["method"] == method and s["mean_accepted_tokens"] >= 1.0 and 0 <= s["acceptance_rate"] <= 1


@pytest.mark.parametrize("method,options", [
    ("chain", dict(budget=4)), ("static", {}), ("sequoia", dict(budget=16)),
    ("dyspec", dict(budget=24)), ("dyspec-threshold", dict(threshold=0.05, budget=24)),
])
def test_draft_equal_to_target_accepts_everything(tiny_pair, tiny_tokenizer, method, options):
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.target)
    ref = engine.generate(PROMPTS[0], max_tokens=48, raw=True)
    out = engine.generate(PROMPTS[0], max_tokens=48, raw=True, method=method, **options)
    assert out.token_ids == ref.token_ids
    s = out.stats
    assert s["acceptance_rate"] >= 0.98, s
    # every step's deepest path is accepted whole: AAT = tree depth + 1 (bonus token)
    assert s["mean_accepted_tokens"] >= 0.98 * (s["mean_tree_depth"] + 1), s


def test_eagle_with_draft_equal_to_target_always_holds_the_first_token(tiny_pair, tiny_tokenizer):
    # EAGLE-2 reranks by cumulative draft probability, so the greedy path may be pruned below
    # depth 1 (a sibling branch can be likelier); its top-k at depth 1 always holds the argmax.
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.target)
    ref = engine.generate(PROMPTS[0], max_tokens=48, raw=True)
    out = engine.generate(PROMPTS[0], max_tokens=48, raw=True, method="eagle", budget=16, depth=4, topk=3)
    assert out.token_ids == ref.token_ids
    assert out.stats["acceptance_by_depth"][0] >= 0.98
    assert out.stats["mean_accepted_tokens"] >= 2.0


@pytest.mark.parametrize("method", ["chain", "dyspec", "eagle"])
def test_eos_and_stop_strings_inside_an_accepted_path(tiny_pair, tiny_tokenizer, method):
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.target)  # long accepted paths
    ref = engine.generate(PROMPTS[1], max_tokens=30, raw=True)
    stop = ref.text[7:9]
    a = engine.generate(PROMPTS[1], max_tokens=30, raw=True, stop=[stop])
    b = engine.generate(PROMPTS[1], max_tokens=30, raw=True, stop=[stop], method=method)
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason) and a.finish_reason == "stop"
    assert b.token_ids == a.token_ids
    engine.eos_token_ids = {ref.token_ids[6]}
    a = engine.generate(PROMPTS[1], max_tokens=30, raw=True)
    b = engine.generate(PROMPTS[1], max_tokens=30, raw=True, method=method)
    assert a.token_ids == b.token_ids and b.finish_reason == "stop"
    c = engine.generate(PROMPTS[1], max_tokens=5, raw=True, method=method)
    assert c.token_ids == ref.token_ids[:5] and c.finish_reason == "length"


def test_sampling_runs_and_is_reproducible(tiny_engine):
    for method in ["chain", "dyspec", "eagle", "dyspec-threshold", "static"]:
        a = tiny_engine.generate(PROMPTS[0], max_tokens=20, raw=True, method=method, temperature=0.8, top_p=0.9, seed=3)
        b = tiny_engine.generate(PROMPTS[0], max_tokens=20, raw=True, method=method, temperature=0.8, top_p=0.9, seed=3)
        assert a.token_ids == b.token_ids and a.token_ids and (len(a.token_ids) == 20 or a.finish_reason == "stop")


def test_method_errors(tiny_pair, tiny_tokenizer, tiny_engine):
    no_draft = Engine(tiny_pair.target, tiny_tokenizer)
    with pytest.raises(SpecwoodError, match="needs a draft model"):
        no_draft.generate(PROMPTS[0], max_tokens=4, raw=True, method="dyspec")
    assert no_draft.generate(PROMPTS[0], max_tokens=4, raw=True, method="pld").token_ids
    with pytest.raises(SpecwoodError, match="unknown"):
        tiny_engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="medusa")
    with pytest.raises(SpecwoodError, match="budget"):
        tiny_engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="dyspec", budget=0)
    with pytest.raises(SpecwoodError, match="budget"):
        tiny_engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="dyspec", budget=10**6)
    with pytest.raises(SpecwoodError, match="threshold"):
        tiny_engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="dyspec-threshold", threshold=1.5)


def test_vocabulary_mismatch_is_refused(tiny_pair, tiny_tokenizer, tiny_model_factory):
    other = tiny_model_factory(vocab_size=tiny_pair.target.config.vocab_size + 8, seed=5)
    with pytest.raises(SpecwoodError, match=r"draft vocabulary \(\d+ tokens.*target's \(\d+ tokens"):
        Engine(tiny_pair.target, tiny_tokenizer, draft=other)


def test_shape_options_take_any_spelling_of_the_shape(tiny_engine):
    """A `shape` option is read by its registered name: "Chain" gets early-exit's default chain of
    EARLY_EXIT_DEPTH and takes chain's options, "Dyspec" takes dyspec's; an unknown one is refused."""
    from specwood.methods import EARLY_EXIT_DEPTH

    for spelling in ("chain", "Chain", " CHAIN "):
        shape = tiny_engine.prepare("early-exit", {"shape": spelling})(lambda model: None, 4, 4).shape
        assert shape.name == "chain" and shape.max_nodes == EARLY_EXIT_DEPTH, spelling
    assert tiny_engine.prepare("early-exit", {"shape": "Dyspec", "depth": 3})(lambda model: None, 4, 4).shape.name \
        == "dyspec"
    with pytest.raises(SpecwoodError, match="does not use option"):
        tiny_engine.prepare("early-exit", {"shape": "Chain", "topk": 2})
    with pytest.raises(SpecwoodError, match="unknown tree shape 'medusa'"):
        tiny_engine.prepare("early-exit", {"shape": "medusa"})
