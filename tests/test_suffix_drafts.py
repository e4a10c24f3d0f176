"""`--method suffix` and the global suffix cache on the tiny models: greedy token-identical to
`ar` with the cache cold, warm and evicting; only committed answers enter it; bad options."""
from __future__ import annotations

import pytest

from specwood.drafting.suffix_source import SuffixCache, suffix_cache_for, suffix_caches
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


def test_seeded_sampling_repeats_whatever_the_cache_holds(engine, private_cache):
    """A seeded request drafts from its own text only: the same seed, the same answer, with the
    global cache cold or warm (filled by the first answer and unseeded ones)."""
    from test_batching import store_auto_plan

    store_auto_plan(engine)
    cache = suffix_cache_for(engine)
    for method in ("suffix", "auto"):
        cache.clear()
        first = engine.generate(PROMPTS[0], max_tokens=30, raw=True, method=method, temperature=0.8, seed=3,
                                progress=False) if method == "auto" else \
            engine.generate(PROMPTS[0], max_tokens=30, raw=True, method=method, temperature=0.8, seed=3)
        engine.generate(PROMPTS[0], max_tokens=30, raw=True, method="suffix", temperature=0.8)
        assert cache.answers == 2
        kw = {"progress": False} if method == "auto" else {}
        again = engine.generate(PROMPTS[0], max_tokens=30, raw=True, method=method, temperature=0.8, seed=3, **kw)
        assert again.token_ids == first.token_ids and len(first.token_ids) == 30, method


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


# --- auto with the suffix source -----------------------------------------------------------------


def test_a_request_indexes_its_context_once_though_the_engine_extends_it_in_place(engine, private_cache):
    """The engine extends a request's context list in place each step. The suffix source must
    carry its index on from it, not index the whole context again every step (it did: the check
    that the context still extends the index read the last token of the live list, which had
    moved on, so every step after the first rebuilt the index: O(context) a step)."""
    from specwood.drafting.suffix_source import SuffixSource

    source = SuffixSource(None, prompt_len=300, max_tokens=64)
    context, root = [i % 37 for i in range(300)], 5
    source.propose(context, root, 16, 16, 0.1)
    first = source.local
    for step in range(20):
        context.extend([root, step % 7])  # a step accepted one token and the bonus is the new root
        root = 11 + step % 3
        source.propose(context, root, 16, 16, 0.1)
    assert source.local is first and source.builds == 1
    assert source.seen == len(context) + 1
    from test_batching import store_auto_plan

    store_auto_plan(engine)
    for method, options in (("suffix", {}), ("auto", {"progress": False})):
        out = engine.generate(PROMPTS[0], max_tokens=40, raw=True, method=method, **options)
        assert out.stats["suffix_steps"] >= 2 and out.stats["suffix_index_builds"] == 1, (method, out.stats)


@pytest.fixture()
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))  # plans from a private store


@pytest.mark.parametrize("cache_tokens", [None, 40])
def test_auto_with_suffix_is_greedy_identical_cold_warm_and_evicting(engine, private_cache, cache_tokens):
    from test_batching import store_auto_plan

    store_auto_plan(engine)
    cache = suffix_cache_for(engine, cache_tokens)
    cache.clear()
    used = {"none": 0, "model": 0, "suffix": 0, "both": 0}
    for rnd in ("cold", "warm"):
        for p in PROMPTS:
            ref = engine.generate(p, max_tokens=40, raw=True).token_ids
            out = engine.generate(p, max_tokens=40, raw=True, method="auto", progress=False,
                                  suffix_cache_tokens=cache_tokens)
            assert out.token_ids == ref, (rnd, p)
            for k, v in out.stats["auto_sources"].items():
                used[k] += v
    assert cache.answers == 2 * len(PROMPTS)
    if cache_tokens is None:  # the repeats find their answers: the suffix drafts (alone or merged)
        assert used["suffix"] + used["both"] > 0 and used["model"] + used["both"] > 0, used


def test_auto_without_a_draft_model_drafts_from_suffixes(pair, tiny_tokenizer, private_cache):
    """No draft model loaded: auto still drafts from the suffix source (it costs no forward), and
    stays greedy-identical to ar; without the suffix source it decodes plainly."""
    engine = Engine(pair[0], tiny_tokenizer, target_name="tiny-alone")
    suffix_cache_for(engine).clear()
    used = {"none": 0, "model": 0, "suffix": 0, "both": 0}
    for _ in range(2):  # the second pass finds the first pass's answers in the global cache
        for p in PROMPTS:
            ref = engine.generate(p, max_tokens=40, raw=True).token_ids
            out = engine.generate(p, max_tokens=40, raw=True, method="auto", progress=False)
            assert out.token_ids == ref, p
            for k, v in out.stats["auto_sources"].items():
                used[k] += v
    assert used["suffix"] > 0 and used["model"] == used["both"] == 0, used
    plain = engine.generate(PROMPTS[0], max_tokens=8, raw=True, method="auto", progress=False, suffix=False)
    assert plain.stats["auto"] == "ar" and "auto_sources" not in plain.stats


def test_auto_with_suffix_under_sampling_runs_and_merges(engine, private_cache):
    from test_batching import store_auto_plan

    store_auto_plan(engine)
    suffix_cache_for(engine).clear()
    for _ in range(2):
        out = engine.generate(PROMPTS[0], max_tokens=40, raw=True, method="auto", progress=False,
                              temperature=0.7, seed=5)
        assert (len(out.token_ids) == 40 or out.finish_reason == "stop") and sum(out.stats["auto_sources"].values()) > 0


def test_concurrent_requests_under_the_batched_scheduler_keep_the_cache_whole(engine, private_cache):
    from specwood.engine.scheduler import SchedulerConfig

    cache = suffix_cache_for(engine, 4096)
    prepared = engine.prepare("suffix", {"suffix_cache_tokens": 4096})
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4), drafts=())
    prompts = [engine.encode(p, raw=True) for p in PROMPTS] * 3
    for rnd in range(2):
        reqs = [engine.new_request(p, max_tokens=24, method="suffix", scheduler=sched, prepared=prepared)
                for p in prompts]
        for r in reqs:
            sched.submit(r)
        while not sched.idle:
            sched.step()
        for p, r in zip(prompts, reqs):
            assert r.error is None
            assert r.result.token_ids == engine.generate(p, max_tokens=24).token_ids
    index = cache.index
    live = [index.token_at(q) for q in range(index.base, index.total)]
    docs = [d for d in " ".join(map(str, live)).split("-1") if d.strip()]
    answers = {tuple(engine.generate(p, max_tokens=24).token_ids) for p in prompts}
    assert len(docs) == 2 * len(prompts)
    for d in docs:  # each document: up to 4 prompt tokens, then one whole answer
        toks = tuple(int(x) for x in d.split())
        assert any(toks[-len(a):] == a and len(toks) - len(a) <= 4 for a in answers), toks


def test_the_server_fills_the_cache_from_concurrent_requests_and_reports_it(engine, private_cache):
    """A real HTTP server (batched scheduler), eight concurrent requests twice: answers equal ar's,
    the global cache holds whole answers, /metrics reports its size and hit rate."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from specwood.serve.app import create_app, server_config
    from test_server import ServerThread

    cache = suffix_cache_for(engine, 4096)
    cache.clear()
    refs = {p: engine.generate(p, max_tokens=24, raw=True).text for p in PROMPTS}
    sched = engine.make_scheduler(server_config(max_batch=4, max_queue=32))
    srv = ServerThread(create_app(engine, sched, method="suffix", options={"suffix_cache_tokens": 4096})).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http:
            def ask(p: str) -> str:
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 24,
                                                       "temperature": 0, "raw": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            for _ in range(2):
                jobs = PROMPTS * 3
                with ThreadPoolExecutor(8) as pool:
                    assert list(pool.map(ask, jobs)) == [refs[p] for p in jobs]
            r = http.get("/metrics")
            m = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    finally:
        srv.stop()
    # the metrics sum the process's caches (one per model; other tests' models may have left theirs)
    others = [c.stats() for c in suffix_caches() if c is not cache]
    assert m["specwood:suffix_cache_tokens"] == cache.size + sum(o["tokens"] for o in others) and cache.size > 0
    assert m["specwood:suffix_cache_capacity_tokens"] == 4096 + sum(o["capacity"] for o in others)
    assert m["specwood:suffix_cache_bytes"] == cache.nbytes + sum(o["bytes"] for o in others) > 0
    assert m["specwood:suffix_cache_answers"] == 18 + sum(o["answers"] for o in others)
    assert 0 < m["specwood:suffix_cache_hit_rate"] <= 1
    live = [cache.index.token_at(q) for q in range(cache.index.base, cache.index.total)]
    docs = [d for d in " ".join(map(str, live)).split("-1") if d.strip()]
    answers = {tuple(engine.generate(p, max_tokens=24, raw=True).token_ids) for p in PROMPTS}
    assert len(docs) == 18
    for d in docs:
        toks = tuple(int(x) for x in d.split())
        assert any(toks[-len(a):] == a and len(toks) - len(a) <= 4 for a in answers), toks


def test_a_deep_chain_refused_at_its_first_token_is_one_miss_not_many():
    """auto's trust in suffix drafts counts the nodes verification tested: a 32-token chain seen
    once and refused at its first token is one miss (the trust stays well above its floor, so the
    request still drafts from suffixes); accepted runs raise it; steps without suffix drafts
    bring it back towards the prior."""
    from specwood.drafting.suffix_tree import continuation_tree
    from specwood.planner.suffix_choice import SuffixTrust, tested_weight

    chain = continuation_tree(7, [list(range(100, 132))], 48, 0.05, 4)
    assert chain.expected == 32  # one occurrence: every node's count ratio is 1
    trust = SuffixTrust()
    prior = trust.ratio(1, 4)
    trust.record(1, tested_weight(chain, []), 0, 4)
    missed = trust.ratio(1, 4)
    assert 0.5 < missed < prior
    for _ in range(150):
        trust.relax(1)
    assert abs(trust.ratio(1, 4) - prior) < 0.01
    trust.record(1, tested_weight(chain, list(range(1, 21))), 20, 4)  # 20 accepted, the 21st refused
    assert trust.ratio(1, 4) > prior
    assert trust.ratio(8, 4) == prior  # per load: a shared step's trust is its own


def test_the_trust_in_a_suffix_draft_is_learnt_per_match_length():
    """A continuation found after a long match is trusted more from the start, and misses after
    two-token matches do not make auto distrust a 20-token match (benchmarks/suffix_replay.py:
    one trust for both kept long matches shallow after short ones failed)."""
    from specwood.drafting.suffix_tree import continuation_tree
    from specwood.planner.suffix_choice import SuffixTrust, tested_weight

    trust = SuffixTrust()
    assert trust.ratio(1, 2) < trust.ratio(1, 5) < trust.ratio(1, 9) < trust.ratio(1, 20)
    long_prior = trust.ratio(1, 20)
    short = continuation_tree(7, [[100, 101]], 48, 0.05, 2)
    for _ in range(5):
        trust.record(1, tested_weight(short, []), 0, short.match)
    assert trust.ratio(1, 2) < 0.2
    assert trust.ratio(1, 20) == long_prior
    assert trust.ratio(1, 3) == trust.ratio(1, 2)  # one bucket: matches under 4 tokens


def test_the_trust_in_a_suffix_draft_is_learnt_per_source():
    """A continuation from an earlier answer (the global cache) is followed less often than one
    from the request's own text at the same match length (benchmarks/suffix_replay.py, §23b): its
    prior is lower, it is learnt apart, and of the two proposals auto takes the one with more
    trusted expected nodes, not the larger raw count."""
    from specwood.drafting.suffix_tree import continuation_tree
    from specwood.planner.suffix_choice import SuffixOrModelShape, SuffixTrust, tested_weight

    trust = SuffixTrust()
    assert trust.ratio(1, 2, "global") < trust.ratio(1, 2, "local")
    local_prior = trust.ratio(1, 2, "local")
    other = continuation_tree(7, [[100, 101]], 48, 0.05, 2)
    other.source = "global"
    for _ in range(5):
        trust.record(1, tested_weight(other, []), 0, other.match, other.source)
    assert trust.ratio(1, 2, "global") < 0.2 and trust.ratio(1, 2, "local") == local_prior
    with pytest.raises(ValueError, match="both sources"):
        SuffixTrust(priors={"local": {0: 0.8}})

    fresh = SuffixTrust()
    own = continuation_tree(7, [[1, 2, 3]], 48, 0.05, 4)  # 3 expected nodes after a 4-token match
    earlier = continuation_tree(7, [[5, 6, 7, 8]], 48, 0.05, 2)  # 4 after a 2-token match elsewhere
    earlier.source = "global"
    shape = SuffixOrModelShape(None, None, 1, 1.0, lambda x: 0.04, lambda x: 0.0,
                               lambda match, source: fresh.ratio(1, match, source))
    assert earlier.expected > own.expected and shape.pick([own, earlier]) is own


def test_with_a_grammar_the_global_cache_keeps_only_what_the_request_emitted(engine):
    """Grammars that force runs (fixed text, JSON keys): the answer each request leaves in the
    global cache is what it emitted (its last token may be missing, where the last step was a
    forced run whose verdict the source never got), never a forced token the target refused."""
    import llguidance

    grammars = [llguidance.LLMatcher.grammar_from_lark('start: "The quick brown fox jumps over: " /[a-z]{2,6}/ "."'),
                llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object", "properties": {"id": {"type": "integer", "maximum": 999},
                                                      "tag": {"enum": ["red", "green", "blue"]}},
                     "required": ["id", "tag"], "additionalProperties": False},
                    overrides={"whitespace_flexible": False})]
    cache = suffix_cache_for(engine)
    eos = set(engine.eos_token_ids or ())
    for grammar in grammars:
        for prompt in PROMPTS:
            cache.clear()
            out = engine.generate(prompt, max_tokens=40, raw=True, grammar=grammar, method="suffix")
            assert out.stats.get("grammar_forced_tokens", 0) > 0
            live = [cache.index.token_at(p) for p in range(cache.index.base, cache.index.total)]
            assert live[-1] == -1 and -1 not in live[:-1]
            answer = live[:-1][min(4, len(live) - 1):]
            emitted = [*out.token_ids, *([t for t in answer[-1:] if t in eos])]  # an EOS ends it, unseen
            assert answer == emitted[:len(answer)], (prompt, answer, out.token_ids)
            assert len(answer) >= len(out.token_ids) - 1, (prompt, answer, out.token_ids)
