"""Prefix reuse across requests (issue 42): a request starts from the longest cached prefix of its
prompt (a finished request's committed tokens, or a running request's row) and prefills only the
rest, for the target and the draft model.

* greedy output with reuse is token-identical to the same request on a fresh scheduler, for every
  method, over multi-turn conversations, after evictions, and with concurrent requests sharing a
  prefix (tiny models, fp32);
* evicting an entry a running request matched does not change its output; the entries never hold
  more than the budget; a prompt differing only in its last token never gets the wrong prefix;
* the n choices of one request are each distributed as a request alone (G-test).
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import specwood  # noqa: F401 - registers the planner's methods (auto, prior)
from conftest import exact_first_two_law, g_test
from specwood.engine.api import Engine
from specwood.engine.scheduler import TREE_ROOM, Scheduler, SchedulerConfig
from specwood.models.prefix_cache import PrefixCache
from specwood.sampling import SamplingParams

# small trees: cheap steps, and every shape still branches
OPTIONS = {"ar": {}, "chain": {"budget": 4}, "dyspec": {"budget": 6}, "eagle": {"budget": 8, "depth": 3, "topk": 3},
           "pld": {"budget": 4}, "early-exit": {"budget": 4}, "head": {"budget": 6, "depth": 3, "topk": 2},
           "sequoia": {"budget": 8}, "auto": {"progress": False}}


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(one_thread_private_cache):
    """Every test here: tiny models on one thread, plans in a private cache (conftest)."""


def scheduler(engine: Engine, budget: int | None = 10 ** 8, max_batch: int = 4) -> Scheduler:
    """A scheduler like the server's (draft pools up front), with a prefix cache of `budget` bytes
    (None: none, a fresh scheduler's behaviour)."""
    return engine.make_scheduler(SchedulerConfig(max_batch=max_batch, row_len=256 + TREE_ROOM, reuse=budget is not None,
                                                 prefix_bytes=budget))


_FACTORIES: dict[tuple[int, str], object] = {}


def prepared(engine: Engine, method: str):
    """The method prepared once per engine, as the server does (early-exit's draft model, and so
    its cache pool, is made at preparation)."""
    key = (id(engine), method)
    if key not in _FACTORIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _FACTORIES[key] = engine.prepare(method, OPTIONS[method])
    return _FACTORIES[key]


def run(engine: Engine, sched: Scheduler, prompts: list[list[int]], method: str, max_tokens: int = 16,
        **params) -> list:
    """Submit every prompt at once and step until all are done; the finished requests."""
    factory = prepared(engine, method)
    reqs = [engine.new_request(p, max_tokens=max_tokens, method=method, scheduler=sched, prepared=factory, **params)
            for p in prompts]
    for r in reqs:
        sched.submit(r)
    sched.run_until_done(reqs)
    for r in reqs:
        assert r.error is None, (method, r.error)
    return reqs


def fresh(engine: Engine, prompt: list[int], method: str, max_tokens: int = 16) -> list[int]:
    return run(engine, scheduler(engine, budget=None, max_batch=1), [prompt], method, max_tokens)[0].result.token_ids


def words(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(32, 127) for _ in range(n)]


def store_auto_plan(engine: Engine) -> None:
    from test_batching import store_auto_plan as store

    store(engine)


@pytest.mark.parametrize("method", list(OPTIONS))
def test_multi_turn_with_reuse_equals_a_fresh_scheduler(tiny_engine, method):
    """Three turns, each prompt the last one + its answer + a new message: the same tokens as a
    scheduler that never saw the conversation, with most of each later prompt found cached (for
    the draft model too)."""
    if method == "auto":
        store_auto_plan(tiny_engine)
    rnd = random.Random(7)
    sched = scheduler(tiny_engine)
    history = words(rnd, 30)
    for turn in range(3):
        req = run(tiny_engine, sched, [history], method)[0]
        assert req.result.token_ids == fresh(tiny_engine, history, method), (method, turn)
        if turn and method == "head":  # its draft head reads the target's features of every prompt token
            assert req.cached_tokens == 0
        elif turn:
            assert req.cached_tokens >= len(history) - 12, (turn, req.cached_tokens, len(history))
        history = history + req.result.token_ids + words(rnd, 8)
    stats = sched.executor.reuse.cache.stats
    if method in ("chain", "dyspec", "eagle", "sequoia", "early-exit"):  # a draft model with a pool row
        assert stats.hit_tokens["draft"] > 0
    assert not sched.running and sched.executor.cache.free_rows == sched.max_batch


def test_concurrent_requests_sharing_a_prompt_compute_it_once(tiny_engine):
    """Four requests with a common 96-token system prompt arrive together: one computes it, the
    others copy it (for the target and the draft), and each answers as it would alone."""
    rnd = random.Random(3)
    system = words(rnd, 96)
    prompts = [system + words(rnd, 5) for _ in range(4)]
    for method in ("ar", "chain"):
        sched = scheduler(tiny_engine)
        reqs = run(tiny_engine, sched, prompts, method)
        for p, r in zip(prompts, reqs):
            assert r.result.token_ids == fresh(tiny_engine, p, method), method
        assert sorted(r.cached_tokens for r in reqs)[1:] == [96] * 3, [r.cached_tokens for r in reqs]
        stats = sched.executor.reuse.cache.stats
        assert stats.hit_tokens["target"] == 3 * 96
        if method == "chain":
            assert stats.hit_tokens["draft"] >= 3 * 96


def test_evictions_under_a_tiny_budget_never_exceed_it_nor_change_outputs(tiny_engine):
    """A budget of about 90 tokens: conversations evict each other (LRU); the entries stay within
    the budget after every request, and every answer equals a fresh scheduler's."""
    sched = scheduler(tiny_engine)
    per_token = sched.executor.cache.bytes_per_slot + next(iter(sched.executor._draft_pools.values()))[1].bytes_per_slot
    cache = sched.executor.reuse.cache
    cache.budget_bytes = 90 * per_token // 2  # target and draft entries share it
    rnd = random.Random(11)
    histories = [words(rnd, 20 + 7 * i) for i in range(3)]
    for turn in range(3):
        for i, method in enumerate(("chain", "ar", "dyspec")):
            req = run(tiny_engine, sched, [histories[i]], method)[0]
            assert cache.nbytes <= cache.budget_bytes
            assert cache.nbytes == sum(e.nbytes for e in cache.entries)
            assert req.result.token_ids == fresh(tiny_engine, histories[i], method), (turn, i)
            histories[i] = histories[i] + req.result.token_ids + words(rnd, 6)
    assert cache.stats.evictions > 0
    run(tiny_engine, sched, [words(rnd, 150)], "ar")  # larger than the budget: not kept
    assert cache.nbytes <= cache.budget_bytes


def test_an_entry_evicted_while_its_request_runs_does_not_change_it(tiny_engine):
    sched = scheduler(tiny_engine)
    rnd = random.Random(5)
    first = words(rnd, 40)
    answer = run(tiny_engine, sched, [first], "chain", max_tokens=12)[0].result.token_ids
    follow = first + answer + words(rnd, 6)
    req = tiny_engine.new_request(follow, max_tokens=24, method="chain", scheduler=sched,
                                  prepared=prepared(tiny_engine, "chain"))
    sched.submit(req)
    sched.step()  # admitted: its rows start from the cached entry
    assert req.cached_tokens > 40
    with torch.inference_mode():
        for entry in list(sched.executor.reuse.cache.entries):  # evicted, and the memory written over
            entry.k.fill_(1e4)
            entry.v.fill_(-1e4)
    sched.executor.reuse.cache.clear()
    sched.run_until_done([req])
    assert req.result.token_ids == fresh(tiny_engine, follow, "chain", max_tokens=24)


def test_a_prompt_differing_in_its_last_token_never_gets_the_wrong_prefix(tiny_engine):
    sched = scheduler(tiny_engine)
    rnd = random.Random(9)
    base = words(rnd, 50)
    for method in ("ar", "chain"):
        a, b = base + [65], base + [66]
        first = run(tiny_engine, sched, [a], method)[0]
        second = run(tiny_engine, sched, [b], method)[0]
        assert second.cached_tokens <= len(base)  # never the entry's token 65
        assert second.result.token_ids == fresh(tiny_engine, b, method)
        again = run(tiny_engine, sched, [a], method)[0]
        assert again.cached_tokens == len(a) - 1  # the last prompt token is computed: its logits start the answer
        assert again.result.token_ids == first.result.token_ids


def test_a_request_cancelled_mid_prefill_frees_its_rows_and_leaves_nothing_cached(tiny_engine):
    sched = scheduler(tiny_engine)
    rnd = random.Random(1)
    other = tiny_engine.new_request(words(rnd, 10), max_tokens=30, scheduler=sched)
    sched.submit(other)
    sched.step()
    sched.step()  # decoding: a newcomer's prompt now rides in chunks of prefill_chunk_tokens
    req = tiny_engine.new_request(words(rnd, 200), max_tokens=8, scheduler=sched)
    sched.submit(req)
    sched.step()
    assert 0 < req.prefilled < 200
    req.cancel()
    sched.run_until_done([req, other])
    assert req.result.finish_reason == "cancelled"
    assert [len(e.tokens) for e in sched.executor.reuse.cache.entries] == [len(other.context)]  # only the finished one
    assert sched.executor.cache.free_rows == sched.max_batch and sched.executor.reuse.running == []


def test_n_choices_are_each_distributed_as_a_request_alone(tiny_engine):
    """Four choices of one prompt (seeds seed + i, the prompt computed once and copied): every
    choice's (first, second) tokens follow the target's exact law (G-test), and the choices are
    independent draws (they differ about as often as two independent draws do)."""
    engine = tiny_engine
    sched = scheduler(engine, max_batch=8)
    prompt = [72, 101, 108, 108, 111, 32]
    params = SamplingParams(temperature=1.0, emit_limit=engine.emit_limit)  # as its requests sample
    law = exact_first_two_law(engine, prompt, params)
    V = engine.target.config.vocab_size
    counts = np.zeros((V + 1, V + 1))
    same, trials, n = 0, 600, 4
    factory = prepared(engine, "ar")
    for t in range(trials):
        reqs = [engine.new_request(prompt, max_tokens=2, temperature=1.0, seed=t * n + i, scheduler=sched,
                                   prepared=factory) for i in range(n)]
        for r in reqs:
            sched.submit(r)
        sched.run_until_done(reqs)
        pairs = []
        for r in reqs:
            ids = r.result.token_ids  # an EOS ends the request unseen: outcome V
            a, b = ids[0] if ids else V, ids[1] if len(ids) > 1 else V
            counts[a, b] += 1
            pairs.append(a)
        same += pairs[0] == pairs[1]
    assert sched.executor.reuse.cache.stats.hit_tokens["target"] > 0  # the choices shared the prompt
    assert g_test(counts, law) > 1e-3
    first = law.sum(axis=1)
    expected_same = float((first ** 2).sum())  # two independent first tokens agree this often
    assert abs(same / trials - expected_same) < 5 * np.sqrt(expected_same * (1 - expected_same) / trials) + 0.02


def test_kv_memory_sizes_and_the_warning_past_the_machines_ram():
    from specwood.errors import SpecwoodError
    from specwood.serve.kv_memory import budget_warning, machine_ram, parse_size

    assert parse_size("123") == 123 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    with pytest.raises(SpecwoodError, match="--kv-memory"):
        parse_size("lots")
    ram = machine_ram()
    assert ram and budget_warning(ram // 2) is None
    line = budget_warning(2 * ram)
    assert line is not None and "\n" not in line and str(ram) in line and str(2 * ram) in line


def test_the_kv_pool_moves_committed_slots_only_through_its_interface():
    """What the prefix cache does to a pool: slots out of a row, into another, row to row; a copy
    past a row's end is the pool's clear error, not a silent partial write."""
    from specwood.errors import ContextLengthError
    from specwood.models.cache import KVCache

    pool = KVCache(n_layers=2, n_kv_heads=2, head_dim=4, max_len=8, batch=3)
    pool.k.normal_(), pool.v.normal_()
    assert pool.bytes_per_slot == 2 * 2 * 2 * 4 * 4
    k, v = (t.clone() for t in pool.slots_of(0, 0, 5))
    pool.put_slots(1, 2, k, v)
    assert torch.equal(pool.k[:, 1, :, 2:7], k) and torch.equal(pool.v[:, 1, :, 2:7], v)
    pool.copy_slots(2, 1, 3, 6)
    assert torch.equal(pool.k[:, 2, :, 3:6], pool.k[:, 1, :, 3:6])
    assert not torch.equal(pool.k[:, 2, :, 2], pool.k[:, 1, :, 2])  # only the slots asked for
    with pytest.raises(ContextLengthError):
        pool.put_slots(0, 6, k, v)


# --- the cache alone: its radix index against a brute-force model ---------------------------------

def _pool(max_len: int = 48, rows: int = 2):
    from specwood.models.cache import KVCache

    return KVCache(n_layers=1, n_kv_heads=1, head_dim=1, max_len=max_len, batch=rows)  # 8 bytes a slot


def _fill(pool, row: int, tokens: list[int]) -> None:
    """The row holds `tokens`: its K slots are the token ids (V their negatives), so a restored
    row shows which tokens' K/V it got."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pool.k[0, row, 0, :len(tokens), 0] = t
    pool.v[0, row, 0, :len(tokens), 0] = -t
    pool.lengths[row] = len(tokens)


def _restored(pool, row: int) -> list[int]:
    n = pool.lengths[row]
    k, v = pool.k[0, row, 0, :n, 0], pool.v[0, row, 0, :n, 0]
    assert torch.equal(v, -k)
    return [int(x) for x in k]


class ReferencePrefixCache:
    """What PrefixCache promises, by scanning every entry: (pool, scope, tokens) least recently
    used first. Where several entries hold the longest match, any may be the one touched: the
    model follows the one the cache touched (its newest entry), after checking it was allowed."""

    def __init__(self, budget: int, per_slot: int):
        self.budget, self.per_slot = budget, per_slot
        self.entries: list[tuple[int, str, tuple[int, ...]]] = []

    @staticmethod
    def shared(a, b) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def best(self, pool: int, scope: str, want: tuple[int, ...]) -> int:
        return max((self.shared(t, want) for p, s, t in self.entries if (p, s) == (pool, scope)), default=0)

    def touch(self, key, allowed) -> None:
        assert key in self.entries and allowed(key), key
        self.entries.remove(key)
        self.entries.append(key)

    def store(self, pool: int, scope: str, new: tuple[int, ...], touched) -> None:
        if len(new) * self.per_slot > self.budget:
            return
        mine = [e for e in self.entries if (e[0], e[1]) == (pool, scope)]
        if any(t[:len(new)] == new for _, _, t in mine):
            self.touch(touched, lambda e: (e[0], e[1]) == (pool, scope) and e[2][:len(new)] == new)
            return
        self.entries = [e for e in self.entries if not ((e[0], e[1]) == (pool, scope) and new[:len(e[2])] == e[2])]
        while self.entries and self.per_slot * (sum(len(t) for _, _, t in self.entries) + len(new)) > self.budget:
            self.entries.pop(0)
        self.entries.append((pool, scope, new))


def _key(entry) -> tuple[int, str, tuple[int, ...]]:
    return entry.pool, entry.scope, tuple(entry.tokens.tolist())


def _check_against_reference(seed: int, steps: int, budget_tokens: int, alphabet: int, longest: int) -> None:
    rnd = random.Random(seed)
    pools = [_pool(max_len=longest), _pool(max_len=longest)]
    cache = PrefixCache(budget_tokens * pools[0].bytes_per_slot)
    ref = ReferencePrefixCache(cache.budget_bytes, pools[0].bytes_per_slot)
    stems = [[rnd.randrange(alphabet) for _ in range(longest)] for _ in range(4)]  # shared openings
    for _ in range(steps):
        pool = rnd.choice(pools)
        scope = rnd.choice(["", "a", "b"])
        stem = rnd.choice(stems)
        cut = rnd.randrange(longest)
        tokens = stem[:cut] + [rnd.randrange(alphabet) for _ in range(rnd.randrange(1, longest - cut + 1))]
        if rnd.random() < 0.5:
            _fill(pool, 0, tokens)
            cache.store(pool, 0, tokens, scope=scope)
            if cache.entries:
                ref.store(id(pool), scope, tuple(tokens), _key(cache.entries[-1]))
        else:
            limit = rnd.randrange(len(tokens) + 1)
            want = tuple(tokens[:limit])
            before = cache.entries
            got = cache.restore(pool, 1, tokens, limit, scope=scope)
            assert got == ref.best(id(pool), scope, want)
            assert _restored(pool, 1) == list(want[:got])
            if got:
                ref.touch(_key(cache.entries[-1]),
                          lambda e: e[:2] == (id(pool), scope) and ref.shared(e[2], want) == got)
            else:
                assert cache.entries == before  # nothing touched
        assert [_key(e) for e in cache.entries] == ref.entries
        assert cache.nbytes == sum(e.nbytes for e in cache.entries) <= cache.budget_bytes
        assert cache.cached_tokens == sum(len(e.tokens) for e in cache.entries)


@pytest.mark.parametrize("seed", range(6))
def test_the_radix_index_matches_a_brute_force_scan(seed):
    """Random stores and lookups over two pools and three scopes, small alphabets (prefixes shared,
    split and merged often): every lookup's length and restored K/V, every entry kept, dropped
    or evicted, and the LRU order are the brute-force model's; first with room for everything,
    then under a budget that evicts."""
    _check_against_reference(seed, steps=400, budget_tokens=10 ** 6, alphabet=3, longest=12)
    _check_against_reference(seed + 100, steps=400, budget_tokens=60, alphabet=3, longest=12)


def test_thousands_of_entries_give_the_longest_match():
    """3,000 entries of one pool: each lookup's length is the longest common prefix over all of
    them, and the K/V restored are those tokens'."""
    rnd = random.Random(4)
    pool = _pool(max_len=40)
    cache = PrefixCache(10 ** 9)
    stems = [[rnd.randrange(50) for _ in range(40)] for _ in range(30)]
    held: list[list[int]] = []
    for _ in range(3000):
        stem = rnd.choice(stems)
        tokens = stem[:rnd.randrange(40)]
        tokens += [rnd.randrange(50) for _ in range(40 - len(tokens))]
        _fill(pool, 0, tokens)
        cache.store(pool, 0, tokens)
        held.append(tokens)
    assert len(cache.entries) == len({tuple(t) for t in held})  # all length 40: none holds another
    for _ in range(300):
        stem = rnd.choice(stems)
        query = stem[:rnd.randrange(41)] + [rnd.randrange(50) for _ in range(rnd.randrange(10))]
        want = max(ReferencePrefixCache.shared(t, query) for t in held)
        assert cache.restore(pool, 1, query, len(query)) == want
        assert _restored(pool, 1) == query[:want]


def test_a_scope_never_sees_nor_changes_another_scopes_entries():
    pool = _pool()
    cache = PrefixCache(10 ** 6)
    a = [1, 2, 3, 4, 5, 6]
    _fill(pool, 0, a)
    cache.store(pool, 0, a, scope="tenant-a")
    assert cache.restore(pool, 1, a, 6, scope="tenant-b") == 0  # another scope: nothing
    assert cache.restore(pool, 1, a, 6) == 0  # nor the default scope
    _fill(pool, 0, a + [7, 8])  # extends a's entry: a's stays
    cache.store(pool, 0, a + [7, 8], scope="tenant-b")
    _fill(pool, 0, a[:3])  # held inside a's entry: stored for b, a's not touched
    cache.store(pool, 0, a[:3], scope="tenant-b")
    assert [(e.scope, e.tokens.tolist()) for e in cache.entries] == [("tenant-a", a), ("tenant-b", a + [7, 8])]
    assert cache.restore(pool, 1, a + [7, 9], 10, scope="tenant-a") == 6
    assert cache.restore(pool, 1, a + [7, 9], 10, scope="tenant-b") == 7
    _fill(pool, 0, a + [7, 8, 9])  # within its scope an entry is still dropped when extended
    cache.store(pool, 0, a + [7, 8, 9], scope="tenant-b")
    assert [(e.scope, len(e.tokens)) for e in cache.entries] == [("tenant-a", 6), ("tenant-b", 9)]


def test_lru_order_and_eviction_under_the_shared_budget():
    """Entries go least recently used first, whatever their scope: a lookup or a store of a held
    sequence makes an entry the newest."""
    pool = _pool()
    per = pool.bytes_per_slot
    cache = PrefixCache(12 * per)
    seqs = {"x": [1, 1, 1, 1], "y": [2, 2, 2, 2], "z": [3, 3, 3, 3]}
    for name, toks in seqs.items():
        _fill(pool, 0, toks)
        cache.store(pool, 0, toks, scope=name)
    assert cache.restore(pool, 1, [1, 1, 9], 3, scope="x") == 2  # x is now the newest
    _fill(pool, 0, [2, 2])
    cache.store(pool, 0, [2, 2], scope="y")  # held inside y's entry: y is touched, nothing stored
    assert [e.scope for e in cache.entries] == ["z", "x", "y"] and cache.stats.stored == 3
    _fill(pool, 0, [4, 4, 4, 4, 4])
    cache.store(pool, 0, [4, 4, 4, 4, 4], scope="w")  # 17 tokens > 12: z goes, then x
    assert [e.scope for e in cache.entries] == ["y", "w"] and cache.stats.evictions == 2
    assert cache.nbytes == 9 * per and cache.cached_tokens == 9
    cache.set_budget(5 * per)
    assert [e.scope for e in cache.entries] == ["w"] and cache.stats.evictions == 3
    cache.set_budget(0)
    assert cache.entries == [] and cache.nbytes == 0 and cache._roots == {}  # no empty trees left behind
    _fill(pool, 0, [5] * 6)
    cache.store(pool, 0, [5] * 6)  # larger than the budget: not kept
    assert cache.entries == []
