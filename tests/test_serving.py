"""The server's handlers without its app (specwood.serve.serving.OpenAIServing), the one path from
a request to its SamplingParams (the HTTP body, the command line and the Python API each build
one; its defaults are the one table of neutral values), and the one scheduler configuration
(specwood.engine.config.SchedulerConfig)."""
from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import fields, replace

import pytest
from starlette.requests import Request as HTTPRequest

from specwood.engine.config import AUTO, SchedulerConfig
from specwood.errors import SamplingParamsError, SpecwoodError
from specwood.sampling import SamplingParams, params_from_flags, split_sampling
from specwood.serve.app import server_config
from specwood.serve.protocol import ProtocolError, parse_chat_request, parse_completion_request
from specwood.serve.serving import OpenAIServing


def http_request(body: dict) -> HTTPRequest:
    """A starlette Request carrying `body` from a client that stays connected (the ASGI receive
    channel an ASGI server hands the app: the body once, then nothing until a disconnect)."""
    raw = json.dumps(body).encode()
    sent = False
    stays = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await stays.wait()  # never set: no http.disconnect
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    return HTTPRequest(scope, receive)


def test_the_handlers_answer_without_the_app(tiny_engine):
    """OpenAIServing over a real scheduler: /health's answer, a completion equal to the engine's own
    greedy answer, and a bad parameter's 400, with no FastAPI app or HTTP server built."""
    sched = tiny_engine.make_scheduler(server_config(max_batch=2, max_queue=8, kv_memory=16 << 20))
    serving = OpenAIServing(tiny_engine, sched, method="ar")
    sched.start()
    try:
        health = serving.health()
        assert health.status_code == 200
        assert json.loads(health.body) == {"status": "ok", "model": "tiny", "running": 0, "waiting": 0, "free_rows": 2}

        async def ask(body: dict):
            return await serving.generate(http_request(body), "completion")

        answer = asyncio.run(ask({"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0}))
        assert answer.status_code == 200
        out = json.loads(answer.body)
        ref = tiny_engine.generate("def add(a, b):", raw=True, max_tokens=6)
        assert out["choices"][0]["text"] == ref.text and out["usage"]["completion_tokens"] == len(ref.token_ids)
        with pytest.raises(ProtocolError) as bad:
            asyncio.run(ask({"prompt": "x", "temperature": 200}))
        e = bad.value
        assert (e.status, e.param, e.code) == (400, "temperature", "invalid_value")
        assert e.message == "temperature must be in [0, 100] (0 = greedy), got 200.0"
    finally:
        sched.stop()
        serving.close()


def test_one_sampling_params_from_the_body():
    """The body's sampling fields become one SamplingParams, its defaults the neutral values (the
    wire's own default temperature aside); choice i of n is seeded seed + i."""
    assert parse_completion_request({"prompt": "x"}).params == SamplingParams(temperature=1.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "seed": 3, "logit_bias": {"7": 2}, "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "repetition_penalty": 1.1, "min_p": 0.05, "logprobs": True, "top_logprobs": 2, "n": 3}
    g = parse_chat_request(body, vocab=100)
    want = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=3, logit_bias={7: 2.0}, presence_penalty=0.1,
                          frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05, logprobs=2)
    assert g.params == want
    assert [g.choice_params(i).seed for i in range(3)] == [3, 4, 5]
    assert g.choice_params(2) == replace(want, seed=5)
    with pytest.raises(ProtocolError, match=r"logit_bias names token id 100, outside the vocabulary \(0..99\)"):
        parse_chat_request({**body, "logit_bias": {"100": 1}}, vocab=100)


def test_one_sampling_params_from_the_api_and_the_command_line(tiny_engine):
    params, rest = split_sampling(None, {"temperature": 0.7, "seed": 1, "budget": 4})
    assert params == SamplingParams(temperature=0.7, seed=1) and rest == {"budget": 4}
    assert split_sampling(params, {"budget": 4}) == (params, {"budget": 4})
    with pytest.raises(SamplingParamsError, match="not both"):
        split_sampling(params, {"top_k": 3})
    flags = argparse.Namespace(temperature=0.7, top_p=1.0, top_k=0, seed=1)
    assert params_from_flags(flags) == params
    assert SamplingParams(logit_bias={"5": 1, 3: -1}).logit_bias == ((3, -1), (5, 1))
    shaped = SamplingParams(temperature=0.7, min_p=0.1, logprobs=0)
    assert shaped.shaping() == ["min_p", "logprobs"] and shaped.unshaped() == SamplingParams(temperature=0.7)
    # a request takes the params object, or its fields as keywords: the same request either way
    a = tiny_engine.new_request("abc", SamplingParams(temperature=0.7, seed=1, presence_penalty=0.5), raw=True)
    b = tiny_engine.new_request("abc", temperature=0.7, seed=1, presence_penalty=0.5, raw=True)
    assert a.params == b.params == SamplingParams(temperature=0.7, seed=1, presence_penalty=0.5,
                                                  emit_limit=tiny_engine.emit_limit)
    schema = tiny_engine.new_request("abc", json_schema={"type": "object"}, raw=True).params
    assert schema.json_schema is None and schema.grammar  # compiled for the engine's tokenizer
    for req in (a, b):
        req.drafter.close()
    neutral = SamplingParams()
    assert all(getattr(neutral, f.name) == f.default for f in fields(SamplingParams))


def test_one_scheduler_config_checked_once():
    for bad, needle in ((dict(max_batch=0), "--max-batch must be >= 1, got 0"),
                        (dict(max_queue=0), "--max-queue must be >= 1, got 0"),
                        (dict(request_timeout_s=0), "--request-timeout must be > 0 seconds, got 0"),
                        (dict(kv_memory=-1), "--kv-memory must be >= 0 bytes, got -1"),
                        (dict(reuse=True), "needs prefix_bytes"),
                        (dict(kv_memory=1 << 20, reuse=True, prefix_bytes=10), "drop prefix_bytes"),
                        (dict(kv_memory=AUTO, growable=True), "growable")):
        with pytest.raises(SpecwoodError, match=needle):
            SchedulerConfig(**bad)
    # the server's flags, read once: --kv-memory 0 keeps the default budget and reuses nothing
    assert server_config() == SchedulerConfig(kv_memory=AUTO, reuse=True)
    assert server_config(kv_memory=0) == SchedulerConfig(kv_memory=AUTO, reuse=False)
    assert server_config(kv_memory=1 << 20, shared_cache=False) == SchedulerConfig(kv_memory=1 << 20, reuse=False)
    with pytest.raises(SpecwoodError, match="--max-batch must be >= 1"):
        server_config(max_batch=0)


def test_make_scheduler_builds_what_the_config_says(tiny_engine):
    config = SchedulerConfig(max_batch=3, max_queue=5, row_len=300, reuse=True, prefix_bytes=1 << 20)
    sched = tiny_engine.make_scheduler(config)
    ex = sched.executor
    assert (sched.max_batch, sched.max_queue, sched.config) == (3, 5, config)
    assert (ex.cache.rows, ex.row_len, ex.kv_budget, ex.prefix_cache.budget_bytes) == (3, 300, None, 1 << 20)
    budget = 3 * 2 * (ex.cache.bytes_per_slot + sum(p.bytes_per_slot for _, p in ex._draft_pools.values())) * 1200
    grown = tiny_engine.make_scheduler(SchedulerConfig(max_batch=3, kv_memory=budget, reuse=True)).executor
    assert grown.kv_budget == budget and grown.max_row_len == tiny_engine.max_context + grown.tree_room
    assert grown.prefix_cache.budget_bytes == budget - grown.rows_bytes()
