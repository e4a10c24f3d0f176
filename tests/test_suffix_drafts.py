"""`--method suffix` and the global suffix cache on the tiny models: greedy token-identical to
`ar` with the cache cold, warm and evicting; only committed answers enter it; bad options."""
from __future__ import annotations

import pytest

from specwood.drafting.suffix_source import SuffixCache, suffix_cache_for
from specwood.engine.api import Engine
from specwood.errors import SpecwoodError

PROMPTS = ["1, 2, 3, 4, 5, 1, 2, 3,", "def add(a, b):", "Once upon a time"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair():
    from conftest import make_tiny_model, perturbed_copy

    target = make_tiny_model(seed=0)
    return target, perturbed_copy(target, 0.3, seed=1)


@pytest.fixture()
def engine(pair, tiny_tokenizer):
    return Engine(pair[0], tiny_tokenizer, draft=pair[1], target_name="tiny")


@pytest.mark.parametrize("cache_tokens", [None, 40])  # the default bound, and one that evicts at once
def test_suffix_is_greedy_identical_cold_warm_and_evicting(engine, cache_tokens):
    cache = suffix_cache_for(engine, cache_tokens)
    cache.clear()
    refs = {p: engine.generate(p, max_tokens=40, raw=True).token_ids for p in PROMPTS}
    aat = {}
    for rnd in ("cold", "warm"):
        for p in PROMPTS:
            out = engine.generate(p, max_tokens=40, raw=True, method="suffix", suffix_cache_tokens=cache_tokens)
            assert out.token_ids == refs[p], (rnd, p)
            aat[rnd, p] = out.stats["mean_accepted_tokens"]
    assert cache.answers == 2 * len(PROMPTS)
    assert cache.size <= cache.capacity
    if cache_tokens is None:  # a warm cache holds every earlier answer: the repeats draft them whole
        assert all(aat["warm", p] > 5 * aat["cold", p] or aat["warm", p] > 10 for p in PROMPTS), aat
        assert cache.stats()["hit_rate"] > 0


def test_the_global_cache_holds_committed_answers_only(engine):
    cache = suffix_cache_for(engine)
    cache.clear()
    out = engine.generate(PROMPTS[1], max_tokens=20, raw=True, method="suffix")
    # the answer (and a few prompt tokens before it) is in the index, in order, and nothing else
    live = [cache.index.token_at(p) for p in range(cache.index.base, cache.index.total)]
    assert live[-1] == -1 and -1 not in live[:-1]  # the answer is one closed document
    assert live[:-1][-len(out.token_ids):] == out.token_ids
    assert len(live) - 1 <= len(out.token_ids) + 4


def test_suffix_under_sampling_keeps_running_and_seeded_runs_repeat(engine):
    cache = suffix_cache_for(engine)
    cache.clear()
    a = engine.generate(PROMPTS[0], max_tokens=30, raw=True, method="suffix", temperature=0.8, seed=3)
    b = engine.generate(PROMPTS[0], max_tokens=30, raw=True, method="ar", temperature=0.8, seed=3)
    assert len(a.token_ids) == len(b.token_ids) == 30


def test_bad_suffix_options_are_one_line_errors(engine):
    with pytest.raises(SpecwoodError, match="suffix_cache_tokens"):
        engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="suffix", suffix_cache_tokens=0)
    with pytest.raises(SpecwoodError, match="budget"):
        engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="suffix", budget=0)
    with pytest.raises(SpecwoodError, match="does not use"):
        engine.generate(PROMPTS[0], max_tokens=4, raw=True, method="suffix", topk=3)


def test_concurrent_answers_keep_the_cache_consistent():
    import threading

    cache = SuffixCache(500)
    answers = [[(k * 7 + i) % 50 for i in range(30)] for k in range(8)]

    def writer(k: int) -> None:
        for _ in range(20):
            cache.add_answer([1, 2, 3, 4], answers[k])
            cache.find(answers[k][:5], 8)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index = cache.index
    assert cache.answers == 160 and index.size == 500
    # every live document is one whole answer with its lead, never two interleaved
    live = [index.token_at(p) for p in range(index.base, index.total)]
    docs = [d for d in " ".join(map(str, live)).split("-1") if d.strip()][1:-1]  # the ends may be cut
    for d in docs:
        assert [int(x) for x in d.split()] in [[1, 2, 3, 4, *a] for a in answers]
