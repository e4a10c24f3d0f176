"""Over-long prompts refused before they are tokenized, and large ones tokenized where their memory
goes back.

Tokenizing is the expensive part of refusing a prompt that cannot fit: 2 MB of text is ~650k
tokens, a second, and ~200 bytes of tokenizer buffers per token. A token stands for at most
`longest_token` characters of normalized text (the longest vocabulary entry), so a prompt with
more than that many characters per context slot cannot fit and is refused without tokenizing it.
The bound is claimed only for tokenizers whose pre-tokenizer keeps every character (byte-level
and SentencePiece-style pipelines, the ones our models use); others get no early refusal. The
text is measured after the tokenizer's own normalizer (NFC composes up to 4 characters into one);
ASCII text, which Unicode normalization leaves alone, is measured as it is.

Freed memory stays with the thread that freed it (glibc keeps a heap per thread): 8 large prompts
on the event loop's worker threads left a server 1.6 GB larger for good. Prompts of
`LARGE_PROMPT_CHARS` or more are tokenized on one thread of their own, one at a time, which hands
its freed heap back after each (malloc_trim).
"""
from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from specwood.heap import release_freed_memory
from specwood.serve.protocol import GenerationRequest, ProtocolError

LARGE_PROMPT_CHARS = 32_768
# pre-tokenizers that split text without dropping any of it
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}  # normalizers that leave ASCII text as it is

T = TypeVar("T")


def longest_token(tokenizer: Any) -> int | None:
    """The most characters of normalized text one token of `tokenizer` can stand for: its
    longest vocabulary entry (added tokens included), whose length counts what it covers (bytes
    for byte-level BPE, where a character is one or more; characters for SentencePiece, "▁" for
    a space). None where the pre-tokenizer may drop text (no sound bound) or for a tokenizer
    without a `tokenizers` pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _keeps_text(_spec(backend.pre_tokenizer)):
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    return longest or None


def _spec(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _forms(normalizer: dict[str, Any] | None) -> set[str | None]:
    if normalizer is None:
        return set()
    if normalizer.get("type") == "Sequence":
        return set().union(*(_forms(n) for n in normalizer.get("normalizers", [])))
    return {normalizer.get("type")}


def prompt_texts(g: GenerationRequest) -> list[str]:
    """The text of the request's prompt that is surely tokenized: a raw prompt's all; of chat
    messages, what every template keeps, the stripped contents of all but assistant messages
    (templates trim contents, and some drop the reasoning of earlier answers). None for token ids."""
    if isinstance(g.prompt, str):
        return [g.prompt]
    messages = [m for m in g.prompt if isinstance(m, dict)]
    if messages and len(messages) == len(g.prompt):
        return [m["content"].strip() for m in messages
                if m.get("role") != "assistant" and isinstance(m.get("content"), str)]
    return []


class PromptLimit:
    """Refuses a prompt that cannot fit in `max_context` tokens before tokenizing it, and runs the
    tokenization of large ones on their own thread (`run`)."""

    def __init__(self, tokenizer: Any, max_context: int, why: str = ""):
        self.max_context = max_context
        self.why = why  # what sets the limit, where it is not the model (the KV budget)
        self.longest_token = longest_token(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        self._ascii_kept = _forms(_spec(self._normalizer)) <= _UNICODE_FORMS
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specwood-tokenize-large")

    def normalized_chars(self, text: str) -> int:
        """Characters of `text` after the tokenizer's normalizer (NFC may compose several into one)."""
        if self._normalizer is None or (self._ascii_kept and text.isascii()):
            return len(text)
        return len(self._normalizer.normalize_str(text))

    def check(self, g: GenerationRequest) -> None:
        """A 400 context_length_exceeded where the prompt has more characters than
        `max_context - 1` tokens can stand for (a prompt needs room for one new token)."""
        per = self.longest_token
        if per is None:
            return
        budget = per * (self.max_context - 1)
        texts = prompt_texts(g)
        if sum(len(t) for t in texts) <= budget // 4:  # NFC shrinks text 4x at most: surely short enough
            return
        chars = sum(self.normalized_chars(t) for t in texts)
        if chars > budget:
            param = "messages" if g.kind == "chat" else "prompt"
            raise ProtocolError(f"the prompt has {chars} characters, at least {math.ceil(chars / per)} tokens, but "
                                f"this model's maximum context length is {self.max_context} tokens{self.why} (the "
                                "prompt and at least one new token); shorten the prompt", param=param,
                                code="context_length_exceeded")

    async def run(self, g: GenerationRequest, encode: Callable[[GenerationRequest], T]) -> T:
        """`check(g)`, then `encode(g)`, off the event loop: on the loop's worker threads for a
        prompt under LARGE_PROMPT_CHARS, on the large prompts' own thread for a larger one."""
        def checked() -> T:
            self.check(g)
            return encode(g)

        if sum(len(t) for t in prompt_texts(g)) < LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(checked)
        return await asyncio.get_running_loop().run_in_executor(self._large, _then_release, checked)

    def close(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)


def _then_release(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        release_freed_memory()
