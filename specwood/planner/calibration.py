"""Calibration text for AAT(x) and the prior-score search: short chat prompts, long windows of
code and prose for the context buckets, and their encoding to token ids.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from specwood.engine.protocols import EngineLike

# Calibration prompts for AAT(x) and the prior-score search. Deliberately *not* the benchmark
# workload (specwood/bench/data/builtin.jsonl), so plans are not tuned on what we report.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    # Interleaved by kind (code, chat, translation, math, extraction, summary, ...) so that the first
    # n prompts any caller takes stay a mix: acceptance differs a lot between kinds of text.
    "Write a Python function `chunked(seq, n)` that yields consecutive lists of length n from any "
    "iterable, the last one possibly shorter. Include a docstring and two doctests.",
    "Explain in four sentences why a hash map has average O(1) lookups but O(n) in the worst case.",
    "Translate into Italian:\n\n\"The library will be closed on Monday for maintenance. Books due that "
    "day can be returned on Tuesday without a fine, and the online catalogue stays available.\"",
    "A recipe for four people uses 300 g of flour, 2 eggs and 250 ml of milk. How much of each is "
    "needed for ten people? Show the calculation.",
    "Extract the contact details as JSON with the keys `name`, `email`, `phone` and `city`. Output "
    "only the JSON.\n\n\"For questions about the workshop, write to Olivia Brandt "
    "(olivia.brandt@example.org) or call +49 30 1234567; she works from our Berlin office.\"",
    "Summarise in two sentences:\n\nThe town library reopened last week after an eight-month "
    "renovation. The building now has a children's wing, twenty study rooms that can be booked "
    "online and a café on the ground floor. Opening hours were extended to 9 pm on weekdays, and "
    "the book collection grew by 12,000 titles, many of them in languages spoken by recent arrivals.",
    "Convert this loop to a list comprehension and explain the change:\n\nsquares = []\n"
    "for i in range(20):\n    if i % 3 == 0:\n        squares.append(i * i)",
    "I want to start running but I have never done sport. Suggest a simple plan for the first four "
    "weeks, with rest days, and tell me how to avoid getting injured.",
    "Translate into Spanish:\n\n\"Your order has shipped and should arrive within three to five "
    "working days. You can follow the parcel with the tracking link below.\"",
    "A savings account pays 3% interest per year, compounded yearly. What is a deposit of 1,000 "
    "euros worth after four years? Show the balance after each year.",
    "List every date in this text with what happens on it, as a JSON array of objects with `date` "
    "(YYYY-MM-DD) and `event`:\n\n\"The conference opens on 2 June 2025 with registration; "
    "workshops run on 3 June, and the closing keynote is on the morning of 4 June.\"",
    "Summarise this product update for a customer newsletter in three bullet points:\n\nVersion 5 "
    "of the app adds offline mode, so notes can be edited without a connection and sync later. "
    "Search is now about twice as fast, and shared folders finally show who changed what. Support "
    "for Android 8 ends in March.",
    "List five practical tips for writing clear git commit messages, one line each.",
    "Write a C function `int is_palindrome(const char *s)` that ignores case and non-letters. "
    "Add a short main() that tests three strings.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder and "
    "prints the ten largest, then explain each part of the pipeline.",
    "Implement binary search over a sorted Python list that returns the leftmost index of the "
    "target or -1, and state its loop invariant.",
)


# Long calibration text for the context buckets: raw windows of stdlib source and of the bundled
# language reference, again not what the built-in workload's long prompts use (textwrap, shlex,
# LICENSE and the "with"/"exceptions"/"assert" topics).
CALIBRATION_MODULES: tuple[str, ...] = ("heapq", "bisect", "fractions", "calendar", "glob", "queue")
CALIBRATION_TOPICS: tuple[str, ...] = ("for", "try", "import", "class", "lambda", "numbers", "if", "while")


def calibration_texts() -> list[str]:
    """Code and prose (alternating) for calibration windows; whatever this Python install has."""
    from specwood.bench.workload import _module_file

    code = []
    for module in CALIBRATION_MODULES:
        path = _module_file(module)
        if path is not None:
            code.append(path.read_text(encoding="utf-8", errors="replace"))
    prose = []
    try:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in CALIBRATION_TOPICS if k in topics)
        half = len(text) // 2  # two different prose windows
        prose = [text[:half], text[half:]] if half > 20000 else [text]
    except Exception:  # minimal installs lack pydoc_data
        pass
    mixed = [t for pair in itertools.zip_longest(code, prose) for t in pair if t]
    return mixed or list(CALIBRATION_PROMPTS)


def calibration_set(engine: EngineLike, ctx: int, n_windows: int, n_chat: int = 0,
                    raw: bool = False) -> list[list[int]]:
    """Calibration prompts for the context bucket `ctx`: `n_chat` short chat prompts (through the
    chat template, as users send them) plus `n_windows` raw windows of exactly `ctx` tokens of
    code and prose (a long document being continued)."""
    out = encode_prompts(engine, CALIBRATION_PROMPTS[:n_chat], raw) if n_chat else []
    windows: list[list[int]] = []
    for text in calibration_texts() if n_windows > 0 else ():
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= ctx + 1:
            windows.append(ids[:ctx])
        if len(windows) == n_windows:
            break
    return out + windows


def encode_prompts(engine: EngineLike, prompts: Sequence[str], raw: bool = False) -> list[list[int]]:
    """Token ids through the chat template (or raw text); long prompts keep their last
    half-context tokens."""
    limit = max(8, engine.max_context // 2)
    return [engine.encode(p, raw=raw)[-limit:] for p in prompts]
