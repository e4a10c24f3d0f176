"""The ids a model may emit: the tokens its tokenizer really has.

A model's vocabulary is often padded past its tokenizer's (Qwen2.5: 151,936 rows for 151,665
tokens); a GGUF file names the padding "[PAD151665]" and so on, a Hugging Face tokenizer just ends
early. Those rows are never trained to be emitted: every request's SamplingParams.emit_limit keeps
the sampler, the drafts' sampling and every verifier off them, and an id past them reaching the
output is an internal error, never text.
"""
from __future__ import annotations

import re
from typing import Any

_PADDING = re.compile(r"\[PAD\d+\]")


def emit_limit(tokenizer: Any, vocab_size: int) -> int:
    """How many leading ids of a `vocab_size` model the tokenizer has as real tokens."""
    try:
        limit = min(vocab_size, len(tokenizer))
    except TypeError:  # a stand-in without a length: nothing known to mask
        return vocab_size
    while limit > 0 and _PADDING.fullmatch(str(tokenizer.convert_ids_to_tokens(limit - 1))):
        limit -= 1
    return limit
