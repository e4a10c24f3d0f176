"""The OpenAI wire format: parsing and validating request bodies, and building response objects.

Parsing is explicit (not pydantic) so that every mistake in a body becomes one clear 400 with the
OpenAI error shape and the name of the offending parameter, never a 422 or a 500. Fields the
engine cannot honour (best_of > 1, logprobs, tools, penalties, ...) are rejected when set to anything
but their neutral value; harmless ones (user, metadata, store, ...) and unknown ones are ignored.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from specwood.sampling import SEED_LIMIT

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               500: "server_error", 503: "service_unavailable_error"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI (and vLLM) default of the legacy endpoint
MAX_CHOICES = 8  # the most choices (`n`) one request may ask for


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # a request body larger than this is a 413


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
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                                                  else "server_error"),
                      "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------
# request bodies


@dataclass
class GenerationRequest:
    """One validated request of either endpoint, ready for `Engine.new_request`."""

    kind: Literal["chat", "completion"]
    prompt: list[dict[str, str]] | str | list[int]  # chat messages, raw text or token ids
    model: str | None = None
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    method: str | None = None
    n: int = 1  # choices: requests of their own, seeded seed + i, sharing the prompt's prefill

    @property
    def raw(self) -> bool:
        return self.kind == "completion"


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    if not raw.strip():
        raise ProtocolError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit
        raise ProtocolError("the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def parse_chat_request(body: dict[str, Any]) -> GenerationRequest:
    if "messages" not in body or body["messages"] is None:
        raise ProtocolError("'messages' is a required property", param="messages", code="missing_required_parameter")
    messages = _parse_messages(body["messages"])
    _check_unsupported(body, CHAT_UNSUPPORTED)
    max_tokens = _opt_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", minimum=1)
    else:
        _opt_int(body, "max_tokens", minimum=1)  # still type-checked when both are given
    return _common(body, GenerationRequest("chat", messages, max_tokens=max_tokens))


def parse_completion_request(body: dict[str, Any]) -> GenerationRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise ProtocolError("'prompt' is a required property", param="prompt", code="missing_required_parameter")
    prompt = _parse_prompt(body["prompt"])
    _check_unsupported(body, COMPLETION_UNSUPPORTED)
    max_tokens = _opt_int(body, "max_tokens", minimum=1)
    return _common(body, GenerationRequest("completion", prompt, max_tokens=max_tokens))


def _common(body: dict[str, Any], req: GenerationRequest) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    req.model = model
    t = _opt_number(body, "temperature")
    if t is not None:
        if t < 0:
            raise ProtocolError(f"temperature must be >= 0 (0 = greedy), got {t}", param="temperature")
        req.temperature = t
    p = _opt_number(body, "top_p")
    if p is not None:
        if not 0 < p <= 1:
            raise ProtocolError(f"top_p must be in (0, 1], got {p}", param="top_p")
        req.top_p = p
    k = _opt_int(body, "top_k", minimum=-1)  # vLLM's extension; -1 (or 0) = off
    req.top_k = 0 if k is None or k < 0 else k
    req.seed = _opt_int(body, "seed", minimum=0, maximum=SEED_LIMIT - 1)
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
    req.method = method.strip() if method is not None else None
    n = _opt_int(body, "n", minimum=1)
    if n is not None and n > MAX_CHOICES:
        raise ProtocolError(f"n must be <= {MAX_CHOICES} (choices per request), got {n}", param="n")
    req.n = n or 1
    return req


def _parse_messages(messages: Any) -> list[dict[str, str]]:
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
        if role not in CHAT_ROLES:
            hint = " (tool calling is not supported)" if role in ("tool", "function") else ""
            raise ProtocolError(f"{where}.role '{role}' is not supported{hint}; use one of {', '.join(CHAT_ROLES)}",
                                param=f"{where}.role")
        if m.get("tool_calls") or m.get("function_call"):
            raise ProtocolError(f"{where}: tool calls are not supported", param=f"{where}.tool_calls")
        content = m.get("content")
        if content is None and role != "assistant":
            raise ProtocolError(f"{where}.content is required", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _message_text(content, f"{where}.content")})
    return out


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise ProtocolError(f"{where}[{j}]: only text content parts are supported (got {kind!r})",
                                    param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _type_error(where, "a string or an array of text parts", content)


def _parse_prompt(prompt: Any) -> str | list[int]:
    """A string or a list of token ids; a batch of exactly one of either is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
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
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "min_p": (0,),
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
CHAT_UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "tool_choice", "function_call",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
                    "ignore_eos", "response_format", "modalities", "audio", "prediction", "guided_json",
                    "guided_regex", "guided_choice", "guided_grammar")
COMPLETION_UNSUPPORTED = ("best_of", "logprobs", "echo", "suffix", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "logit_bias", "min_p", "min_tokens", "ignore_eos", "guided_json",
                          "guided_regex", "guided_choice", "guided_grammar")


def _check_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        v = body.get(name)
        if v is None or any(_same(v, ok) for ok in _NEUTRAL[name]):
            continue
        if name in ("n", "best_of") and isinstance(v, int) and not isinstance(v, bool) and v >= 1:
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


def completion_response(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                        usage_: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [choice], "usage": usage_, "specwood_stats": jsonable(stats)}


def stream_chunk(kind: str, rid: str, created: int, model: str, *, text: str | None = None, role: bool = False,
                 finish_reason: str | None = None, usage_: dict[str, int] | None = None,
                 with_usage: bool = False) -> dict[str, Any]:
    """One chunk with one choice: a text delta (or the role, or the finish reason)."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
             "choices": [choice]}
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict[str, int],
                stats: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of `stream_options.include_usage`: no choices, the usage and the stats."""
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "system_fingerprint": None, "choices": [], "usage": usage_,
            "specwood_stats": jsonable(stats)}


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"
