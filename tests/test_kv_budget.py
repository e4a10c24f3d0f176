"""Memory by budget, not by rows (issue 42, item 2): under `kv_budget` the cache rows start short,
grow with the longest running request (in place, other rows' entries kept) up to what the budget
holds, go back to their base length when idle, and leave the rest of the budget to the prefix
cache. Outputs are those of a scheduler with static rows; the rows and the entries never hold
more than the budget; what cannot fit is a one-line error naming the numbers."""
from __future__ import annotations

import random

import httpx
import pytest

from specwood.engine.api import Engine
from specwood.engine.scheduler import Scheduler, SchedulerConfig
from specwood.errors import ContextLengthError, SpecwoodError
from test_prefix_cache import _one_thread_and_private_cache  # noqa: F401 - the same autouse fixture

TREE = 16  # tree room of these schedulers: small trees, small rows
BASE = 64  # the rows' base length here (the server's is 4096 + its tree room)


def per_slot(engine: Engine, head: bool = False) -> int:
    """K/V bytes a slot of the target's and the draft model's pools (and the draft head's)."""
    from specwood.models.transformer import Transformer

    models = (engine.target, engine.draft_model) + ((engine.draft_head,) if head else ())
    return sum(2 * len(m.layers) * m.config.n_kv_heads * m.config.head_dim * m.dtype.itemsize
               for m in models if isinstance(m, Transformer))


def budgeted(engine: Engine, budget: int, max_batch: int = 2) -> Scheduler:
    return engine.make_scheduler(SchedulerConfig(max_batch=max_batch, tree_room=TREE, kv_memory=budget, reuse=True,
                                                 base_row_len=BASE), drafts=(engine.draft_model,))


def static(engine: Engine) -> Scheduler:
    return engine.make_scheduler(SchedulerConfig(max_batch=1, tree_room=TREE, row_len=256 + TREE),
                                 drafts=(engine.draft_model,))


def run(engine: Engine, sched: Scheduler, jobs: list[tuple[list[int], int]], method: str,
        watch: list[int] | None = None) -> list[list[int]]:
    """Every (prompt, max_tokens) submitted at once, stepped to the end; their tokens. `watch`
    collects the rows' length after every step."""
    options = {"budget": 4} if method != "ar" else {}
    reqs = [engine.new_request(p, max_tokens=n, method=method, scheduler=sched, **options) for p, n in jobs]
    for r in reqs:
        sched.submit(r)
    while not all(r.done.is_set() for r in reqs):
        sched.step()
        ex = sched.executor
        if ex.kv_budget is not None:
            assert ex.rows_bytes() + ex.reuse.cache.nbytes <= ex.kv_budget
        if watch is not None:
            watch.append(sched.row_len)
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return [r.result.token_ids for r in reqs]


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_rows_grow_with_a_long_request_beside_a_short_one_and_outputs_do_not_change(tiny_engine, method,
                                                                                     monkeypatch):
    """A 20-token request and a 150-token one share the steps: the rows grow (twice) while the
    short one runs and keep its entries; both answers equal those of static rows; idle again,
    the rows go back to their base length and the prefix cache gets the memory back."""
    monkeypatch.setattr("specwood.engine.sequential.GROW_AHEAD", 8)  # grown as the request goes on
    rnd = random.Random(4)
    short, long = [rnd.randrange(32, 127) for _ in range(12)], [rnd.randrange(32, 127) for _ in range(30)]
    budget = 2 * per_slot(tiny_engine) * 300  # two rows of 300 slots: the model's whole context fits
    sched = budgeted(tiny_engine, budget)
    assert sched.row_len == BASE and sched.executor.max_row_len == 256 + TREE
    lengths: list[int] = []
    got = run(tiny_engine, sched, [(short, 20), (long, 150)], method, lengths)
    assert got == [run(tiny_engine, static(tiny_engine), [job], method)[0] for job in [(short, 20), (long, 150)]]
    assert len(set(lengths)) >= 3 and max(lengths) >= 30 + 150 + TREE, sorted(set(lengths))
    run(tiny_engine, sched, [(short, 4)], method)  # admitted to an idle pool: back to the base
    assert sched.row_len == BASE
    assert sched.executor.reuse.cache.budget_bytes == budget - sched.executor.rows_bytes()


def test_growing_rows_evict_prefix_entries_to_stay_within_the_budget(tiny_engine):
    """Entries fill what the short rows leave; a long request's rows take it back (LRU first)."""
    budget = 2 * per_slot(tiny_engine) * 200
    sched = budgeted(tiny_engine, budget)
    rnd = random.Random(8)
    for _ in range(4):  # finished requests' entries
        run(tiny_engine, sched, [([rnd.randrange(32, 127) for _ in range(40)], 8)], "ar")
    before = sched.executor.reuse.cache.nbytes
    assert before > 0
    run(tiny_engine, sched, [([rnd.randrange(32, 127) for _ in range(20)], 150)], "ar")  # the rows grow to ~190
    cache = sched.executor.reuse.cache
    assert cache.stats.evictions > 0 and cache.nbytes <= cache.budget_bytes


def test_what_the_budget_cannot_hold_is_a_one_line_error(tiny_engine):
    slot = per_slot(tiny_engine)
    with pytest.raises(SpecwoodError, match=r"KV budget of \d+ bytes \(--kv-memory\) holds \d+ slots"):
        budgeted(tiny_engine, 2 * slot * (TREE + 10))  # not a tree and 64 tokens a row
    sched = budgeted(tiny_engine, 2 * slot * 150)  # 149 slots a row: 133 tokens of context
    assert sched.executor.max_row_len == 149
    with pytest.raises(ContextLengthError, match=r"needs 140 context tokens but the KV budget of \d+ bytes "
                                                 r"\(--kv-memory\) holds 133 for each of 2 rows"):
        tiny_engine.new_request(list(range(40, 140)), max_tokens=40, scheduler=sched)
    assert run(tiny_engine, sched, [(list(range(40, 100)), 60)], "ar")  # 120 tokens fit
    assert sched.executor.cache.free_rows == 2


def test_the_server_refuses_a_prompt_over_the_budget_naming_both_numbers(tiny_engine):
    """Over HTTP: a 400 that names the budget's context and the model's own; the server goes on."""
    from test_server import ServerThread

    from specwood.serve.app import create_app, server_config

    budget = 8 * per_slot(tiny_engine, head=True) * (1025 + 160)  # 8 rows of the server's tree room + ~150 tokens
    sched = tiny_engine.make_scheduler(server_config(max_batch=8, kv_memory=budget))
    room = sched.executor.max_row_len - sched.tree_room
    assert room == 159
    srv = ServerThread(create_app(tiny_engine, sched, method="ar")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as http:
            r = http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 4})
            assert r.status_code == 400, r.text
            msg = r.json()["error"]["message"]
            assert "--kv-memory" in msg and "the model's own context is 256" in msg and f"holds {room} in" in msg, msg
            ok = http.post("/v1/completions", json={"prompt": "x" * 20, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
