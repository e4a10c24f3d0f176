"""llguidance's view of a tokenizer, and a grammar compiled into a matcher for one request.

Building an LLTokenizer from a Hugging Face tokenizer costs ~1 s on a 150k vocabulary, so it is
made once per (tokenizer, vocabulary size, EOS ids) and kept. A grammar that does not compile for
it is refused with one line (GrammarError) when the request is built, never mid-generation.

Added tokens (<|im_end|>, Qwen2.5's <tool_call> and </tool_call>) are control tokens to
llguidance: a grammar names them (`<[id]>`), text never holds them. Yet llguidance's own Hugging
Face tokenizer, which turns the bytes a grammar forces (an enum's "</tool_call>") into the one
token the mask then allows, splits added tokens out of text: the mask allowed only a token the
grammar refuses, and the request failed. Our llguidance tokenizer reads added tokens' text as text.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any

from specwood.errors import GrammarError

_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: set[int] | list[int]) -> Any:
    """The llguidance tokenizer of a Hugging Face fast tokenizer, with the model's vocabulary size
    (ids past the tokenizer's own are never allowed) and every EOS id the engine stops at (the
    grammar lets any of them end the output)."""
    import llguidance.hf

    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), vocab_size, eos)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        try:
            base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
            # a duck of llguidance's TokenizerWrapper, which is a class (not a Protocol)
            ll = llguidance.LLTokenizer(_AddedTokensAsText(tokenizer, base),  # type: ignore[arg-type]
                                        n_vocab=vocab_size, eos_token=list(eos) or None)
        except Exception as e:  # a slow (non-Rust) tokenizer, or one llguidance cannot read
            raise GrammarError(f"grammars need a fast Hugging Face tokenizer; this one cannot be used ({e})") from None
        _TOKENIZERS[key] = (tokenizer, ll)
        return ll


class _AddedTokensAsText:
    """llguidance's tokenizer interface (its TokenizerWrapper's fields): the vocabulary and control
    tokens exactly as llguidance reads them from the Hugging Face tokenizer (`base`), and text
    encoded with every added token's text read as text (see the module)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Any, base: Any):
        from tokenizers import Tokenizer

        n = base.vocab_size
        self.tokens = [bytes(base.decode_bytes([i])) for i in range(n)]  # control tokens: their names
        self.special_token_ids = [i for i in range(n) if base.is_special_token(i)]
        self.eos_token_id = base.eos_token
        self.bos_token_id = None
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        for added in spec.get("added_tokens", []):
            added["special"] = True  # so that encode_special_tokens reads every one as text
        self._text = Tokenizer.from_str(json.dumps(spec))
        self._text.no_padding()
        self._text.no_truncation()
        self._text.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        return list(self._text.encode(text, add_special_tokens=False).ids)


MAX_COMPILED = 64  # compiled grammars kept (a tools grammar of many schemas: a few MB at most)
_COMPILED: "collections.OrderedDict[tuple[int, str, str], tuple[Any, Any]]" = collections.OrderedDict()


def grammar_matcher(ll_tok: Any, grammar: str, scope: str | None = "") -> Any:
    """A fresh matcher for `grammar` (an llguidance grammar string), or GrammarError saying why not.

    Compiling is the expensive part (a tools grammar of many schemas: up to seconds), so each
    grammar is compiled once per tokenizer and cache scope (Request.cache_scope: how fast a
    grammar compiles must not tell one tenant what another sent) and kept (the MAX_COMPILED
    used last); a request gets a copy of the compiled matcher in its start state. Scope None:
    compiled for this request alone."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("grammar must be a non-empty llguidance grammar string")
    if scope is None:
        return _compile(ll_tok, grammar)
    key = (id(ll_tok), scope, grammar)
    with _LOCK:
        compiled = _COMPILED.get(key)
        if compiled is not None and compiled[0] is ll_tok:
            _COMPILED.move_to_end(key)
            return compiled[1].deep_copy()
    matcher = _compile(ll_tok, grammar)
    with _LOCK:
        _COMPILED[key] = (ll_tok, matcher)
        _COMPILED.move_to_end(key)
        while len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
        return matcher.deep_copy()


def _compile(ll_tok: Any, grammar: str) -> Any:
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar, ll_tok)
    except Exception as e:  # noqa: BLE001 - not even a grammar document
        problem = str(e)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"grammar: {' '.join(problem.split())}")
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"grammar: {' '.join(matcher.get_error().split())}")
    return matcher
