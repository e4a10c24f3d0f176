"""Structured output through the OpenAI surface, for real: grammars built from JSON schemas and
tools (specwood.constrain.grammars) checked with llguidance's own matcher on the tiny tokenizer,
and a uvicorn server on 127.0.0.1 with the tiny fp32 pair answering response_format, tools,
logprobs and logit_bias requests from raw httpx and the official `openai` client. Nothing is mocked.

The server tests that need the engine's grammar mask and logprobs (specwood.constrain.processors,
branch structured-core) say so in their names: `..._enforced`."""
from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from specwood.constrain import grammars as G
from specwood.engine.api import Engine
from specwood.errors import GrammarError
from specwood.serve.app import create_app, server_config
from specwood.serve.structured import ToolCallText

from test_server import CHATS, ServerThread, assert_openai_error, sse_events

METHODS = ("ar", "dyspec", "chain")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}},
    "required": ["name", "kind", "age", "ok"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "id": {"type": "string", "pattern": "^[0-9]{2,4}$"}},
    "required": ["tags", "id"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 8},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


# ---------------------------------------------------------------------------------------------
# grammars, with llguidance's matcher on the tiny tokenizer


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tiny_tokenizer, n_vocab=264)


def _accepts(ll_tokenizer, grammar: str, ids: list[int]) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(ll_tokenizer, grammar)
    assert not m.is_error(), m.get_error()
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_schema_grammar_takes_compact_valid_json_and_refuses_the_rest(ll_tokenizer, tiny_tokenizer):
    g = G.json_schema_grammar(PERSON)
    enc = lambda s: tiny_tokenizer.encode(s)  # noqa: E731
    assert _accepts(ll_tokenizer, g, enc('{"name": "Bo", "kind": "cat", "age": 7, "ok": true}'))
    assert not _accepts(ll_tokenizer, g, enc('{"name": "Bo", "kind": "cow", "age": 7, "ok": true}'))  # enum
    assert not _accepts(ll_tokenizer, g, enc('{"name": "Bo", "kind": "cat", "age": 7}'))  # required
    assert not _accepts(ll_tokenizer, g, enc('{ "name": "Bo", "kind": "cat", "age": 7, "ok": true}'))  # compact
    assert _accepts(ll_tokenizer, G.json_object_grammar(), enc('{"x": [1, {"y": null}]}'))
    assert not _accepts(ll_tokenizer, G.json_object_grammar(), enc('[1]'))


def test_strict_closes_objects_that_do_not_say(ll_tokenizer, tiny_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tiny_tokenizer.encode('{"a": 1, "b": 2}')
    assert _accepts(ll_tokenizer, G.json_schema_grammar(schema), extra)  # JSON Schema's default: open
    assert not _accepts(ll_tokenizer, G.json_schema_grammar(schema, strict=True), extra)
    assert _accepts(ll_tokenizer, G.json_schema_grammar(schema, strict=True), tiny_tokenizer.encode('{"a": 1}'))
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


@pytest.mark.parametrize("schema,says", [
    ({"type": "strong"}, "strong"),
    ({"type": "string", "pattern": "a(b"}, "regular expression"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"type": "array", "uniqueItems": True}, "unsupported keyword"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "unsupported keyword"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "cannot be satisfied"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "cannot be satisfied"),
    ({"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False}, "cannot be satisfied"),
    ({"enum": list(range(G.MAX_ENUM_VALUES + 1))}, "enum values"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(G.MAX_PROPERTIES + 1)}}, "properties"),
    ({"description": "x" * G.MAX_SCHEMA_BYTES}, "bytes"),
    (json.loads('{"items": ' * G.MAX_SCHEMA_DEPTH + "{}" + "}" * G.MAX_SCHEMA_DEPTH), "deeper"),
    ([{"type": "string"}], "must be an object"),
])
def test_unusable_schemas_are_one_line_errors(schema, says):
    with pytest.raises(GrammarError) as e:
        G.json_schema_grammar(schema)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_tool_grammars_follow_tool_choice(ll_tokenizer, tiny_tokenizer):
    tools = G.parse_tools(TOOLS)
    fmt = G.ToolFormat.of(tiny_tokenizer)
    assert fmt.open_id is None  # the tiny vocabulary has no tag tokens: the tags are text
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    enc = lambda s: tiny_tokenizer.encode(s)  # noqa: E731
    required = G.tools_grammar(tools, "required", fmt)
    assert _accepts(ll_tokenizer, required, enc(call)) and _accepts(ll_tokenizer, required, enc(call + "\n" + weather))
    assert not _accepts(ll_tokenizer, required, enc("hello"))
    assert not _accepts(ll_tokenizer, required, enc(call.replace('"b": 2', '"b": 12')))  # maximum 9
    single = G.tools_grammar(tools, "required", fmt, parallel=False)
    assert not _accepts(ll_tokenizer, single, enc(call + "\n" + weather))
    named = G.tools_grammar(tools, "add", fmt)
    assert _accepts(ll_tokenizer, named, enc(call)) and not _accepts(ll_tokenizer, named, enc(weather))
    auto = G.tools_grammar(tools, "auto", fmt)
    assert _accepts(ll_tokenizer, auto, enc("plain words")) and _accepts(ll_tokenizer, auto, enc("Sure.\n" + call))
    assert not _accepts(ll_tokenizer, auto, enc('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'))
    assert G.tools_grammar(tools, "none", fmt) is None
    both = G.tools_grammar(tools, "auto", fmt, content=G.prepare_schema(PERSON))
    assert _accepts(ll_tokenizer, both, enc(call))
    assert _accepts(ll_tokenizer, both, enc('{"name": "Bo", "kind": "cat", "age": 7, "ok": true}'))
    assert not _accepts(ll_tokenizer, both, enc("plain words"))


def test_tool_names_are_matched_whole():
    for name in ("f\n", "f\nx", "a" * 65, ""):
        with pytest.raises(GrammarError):
            G.parse_tools([{"type": "function", "function": {"name": name}}])
    assert G.parse_tools([{"type": "function", "function": {"name": "a-b_9"}}])[0].name == "a-b_9"


def test_text_tags_inside_arguments_do_not_end_a_call():
    """Tags that are plain text: a call ends at the close tag after its JSON object, so a string in
    the arguments may hold either tag; content ends at the first open tag (where the grammar ends it)."""
    fmt = G.ToolFormat()
    call = '<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>\\n<tool_call>", "t": "}"}}\n</tool_call>'
    want = ("f", '{"s": "</tool_call>\\n<tool_call>", "t": "}"}')
    assert ToolCallText(fmt).finish("Hi.\n" + call + "\n" + call) == ("Hi.", [want, want])
    odd = call.replace("}\n</tool_call>", "} and more")  # no close tag after the object: content
    assert ToolCallText(fmt).finish(odd) == (odd, [])
    answer = '{"t": "' + call.replace('"', '\\"').replace("\n", "\\n") + '"}'  # a JSON answer quoting a call
    assert ToolCallText(fmt, calls_first=True).finish(answer) == (answer, [])
    assert ToolCallText(fmt, calls_first=True).finish(call) == ("", [want])


def test_tool_tags_that_are_tokens_are_used_as_tokens(tiny_tokenizer):
    """A vocabulary with <tool_call> tokens (as Qwen2.5's, ids 151657/151658): the grammar names
    those ids, and the tags cannot be spelled out of text bytes instead."""
    import llguidance.hf
    from llguidance import LLMatcher

    from specwood.models.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # ordinary added tokens, as in Qwen2.5
    fmt = G.ToolFormat.of(tok)
    assert (fmt.open_id, fmt.close_id) == (259, 260)
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=264)
    grammar = G.tools_grammar(G.parse_tools([ADD]), "required", fmt)
    body = tok.encode('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', add_special_tokens=False)
    m = LLMatcher(ll, grammar)
    assert m.compute_ff_tokens()[:1] == [259]  # the tag token is forced
    assert m.try_consume_tokens([259, *body, 260]) == len(body) + 2 and m.is_accepting()
    spelled = LLMatcher(ll, grammar)
    text = tok.backend_tokenizer.model.token_to_id("<")
    assert spelled.try_consume_tokens([text]) == 0


def test_tools_and_tool_choice_are_checked():
    bad = [
        ({"tools": "f"}, "tools"), ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([ADD, ADD], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "tools[0].function.parameters"),
    ]
    for tools, where in bad:
        with pytest.raises(GrammarError) as e:
            G.parse_tools(tools)
        assert str(e.value).startswith(where + ":"), (tools, str(e.value))
    tools = G.parse_tools(TOOLS)
    assert G.parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == "add"
    assert G.parse_tool_choice("required", tools) == "required"
    for choice, tools_ in (("auto", None), ({"type": "function", "function": {"name": "sub"}}, tools),
                           ("always", tools), (3, tools)):
        with pytest.raises(GrammarError):
            G.parse_tool_choice(choice, tools_)


def test_streamed_content_stops_where_a_tool_call_begins():
    fmt = G.ToolFormat()
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        s = ToolCallText(fmt)
        streamed = "".join(s.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = s.finish(text)
        assert streamed + rest == "Let me check." and calls == [("add", '{"a": 1}')]
    cut = text + "\n<tool_call>\n{\"name\": \"ad"  # out of tokens inside a second call
    assert ToolCallText(fmt).finish(cut) == ("Let me check.", [("add", '{"a": 1}')])
    assert ToolCallText(fmt).finish(text.replace("}}", "}")) == (text.replace("}}", "}"), [])  # malformed
    s = ToolCallText(fmt)
    assert s.feed("a <tool") == "a" and s.feed("box> b") == " <toolbox> b" and s.finish("a <toolbox> b") == ("", [])


# ---------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def server(tiny_pair, tiny_tokenizer, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECWOOD_CACHE", str(tmp_path_factory.mktemp("cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.draft, target_name="tiny",
                    draft_name="tiny-draft")
    sched = engine.make_scheduler(server_config(max_batch=4, max_queue=64))
    srv = ServerThread(create_app(engine, sched, method="ar")).start()
    srv.engine = engine
    yield srv
    srv.stop()
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _chat(http, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": CHATS[0], **body})
    assert r.status_code == 200, r.text
    return r.json()


def _history_call(arguments: str) -> dict[str, Any]:
    """A body whose history holds an assistant's call with these arguments."""
    return {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]}


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strong"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),  # unsupported keyword or unsatisfiable: either way a 400
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 3, "maximum": 1}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "[a-"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/a"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "enum": list(range(5000))}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": "json"}, "response_format"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                          "function": {"name": "add",
                                                                                       "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    (_history_call("[" * 100_000 + "]" * 100_000),  # deeper than Python's recursion limit
     "messages[0].tool_calls[0].function.arguments"),
    (_history_call('{"a": ' + "[" * 200 + "]" * 200 + "}"),  # within it, over MAX_JSON_DEPTH
     "messages[0].tool_calls[0].function.arguments"),
    ({"logit_bias": {"1" * 5000: 5}}, "logit_bias"),  # past Python's int digit limit
    ({"logit_bias": {"99999999999": 5}}, "logit_bias"),
    ({"logit_bias": {"\u0663": 5}}, "logit_bias"),  # a digit, not an ASCII one
    ({"tools": [{"type": "function", "function": {"name": "f\n"}}]}, "tools[0].function.name"),
    ({"metadata": json.loads("[" * 200 + "]" * 200)}, None),  # the body itself, over MAX_JSON_DEPTH
    ({"logit_bias": {"264": 5}}, "logit_bias"),  # the tiny vocabulary is 0..263
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_structured_input_gives_400_naming_the_parameter(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": CHATS[0], "max_tokens": 4, **body})
    err = assert_openai_error(r, 400, param)
    assert "\n" not in err["message"]
    assert http.get("/health").status_code == 200


def test_a_body_deeper_than_python_can_parse_gives_400(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                  headers={"content-type": "application/json"})
    assert "deeper" in assert_openai_error(r, 400, None)["message"]
    assert http.get("/health").status_code == 200


def test_bad_completion_logprobs_and_bias_give_400(http):
    for body, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                        ({"logit_bias": {"99999": 1}}, "logit_bias")):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert_openai_error(r, 400, param)


def test_tool_messages_go_through_the_template(http):
    """A conversation with an assistant's tool call and the tool's answer is accepted (tools=
    reach the chat template; the tiny template shows roles and contents only)."""
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out = _chat(http, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out["choices"][0]["message"]["role"] == "assistant" and out["usage"]["completion_tokens"] >= 1


# --- enforced by the engine (specwood.constrain.processors) ------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_json_schema_outputs_validate_enforced(http, method):
    """Every finished output validates against its schema, greedy and sampled, for every method
    (the tiny draft disagrees with the target often)."""
    finished = 0
    for schema in (PERSON, TAGS):
        for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
            out = _chat(http, method=method, temperature=temperature, seed=seed, max_tokens=120,
                        response_format={"type": "json_schema",
                                         "json_schema": {"name": "s", "schema": schema, "strict": True}})
            choice = out["choices"][0]
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                finished += 1
    assert finished >= 4  # the schemas bound every output well inside max_tokens


def test_json_object_output_is_an_object_enforced(http):
    out = _chat(http, response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # ran out of tokens inside the object: a prefix of one
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("method", ("ar", "dyspec"))
def test_completions_take_a_response_format_enforced(http, method):
    """/v1/completions takes response_format as vLLM does: the raw completion is JSON valid under
    the schema (streamed too); a bad schema is a 400 naming it there as well."""
    body = {"prompt": "A pet, as JSON:", "max_tokens": 120, "temperature": 0, "method": method,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": PERSON, "strict": True}}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), PERSON)
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    text = "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(streamed.text)[:-1]
                   if json.loads(e).get("choices"))
    assert text == choice["text"]
    bad = http.post("/v1/completions", json={**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "strong"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize("method", ("ar", "dyspec"))
def test_required_and_named_tool_choice_always_call_enforced(client, method):
    for seed, parallel in ((1, False), (2, False), (3, True)):
        out = client.chat.completions.create(model="tiny", messages=CHATS[0], tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=parallel,
                                             extra_body={"method": method})
        choice = out.choices[0]
        # one call: the grammar ends the answer after it; several: the random model may go on calling
        # until max_tokens, and the complete calls are returned with finish_reason "length"
        assert choice.message.tool_calls and choice.finish_reason == ("tool_calls" if not parallel else
                                                                      choice.finish_reason), choice
        assert choice.finish_reason in ("tool_calls", "length")
        assert len(choice.message.tool_calls) == 1 or parallel
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    named = client.chat.completions.create(model="tiny", messages=CHATS[0], tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0, extra_body={"method": method})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]


def test_tool_calls_round_trip_through_the_openai_client_streaming_enforced(client):
    """Streamed: the calls arrive as delta.tool_calls and equal the non-streamed answer's; then
    the conversation goes on with the call and its result."""
    kw = dict(model="tiny", messages=CHATS[0], tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    calls: dict[int, dict[str, str]] = {}
    finish, content, pieces = None, "", 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function.name:  # the name comes once, with the call's id
                assert tc.id and not c["name"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
            pieces += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert pieces > 1  # the arguments stream as they are written, not whole at the end
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    call = whole.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, tools=TOOLS, messages=[
        *CHATS[0], {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"}])
    assert follow.choices[0].message.role == "assistant"


TAG_ARG = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"t": {"enum": ["</tool_call>"]}}, "required": ["t"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_tag_forced_into_an_argument_comes_back_as_it_enforced(http, stream):
    """Tags that are plain text (the tiny vocabulary): an argument holding "</tool_call>" does not
    end its call."""
    body = {"messages": CHATS[0], "tools": [TAG_ARG], "tool_choice": {"type": "function", "function": {"name": "tag"}},
            "max_tokens": 120, "temperature": 0, "stream": stream}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        args, finish = "", None
        for event in sse_events(r.text)[:-1]:
            choice = json.loads(event)["choices"][0]
            args += "".join(tc["function"].get("arguments") or "" for tc in choice["delta"].get("tool_calls") or [])
            finish = choice["finish_reason"] or finish
    else:
        choice = r.json()["choices"][0]
        args, finish = choice["message"]["tool_calls"][0]["function"]["arguments"], choice["finish_reason"]
    assert finish == "tool_calls" and json.loads(args) == {"t": "</tool_call>"}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_json_object_beside_tools_constrains_the_answer_enforced(http, choice):
    """response_format json_object with tools: under "auto" the answer is a JSON object or tool
    calls (it was free text: the format was dropped); under "required" the calls are the answer."""
    for seed in range(3):
        out = _chat(http, tools=TOOLS, tool_choice=choice, response_format={"type": "json_object"}, max_tokens=160,
                    temperature=1.0, seed=seed, parallel_tool_calls=False)["choices"][0]
        message = out["message"]
        if message.get("tool_calls"):
            assert out["finish_reason"] == "tool_calls" and message["content"] is None
        elif out["finish_reason"] == "length":  # out of tokens inside the JSON or the call
            assert message["content"].startswith(("{", "<tool_call>\n{")), out
        else:
            assert choice == "auto" and isinstance(json.loads(message["content"]), dict), out
    assert http.get("/health").status_code == 200


def test_logprobs_chat_and_completions_enforced(http, tiny_tokenizer):
    out = _chat(http, logprobs=True, top_logprobs=3, max_tokens=12, temperature=0, method="dyspec")
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 and bytes(e["bytes"]).decode("utf-8", "replace")
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"], abs=1e-4)  # greedy: the best
    r = http.post("/v1/chat/completions", json={"messages": CHATS[0], "logprobs": True, "top_logprobs": 2,
                                                "max_tokens": 12, "temperature": 0, "stream": True})
    events = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    streamed = [x for e in events for x in ((e["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]
    done = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 2})
    lp = done.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["text_offset"][0] == 0 and all(len(t) <= 2 for t in lp["top_logprobs"])


def test_logit_bias_steers_every_token_enforced(http, tiny_tokenizer):
    a = tiny_tokenizer.encode("A")[0]
    out = _chat(http, logit_bias={str(a): 100}, max_tokens=6, temperature=0, method="dyspec")
    assert out["choices"][0]["message"]["content"] == "AAAAAA"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 10_000])
def test_streamed_tool_calls_add_up_to_the_parsed_ones(step):
    """ToolCallText cut at any points: the content before the calls, each call's name once with its
    id, its arguments in pieces (a brace inside a string, nested objects, the object's own closing
    brace held back), and the pieces add up to what the non-streamed parse returns; a call cut short
    (max_tokens) is never content."""
    from specwood.constrain.grammars import ToolFormat
    from specwood.serve.structured import ToolCallText

    texts = ['Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"u": "c"}}}\n'
             '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
             '<tool_call>\n{"name": "x", "arguments": {"s": "a } b", "t": "caf\u00e9"}}\n</tool_call>',
             '<tool_call>\n{"name": "x", "arguments": {"s": "cut']
    for text in texts:
        stream, content, calls = ToolCallText(ToolFormat()), "", {}

        def take(deltas: list) -> None:
            for d in deltas:
                c = calls.setdefault(d["index"], {"name": "", "arguments": "", "ids": 0})
                c["name"] += d["function"].get("name", "")
                c["arguments"] += d["function"]["arguments"]
                c["ids"] += "id" in d

        for i in range(0, len(text), step):
            content += stream.feed(text[i:i + step])
            take(stream.call_deltas())
        rest, parsed = stream.finish(text)
        take(stream.final_call_deltas(parsed))
        content += rest
        assert content == ("Sure." if text.startswith("Sure.") else "")
        if parsed:
            assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == parsed
            assert all(c["ids"] == 1 for c in calls.values())
        else:  # cut short: the partial call went out as a call
            assert calls[0]["name"] == "x" and calls[0]["arguments"] == '{"s": "cut'[:len(calls[0]["arguments"])]
