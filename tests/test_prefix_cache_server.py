"""Prefix reuse through the real server (uvicorn on 127.0.0.1, the tiny fp32 pair): a chat's later
turns report their cached prompt tokens (usage.prompt_tokens_details.cached_tokens) and answer as
the engine does alone; /metrics counts hits, bytes and evictions; `n` choices; a client that leaves
mid-prefill frees its rows and leaves nothing cached."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwood.serve.app import create_app, server_config
from test_server import ServerThread


@pytest.fixture(scope="module")
def engine(served_tiny_engine):
    return served_tiny_engine


@pytest.fixture(scope="module")
def server(engine):
    sched = engine.make_scheduler(server_config(max_batch=4, max_queue=16, kv_memory=64 << 20))
    srv = ServerThread(create_app(engine, sched, method="ar")).start()
    srv.sched = sched
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
        yield c


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """A sample of /metrics (0 for a labelled counter not yet counted)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_a_chat_reuses_its_history_and_answers_as_alone(engine, http, method):
    messages = [{"role": "system", "content": f"You answer in short words ({method})."},
                {"role": "user", "content": "Tell me about the sea."}]
    hits_before = metric(http, "specwood:prefix_cache_hits_total", model="target")
    for turn in range(3):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0,
                                                     "method": method})
        assert r.status_code == 200, r.text
        body = r.json()
        text = body["choices"][0]["message"]["content"]
        alone = engine.generate(messages, max_tokens=12, method="ar")
        assert text == alone.text, turn
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        if turn:  # the previous turn's prompt and answer, up to where the template differs
            assert cached >= previous_prompt, (turn, cached, previous_prompt)
        previous_prompt = body["usage"]["prompt_tokens"]
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    assert metric(http, "specwood:prefix_cache_hits_total", model="target") > hits_before
    if method == "chain":
        assert metric(http, "specwood:prefix_cache_hits_total", model="draft") > 0
    assert 0 < metric(http, "specwood:prefix_cache_bytes") <= metric(http, "specwood:prefix_cache_budget_bytes")


def test_completions_report_cached_tokens(http):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
    again = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


def test_n_choices_greedy_and_streamed(http):
    body = {"messages": [{"role": "user", "content": "Count with me: one two"}], "max_tokens": 10, "temperature": 0}
    one = http.post("/v1/chat/completions", json=body).json()
    three = http.post("/v1/chat/completions", json={**body, "n": 3}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in three["choices"]} == {one["choices"][0]["message"]["content"]}
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    # streamed: every choice's deltas under its own index, each choice finished once
    texts, finished = {}, []
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "n": 2, "stream": True, "temperature": 1.0, "seed": 5,
                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finished.append(choice["index"])
    assert sorted(finished) == [0, 1] and set(texts) == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] >= 2
    # choice i is the request alone with seed + i
    for i in range(2):
        alone = http.post("/v1/chat/completions", json={**body, "temperature": 1.0, "seed": 5 + i}).json()
        assert alone["choices"][0]["message"]["content"] == texts[i], i
    bad = http.post("/v1/completions", json={"prompt": "x", "n": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n" and "8" in bad.json()["error"]["message"]


def test_a_client_gone_mid_prefill_frees_its_rows_and_caches_nothing(server, http, engine):
    sched = server.sched
    cancelled = metric(http, "specwood:request_success_total", finished_reason="cancelled")
    long_prompt = "word " * 40  # 200 byte tokens, prefilled one a step
    prompt_ids = engine.encode(long_prompt, raw=True)
    sched.executor.prefill_share = lambda newcomers, decoding: (1, 1)  # this instance only
    try:
        with http.stream("POST", "/v1/completions", json={"prompt": long_prompt, "max_tokens": 4, "stream": True}):
            deadline = time.monotonic() + 60
            while not any(0 < r.prefilled < len(prompt_ids) // 2 for r in list(sched.running)):
                assert time.monotonic() < deadline, "the request never started its prefill"
                time.sleep(0.002)
        # the connection is closed mid-prefill
        while sched.num_running or sched.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        del sched.executor.prefill_share
    assert metric(http, "specwood:request_success_total", finished_reason="cancelled") == cancelled + 1
    assert sched.executor.cache.free_rows == sched.max_batch and sched.executor.reuse.running == []
    assert not any(e.tokens[:20].tolist() == prompt_ids[:20] for e in sched.executor.reuse.cache.entries)
