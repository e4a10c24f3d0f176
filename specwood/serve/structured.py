"""The response side of structured output: tool calls out of the model's text, and `logprobs` in
OpenAI's two shapes (chat: `content[{token, logprob, bytes, top_logprobs}]`; completions:
`tokens, token_logprobs, top_logprobs, text_offset`)."""
from __future__ import annotations

import json
from typing import Any

from specwood.constrain.grammars import ToolFormat, parse_tool_calls


class ToolCallText:
    """A streamed answer that may end in tool calls: passes on the content before the first
    tool-call tag, holding back a tail that may be the tag's beginning; `finish` parses the calls."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of content passed on
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that may be streamed now, given the next text delta."""
        self.text += delta
        if self.in_calls:
            return ""
        tag = self.fmt.open
        at = self.text.find(tag)
        if at >= 0:
            self.in_calls, end = True, at
        else:
            end = len(self.text) - _partial_tail(self.text, tag)
        end = len(self.text[:end].rstrip())  # whitespace before a call is not content: held until known
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The content not passed on yet and the parsed calls (none: all of the text is content)."""
        content, calls = parse_tool_calls(text, self.fmt)
        rest = content[self.sent:] if calls else text[self.sent:]
        return rest, calls


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
