"""Tenants on the real server (uvicorn on 127.0.0.1, the tiny fp32 pair): requests of different
API keys or `cache_salt`s never reuse each other's cached work (prefix cache, running prompts,
suffix drafts, compiled grammars), requests of one scope do, `--no-shared-cache` shares nothing,
`--no-specwood-stats` leaves the statistics out; greedy output is the same whatever the scope."""
from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from specwood.cli import main, read_keys_file
from specwood.engine.api import Engine
from specwood.errors import SpecwoodError
from specwood.serve.app import create_app, server_config
from specwood.serve.guard import Access
from specwood.serve.tenancy import Sharing
from test_server import ServerThread

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
KEY_SALTS = "key-of-the-salting-tenant"
PROBES = tuple(f"key-of-prober-{i}" for i in range(3))  # one key a guess: a key's own guesses are its to reuse


@pytest.fixture(scope="module")
def engine(served_tiny_engine):
    return served_tiny_engine


def _server(engine: Engine, sharing: Sharing = Sharing(), keys: tuple[str, ...] = (KEY_A, KEY_B, KEY_SALTS, *PROBES)
            ) -> ServerThread:
    sched = engine.make_scheduler(server_config(max_batch=4, max_queue=16,
                                                kv_memory=(64 << 20) if sharing.shared_cache else 0))
    access = Access(api_key=keys[0], more_keys=keys[1:]) if keys else Access()
    srv = ServerThread(create_app(engine, sched, method="ar", access=access, sharing=sharing)).start()
    srv.sched = sched
    return srv


@pytest.fixture(scope="module")
def server(engine):
    srv = _server(engine)
    yield srv
    srv.stop()


def _client(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, timeout=120, trust_env=False, headers=headers)


def _chat(client: httpx.Client, content: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_key_finds_nothing_cached_however_right_its_guess(engine, server):
    secret = "My PIN is 4831. Say OK."
    with _client(server, KEY_A) as a:
        first = _chat(a, secret)
        for key, guess in zip(PROBES, ("My PIN is 0000. Say OK.", "My PIN is 4800. Say OK.", secret)):
            with _client(server, key) as b:
                probe = _chat(b, guess)
            assert _cached(probe) == 0, (guess, probe["usage"])
        near = _chat(a, "My PIN is 4800. Say OK.")  # the same key reuses its own prompt, up to where it differs
        again = _chat(a, secret)
        assert 0 < _cached(near) < _cached(again)
        alone = engine.generate([{"role": "user", "content": secret}], max_tokens=8, method="ar")
        # greedy output is the same whatever reuse happened
        assert first["choices"][0]["message"]["content"] == alone.text
        assert again["choices"][0]["message"]["content"] == alone.text
        assert probe["choices"][0]["message"]["content"] == alone.text


def test_a_cache_salt_isolates_within_a_key(server):
    with _client(server, KEY_SALTS) as a:  # a key of its own: nothing cached for it before
        text = "Salted prompts are cached apart from each other, says the test."
        _chat(a, text, cache_salt="salt-1")
        assert _cached(_chat(a, text, cache_salt="salt-2")) == 0
        assert _cached(_chat(a, text)) == 0  # no salt is a scope of its own too
        assert _cached(_chat(a, text, cache_salt="salt-1")) > 0


def test_suffix_drafts_never_come_from_another_tenants_answers(server):
    prompt = "Count the birds in the garden and then count them again, slowly."
    body = {"max_tokens": 24, "method": "suffix"}
    with _client(server, KEY_A) as a, _client(server, KEY_B) as b:
        first = _chat(a, prompt, **body)
        other = _chat(b, prompt, **body)
        same = _chat(a, prompt, **body)
    # the repeat of tenant A drafts from A's first answer; B's identical request never does
    assert same["specwood_stats"]["suffix_global_wins"] > 0, same["specwood_stats"]
    assert other["specwood_stats"]["suffix_global_wins"] == 0, other["specwood_stats"]
    text = first["choices"][0]["message"]["content"]
    assert other["choices"][0]["message"]["content"] == text == same["choices"][0]["message"]["content"]


def test_grammars_compile_off_the_event_loop_and_once_per_scope(engine, server, monkeypatch):
    from specwood.constrain import matcher

    compiled: list[tuple[str, str]] = []  # (thread name, grammar) of each compile
    real = matcher._compile

    def counting(ll_tok, grammar):
        compiled.append((threading.current_thread().name, grammar))
        return real(ll_tok, grammar)

    monkeypatch.setattr(matcher, "_compile", counting)
    schema = {"type": "object", "properties": {"tenancy_probe": {"type": "integer"}}, "required": ["tenancy_probe"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}
    with _client(server, KEY_A) as a, _client(server, KEY_B) as b:
        _chat(a, "Give a number.", response_format=fmt, n=2)
        _chat(a, "Give another number.", response_format=fmt)
        _chat(b, "Give a number.", response_format=fmt)
    # compiled once for tenant A (its two choices and its second request reuse it), once for B;
    # never on the HTTP server's thread (its event loop)
    assert len(compiled) == 2, compiled
    assert all(name != server.thread.name for name, _ in compiled), compiled


def test_a_draft_pool_made_for_a_request_is_made_on_the_stepping_thread(engine, server, monkeypatch):
    executor = server.sched.executor
    made: list[str] = []
    real = executor.add_draft_pool

    def spying(model):
        made.append(threading.current_thread().name)
        return real(model)

    monkeypatch.setattr(executor, "add_draft_pool", spying)
    with _client(server, KEY_A) as a:
        body = _chat(a, "Exit early, please.", method="early-exit")
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert made and all(name == server.sched._thread.name for name in made), made
    reuse = executor.reuse
    # the new pool is counted in the KV budget: the prefix cache keeps what the rows leave
    assert reuse.cache.budget_bytes == max(0, executor.kv_budget - executor.rows_bytes())


def test_no_shared_cache_and_no_stats(engine):
    srv = _server(engine, Sharing(shared_cache=False, specwood_stats=False), keys=())
    try:
        with _client(srv, None) as c:
            text = "Nothing is shared on this server, not even with myself."
            first = _chat(c, text)
            again = _chat(c, text, method="suffix", max_tokens=12)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                      "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}})
            assert r.status_code == 200
            assert '"usage"' in r.text and "specwood_stats" not in r.text
        assert _cached(first) == 0 and _cached(again) == 0
        assert "specwood_stats" not in first and "specwood_stats" not in again
        assert srv.sched.executor.reuse is None  # no prefix cache at all
    finally:
        srv.stop()


@pytest.mark.parametrize("salt, says", [(123, "cache_salt must be a string"), ("", "non-empty"),
                                        ("x" * 257, "at most 256"), (["a"], "cache_salt must be a string")])
def test_a_bad_cache_salt_is_a_400_naming_it(server, salt, says):
    with _client(server, KEY_A) as a:
        r = a.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "cache_salt": salt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and says in err["message"], err
        assert a.get("/health").status_code == 200


def test_every_key_is_let_in_and_others_are_not(server):
    for key, status in ((KEY_A, 200), (KEY_B, 200), ("key-of-nobody", 401), (None, 401)):
        with _client(server, key) as c:
            r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert r.status_code == status, (key, r.text)


def test_keys_files(tmp_path, capsys):
    path = tmp_path / "keys"
    path.write_text("# tenants\nkey-one\n\n  key-two  \n")
    assert read_keys_file(str(path)) == ["key-one", "key-two"]
    path.write_text("# nobody\n\n")
    with pytest.raises(SpecwoodError, match="holds no key"):
        read_keys_file(str(path))
    with pytest.raises(SpecwoodError, match="cannot be read"):
        read_keys_file(str(tmp_path / "missing"))
    # the CLI says it in one line, before any model is loaded
    assert main(["serve", "--api-keys-file", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--api-keys-file" in err[0] and "cannot be read" in err[0], err


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tiny_pair, tiny_tokenizer):
    """vLLM's chat_template_kwargs: Qwen3's enable_thinking turns its empty think block on; bad
    names are a 400 naming the field."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = THINKING
    engine = Engine(tiny_pair.target, tok, target_name="tiny")
    messages = [{"role": "user", "content": "hi"}]
    plain, off = engine.encode(messages), engine.encode(messages, template_kwargs={"enable_thinking": False})
    assert off[:len(plain)] == plain and tok.decode(off[len(plain):]) == "<think>\n\n</think>\n\n"
    srv = ServerThread(create_app(engine, engine.make_scheduler(server_config(max_batch=2, kv_memory=16 << 20)),
                                  method="ar")).start()
    try:
        with _client(srv, None) as c:
            def usage(**extra: Any) -> httpx.Response:
                return c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})

            r = usage(chat_template_kwargs={"enable_thinking": False})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(off)
            assert usage().json()["usage"]["prompt_tokens"] == len(plain)
            for bad in ([1], {"not a name": 1}, {"tools": []}, {f"k{i}": i for i in range(40)}):
                r = usage(chat_template_kwargs=bad)
                assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", (bad, r.text)
    finally:
        srv.stop()
