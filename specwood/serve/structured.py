"""The response side of structured output: tool calls out of the model's text, and `logprobs` in
OpenAI's two shapes (chat: `content[{token, logprob, bytes, top_logprobs}]`; completions:
`tokens, token_logprobs, top_logprobs, text_offset`)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from specwood.constrain.grammars import ToolFormat, parse_tool_calls
from specwood.serve.protocol import tool_call_id


class ToolCallText:
    """A streamed answer that may end in tool calls: passes on the content before the first
    tool-call tag, holding back a tail that may be the tag's beginning, and then each call as it
    is written (`call_deltas`): its name and id once its `"arguments": ` has arrived, then its
    arguments' text piece by piece, as OpenAI streams them. `finish` parses the calls;
    `final_call_deltas` sends what of them did not go out yet."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of content passed on
        self.in_calls = False
        self.calls: list[_StreamedCall] = []  # calls whose name went out
        self._open_at: int | None = None  # where the call being written starts (its open tag)
        self._head = False  # whether that call's name went out
        self._search_from = 0  # where to look for the next call's open tag
        self._stopped = False  # a call not in the expected shape: the rest waits for `finish`

    def feed(self, delta: str) -> str:
        """The content that may be streamed now, given the next text delta."""
        self.text += delta
        if self.in_calls:
            return ""
        tag = self.fmt.open
        at = self.text.find(tag)
        if at >= 0:
            self.in_calls, end = True, at
            self._open_at, self._head = at, False
        else:
            end = len(self.text) - _partial_tail(self.text, tag)
        end = len(self.text[:end].rstrip())  # whitespace before a call is not content: held until known
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def call_deltas(self) -> list[dict[str, Any]]:
        """The `delta.tool_calls` entries the text fed so far allows (none before the first call)."""
        out: list[dict[str, Any]] = []
        text, fmt = self.text, self.fmt
        while self.in_calls and not self._stopped:
            if self._open_at is None:
                at = text.find(fmt.open, self._search_from)
                if at < 0:
                    break
                self._open_at, self._head = at, False
            body = self._open_at + len(fmt.open)
            close = text.find(fmt.close, body)
            if not self._head:
                head = _CALL_HEAD.match(text, body)
                if head is None:
                    if close >= 0 or len(text) - body > _HEAD_LIMIT:
                        self._stopped = True  # not our format: `finish` parses what there is
                    break
                call = _StreamedCall(json.loads(head.group(1)), head.end())
                self.calls.append(call)
                self._head = True
                out.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            call = self.calls[-1]
            if close >= 0:  # the call is complete: its arguments end at the object's last brace
                end = text.rfind("}", call.start, close)
            else:  # hold back what may be the object's closing brace, whitespace and the close tag's start
                end = len(text) - _partial_tail(text, fmt.close)
                while end > call.start and text[end - 1].isspace():
                    end -= 1
                if end > call.start and text[end - 1] == "}":
                    end -= 1
            piece = text[call.start + len(call.arguments):end] if end > call.start + len(call.arguments) else ""
            if piece:
                call.arguments += piece
                out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if close < 0:
                break
            self._search_from, self._open_at = close + len(fmt.close), None
        return out

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The content not passed on yet and the parsed calls (none: all of the text is content)."""
        content, calls = parse_tool_calls(text, self.fmt)
        if self.calls and not calls:  # a call began in the stream but was cut short: not content
            content = text[:max(text.find(self.fmt.open), 0)].rstrip()
        rest = content[self.sent:] if calls or self.calls else text[self.sent:]
        return rest, calls

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


# a call as the tool grammar writes it, up to its arguments' first brace: {"name": "<name>", "arguments": {...}}
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_HEAD_LIMIT = 4096  # characters after an open tag without a call's head: not our format


@dataclass
class _StreamedCall:
    name: str
    start: int  # where its arguments start in the text
    arguments: str = ""  # the arguments' text sent so far
    id: str = field(default_factory=tool_call_id)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def answer_text(tokenizer: Any, text: str, token_ids: list[int], fmt: ToolFormat) -> str:
    """The text to parse tool calls from: the output text, or, where the tool-call tags are special
    tokens (dropped from the output text), the tokens decoded with them."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if fmt.open_id is not None and fmt.open_id in special:
        return tokenizer.decode(token_ids, skip_special_tokens=False)
    return text


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
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
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
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
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
