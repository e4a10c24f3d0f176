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
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": list(P.CHAT_ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}


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
    }


def chat_body(model: str, methods: list[str], max_context: int) -> dict[str, Any]:
    """The chat body; the prompt and max_tokens together must fit `max_context` tokens."""
    return {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": max_context},
        **_common(model, methods, max_context)}}


def completion_body(model: str, methods: list[str], vocab_size: int, max_context: int) -> dict[str, Any]:
    """The completions body: a string, or token ids below `vocab_size`, within `max_context`."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
           "minItems": 1, "maxItems": max_context}
    return {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, ids],
                   "description": "a string or the prompt's token ids"},
        **_common(model, methods, max_context)}}


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
