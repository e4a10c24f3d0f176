"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32: every speculative method
emits exactly our autoregressive greedy tokens (64 per prompt), with stop strings honoured."""
import pytest

METHODS = ["chain", "static", "sequoia", "eagle", "dyspec", "dyspec-threshold", "pld", "early-exit"]
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    [{"role": "user", "content": "Translate to French: The weather is nice today and we are going to the beach."}],
]


_references: list = []


@pytest.fixture()
def references(real_pair_engine_fp32):
    """Our autoregressive outputs, computed once per process (the pair is held only while
    consecutive tests use it: conftest's `_held_models`)."""
    if not _references:  # all or nothing: a failure part way must not leave fewer references
        _references[:] = [real_pair_engine_fp32.generate(p, max_tokens=64) for p in PROMPTS]
    return _references


@pytest.mark.parametrize("method", METHODS)
def test_real_pair_greedy_lossless(real_pair_engine_fp32, references, method):
    for prompt, ref in zip(PROMPTS, references):
        out = real_pair_engine_fp32.generate(prompt, max_tokens=64, method=method)
        assert out.token_ids == ref.token_ids, (method, prompt)
        assert out.stats["mean_accepted_tokens"] >= 1.0


def test_real_pair_stop_string_inside_accepted_path(real_pair_engine_fp32, references):
    ref = references[0]
    stop = "def "
    assert stop in ref.text
    a = real_pair_engine_fp32.generate(PROMPTS[0], max_tokens=64, stop=[stop])
    b = real_pair_engine_fp32.generate(PROMPTS[0], max_tokens=64, stop=[stop], method="dyspec")
    assert a.text == b.text == ref.text[: ref.text.find(stop)]
    assert a.token_ids == b.token_ids and b.finish_reason == "stop"


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "languages": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["Python", "Rust", "Go", "C", "Java"]}}}}


@pytest.mark.parametrize("method", ["chain", "dyspec", "pld", "suffix"])
def test_real_pair_constrained_greedy_lossless(real_pair_engine_fp32, method):
    """A json_schema on the real pair: every method's output token-identical to constrained `ar`,
    valid against the schema, the grammar's forced runs (keys, punctuation) verified as free
    candidates with the draft going on after them."""
    import json

    import jsonschema

    engine = real_pair_engine_fp32
    prompt = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]
    ref = engine.generate(prompt, max_tokens=64, json_schema=PERSON)
    out = engine.generate(prompt, max_tokens=64, json_schema=PERSON, method=method)
    assert out.token_ids == ref.token_ids, (method, out.text, ref.text)
    assert ref.finish_reason == "stop"
    jsonschema.validate(json.loads(ref.text), PERSON)
    assert out.stats["grammar_forced_tokens"] > 0, out.stats
