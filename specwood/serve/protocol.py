"""The OpenAI wire format: parsing and validating request bodies, and building response objects.

Parsing is explicit (not pydantic) so that every mistake in a body becomes one clear 400 with the
OpenAI error shape and the name of the offending parameter, never a 422 or a 500. Fields the
engine cannot honour (echo, best_of, ...) are rejected when set to anything but their neutral value;
harmless ones (user, metadata, store, ...) and unknown ones are ignored. Structured output
(response_format, tools, tool_choice) becomes a grammar (specwood.constrain.grammars), and
logprobs, logit_bias, the penalties and min_p go with temperature, top_p, top_k and seed into one
SamplingParams (specwood.sampling: its defaults are the neutral values, its validation the last
word); `n` choices are requests of their own.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from specwood.constrain import grammars
from specwood.errors import ContextLengthError, GrammarError, SamplingParamsError, SpecwoodError
from specwood.sampling import SEED_LIMIT, SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               500: "server_error", 503: "service_unavailable_error"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI (and vLLM) default of the legacy endpoint
MAX_CHOICES = 8  # the most choices (`n`) one request may ask for
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the engine's own is greedy)


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # a request body larger than this is a 413
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat); the completions endpoint takes the same
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values lie in [-100, 100]
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias
MAX_JSON_DEPTH = 128  # arrays and objects nested in client JSON: a body, a tool call's arguments
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")  # a logit_bias key (fullmatch; ids out of range: 400 later)


class ProtocolError(Exception):
    """A request the server answers with an OpenAI-style error (400 unless told otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": printable(message),
                      "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                      "param": None if param is None else printable(param), "code": code}}


def printable(text: str) -> str:
    """`text` safe to echo in a response: what UTF-8 cannot encode (a lone surrogate such as
    "\\ud800", which JSON allows and a Python string holds) written as its escape."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_text(text: str, where: str) -> str:
    """`text` when it is valid Unicode, else a 400 naming `where` (a lone surrogate is no character:
    no tokenizer, template or response can hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = printable(text[e.start:e.end])
        raise ProtocolError(f"{where} is not valid Unicode text: it holds the lone UTF-16 surrogate {bad} at "
                            f"character {e.start}; send well-formed UTF-8 (pair or remove it)", param=where,
                            code="invalid_text") from None
    return text


# ---------------------------------------------------------------------------------------------
# request bodies


@dataclass
class GenerationRequest:
    """One validated request of either endpoint, ready for `Engine.new_request`."""

    kind: Literal["chat", "completion"]
    prompt: list[dict[str, Any]] | str | list[int]  # chat messages, raw text or token ids
    model: str | None = None
    max_tokens: int | None = None  # None: the endpoint's default
    # how it samples, built once from the body (the tools' grammar joins it once the tokenizer's tags are known)
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=DEFAULT_TEMPERATURE))
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    method: str | None = None
    json_schema: dict[str, Any] | None = None  # response_format's prepared schema (json_object's too), for tools + JSON
    tools: list[grammars.Tool] | None = None
    tool_specs: list[dict[str, Any]] | None = None  # the request's tools as sent, for the chat template
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs (vLLM's): e.g. Qwen3's enable_thinking
    tool_choice: str = "auto"  # "none", "auto", "required" or a function's name
    parallel_tool_calls: bool = True
    n: int = 1  # choices: requests of their own, seeded seed + i, sharing the prompt's prefill
    cache_salt: str | None = None  # vLLM's field: reuse cached work only with requests of the same salt

    @property
    def raw(self) -> bool:
        return self.kind == "completion"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (parsed into tool_calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def choice_params(self, index: int) -> SamplingParams:
        """The sampling parameters of choice `index` of the `n`: seeded seed + index."""
        seed = self.params.seed
        return self.params if seed is None or index == 0 else replace(self.params, seed=(seed + index) % SEED_LIMIT)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 (its size is bounded before: a 413)."""
    if not raw.strip():
        raise ProtocolError("the request body is empty; send a JSON object")
    body = load_json(raw, "the request body", None)
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def load_json(text: str | bytes, what: str, param: str | None) -> Any:
    """Client-sent JSON text (bounded in size by the body's limit) as a value, or a 400 naming
    `param`: not JSON, or arrays and objects nested deeper than MAX_JSON_DEPTH."""
    too_deep = ProtocolError(f"{what} nests JSON arrays or objects deeper than {MAX_JSON_DEPTH} levels", param=param,
                             code="invalid_json")
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than Python's recursion limit
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{what} is not valid JSON ({_one_line(str(e))})", param=param,
                            code="invalid_json") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


def json_depth(value: Any) -> int:
    """How deep arrays and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, level)
        stack.extend((x, level + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def parse_chat_request(body: dict[str, Any], vocab: int | None = None) -> GenerationRequest:
    """A chat completion's body (`vocab`: the model's, for the token ids of logit_bias)."""
    if "messages" not in body or body["messages"] is None:
        raise ProtocolError("'messages' is a required property", param="messages", code="missing_required_parameter")
    messages = _parse_messages(body["messages"])
    _check_unsupported(body, CHAT_UNSUPPORTED)
    req = GenerationRequest("chat", messages)
    sampling = {"logprobs": _parse_chat_logprobs(body)}
    _parse_structured(body, req, sampling)
    req.template_kwargs = parse_template_kwargs(body.get("chat_template_kwargs"))
    max_tokens = _opt_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", minimum=1)
    else:
        _opt_int(body, "max_tokens", minimum=1)  # still type-checked when both are given
    req.max_tokens = max_tokens
    return _common(body, req, sampling, vocab)


def parse_completion_request(body: dict[str, Any], vocab: int | None = None) -> GenerationRequest:
    """A (legacy) completion's body (`vocab`: the model's, for the token ids of logit_bias)."""
    if "prompt" not in body or body["prompt"] is None:
        raise ProtocolError("'prompt' is a required property", param="prompt", code="missing_required_parameter")
    prompt = _parse_prompt(body["prompt"])
    _check_unsupported(body, COMPLETION_UNSUPPORTED)
    max_tokens = _opt_int(body, "max_tokens", minimum=1)
    req = GenerationRequest("completion", prompt, max_tokens=max_tokens)
    sampling = {"logprobs": _opt_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)}
    _parse_response_format(body, req, sampling)
    return _common(body, req, sampling, vocab)


def _common(body: dict[str, Any], req: GenerationRequest, sampling: dict[str, Any],
            vocab: int | None) -> GenerationRequest:
    """The fields both endpoints take; the sampling ones (with `sampling`, what the endpoint's own
    fields gave) become the request's SamplingParams."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    req.model = None if model is None else check_text(model, "model")
    t = _opt_number(body, "temperature")
    if t is not None and t < 0:
        raise ProtocolError(f"temperature must be >= 0 (0 = greedy), got {t}", param="temperature")
    sampling["temperature"] = DEFAULT_TEMPERATURE if t is None else t
    p = _opt_number(body, "top_p")
    if p is not None:
        if not 0 < p <= 1:
            raise ProtocolError(f"top_p must be in (0, 1], got {p}", param="top_p")
        sampling["top_p"] = p
    k = _opt_int(body, "top_k", minimum=-1)  # vLLM's extension; -1 (or 0) = off
    if k is not None and k > 0:
        sampling["top_k"] = k
    sampling["seed"] = _opt_int(body, "seed", minimum=0, maximum=SEED_LIMIT - 1)
    req.stop = _parse_stop(body.get("stop"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    req.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        if not req.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
        for name in ("include_usage", "continuous_usage_stats"):
            v = opts.get(name)
            if v is not None and not isinstance(v, bool):
                raise _type_error(f"stream_options.{name}", "a boolean", v)
        req.include_usage = bool(opts.get("include_usage"))
        req.continuous_usage = bool(opts.get("continuous_usage_stats"))
    method = body.get("method")
    if method is not None and (not isinstance(method, str) or not method.strip()):
        raise ProtocolError(f"method must be a non-empty string naming a decoding method, got {method!r}",
                            param="method")
    req.method = check_text(method, "method").strip() if method is not None else None
    n = _opt_int(body, "n", minimum=1)
    if n is not None and n > MAX_CHOICES:
        raise ProtocolError(f"n must be <= {MAX_CHOICES} (choices per request), got {n}", param="n")
    req.n = n or 1
    req.cache_salt = _parse_cache_salt(body.get("cache_salt"))
    _parse_processors(body, sampling, vocab)
    try:
        req.params = SamplingParams(**sampling)
    except SamplingParamsError as e:  # what the engine refuses beyond the wire's own checks
        raise ProtocolError(str(e), param=param_of(e), code=code_of(e)) from None
    return req


# the request fields an engine error may name, by the start of its message
_ERROR_PARAMS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "messages", "logit_bias",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def param_of(e: SpecwoodError) -> str | None:
    """The request field an engine error is about (OpenAI's error.param), from its message."""
    msg = str(e)
    for p in _ERROR_PARAMS:
        if msg.startswith(p):
            return p
    if isinstance(e, ContextLengthError):
        return "max_tokens"
    return "method" if msg.startswith("method") else None


def code_of(e: SpecwoodError) -> str | None:
    """OpenAI's error.code of an engine error."""
    if isinstance(e, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(e, SamplingParamsError):
        return "invalid_value"
    return None


MAX_CACHE_SALT_CHARS = 256


def _parse_cache_salt(salt: Any) -> str | None:
    """`cache_salt`: a short non-empty string (vLLM's extension; docs/server.md, Isolation)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise _type_error("cache_salt", "a string", salt)
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ProtocolError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                            f"got {len(salt)}", param="cache_salt")
    return check_text(salt, "cache_salt")


def _parse_processors(body: dict[str, Any], sampling: dict[str, Any], vocab: int | None) -> None:
    """logit_bias, the penalties and min_p into `sampling` (token ids checked against `vocab`
    where given)."""
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = _opt_number(body, name)
        if v is not None:
            if not lo <= v <= hi:
                raise ProtocolError(f"{name} must be in [{lo:g}, {hi:g}] (0 = off), got {v:g}", param=name)
            sampling[name] = v
    v = _opt_number(body, "repetition_penalty")
    if v is not None:
        if not 0 < v <= 100:
            raise ProtocolError(f"repetition_penalty must be in (0, 100] (1 = off), got {v:g}",
                                param="repetition_penalty")
        sampling["repetition_penalty"] = v
    v = _opt_number(body, "min_p")
    if v is not None:
        if not 0 <= v <= 1:
            raise ProtocolError(f"min_p must be in [0, 1] (0 = off), got {v:g}", param="min_p")
        sampling["min_p"] = v
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _type_error("logit_bias", "an object mapping token ids (as strings) to numbers", bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise ProtocolError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias")
    for key, value in bias.items():
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key.strip())):
            raise ProtocolError(f"logit_bias keys must be token ids as strings (e.g. \"50256\"), got {_short(key)}",
                                param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ProtocolError(f"logit_bias values must be numbers in [-100, 100], got {_short(value)} for token "
                                f"{key}", param="logit_bias")
    ids = {int(key): float(value) for key, value in bias.items()}
    bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise ProtocolError(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{vocab - 1})",
                            param="logit_bias")
    sampling["logit_bias"] = ids


def _parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """logprobs and top_logprobs: None (off) or the alternatives each token reports."""
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _type_error("logprobs", "a boolean", lp)
    top = _opt_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not lp:
        raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (top or 0) if lp else None


def _parse_response_format(body: dict[str, Any], req: GenerationRequest, sampling: dict[str, Any]) -> None:
    """response_format (chat, and completions as vLLM takes it): the answer's grammar."""
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _type_error("response_format", "an object such as {\"type\": \"json_object\"}", rf)
        kind = rf.get("type")
        if kind == "json_object":
            req.json_schema = grammars.json_object_schema()
            sampling["grammar"] = grammars.json_object_grammar()
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            where = "response_format.json_schema"
            if not isinstance(spec, dict):
                raise ProtocolError(f"{where} is required with type json_schema: {{\"name\": ..., \"schema\": {{...}}}}",
                                    param=where)
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise _type_error(f"{where}.name", "a string", name)
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise _type_error(f"{where}.strict", "a boolean", strict)
            schema = spec.get("schema", {"type": "object"})  # OpenAI: absent = any JSON object
            try:
                req.json_schema = grammars.prepare_schema(schema, bool(strict))
                sampling["grammar"] = grammars.json_schema_grammar(schema, bool(strict))
            except GrammarError as e:
                raise ProtocolError(f"{where}.schema: {e}", param=f"{where}.schema", code="invalid_schema") from None
        elif kind != "text":
            raise ProtocolError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                                f"{_short(kind)}", param="response_format.type")


MAX_TEMPLATE_KWARGS = 32
# what the server itself passes to the template: a request may not replace it
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "tokenize", "return_dict",
                                      "add_generation_prompt", "continue_final_message", "chat_template"})


def parse_template_kwargs(kwargs: Any) -> dict[str, Any] | None:
    """`chat_template_kwargs` (vLLM's extension): extra variables for the chat template, such as
    Qwen3's `enable_thinking`; names are identifiers, values plain JSON."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", "an object", kwargs)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ProtocolError(f"chat_template_kwargs may hold at most {MAX_TEMPLATE_KWARGS} entries, got {len(kwargs)}",
                            param="chat_template_kwargs")
    for name in kwargs:
        if not (name.isascii() and name.isidentifier()):
            raise ProtocolError(f"chat_template_kwargs names must be identifiers, got {_short(name)}",
                                param="chat_template_kwargs")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ProtocolError(f"chat_template_kwargs may not set '{name}' (the server passes it; use the request's "
                                "own field)", param="chat_template_kwargs")
    return dict(kwargs)


def _parse_structured(body: dict[str, Any], req: GenerationRequest, sampling: dict[str, Any]) -> None:
    """response_format, tools, tool_choice and parallel_tool_calls (chat)."""
    _parse_response_format(body, req, sampling)
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not (isinstance(tools, list) and not tools):  # [] = no tools
        try:
            req.tools = grammars.parse_tools(tools)
            req.tool_specs = [{"type": "function", "function": t["function"]} for t in tools]
        except GrammarError as e:
            raise ProtocolError(str(e), param=str(e).split(":", 1)[0], code="invalid_tools") from None
    if choice is not None:
        try:
            req.tool_choice = grammars.parse_tool_choice(choice, req.tools)
        except GrammarError as e:
            raise ProtocolError(str(e), param="tool_choice", code="invalid_tool_choice") from None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _type_error("parallel_tool_calls", "a boolean", parallel)
        req.parallel_tool_calls = parallel


def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _type_error("messages", "an array of message objects", messages)
    if not messages:
        raise ProtocolError("messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object with 'role' and 'content'", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise ProtocolError(f"{where}.role is required and must be a string", param=f"{where}.role")
        check_text(role, f"{where}.role")
        if role not in CHAT_ROLES:
            hint = " (legacy function calling: use tools and role 'tool')" if role == "function" else ""
            raise ProtocolError(f"{where}.role '{role}' is not supported{hint}; use one of {', '.join(CHAT_ROLES)}",
                                param=f"{where}.role")
        if m.get("function_call"):
            raise ProtocolError(f"{where}.function_call: legacy function calls are not supported; use tool_calls",
                                param=f"{where}.function_call")
        content = m.get("content")
        calls = m.get("tool_calls")
        if content is None and not (role == "assistant"):
            raise ProtocolError(f"{where}.content is required", param=f"{where}.content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _message_text(content, f"{where}.content")}
        if calls is not None and calls != []:
            if role != "assistant":
                raise ProtocolError(f"{where}.tool_calls: only assistant messages carry tool calls",
                                    param=f"{where}.tool_calls")
            msg["tool_calls"] = _parse_message_tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ProtocolError(f"{where}.tool_call_id is required for a tool message (the id of the call it "
                                    "answers)", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
            name = m.get("name")
            if isinstance(name, str):
                msg["name"] = name
        out.append(msg)
    return out


def _parse_message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls for the chat template: arguments as objects (templates
    write them with tojson; the wire carries them as JSON strings)."""
    if not isinstance(calls, list):
        raise _type_error(where, "an array of tool calls", calls)
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ProtocolError(f"{w} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"arguments\": \"{{...}}\"}}}}", param=w)
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            where_args = f"{w}.function.arguments"
            args = load_json(args, where_args, where_args) if args.strip() else {}
        if not isinstance(args, dict):
            raise ProtocolError(f"{w}.function.arguments must be a JSON object, got {_short(args)}",
                                param=f"{w}.function.arguments")
        call_id = c.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _type_error(f"{w}.id", "a string", call_id)
        out.append({"id": call_id or f"call_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, where)
    if isinstance(content, list):  # content parts: only text
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise ProtocolError(f"{where}[{j}]: only text content parts are supported (got {kind!r})",
                                    param=f"{where}[{j}]")
            texts.append(check_text(part["text"], f"{where}[{j}].text"))
        return "".join(texts)
    raise _type_error(where, "a string or an array of text parts", content)


def _parse_prompt(prompt: Any) -> str | list[int]:
    """A string or a list of token ids; a batch of exactly one of either is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return check_text(prompt, "prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ProtocolError("batched prompts are not supported; send one prompt per request", param="prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ProtocolError("prompt must be a string or an array of token ids (integers)", param="prompt")
        return list(prompt)
    raise _type_error("prompt", "a string or an array of token ids", prompt)


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _type_error("stop", "a string or an array of strings", stop)
    for s in stop:
        check_text(s, "stop")
    # every stop string is checked against the text at every step: bounded, so one request cannot
    # slow everyone's steps
    if len(stop) > MAX_STOP_STRINGS:
        raise ProtocolError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ProtocolError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}",
                            param="stop")
    return [s for s in stop if s]


# name -> the neutral values it may take (anything else is a 400: the engine cannot honour it)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
CHAT_UNSUPPORTED = ("functions", "function_call", "min_tokens", "ignore_eos", "modalities", "audio",
                    "prediction", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
COMPLETION_UNSUPPORTED = ("best_of", "echo", "suffix", "min_tokens", "ignore_eos", "guided_json", "guided_regex",
                          "guided_choice", "guided_grammar")


def _check_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        v = body.get(name)
        if v is None or any(_same(v, ok) for ok in _NEUTRAL[name]):
            continue
        if name == "best_of" and isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            raise ProtocolError(f"{name} = {v} is not supported: this server returns one choice per request "
                                f"({name} must be 1)", param=name, code="unsupported_parameter")
        raise ProtocolError(f"'{name}' is not supported by this server (got {_short(v)})", param=name,
                            code="unsupported_parameter")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


def _opt_number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
        raise _type_error(name, "a number", v)
    return float(v)


def _opt_int(body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if minimum is not None and v < minimum:
        raise ProtocolError(f"{name} must be >= {minimum}, got {v}", param=name)
    if maximum is not None and v > maximum:
        raise ProtocolError(f"{name} must be <= {maximum}, got {v}", param=name)
    return v


def _type_error(name: str, expected: str, got: Any) -> ProtocolError:
    return ProtocolError(f"{name} must be {expected}, got {_json_type(got)} {_short(got)}", param=name,
                         code="invalid_type")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object" if isinstance(v, dict) else type(v).__name__


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose K/V came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def jsonable(v: Any) -> Any:
    """Stats as strict JSON: non-finite floats become null, keys strings."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


def tool_call_id() -> str:
    """A new tool call's id, in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_objects(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """OpenAI's tool_calls for parsed (name, arguments JSON) calls (streamed ones: ToolCallText)."""
    return [{"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


def completion_response(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                        usage_: dict[str, int], stats: dict[str, Any] | None, *,
                        tool_calls: list[dict[str, Any]] | None = None,
                        logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
           "choices": [choice], "usage": usage_}
    if stats is not None:  # None: the server leaves its statistics out (--no-specwood-stats)
        out["specwood_stats"] = jsonable(stats)
    return out


def stream_chunk(kind: str, rid: str, created: int, model: str, *, text: str | None = None, role: bool = False,
                 finish_reason: str | None = None, usage_: dict[str, int] | None = None,
                 with_usage: bool = False, tool_calls: list[dict[str, Any]] | None = None,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chunk with one choice: a text delta (or the role, tool calls, or the finish reason),
    with the logprobs of the tokens it carries."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
             "choices": [choice]}
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict[str, int],
                stats: dict[str, Any] | None) -> dict[str, Any]:
    """The last chunk of `stream_options.include_usage`: no choices, the usage and the stats."""
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": created, "model": model, "system_fingerprint": None, "choices": [], "usage": usage_}
    if stats is not None:
        out["specwood_stats"] = jsonable(stats)
    return out


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"
