"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1 (a free port) in a background
thread, the tiny fp32 model pair behind one continuous-batching scheduler, and clients that are
the official `openai` package and raw httpx. Nothing is mocked."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specwood.engine.api import Engine
from specwood.serve.app import bind_socket, create_app, server_config

from conftest import worker_core_share

MAX_BATCH = 8
RAW = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The", "Once upon a time", "hello"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Write code"}]]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a thread; `stop()` waits for it to end."""

    def __init__(self, app: Any):
        self.sock = bind_socket("127.0.0.1", 0)  # as `specwood serve` binds (Nagle off on its connections)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="test-uvicorn", daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        assert not self.thread.is_alive(), "the server thread did not stop"


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One torch thread (tiny models run fastest so on a shared 2-core box) and a private cache
    holding a plan for the tiny pair, so `auto` (the default method) has something to follow."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECWOOD_CACHE", str(tmp_path_factory.mktemp("cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def engine(env, tiny_pair, tiny_tokenizer):
    from specwood.planner.analytic import build_analytic_plan
    from specwood.planner.store import plan_key_for, save_plan

    eng = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.draft, target_name="tiny", draft_name="tiny-draft")
    # a plan with the shapes of a real pair, keyed to this engine: auto speculates with dyspec
    plan = build_analytic_plan("local-cpu", "qwen2.5-1.5b", "qwen2.5-0.5b", method="dyspec", dtype="fp32",
                               contexts=(32, 128), x_max=8)
    plan.key = plan_key_for(eng, "dyspec")
    plan.x_cap = 8
    save_plan(plan)
    assert any(c.method == "dyspec" for c in plan.choices)
    return eng


@pytest.fixture(scope="module")
def server(engine):
    sched = engine.make_scheduler(server_config(max_batch=MAX_BATCH, max_queue=64))
    app = create_app(engine, sched)  # default method: auto
    assert app.state.methods.default == "auto"
    srv = ServerThread(app).start()
    srv.sched, srv.app = sched, app
    yield srv
    srv.stop()
    assert sched._thread is None  # the lifespan stopped the scheduler
    assert not [t for t in threading.enumerate() if t.name in ("specwood-scheduler", "test-uvicorn")]


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def refs(engine):
    """Each prompt run alone, greedy, plain autoregressive (computed while the server is idle)."""
    out = {}
    for p in RAW:
        out[p] = engine.generate(p, raw=True, max_tokens=48, method="ar")
    for i, m in enumerate(CHATS):
        out[i] = engine.generate(m, max_tokens=48, method="ar")
    return out


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def metric_values(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param != "<any>":
        assert err["param"] == param, err
    return err


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------------------------------------
# endpoints


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert_openai_error(http.get("/v1/nope"), 404)


def test_chat_completion_and_its_stream(client, http, engine, refs):
    ref = refs[1]
    resp = client.chat.completions.create(model="tiny", messages=CHATS[1], temperature=0, max_tokens=48,
                                          user="someone")
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert resp.choices[0].message.content == ref.text and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(engine.encode(CHATS[1]))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert extra(resp, "specwood_stats")["method"] == "auto"

    chunks = list(client.chat.completions.create(model="tiny", messages=CHATS[1], temperature=0, max_tokens=48,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == resp.usage.prompt_tokens
    assert "ttft_s" in extra(last, "specwood_stats")
    assert all(c.usage is None for c in chunks[:-1])

    # max_completion_tokens (the newer name of max_tokens)
    one = client.chat.completions.create(model="tiny", messages=CHATS[0], temperature=0, max_completion_tokens=1)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"


def test_completion_and_its_stream(client, http, refs):
    p = RAW[0]
    ref = refs[p]
    resp = client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=48)
    assert resp.object == "text_completion" and resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == len(ref.token_ids) == 48
    stream = client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=48, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48
    # raw SSE: `data: [DONE]` ends it; vLLM's continuous usage counts tokens in every chunk
    r = http.post("/v1/completions", json={"prompt": p, "temperature": 0, "max_tokens": 12, "stream": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    counts = [json.loads(e)["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12
    # token ids as the prompt, and a batch of one prompt
    ids = client.completions.create(model="tiny", prompt=[[1, 2, 3]], temperature=0, max_tokens=4)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4
    # the default max_tokens of the legacy endpoint is 16
    assert client.completions.create(model="tiny", prompt=p, temperature=0).usage.completion_tokens == 16


def test_stop_strings(client, refs):
    p = RAW[0]
    text = refs[p].text
    stops = [c for c in dict.fromkeys(text[3:]) if c.isascii() and c.isprintable() and c.strip()]
    assert len(stops) >= 2, text
    for stop in (stops[0], ["never-there", stops[1]]):
        first = min(text.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in text)
        r = client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=48, stop=stop)
        assert r.choices[0].text == text[:first] and r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, temperature=0, max_tokens=48, stop=stop, stream=True))
        assert streamed == text[:first]


def test_seeded_sampling_is_reproducible(client, engine):
    p = RAW[1]
    kw = dict(model="tiny", prompt=p, temperature=1.0, top_p=0.9, max_tokens=24, seed=7)
    a = client.completions.create(**kw, extra_body={"method": "ar"}).choices[0].text
    b = client.completions.create(**kw, extra_body={"method": "dyspec"}).choices[0].text
    ref = engine.generate(p, raw=True, max_tokens=24, temperature=1.0, top_p=0.9, seed=7, method="ar").text
    assert a == ref
    # a speculative method samples the same distribution but not the same stream: it is still seeded
    assert b == client.completions.create(**kw, extra_body={"method": "dyspec"}).choices[0].text


def test_metrics_after_a_speculative_request(client, http):
    before = metric_values(http)
    r = client.completions.create(model="tiny", prompt=RAW[2], temperature=0, max_tokens=32,
                                  extra_body={"method": "dyspec"})
    stats = extra(r, "specwood_stats")
    assert stats["method"] == "dyspec" and stats["spec_steps"] > 0 and stats["mean_accepted_tokens"] >= 1
    # the scheduler answers a step's requests once the step's metrics are recorded: a scrape right
    # after the response sees every step that made it
    m = metric_values(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return m.get(key, 0.0) - before.get(key, 0.0)

    assert delta("specwood:spec_decode_num_drafts_total") >= stats["spec_steps"]
    assert delta("specwood:spec_decode_num_draft_tokens_total") > 0
    accepted = delta("specwood:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    per_pos = sum(delta("specwood:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(16))
    assert per_pos == accepted and delta("specwood:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert delta("specwood:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("specwood:generation_tokens_total") == r.usage.completion_tokens == 32
    assert delta("specwood:request_success_total", finished_reason="length") == 1
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert delta(f"specwood:{h}_count") == 1, h
    assert delta("specwood:decode_tokens_total") >= 31
    assert ("specwood:num_requests_running", ()) in m and ("specwood:num_requests_waiting", ()) in m
    assert ("specwood:decode_tokens_per_second", ()) in m


# ---------------------------------------------------------------------------------------------
# batching, cancellation, overload


def test_concurrent_requests_with_different_methods_match_plain_decoding(server, engine, refs):
    jobs = [(RAW[0], "ar"), (RAW[1], "dyspec"), (RAW[2], "chain"), (RAW[3], "auto"),
            (RAW[0], "dyspec"), (RAW[1], "auto"), (0, "chain"), (1, None)]
    results: dict[int, Any] = {}
    barrier = threading.Barrier(len(jobs))
    sizes: list[int] = []
    observe = lambda rec: sizes.append(rec.batch_size)  # noqa: E731
    server.sched.observers.append(observe)

    def run(i: int, prompt: Any, method: str | None) -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        body = {"method": method} if method else None
        barrier.wait(timeout=30)
        try:
            if isinstance(prompt, str):
                results[i] = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=48,
                                                  extra_body=body)
            else:
                results[i] = c.chat.completions.create(model="tiny", messages=CHATS[prompt], temperature=0,
                                                       max_tokens=48, extra_body=body)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(i, p, m)) for i, (p, m) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    server.sched.observers.remove(observe)
    assert max(sizes) > 1  # the requests really shared steps
    for i, (prompt, method) in enumerate(jobs):
        r, ref = results[i], refs[prompt]
        assert not isinstance(r, Exception), r
        text = r.choices[0].text if isinstance(prompt, str) else r.choices[0].message.content
        assert text == ref.text, (prompt, method)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert extra(r, "specwood_stats")["method"] == (method or "auto")


def test_clients_that_disconnect_cancel_their_requests(server, http, refs):
    before = metric_values(http)
    errors: list[str] = []

    def worker(k: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as c:
            for j in range(10):
                body = {"prompt": RAW[0], "max_tokens": 200, "temperature": 0, "stream": True,
                        "method": ("ar", "dyspec", "chain", "auto")[(k + j) % 4]}
                path = "/v1/completions"
                if j % 3 == 0:
                    body = {"messages": CHATS[0], "max_tokens": 200, "temperature": 0.7, "stream": True}
                    path = "/v1/chat/completions"
                with c.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.read()!r}")
                        continue
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break  # close the stream after the first chunk

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    # a fresh request still completes, exactly
    r = http.post("/v1/completions", json={"prompt": RAW[3], "max_tokens": 48, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs[RAW[3]].text
    # and every cache row (target and draft pools) comes back
    sched = server.sched
    pools = [pool for _, pool in getattr(sched, "_draft_pools", {}).values()]
    deadline = time.monotonic() + 15
    while not (sched.executor.cache.free_rows == MAX_BATCH and sched.idle
               and all(p.free_rows == MAX_BATCH for p in pools)):
        assert time.monotonic() < deadline, (sched.executor.cache.free_rows, sched.num_running, sched.num_waiting)
        time.sleep(0.05)
    m = metric_values(http)
    cancelled = m.get(("specwood:request_success_total", (("finished_reason", "cancelled"),)), 0) - \
        before.get(("specwood:request_success_total", (("finished_reason", "cancelled"),)), 0)
    assert cancelled >= 25  # most of the 50 were dropped mid-generation, not run to the end
    assert m[("specwood:num_requests_running", ())] == 0


def test_a_non_streamed_request_is_cancelled_when_its_client_goes(server, http):
    """A raw socket sends a long non-streamed request and hangs up; the request is dropped."""
    sched = server.sched
    slow = lambda rec: time.sleep(0.01)  # noqa: E731 - 200 tokens would take > 2 s
    sched.observers.append(slow)
    key = ("specwood:request_success_total", (("finished_reason", "cancelled"),))
    try:
        before = metric_values(http).get(key, 0)
        body = json.dumps({"prompt": RAW[0], "max_tokens": 200, "temperature": 0}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while sched.idle:  # wait until it runs
                assert time.monotonic() < deadline
                time.sleep(0.01)
        deadline = time.monotonic() + 10
        while not (sched.idle and sched.executor.cache.free_rows == MAX_BATCH):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        sched.observers.remove(slow)
    assert metric_values(http).get(key, 0) == before + 1


BAD_INPUTS = [
    ("chat", b"{not json", None),
    ("chat", b"[1, 2]", None),
    ("completion", b"", None),
    ("chat", {"model": "gpt-4o", "messages": CHATS[0]}, "model"),
    ("chat", {"model": "tiny"}, "messages"),
    ("completion", {"model": "tiny"}, "prompt"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": CHATS[0], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": CHATS[0], "max_tokens": "5"}, "max_tokens"),
    ("chat", {"messages": CHATS[0], "stop": 5}, "stop"),
    ("chat", {"messages": CHATS[0], "stop": ["a", 1]}, "stop"),
    ("chat", {"messages": CHATS[0], "stop": [f"s{i}" for i in range(17)]}, "stop"),  # at most 16
    ("chat", {"messages": CHATS[0], "stop": "x" * 513}, "stop"),  # of at most 512 characters
    # the limits themselves
    ("chat", {"messages": CHATS[0], "stop": [chr(97 + i) * 512 for i in range(16)]}, "OK-JSON"),
    ("chat", {"messages": CHATS[0], "stream": "yes"}, "stream"),
    ("chat", {"messages": CHATS[0], "seed": "7"}, "seed"),
    ("chat", {"messages": CHATS[0], "seed": 2 ** 64}, "seed"),  # beyond torch's seeds: was a 500
    ("chat", {"messages": CHATS[0], "seed": -1}, "seed"),
    ("chat", b"[" * 10_000 + b"]" * 10_000, None),  # 10,000 levels of nesting: was a RecursionError, a 500
    ("chat", b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None),
    ("chat", {"messages": CHATS[0], "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": CHATS[0], "max_tokens": -3}, "max_tokens"),
    ("chat", {"messages": CHATS[0], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("completion", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("chat", {"messages": CHATS[0], "max_completion_tokens": 255}, "max_completion_tokens"),
    ("completion", {"prompt": "word " * 300}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
    ("chat", {"messages": CHATS[0], "temperature": -0.5}, "temperature"),
    ("chat", {"messages": CHATS[0], "temperature": 1000}, "temperature"),
    ("chat", {"messages": CHATS[0], "top_p": 0}, "top_p"),
    ("chat", {"messages": CHATS[0], "top_p": 1.5}, "top_p"),
    ("chat", {"messages": CHATS[0], "n": 9}, "n"),
    ("chat", {"messages": CHATS[0], "logprobs": "yes"}, "logprobs"),
    ("chat", {"messages": CHATS[0], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("chat", {"messages": CHATS[0], "presence_penalty": 5}, "presence_penalty"),
    ("chat", {"messages": CHATS[0], "response_format": {"type": "xml"}}, "response_format.type"),
    ("completion", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("completion", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completion", {"prompt": "hi", "echo": True}, "echo"),
    ("completion", {"prompt": "hi", "n": 0}, "n"),
    ("chat", {"messages": CHATS[0], "method": "nope"}, "method"),
    ("chat", {"messages": CHATS[0], "method": 3}, "method"),
    ("chat", {"messages": CHATS[0], "method": "early-exit", "stream": True, "user": "u"}, "OK"),  # a control
    ("chat", {"messages": CHATS[0], "stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": [999999]}, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": {"text": "a"}}, "prompt"),
]


@pytest.mark.parametrize("kind,body,param", BAD_INPUTS, ids=[f"{i}-{k}-{p}" for i, (k, _, p) in enumerate(BAD_INPUTS)])
def test_bad_input_gives_400_and_the_server_goes_on(http, kind, body, param):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    if param == "OK":  # the control: a valid streaming request with another method
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        return
    if param == "OK-JSON":  # a valid request at a limit
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    assert_openai_error(r, 400, param)
    assert http.get("/health").status_code == 200


def test_a_body_over_the_limit_gets_413_and_the_server_goes_on(http):
    """--max-body-bytes (default 2 MiB): a 10 MB body is refused with an OpenAI-style 413 whether it
    declares its length or streams it in chunks, and nothing of it is kept."""
    big = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413, None)
    assert "limit" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                  headers={"content-type": "application/json"})  # chunked: no Content-Length
    assert_openai_error(r, 413, None)
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_health_answers_while_a_prompt_is_being_tokenised(server, engine, monkeypatch):
    """Parsing, the chat template and tokenisation run off the event loop: while one request's
    prompt is held in tokenisation, /health and other requests are answered (were they on the
    loop, /health would wait for it and time out)."""
    import asyncio

    entered, release, on_loop = threading.Event(), threading.Event(), []
    original = engine.encode

    def held_encode(*args: Any, **kwargs: Any) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            pass
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "encode", held_encode)
    result: dict[str, Any] = {}
    body = {"messages": [{"role": "user", "content": "word " * 20}], "max_tokens": 2}
    slow = threading.Thread(target=lambda: result.update(r=httpx.post(server.url + "/v1/chat/completions", json=body,
                                                                      timeout=60, trust_env=False)))
    slow.start()
    try:
        assert entered.wait(30)
        assert httpx.get(server.url + "/health", timeout=10, trust_env=False).status_code == 200
        other = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30,
                           trust_env=False)
        assert other.status_code == 200, other.text
    finally:
        release.set()
        slow.join(60)
    assert result["r"].status_code == 200 and not on_loop, result["r"].text


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHATS[0], n=9)
    assert e.value.status_code == 400 and "n" == e.value.body["param"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="other-model", prompt="x")
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens


def test_full_queue_gives_503_with_retry_after(env, tiny_model_factory, tiny_tokenizer):
    eng = Engine(tiny_model_factory(seed=0), tiny_tokenizer, target_name="tiny")
    sched = eng.make_scheduler(server_config(max_batch=1, max_queue=1))
    sched.observers.append(lambda rec: time.sleep(0.02))  # slow steps: ~0.6 s a request
    srv = ServerThread(create_app(eng, sched, method="ar")).start()
    try:
        results: list[httpx.Response] = []
        barrier = threading.Barrier(5)

        def send() -> None:
            with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
                barrier.wait(timeout=30)
                results.append(c.post("/v1/completions", json={"prompt": RAW[0], "max_tokens": 30, "temperature": 0}))

        threads = [threading.Thread(target=send) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        codes = sorted(r.status_code for r in results)
        assert len(codes) == 5 and codes[0] == 200 and codes[-1] == 503, codes
        for r in results:
            if r.status_code == 503:
                assert_openai_error(r, 503)
                assert r.headers["retry-after"] == "1"
            else:
                assert r.json()["usage"]["completion_tokens"] == 30
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            # this engine has no draft model: a method that needs one is a 400, not a 500
            err = assert_openai_error(c.post("/v1/completions", json={"prompt": "x", "method": "dyspec"}), 400,
                                      "method")
            assert "draft" in err["message"]
            m = metric_values(c)
            assert m[("specwood:requests_rejected_total", ())] == codes.count(503)
            # queue time: the first request was admitted at once, a second one waited for its row
            q = "specwood:request_queue_time_seconds"
            assert m[(f"{q}_count", ())] == codes.count(200) + 1
            assert m[(f"{q}_bucket", (("le", "0.05"),))] >= 1
            if codes.count(200) >= 2:
                assert m[(f"{q}_sum", ())] >= 0.3
    finally:
        srv.stop()
    assert sched._thread is None


def test_a_request_past_the_request_timeout_gets_504_and_the_server_goes_on(env, tiny_model_factory, tiny_tokenizer):
    eng = Engine(tiny_model_factory(seed=0), tiny_tokenizer, target_name="tiny")
    sched = eng.make_scheduler(server_config(max_batch=2, max_queue=4))
    sched.request_timeout_s = 0.3  # what `serve --request-timeout 0.3` sets
    slow = [True]
    sched.observers.append(lambda rec: slow and time.sleep(0.05))  # slow steps: 30 tokens take ~1.5 s
    srv = ServerThread(create_app(eng, sched, method="ar")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            long = {"prompt": RAW[0], "max_tokens": 30, "temperature": 0}
            err = assert_openai_error(c.post("/v1/completions", json=long), 504, None)
            assert err["code"] == "request_timeout" and "ran past its 0.3 s deadline" in err["message"]
            events = sse_events(c.post("/v1/completions", json={**long, "stream": True}).text)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
            slow.clear()  # steps at full speed: a short request well inside the same deadline is answered
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()
    assert sched.idle


def test_queued_clients_that_leave_free_their_places_at_once(env, tiny_model_factory, tiny_tokenizer):
    """64 clients queue behind a full batch and disconnect: their requests leave the queue within
    a step or two, not when a cache row frees, so a new request is queued instead of getting 503."""
    eng = Engine(tiny_model_factory(seed=0), tiny_tokenizer, target_name="tiny")
    sched = eng.make_scheduler(server_config(max_batch=1, max_queue=64))
    sched.observers.append(lambda rec: time.sleep(0.05))  # slow steps: the long request holds the batch
    srv = ServerThread(create_app(eng, sched, method="ar")).start()
    host, port = srv.url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            long_job = threading.Thread(target=lambda: c.post("/v1/completions", json={
                "prompt": RAW[0], "max_tokens": 200, "temperature": 0}))
            long_job.start()
            wait_for(lambda: c.get("/health").json()["running"] == 1)
            body = json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            for _ in range(64):
                s = socket.create_connection((host, int(port)), timeout=10)
                s.sendall(head + body)
                socks.append(s)
            wait_for(lambda: c.get("/health").json()["waiting"] == 64)
            for s in socks:
                s.close()
            wait_for(lambda: c.get("/health").json()["waiting"] == 0, timeout=5)
            assert c.get("/health").json()["running"] == 1  # the long request still holds the batch
            late = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 200
            long_job.join(60)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# the command


def test_cli_errors_are_one_line(capsys):
    from specwood.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, needle in ((["--method", "nope"], "unknown method"), (["--max-batch", "0"], "--max-batch"),
                             (["--port", str(port)], "cannot listen"), (["--port", "70000"], "--port")):
            assert main(["serve", *argv]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("specwood: error:") and needle in err[0], err


@contextlib.contextmanager
def serve_command(cmd: list[str], cache: Any, start_timeout_s: float = 60, stop_timeout_s: float = 30):
    """Run a `specwood serve` command line (port 0) in its own process group; yield (its URL from
    the "listening on" line, the output lines so far, the process). On exit: SIGTERM, a clean exit within
    `stop_timeout_s` and no traceback in the output; the whole group is killed if it hangs."""
    env = dict(os.environ, SPECWOOD_CACHE=str(cache))
    share = worker_core_share()
    if share is not None:  # two servers with a thread per core each, beside the other xdist worker, spun
        # their OpenMP teams against each other (a tiny model at 43 tokens/s)
        env["OMP_NUM_THREADS"] = str(share)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    try:
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline, url = time.monotonic() + start_timeout_s, None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, lines
            found = [re.search(r"listening on (http://\S+)", ln) for ln in lines]
            url = next((f.group(1) for f in found if f), None)
            time.sleep(0.05)
        yield url, lines, proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=stop_timeout_s) in (0, -signal.SIGTERM)
        reader.join(timeout=5)
        assert "Traceback" not in "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_specwood_serve_command(tmp_path):
    """`specwood serve` as a user runs it: a tiny HF folder, port 0, the listening line, SIGTERM."""
    from specwood.models.testing import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=128)
    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(folder), "--draft", "none", "--dtype",
           "fp32", "--method", "ar", "--port", "0", "--max-batch", "2", "--api-key", "k-123"]
    with serve_command(cmd, tmp_path / "cache") as (url, _, _):
        with httpx.Client(base_url=url, timeout=30, trust_env=False, headers={"authorization": "Bearer k-123"}) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 128
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
            # --api-key guards /v1/*; bound to loopback, the server answers loopback Host names only
            assert_openai_error(c.get("/v1/models", headers={"authorization": ""}), 401, None)
            assert_openai_error(c.get("/v1/models", headers={"host": "attacker.example"}), 403, None)
        with httpx.Client(timeout=30, trust_env=False) as plain:
            assert plain.get(url + "/health").status_code == 200


def test_sigterm_drains_running_streams(tmp_path):
    """SIGTERM: a running stream gets --drain-timeout seconds and ends normally; with no time
    left it ends with an error event and [DONE]; the server exits 0 either way."""
    import specwood
    from specwood.models.testing import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=1024)
    engine = specwood.load(str(folder), None, dtype="fp32", progress=False)
    prompt = next(p for p in ("hello", "abc", "the end", "0123") if len(engine.generate(
        p, raw=True, max_tokens=600).token_ids) == 600)  # a prompt whose reply runs to the limit
    del engine
    for drain in ("30", "0"):
        cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(folder), "--draft", "none", "--dtype",
               "fp32", "--method", "ar", "--port", "0", "--max-context", "1024", "--drain-timeout", drain]
        with serve_command(cmd, tmp_path / "cache") as (url, lines, proc):
            events: list[str] = []
            with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
                with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 600, "stream": True,
                                                                "temperature": 0}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: "):])
                            if len(events) == 2:
                                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, lines
            assert events[-1] == "[DONE]"
            if drain == "30":  # drained: the whole reply
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            else:  # no time to drain: the stream ends with an error event
                err = json.loads(events[-2])["error"]
                assert "shutting down" in err["message"]
            assert any("draining" in ln for ln in lines)


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["background-plan", "parallel-worker"])
def test_children_die_with_a_killed_server(tmp_path, mode):
    """SIGKILL of `specwood serve`: within 10 s no child it started (the background planner, kept
    stopped while busy; the DuoDecoding draft worker) is alive or stopped."""
    from specwood.models.testing import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=128)
    extra = ["--method", "auto"] if mode == "background-plan" else ["--executor", "parallel", "--method", "duo"]
    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(folder), "--draft", str(folder), "--dtype",
           "fp32", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, SPECWOOD_CACHE=str(tmp_path / "cache")), start_new_session=True)
    children: list[int] = []
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        wait_for(lambda: any("listening on" in ln for ln in lines) or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, lines
        wait_for(lambda: bool(_children(proc.pid)), timeout=60)
        children = _children(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(_alive(c) for c in children), timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for c in children:  # whatever the test found left, it does not leave behind
            if _alive(c):
                os.kill(c, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# access: API key, browser origins, Host names, JSON bodies (specwood.serve.guard)

KEY = "sk-test-4242"
GOOD_ORIGIN = "http://localhost:5173"


@pytest.fixture(scope="module")
def guarded(engine):
    from specwood.serve.guard import LOOPBACK_HOSTS, Access

    sched = engine.make_scheduler(server_config(max_batch=2, max_queue=8))
    app = create_app(engine, sched, method="ar",
                     access=Access(api_key=KEY, allowed_origins=(GOOD_ORIGIN,), allowed_hosts=LOOPBACK_HOSTS))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def test_the_api_key_guards_v1_only(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60, trust_env=False) as c:
        body = {"messages": CHATS[0], "max_tokens": 3}
        missing = assert_openai_error(c.post("/v1/chat/completions", json=body), 401, None)
        assert missing["code"] == "invalid_api_key" and "missing" in missing["message"]
        wrong = c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
        assert_openai_error(wrong, 401, None)
        assert wrong.headers["www-authenticate"] == "Bearer" and "wrong" in wrong.json()["error"]["message"]
        assert_openai_error(c.get("/v1/models"), 401, None)
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        out = client.chat.completions.create(model="tiny", messages=CHATS[0], max_tokens=3, temperature=0)
        assert out.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=guarded.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        client.close()


def test_non_json_posts_get_415(guarded):
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded.url, timeout=60, trust_env=False, headers=auth) as c:
        for ctype, data in (("text/plain", '{"prompt": "hi"}'), ("application/x-www-form-urlencoded", "prompt=hi"),
                            ("multipart/form-data; boundary=x", "--x--")):
            r = c.post("/v1/completions", content=data, headers={"content-type": ctype})
            assert_openai_error(r, 415, None)
        ok = c.post("/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                    headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_browser_origins_and_host_names(guarded):
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=guarded.url, timeout=60, trust_env=False, headers=auth) as c:
        evil = c.post("/v1/completions", json=body, headers={"origin": "https://evil.example"})
        assert "--allowed-origins" in assert_openai_error(evil, 403, None)["message"]
        assert_openai_error(c.options("/v1/completions", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"}), 403, None)
        pre = c.options("/v1/completions", headers={"origin": GOOD_ORIGIN, "access-control-request-method": "POST",
                                                    "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == GOOD_ORIGIN
        good = c.post("/v1/completions", json=body, headers={"origin": GOOD_ORIGIN})
        assert good.status_code == 200 and good.headers["access-control-allow-origin"] == GOOD_ORIGIN
        rebound = c.post("/v1/completions", json=body, headers={"host": "evil.example:8000"})
        assert_openai_error(rebound, 403, None)
        assert c.get("/health", headers={"host": "localhost:1"}).status_code == 200
        assert c.get("/health", headers={"host": "[::1]:8000"}).status_code == 200


def test_a_key_over_every_endpoint(engine):
    from specwood.serve.guard import Access

    sched = engine.make_scheduler(server_config(max_batch=1, max_queue=2))
    srv = ServerThread(create_app(engine, sched, method="ar", access=Access(api_key=KEY, key_scope="all"))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as c:
            for path in ("/health", "/metrics", "/v1/models"):
                assert_openai_error(c.get(path), 401, None)
                assert c.get(path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        srv.stop()


def test_background_measurement_runs_only_while_the_server_is_idle():
    """The plan measured beside a server (`serve --method auto` without a plan) is stopped, with
    the processes it started, while requests run, continued when idle, and ended even when stopped."""
    from specwood.serve.background import end_process_group, pause_while_busy

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait_state(pid: int, want: set[str], timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while (s := state(pid)) not in want and time.monotonic() < deadline:
            time.sleep(0.01)
        return s

    class Load:
        idle = True

    # a busy leader with a busy child of its own (like the plan's worker processes)
    spin = "import time\nwhile True: time.sleep(0.001)"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {spin!r}])\n{spin}"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        kids: list[int] = []
        while not kids and time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
            time.sleep(0.01)
        assert kids, "the child did not start its own child"
        load = Load()
        watcher = pause_while_busy(proc, load, period_s=0.01)
        assert wait_state(proc.pid, {"R", "S"}) in ("R", "S")
        load.idle = False  # requests arrive
        assert wait_state(proc.pid, {"T"}) == "T" and wait_state(kids[0], {"T"}) == "T"
        load.idle = True
        assert wait_state(proc.pid, {"R", "S"}) in ("R", "S") and wait_state(kids[0], {"R", "S"}) in ("R", "S")
        load.idle = False
        assert wait_state(proc.pid, {"T"}) == "T"
        end_process_group(proc)  # stopped, yet it ends
        assert proc.returncode is not None
        watcher.join(5)
        assert not watcher.is_alive()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{kids[0]}") and state(kids[0]) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{kids[0]}") or state(kids[0]) == "Z"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
