"""Autoregressive generation on tiny models: stopping, streaming, sampling, bad input; and every
speculative method token-identical to it under greedy decoding."""
import pytest
import torch

from specwood.errors import ContextLengthError, SamplingParamsError, SpecwoodError

PROMPT = "def add(a, b):"


def test_greedy_is_deterministic_and_streams_the_same_text(tiny_engine):
    chunks = []
    a = tiny_engine.generate(PROMPT, max_tokens=20, raw=True, on_text=chunks.append)
    b = tiny_engine.generate(PROMPT, max_tokens=20, raw=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert "".join(chunks) == a.text
    assert a.finish_reason == "length"
    assert a.stats["new_tokens"] == 20 and a.stats["method"] == "ar"
    assert a.stats["tokens_per_s"] > 0 and a.stats["ttft_s"] > 0


def test_matches_naive_full_recompute(tiny_engine):
    ids = tiny_engine.encode(PROMPT, raw=True)
    out = tiny_engine.generate(PROMPT, max_tokens=16, raw=True).token_ids
    seq = list(ids)
    model = tiny_engine.target
    for _ in range(16):
        logits = model(torch.tensor([seq]), torch.arange(len(seq)))[0, -1]
        seq.append(int(logits[:tiny_engine.emit_limit].argmax()))  # never a padding id past the tokenizer's
    assert out == seq[len(ids):]


def test_eos_stops_and_is_not_emitted(tiny_engine):
    ref = tiny_engine.generate(PROMPT, max_tokens=12, raw=True).token_ids
    eos = ref[5]
    first = ref.index(eos)
    saved = tiny_engine.eos_token_ids
    tiny_engine.eos_token_ids = {eos}
    try:
        out = tiny_engine.generate(PROMPT, max_tokens=12, raw=True)
    finally:
        tiny_engine.eos_token_ids = saved
    assert out.token_ids == ref[:first] and out.finish_reason == "stop"


def test_stop_string_truncates_text_and_streams_nothing_past_it(tiny_engine):
    ref = tiny_engine.generate(PROMPT, max_tokens=24, raw=True)
    assert len(ref.text) > 6
    stop = ref.text[4:6]
    chunks = []
    out = tiny_engine.generate(PROMPT, max_tokens=24, raw=True, stop=[stop], on_text=chunks.append)
    assert out.finish_reason == "stop"
    assert out.text == ref.text[: ref.text.find(stop)]
    assert "".join(chunks) == out.text
    assert stop not in out.text


def test_sampling_is_reproducible_with_seed_and_varies_without(tiny_engine):
    a = tiny_engine.generate(PROMPT, max_tokens=16, raw=True, temperature=1.5, seed=7)
    b = tiny_engine.generate(PROMPT, max_tokens=16, raw=True, temperature=1.5, seed=7)
    c = tiny_engine.generate(PROMPT, max_tokens=16, raw=True, temperature=1.5, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_chat_template_is_applied_by_default(tiny_engine):
    chat = tiny_engine.encode("hi")
    raw = tiny_engine.encode("hi", raw=True)
    assert len(chat) > len(raw)
    assert tiny_engine.tokenizer.decode(chat).startswith("<|im_start|>user")


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2 ** 64), "seed"),  # beyond torch.Generator's seeds
])
def test_invalid_sampling_params(tiny_engine, kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        tiny_engine.generate(PROMPT, max_tokens=4, raw=True, **kwargs)


def test_bad_max_tokens_and_prompt_too_long(tiny_engine):
    with pytest.raises(SpecwoodError, match="max_tokens"):
        tiny_engine.generate(PROMPT, max_tokens=0, raw=True)
    with pytest.raises(ContextLengthError, match="context holds"):
        tiny_engine.generate("x" * (tiny_engine.max_context + 5), max_tokens=4, raw=True)


def test_generation_near_the_context_end_stops_at_length(tiny_engine):
    ids = tiny_engine.encode("y" * (tiny_engine.max_context - 3), raw=True)
    out = tiny_engine.generate(ids, max_tokens=50)
    assert out.finish_reason == "length" and len(out.token_ids) == tiny_engine.max_context - len(ids)


def test_incremental_detokenisation_matches_full_decode(tiny_tokenizer):
    """Text is built from a short window per token (no O(n^2) re-decoding), yet equals decoding
    everything at once, multi-byte characters split over byte tokens included; the stream never
    shows half a character."""
    import random

    from specwood.engine.output import OutputStream

    ids = tiny_tokenizer.encode("héllo wörld — 你好, ünïcödé 🎉\n  x", add_special_tokens=False)
    for trial in range(30):
        rnd = random.Random(trial)
        seq = ids + [rnd.randrange(0, 259) for _ in range(40)]
        pieces: list[str] = []
        out = OutputStream(tiny_tokenizer, 1, 1000, set(), None, pieces.append)
        i = 0
        while i < len(seq):
            k = rnd.randint(1, 4)
            out.push_step(seq[i:i + k])
            i += k
        result = out.finish("ar")
        assert result.text == tiny_tokenizer.decode(seq, skip_special_tokens=True)
        assert "".join(pieces) == result.text
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in tiny_tokenizer.decode(seq)


def test_stop_strings_cut_where_the_first_one_completes(tiny_tokenizer):
    """OutputStream's stop check (one KMP automaton per string, linear in the text) against brute
    force: the text is cut at the stop string that completes first (the earliest starting of
    those), the stream never shows a character past the cut, and a partial match is held back."""
    import random

    from specwood.engine.output import OutputStream

    for trial in range(300):
        rnd = random.Random(trial)
        text = "".join(rnd.choice("abc ") for _ in range(rnd.randint(1, 60)))
        stops = ["".join(rnd.choice("ab") for _ in range(rnd.randint(1, 5))) for _ in range(rnd.randint(1, 4))]
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        pieces: list[str] = []
        out = OutputStream(tiny_tokenizer, 1, 1000, set(), stops, pieces.append)
        i = 0
        while i < len(ids) and not out.finished:
            k = rnd.randint(1, 3)
            out.push_step(ids[i:i + k])
            i += k
        result = out.finish("ar")
        want = text
        for end in range(1, len(text) + 1):
            starts = [end - len(s) for s in stops if text[:end].endswith(s)]
            if starts:
                want = text[:min(starts)]
                break
        assert result.text == want, (text, stops)
        assert "".join(pieces) == want
