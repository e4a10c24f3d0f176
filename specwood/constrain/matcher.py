"""llguidance's view of a tokenizer, and a grammar compiled into a matcher for one request.

Building an LLTokenizer from a Hugging Face tokenizer costs ~1 s on a 150k vocabulary, so it is
made once per (tokenizer, vocabulary size, EOS ids) and kept. A grammar that does not compile for
it is refused with one line (GrammarError) when the request is built, never mid-generation.
"""
from __future__ import annotations

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
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        except Exception as e:  # a slow (non-Rust) tokenizer, or one llguidance cannot read
            raise GrammarError(f"grammars need a fast Hugging Face tokenizer; this one cannot be used ({e})") from None
        _TOKENIZERS[key] = (tokenizer, ll)
        return ll


def grammar_matcher(ll_tok: Any, grammar: str) -> Any:
    """A fresh matcher for `grammar` (an llguidance grammar string), or GrammarError saying why not."""
    import llguidance

    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("grammar must be a non-empty llguidance grammar string")
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
