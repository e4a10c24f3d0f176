"""Tool-call tags that are tokens (Qwen2.5's <tool_call> = 151657, </tool_call> = 151658), on the
tiny tokenizer with the two tags added (ids 259, 260), as ordinary added tokens (Qwen2.5's) and as
special ones: a call starts and ends only at those ids; the same characters spelled in ordinary
tokens are text, in content or inside a call's arguments. The grammar's forced text never turns
into a tag token (it did: an enum forcing "</tool_call>" made the mask allow only token 260, which
the grammar then refused, a 500). Real uvicorn servers on 127.0.0.1 with the tiny fp32 pair."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from llguidance import LLMatcher
from tokenizers import AddedToken

from specwood.constrain import grammars as G
from specwood.constrain.matcher import ll_tokenizer
from specwood.engine.api import Engine
from specwood.models.testing import make_tiny_tokenizer
from specwood.serve.app import create_app, server_config
from specwood.serve.structured import ToolCallText

from test_server import CHATS, ServerThread, sse_events

OPEN, CLOSE = 259, 260
TAG_ARG = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"t": {"enum": ["</tool_call>"]}}, "required": ["t"],
    "additionalProperties": False}}}
OPEN_ARG = {"type": "function", "function": {"name": "open", "parameters": {
    "type": "object", "properties": {"t": {"type": "string", "pattern": "^<tool_call>$"}}, "required": ["t"],
    "additionalProperties": False}}}
SAYS_TAG = {"type": "object", "properties": {"t": {"const": "<tool_call>"}}, "required": ["t"],
            "additionalProperties": False}


def tag_tokenizer(special: bool) -> Any:
    tok = make_tiny_tokenizer()
    if special:
        tok.add_special_tokens({"additional_special_tokens": [
            "<|im_start|>", "<|im_end|>", AddedToken("<tool_call>", special=True),
            AddedToken("</tool_call>", special=True)]})
    else:
        tok.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's tokenizer has them
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [OPEN, CLOSE]
    return tok


def text_tokens(tok: Any) -> Any:
    """Text as ordinary tokens only, the tags' characters spelled out (the grammar's tokenizer)."""
    return ll_tokenizer(tok, 264, {256}).tokenize_str


@pytest.fixture(scope="module", params=["added", "special"])
def tok(request):
    return tag_tokenizer(request.param == "special")


def _forced(ll: Any, grammar: str) -> list[int]:
    """The tokens a grammar that allows one output forces, each checked by the matcher."""
    m, out = LLMatcher(ll, grammar), []
    while not m.is_stopped():
        run = m.compute_ff_tokens()
        if not run:
            break
        assert m.validate_tokens(run) == len(run), (run, out)  # the mask and the grammar agree
        assert m.consume_tokens(run)
        out += run
    assert m.is_accepting()
    return out


def test_forced_tag_text_is_spelled_in_text_tokens(tok):
    ll = ll_tokenizer(tok, 264, {256})
    fmt = G.ToolFormat.of(tok)
    assert (fmt.open_id, fmt.close_id) == (OPEN, CLOSE)
    ids = _forced(ll, G.tools_grammar(G.parse_tools([TAG_ARG]), "tag", fmt))
    assert ids[0] == OPEN and ids[-1] == CLOSE and CLOSE not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == '\n{"name": "tag", "arguments": {"t": "</tool_call>"}}\n'
    # a JSON answer that must hold the tag's text, and one that must hold <|im_end|>'s (a control token)
    for schema, text in ((SAYS_TAG, '{"t": "<tool_call>"}'),
                         ({"enum": ["<|im_end|>"]}, '"<|im_end|>"')):
        ids = _forced(ll, G.json_schema_grammar(schema))
        assert tok.decode(ids) == text and not set(ids) & {OPEN, CLOSE, 258}


def test_calls_start_and_end_only_at_the_tag_tokens(tok):
    fmt = G.ToolFormat.of(tok)
    enc = text_tokens(tok)
    body = '\n{"name": "add", "arguments": {"a": 1, "s": "</tool_call> <tool_call>"}}\n'
    call = ("add", '{"a": 1, "s": "</tool_call> <tool_call>"}')
    spelled = enc("Write <tool_call>" + body + "</tool_call> like this.")
    ids = spelled + enc(" Now:\n") + [OPEN, *enc(body), CLOSE, *enc("\n"), OPEN, *enc(body), CLOSE]
    text = tok.decode(ids, skip_special_tokens=True)  # what the engine's text is
    content = tok.decode(spelled + enc(" Now:"), skip_special_tokens=True)
    assert ToolCallText(fmt, tok).finish(text, ids) == (content, [call, call])
    text = tok.decode(spelled, skip_special_tokens=True)
    assert ToolCallText(fmt, tok).finish(text, spelled) == (text, [])  # a spelled block is content
    cut = ids[:-3]  # out of tokens inside the second call: the first is returned
    assert ToolCallText(fmt, tok).finish(tok.decode(cut, skip_special_tokens=True), cut) == (content, [call])
    bad = [OPEN, *enc('\n{"name": "add"}\n'), CLOSE]  # no arguments: not a call, all of it content
    assert ToolCallText(fmt, tok).finish(tok.decode(bad, skip_special_tokens=True), bad)[1] == []
    first = [*enc('{"a": 1}'), OPEN, *enc(body), CLOSE]  # JSON or calls: a call only at the start
    assert ToolCallText(fmt, tok, calls_first=True).finish("x", first) == ("x", [])


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_calls_by_token_add_up_to_the_parsed_ones(tok, step):
    fmt = G.ToolFormat.of(tok)
    enc = text_tokens(tok)
    body = '\n{"name": "f", "arguments": {"s": "a </tool_call> } b", "n": {"k": [1, 2]}}}\n'
    ids = [*enc("Calling <tool_call> now."), OPEN, *enc(body), CLOSE, *enc("\n"), OPEN, *enc(body), CLOSE]
    stream, content, calls = ToolCallText(fmt, tok), "", {}
    text = ""
    for n in range(step, len(ids) + step, step):
        n = min(n, len(ids))
        now = tok.decode(ids[:n], skip_special_tokens=True)
        content += stream.feed(now[len(text):], ids[:n])
        text = now
        for d in stream.call_deltas():
            c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            c["name"] += d["function"].get("name", "")
            c["arguments"] += d["function"]["arguments"]
    rest, parsed = stream.finish(text, ids)
    assert not stream.final_call_deltas(parsed)  # every piece went out as it was written
    assert content + rest == "Calling <tool_call> now."
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == parsed
    assert parsed == [("f", '{"s": "a </tool_call> } b", "n": {"k": [1, 2]}}')] * 2


# ---------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def http(tok, tiny_pair, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECWOOD_CACHE", str(tmp_path_factory.mktemp("cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(tiny_pair.target, tok, draft=tiny_pair.draft, target_name="tiny", draft_name="tiny-draft")
    srv = ServerThread(create_app(engine, engine.make_scheduler(server_config(max_batch=4, max_queue=64)),
                                  method="ar")).start()
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        yield c
    srv.stop()
    torch.set_num_threads(threads)
    mp.undo()


def _post(http, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": CHATS[0], "temperature": 0, "max_tokens": 60, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(http, **body: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    r = http.post("/v1/chat/completions", json={"messages": CHATS[0], "temperature": 0, "max_tokens": 60,
                                                "stream": True, **body})
    assert r.status_code == 200, r.text
    content, calls, finish = "", {}, None
    for event in sse_events(r.text):
        if event == "[DONE]":
            break
        choice = json.loads(event)["choices"][0]
        content += choice["delta"].get("content") or ""
        for tc in choice["delta"].get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc["function"].get("name") or ""
            c["arguments"] += tc["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("tool,choice", [(TAG_ARG, {"type": "function", "function": {"name": "tag"}}),
                                         (OPEN_ARG, "required")])
def test_an_argument_holding_a_tag_comes_back_as_that_argument(http, tool, choice):
    name = tool["function"]["name"]
    want = {"t": "</tool_call>" if name == "tag" else "<tool_call>"}
    body = {"tools": [tool], "tool_choice": choice, "parallel_tool_calls": False}
    out = _post(http, **body)["choices"][0]
    calls = out["message"]["tool_calls"]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
    assert [c["function"]["name"] for c in calls] == [name] and json.loads(calls[0]["function"]["arguments"]) == want
    content, streamed, finish = _streamed(http, **body)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [(name, want)]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_answer_beside_tools_may_hold_the_tag_text(http, stream):
    """tools + a json_schema answer that must say "<tool_call>": the answer is that JSON, no call."""
    body = {"tools": [TAG_ARG], "tool_choice": "auto",
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SAYS_TAG}}}
    if stream:
        content, calls, finish = _streamed(http, **body)
    else:
        out = _post(http, **body)["choices"][0]
        content, calls, finish = out["message"]["content"], out["message"].get("tool_calls"), out["finish_reason"]
    assert json.loads(content) == {"t": "<tool_call>"} and not calls and finish == "stop"
