"""The response side of structured output: tool calls out of the model's output, and `logprobs` in
OpenAI's two shapes (chat: `content[{token, logprob, bytes, top_logprobs}]`; completions:
`tokens, token_logprobs, top_logprobs, text_offset`).

How a call is found depends on the tool-call markup (specwood.constrain.grammars.ToolFormat):

- Tags that are tokens (Qwen2.5's <tool_call> = 151657): a call starts at the open tag's token id
  and ends at the close tag's, both found in the output's token ids; the text between them is
  the call. The same characters spelled in ordinary tokens are text: content, or a string inside
  a call's arguments (the grammar never lets a tag token into text, specwood.constrain.matcher).
- Tags that are plain text: a call starts at the first open tag (the tools grammar ends content
  there, lazily, so content never holds one) and ends at the close tag that follows its JSON
  object, which is read as JSON: a string in the arguments may hold either tag.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from specwood.constrain.grammars import ToolFormat
from specwood.serve.protocol import tool_call_id


class ToolCallText:
    """A chat answer that may hold tool calls, read as it streams and once it is done: passes on
    the content before the first call (holding back a tail that may be a text tag's beginning),
    and then each call as it is written (`call_deltas`): its name and id once its `"arguments": `
    has arrived, then its arguments' text piece by piece, as OpenAI streams them. `finish` parses
    the calls; `final_call_deltas` sends what of them did not go out yet.

    tokenizer: decodes the output's token ids where the tags are tokens (then `feed` and `finish`
    take the token ids too). calls_first: the answer is JSON or calls (tools with a response
    format), so a call can only be at its very start."""

    def __init__(self, fmt: ToolFormat, tokenizer: Any = None, calls_first: bool = False):
        self.fmt = fmt
        self.by_tokens = fmt.tags_are_tokens and tokenizer is not None
        self.tokenizer = tokenizer
        self.calls_first = calls_first
        self.text = ""
        self.ids: Sequence[int] = ()
        self.sent = 0  # characters of content passed on
        self.in_calls = False
        self.calls: list[_StreamedCall] = []  # calls whose name went out
        self._done = 0  # calls streamed to their end
        self._stopped = False  # a call not in the expected shape: the rest waits for `finish`
        self._tags = _TagTokens(fmt, tokenizer) if self.by_tokens else None
        self._objects: dict[int, _JsonEnd] = {}  # text mode: each call's object, by where it starts

    def feed(self, delta: str, token_ids: Sequence[int] | None = None) -> str:
        """The content that may be streamed now, given the next text delta (and, where the tags
        are tokens, the output's token ids so far)."""
        self.text += delta
        if token_ids is not None:
            self.ids = token_ids
        if self.in_calls:
            return ""
        first, _ = self._spans()
        if first is not None:
            self.in_calls, end = True, min(first, len(self.text))
        elif self.by_tokens or (self.calls_first and not self.fmt.open.startswith(self.text)):
            end = len(self.text)  # nothing in the text can begin a call
        else:
            end = len(self.text) - _partial_tail(self.text, self.fmt.open)
        end = len(self.text[:end].rstrip())  # whitespace before a call is not content: held until known
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def call_deltas(self) -> list[dict[str, Any]]:
        """The `delta.tool_calls` entries the output fed so far allows (none before the first call)."""
        out: list[dict[str, Any]] = []
        if not self.in_calls or self._stopped:
            return out
        _, spans = self._spans()
        for i in range(self._done, len(spans)):
            span = spans[i]
            if span.bad:
                self._stopped = True  # not our format: `finish` parses what there is
                break
            if i == len(self.calls):
                head = _CALL_HEAD.match(span.body)
                if head is None:
                    if span.closed or len(span.body) > _HEAD_LIMIT:
                        self._stopped = True
                    break
                call = _StreamedCall(json.loads(head.group(1)), head.end())
                self.calls.append(call)
                out.append({"index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            call = self.calls[i]
            end = call.arguments_end.scan(span.body)  # the arguments end at their object's last brace
            if call.arguments_end.bad:
                self._stopped = True
                break
            end = len(span.body) if end is None else end
            piece = span.body[call.start + len(call.arguments):end]
            if piece:
                call.arguments += piece
                out.append({"index": i, "function": {"arguments": piece}})
            if not span.closed:
                break
            self._done = i + 1
        return out

    def finish(self, text: str, token_ids: Sequence[int] | None = None) -> tuple[str, list[tuple[str, str]]]:
        """The content not passed on yet and the parsed calls (none: all of the text is content,
        as when a call is malformed or the only call was cut short)."""
        reading = ToolCallText(self.fmt, self.tokenizer, self.calls_first)  # the whole output, read afresh
        reading.text, reading.ids = text, token_ids if token_ids is not None else ()
        first, spans = reading._spans()
        calls: list[tuple[str, str]] = []
        for span in spans:
            call = None if span.bad else _read_call(span.body) if span.closed else ()
            if call is None:  # malformed: no calls at all
                calls = []
                break
            if not call:  # cut short (out of tokens): left out
                break
            calls.append(call)
        content = text[:first].rstrip() if first is not None and (calls or self.calls) else text
        return content[self.sent:], calls

    def final_call_deltas(self, parsed: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """What of the parsed calls has not gone out: a call's missing end of arguments, or whole
        calls not begun in the stream."""
        out: list[dict[str, Any]] = []
        for i, (name, arguments) in enumerate(parsed):
            if i < len(self.calls):
                sent = self.calls[i].arguments
                if arguments.startswith(sent) and len(arguments) > len(sent):
                    out.append({"index": i, "function": {"arguments": arguments[len(sent):]}})
            else:
                out.append({"index": i, "id": tool_call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
        return out

    # --- where the calls are ------------------------------------------------------------------

    def _spans(self) -> tuple[int | None, list[_Span]]:
        """Where in the text the first call begins (None: no call so far) and each call's span."""
        return self._token_spans(self._tags) if self._tags is not None else self._text_spans()

    def _token_spans(self, tag_tokens: _TagTokens) -> tuple[int | None, list[_Span]]:
        tags = tag_tokens.update(self.ids)
        text, first, spans = self.text, None, []
        opened: _Tag | None = None
        for tag in tags:
            if tag.is_open:
                if first is None:
                    if self.calls_first and tag.start > 0:
                        return None, []
                    first = tag.start
                if opened is not None:  # a call inside a call
                    spans.append(_Span(text[opened.end:tag.start], closed=False, bad=True))
                    return first, spans
                opened = tag
            elif opened is not None:  # (a close tag outside a call: the grammar never writes one)
                spans.append(_Span(text[opened.end:tag.start], closed=True))
                opened = None
        if opened is not None:
            spans.append(_Span(text[opened.end:], closed=False))
        return first, spans

    def _text_spans(self) -> tuple[int | None, list[_Span]]:
        text, tag, close = self.text, self.fmt.open, self.fmt.close
        if self.calls_first:
            first = 0 if text.startswith(tag) else -1
        else:
            first = text.find(tag)
        if first < 0:
            return None, []
        spans, at = [], first
        while at >= 0:
            start = at + len(tag)
            scan = self._objects.setdefault(start, _JsonEnd(start))
            end = scan.scan(text)
            if scan.bad:
                spans.append(_Span(text[start:], closed=False, bad=True))
                break
            if end is None:  # the object is still being written
                spans.append(_Span(text[start:], closed=False))
                break
            blank = _WHITESPACE.match(text, end)  # `\s*` always matches
            j = blank.end() if blank else end
            if text.startswith(close, j):
                spans.append(_Span(text[start:j], closed=True))
                at = text.find(tag, j + len(close))
            elif len(text) - j < len(close) and close.startswith(text[j:]):  # the close tag on its way
                spans.append(_Span(text[start:], closed=False))
                break
            else:
                spans.append(_Span(text[start:], closed=False, bad=True))
                break
        return first, spans


@dataclass
class _Span:
    body: str  # a call's text after its open tag, up to its close tag (or the end of the output so far)
    closed: bool  # its close tag came
    bad: bool = False  # not a call in our format


@dataclass
class _Tag:
    is_open: bool
    start: int  # where the tag token's text starts in the output text
    end: int  # and ends (= start where the tag is a special token, dropped from the text)


class _TagTokens:
    """The tag tokens among the output's token ids and where they fall in the output text (decoded
    without special tokens, as the engine's text is): each stretch between tags decoded once."""

    def __init__(self, fmt: ToolFormat, tokenizer: Any):
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.found: list[_Tag] = []
        self._seen = 0  # token ids looked at
        self._after = 0  # the token id after the last tag
        self._chars = 0  # characters of text up to and with the last tag

    def update(self, ids: Sequence[int]) -> list[_Tag]:
        for k in range(self._seen, len(ids)):
            if ids[k] in (self.fmt.open_id, self.fmt.close_id):
                start = self._chars + len(self._decode(ids[self._after:k]))
                self._chars = start + len(self._decode([ids[k]]))
                self.found.append(_Tag(ids[k] == self.fmt.open_id, start, self._chars))
                self._after = k + 1
        self._seen = max(self._seen, len(ids))
        return self.found

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""


class _JsonEnd:
    """Where the JSON object that starts (after whitespace) at `start` of a growing text ends,
    scanned once per character: braces and tags inside its strings are text. `bad`: the text
    there is not an object."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None
        self.bad = False

    def scan(self, text: str) -> int | None:
        """The index just past the object, or None while it is not complete."""
        if self.end is not None or self.bad:
            return self.end
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif self.depth == 0 and c != "{":
                if not c.isspace():
                    self.bad = True
                    return None
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
                    return self.end
        self.pos = len(text)
        return None


def _read_call(body: str) -> tuple[str, str] | None:
    """A complete call's (name, arguments as a JSON string), or None when it is not one."""
    try:
        obj = json.loads(body)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            return None
        return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
    except (ValueError, RecursionError):  # (a model may nest arguments as deep as its tokens allow)
        return None


# a call as the tool grammar writes it, up to its arguments' first brace: {"name": "<name>", "arguments": {...}}
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_HEAD_LIMIT = 4096  # characters after an open tag without a call's head: not our format
_WHITESPACE = re.compile(r"\s*")


@dataclass
class _StreamedCall:
    name: str
    start: int  # where its arguments start in its span's body
    arguments: str = ""  # the arguments' text sent so far
    id: str = field(default_factory=tool_call_id)
    arguments_end: _JsonEnd = field(init=False)

    def __post_init__(self) -> None:
        self.arguments_end = _JsonEnd(self.start)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------------------------------------
# logprobs


class TokenBytes:
    """The bytes of each token id (OpenAI's `bytes`; the `token` string is their UTF-8 reading)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        piece: str | None = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if self.byte_level and all(c in self._unicode_to_byte for c in piece):
            return bytes(self._unicode_to_byte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        return self(token_id).decode("utf-8", errors="replace")


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        return "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))
    except (ValueError, AttributeError):
        return False


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _finite(v: float) -> float:
    return v if v > -1e30 else -9999.0  # OpenAI's stand-in for a probability of zero


def chat_logprobs(entries: list[Any], token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat's `logprobs` object for TokenLogprob entries (specwood.constrain.logprobs)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        b = token_bytes(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(b)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[Any], token_bytes: TokenBytes, offset: int = 0) -> dict[str, Any]:
    """The completions endpoint's `logprobs` object; `offset`: where the first token's text starts
    in the completion's text (a streamed chunk's entries continue the earlier ones)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text = token_bytes.text(e.token)
        tokens.append(text)
        values.append(_finite(e.logprob))
        tops.append({token_bytes.text(t): _finite(v) for t, v in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
