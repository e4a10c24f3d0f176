"""The request bodies of the two generation endpoints as OpenAPI (JSON Schema), for /openapi.json.

The endpoints parse their bodies themselves (specwood.serve.protocol: OpenAI-shaped 400s, never
FastAPI's 422), so FastAPI cannot infer these; they are written out here for clients, generators
and the fuzzing test (tests/test_server_reliability.py), and must say what protocol.py accepts.
"""
from __future__ import annotations

from typing import Any

from specwood.sampling import SEED_LIMIT
from specwood.serve import protocol as P

_STOP = {"maxLength": P.MAX_STOP_CHARS, "type": "string"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string", "description": "a JSON object"}}}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": list(P.CHAT_ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant message's calls"},
    "tool_call_id": {"type": "string", "description": "required in a tool message: the call it answers"}}}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_SCHEMA = {"type": "object", "description": "a JSON schema (llguidance's subset; 400 for what it cannot enforce)"}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": {"type": "string"}, "parameters": _SCHEMA, "strict": {"type": "boolean"}}}}}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "schema": _SCHEMA,
            "strict": {"type": ["boolean", "null"]}}}}},
    {"type": "null"}]}
_TOOL_CHOICE = {"anyOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}},
    {"type": "null"}], "description": "only with tools"}
_PROCESSORS = {
    "logit_bias": {"type": ["object", "null"], "description": "token id (a string) -> a bias in [-100, 100]",
                   "propertyNames": {"pattern": "^-?[0-9]{1,10}$"},
                   "additionalProperties": {"type": "number", "minimum": -P.LOGIT_BIAS_LIMIT,
                                            "maximum": P.LOGIT_BIAS_LIMIT}},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100,
                           "description": "vLLM's extension; 1 = off"},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1, "description": "vLLM's extension; 0 = off"},
}


def _common(model: str, methods: list[str], max_context: int) -> dict[str, Any]:
    return {
        "model": {"type": "string", "enum": [model], "description": "the served model (optional)"},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": max_context},
        "temperature": {"type": ["number", "null"], "minimum": 0, "description": "0 = greedy"},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1, "description": "-1 or 0 = off (vLLM's extension)"},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": SEED_LIMIT - 1},
        "stop": {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": P.MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "description": "only with stream: true", "properties": {
            "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": P.MAX_CHOICES,
              "description": "choices, each its own request seeded seed + i; the prompt is prefilled once"},
        "method": {"type": "string", "enum": methods,
                   "description": "specwood's extension: the decoding method (default: the server's)"},
        "cache_salt": {"type": ["string", "null"], "minLength": 1, "maxLength": P.MAX_CACHE_SALT_CHARS,
                       "description": "vLLM's extension: cached work is reused only among requests of the same "
                                      "API key and salt (docs/server.md, Isolation)"},
    }


def chat_body(model: str, methods: list[str], max_context: int) -> dict[str, Any]:
    """The chat body; the prompt and max_tokens together must fit `max_context` tokens."""
    return {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": max_context},
        "response_format": _RESPONSE_FORMAT,
        "tools": {"type": ["array", "null"], "items": _TOOL},
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "chat_template_kwargs": {"type": ["object", "null"], "maxProperties": P.MAX_TEMPLATE_KWARGS,
                                 "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                                                   "not": {"enum": sorted(P.RESERVED_TEMPLATE_KWARGS)}},
                                 "description": "vLLM's extension: the chat template's own variables, e.g. "
                                                "{\"enable_thinking\": false} for Qwen3"},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": P.MAX_TOP_LOGPROBS,
                         "description": "only with logprobs: true"},
        **_PROCESSORS, **_common(model, methods, max_context)}}


def completion_body(model: str, methods: list[str], vocab_size: int, max_context: int) -> dict[str, Any]:
    """The completions body: a string, or token ids below `vocab_size`, within `max_context`."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
           "minItems": 1, "maxItems": max_context}
    return {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, ids],
                   "description": "a string or the prompt's token ids"},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": P.MAX_TOP_LOGPROBS,
                     "description": "the emitted tokens' logprobs and this many alternatives each"},
        "response_format": _RESPONSE_FORMAT,
        **_PROCESSORS, **_common(model, methods, max_context)}}


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "integer", "null"]}}}}}


def generation_operation(body: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a generation endpoint: its JSON body and the answers it gives."""
    errors = {str(status): {"description": what, "content": {"application/json": {"schema": _ERROR}}}
              for status, what in ((400, "a malformed or unsupported request"), (401, "a missing or wrong API key"),
                                   (413, "a body over --max-body-bytes"), (415, "a body that is not JSON"),
                                   (503, "the queue is full (Retry-After) or the server is stopping"))}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the completion, or its server-sent events when stream is true",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **errors}}
