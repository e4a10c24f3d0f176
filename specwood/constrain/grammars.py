"""Grammars for structured output: JSON (`response_format`) and the model's tool-call format (`tools`).

Each function returns an llguidance grammar string, what `SamplingParams.grammar` carries and the
per-path processors compile into a matcher, or raises GrammarError with one line that says what is
wrong. Schemas are checked here, before any request runs: size limits first (a schema is compiled
on the request's thread, so it must be bounded), then llguidance compiles it, which rejects
unsupported keywords, `$ref`s that do not resolve, bad `pattern` regexes and schemas no value can
satisfy. Nothing is silently dropped: a keyword llguidance cannot enforce is an error, never ignored.

JSON is written compactly with `", "` and `": "` separators and no other whitespace: every byte
the schema fixes is then forced (free tokens under speculation), and a model cannot loop on
whitespace.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from specwood.errors import GrammarError

MAX_SCHEMA_BYTES = 64 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document (a schema level takes about two)
MAX_PROPERTIES = 1000  # object properties, all objects together
MAX_ENUM_VALUES = 1000  # enum values and consts, all together
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)

# llguidance's JSON options: compact, fixed separators; every unsupported keyword an error
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
                "coerce_one_of": False}
_ANY_OBJECT = {"type": "object"}


def json_object_grammar() -> str:
    """`response_format: {"type": "json_object"}`: any JSON object."""
    return _compile(json_object_schema(), "JSON object")


def json_object_schema() -> dict[str, Any]:
    """`json_object`'s schema, with our JSON options (what tools_grammar's `content` takes)."""
    return _with_options(dict(_ANY_OBJECT))


def json_schema_grammar(schema: dict[str, Any], strict: bool = False) -> str:
    """`response_format: {"type": "json_schema", ...}`: a JSON value valid under `schema`.

    strict: objects that do not say otherwise admit only their listed properties, as OpenAI's
    strict outputs never carry extra keys (`additionalProperties: false` where absent)."""
    return _compile(prepare_schema(schema, strict), "schema")


def prepare_schema(schema: Any, strict: bool = False) -> dict[str, Any]:
    """The schema checked against the size limits, closed when `strict`, with our JSON options."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {_json_type(schema)}")
    check_schema_size(schema)
    schema = json.loads(json.dumps(schema))  # a private copy
    if strict:
        _close_objects(schema)
    return _with_options(schema)


def check_schema_size(schema: Any) -> None:
    """GrammarError for a schema over MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_PROPERTIES or MAX_ENUM_VALUES."""
    try:
        size = len(json.dumps(schema, separators=(",", ":")).encode())
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarError(f"the schema is not plain JSON ({e})") from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema has {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    depth, properties, enums = 0, 0, 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON")
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            enums += "const" in node
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node)
    if properties > MAX_PROPERTIES:
        raise GrammarError(f"the schema has {properties} properties; at most {MAX_PROPERTIES} are allowed")
    if enums > MAX_ENUM_VALUES:
        raise GrammarError(f"the schema has {enums} enum values; at most {MAX_ENUM_VALUES} are allowed")


def _close_objects(node: Any, in_all_of: bool = False) -> None:
    """additionalProperties: false on every object schema that lists properties and says nothing
    about others (not on allOf members: closing each would forbid the others' properties)."""
    if isinstance(node, list):
        for v in node:
            _close_objects(v, in_all_of)
        return
    if not isinstance(node, dict):
        return
    if (isinstance(node.get("properties"), dict) and not in_all_of
            and not any(k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        node["additionalProperties"] = False
    for key, v in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            if isinstance(v, dict):
                for sub in v.values():
                    _close_objects(sub)
        elif key in ("enum", "const", "default", "examples", "required"):
            continue  # values, not schemas
        else:
            _close_objects(v, in_all_of=key == "allOf")


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    schema.pop("x-guidance", None)  # llguidance's own options are ours to set, not the request's
    schema["x-guidance"] = dict(JSON_OPTIONS)
    return schema


def _compile(schema: dict[str, Any], what: str) -> str:
    from llguidance import LLMatcher

    with _llguidance_errors(what):
        grammar = LLMatcher.grammar_from_json_schema(schema)
    _validate(grammar)
    return grammar


def _validate(grammar: str) -> None:
    from llguidance import LLMatcher

    with _llguidance_errors("grammar"):
        message = LLMatcher.validate_grammar(grammar)
    if message:
        raise GrammarError(explain(message))


@contextlib.contextmanager
def _llguidance_errors(what: str) -> Iterator[None]:
    """Any failure inside llguidance (a Rust panic included) as a GrammarError, never a 500."""
    try:
        yield
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001
        raise GrammarError(f"the {what} cannot be compiled: {_one_line(str(e))}") from None
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise GrammarError(f"the {what} cannot be compiled: {_one_line(str(e))}") from None


def explain(message: str) -> str:
    """llguidance's compile error as one line saying what is wrong with the schema."""
    m = re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", message.strip())
    if m.startswith("regex parse error"):
        lines = [x.strip() for x in m.splitlines() if x.strip()]
        why = lines[-1].removeprefix("error:").strip()
        pattern = lines[1] if len(lines) > 2 else ""
        return f"a 'pattern' is not a valid regular expression ({why}: {pattern!r})"
    m = m.split("\n   ")[0]  # a lark error appends the grammar's line and a caret
    if m.startswith("Unimplemented keys:"):
        keys = m.split(":", 1)[1].strip()
        return f"unsupported keyword(s) {keys}: remove them (they cannot be enforced while decoding)"
    if m.startswith("Unsatisfiable schema"):
        return f"the schema cannot be satisfied by any value ({m.split(':', 1)[1].strip()})"
    if "does not exist" in m or "not present in a registry" in m or "retrieving it failed" in m:
        return f"a $ref does not resolve ({_one_line(m)}); only local references (#/$defs/...) are supported"
    return f"the schema cannot be used: {_one_line(m)}"


# ---------------------------------------------------------------------------------------------
# tool calls


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a tool call: `open`, a JSON object {"name": ..., "arguments": {...}},
    `close`, each on its own line (Qwen2.5's and Hermes' format). Where the tokenizer has both tags
    as added tokens (Qwen2.5: 151657, 151658) they are those tokens, which text never holds
    (llguidance keeps added tokens out of text): a call starts and ends only at those ids.
    Otherwise they are plain text (see specwood.serve.structured for how calls are read then)."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    open_id: int | None = None
    close_id: int | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> "ToolFormat":
        get_added = getattr(tokenizer, "get_added_vocab", None)
        added = get_added() if get_added is not None else {}
        open_id, close_id = added.get(cls.open), added.get(cls.close)
        if open_id is None or close_id is None:  # half the markup a token: read both as text
            return cls()
        return cls(open_id=int(open_id), close_id=int(close_id))

    @property
    def tags_are_tokens(self) -> bool:
        return self.open_id is not None and self.close_id is not None

    def lark_open(self) -> str:
        return f"<[{self.open_id}]>" if self.open_id is not None else json.dumps(self.open)

    def lark_close(self) -> str:
        return f"<[{self.close_id}]>" if self.close_id is not None else json.dumps(self.close)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False


def parse_tools(tools: Any) -> list[Tool]:
    """The request's `tools`, checked: function tools with unique names and usable parameter
    schemas. GrammarError messages start with the offending path (tools[i]...)."""
    if not isinstance(tools, list):
        raise GrammarError(f"tools: must be an array of tool objects, got {_json_type(tools)}")
    if len(tools) > MAX_TOOLS:
        raise GrammarError(f"tools: at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise GrammarError(f"{where}: must be an object, got {_json_type(t)}")
        if t.get("type", "function") != "function":
            raise GrammarError(f"{where}.type: only 'function' tools are supported, got {t.get('type')!r}")
        f = t.get("function")
        if not isinstance(f, dict):
            raise GrammarError(f"{where}.function: must be an object with a 'name'")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise GrammarError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if any(o.name == name for o in out):
            raise GrammarError(f"{where}.function.name: '{name}' is defined twice")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise GrammarError(f"{where}.function.description: must be a string")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"{where}.function.strict: must be a boolean")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        try:
            prepared = prepare_schema(params, bool(strict))
            _compile(json.loads(json.dumps(prepared)), "schema")
        except GrammarError as e:
            raise GrammarError(f"{where}.function.parameters: {e}") from None
        if prepared.get("type") not in ("object", None):
            raise GrammarError(f"{where}.function.parameters: must describe an object (\"type\": \"object\")")
        out.append(Tool(name, desc, prepared, bool(strict)))
    if not out:
        raise GrammarError("tools: must hold at least one tool (leave tools out for none)")
    return out


def parse_tool_choice(choice: Any, tools: list[Tool] | None) -> str:
    """`tool_choice` as "none", "auto", "required" or the name of the one function to call.
    GrammarError messages start with "tool_choice"."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise GrammarError(f"tool_choice: must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": ...}}}}, got {choice!r}")
        name = choice
    elif isinstance(choice, dict):
        f = choice.get("function")
        named = f.get("name") if isinstance(f, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(named, str):
            raise GrammarError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        name = named
    else:
        raise GrammarError(f"tool_choice: must be a string or an object, got {_json_type(choice)}")
    if not tools:
        raise GrammarError("tool_choice: is only allowed when tools are given")
    if name not in ("none", "auto", "required") or isinstance(choice, dict):
        if not any(t.name == name for t in tools):
            raise GrammarError(f"tool_choice: names the function '{name}', which is not among the tools "
                               f"({', '.join(t.name for t in tools)})")
    return name


def tools_grammar(tools: list[Tool], tool_choice: str, fmt: ToolFormat, parallel: bool = True,
                  content: dict[str, Any] | None = None) -> str | None:
    """The grammar of the model's answer given `tools` (`tool_choice` as parse_tool_choice gives
    it): "auto" text, or text and then tool calls; "required" one or more calls; a function's name
    exactly one call of it; "none" no grammar (None: the model answers in text, its tools still
    in the prompt, as OpenAI does). `parallel` (parallel_tool_calls) allows several calls.
    `content` (a prepare_schema result, from response_format): with "auto", the answer is either
    JSON under it or tool calls."""
    if tool_choice == "none":
        return None
    named = tool_choice not in ("auto", "required")
    chosen = [t for t in tools if t.name == tool_choice] if named else tools
    open_, close = fmt.lark_open(), fmt.lark_close()
    bodies = [f"body_{i}: {json.dumps(_call_head(t.name))} %json {json.dumps(t.parameters)} "
              f"{json.dumps(CALL_TAIL)} {close}" for i, t in enumerate(chosen)]
    more = f' ("\\n" {open_} body)*' if parallel and not named else ""
    if tool_choice != "auto":
        start = [f"start: {open_} body{more}"]
    elif content is not None:
        start = [f"start: %json {json.dumps(content)} | {open_} body{more}"]
    elif fmt.open_id is not None:  # the tag is a token: text can never contain it
        start = [f"start: TEXT | TEXT {open_} body{more}"]
    else:  # the tag is text: the text ends (lazily) where the tag first appears
        start = [f"start: TEXT | lead body{more}", f"lead[lazy]: TEXT {open_}"]
    lark = "\n".join([*start, "TEXT: /(.|\\n)*/", "body: " + " | ".join(f"body_{i}" for i in range(len(chosen))),
                      *bodies]) + "\n"
    from llguidance import LLMatcher

    with _llguidance_errors("tools' grammar"):
        grammar = LLMatcher.grammar_from_lark(lark)
    _validate(grammar)
    return grammar


CALL_TAIL = "}\n"


def _call_head(name: str) -> str:
    """What follows the open tag up to the arguments: Qwen2.5's `\\n{"name": "f", "arguments": `."""
    return '\n{"name": ' + json.dumps(name) + ', "arguments": '


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else type(v).__name__
