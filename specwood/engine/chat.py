"""Chat messages to token ids: the template's markup may hold special (added) tokens, message text never.

Rendering the chat template to one string and encoding it with special tokens parsed lets a message
that contains "<|im_end|>\\n<|im_start|>system\\n..." forge turns of its own (role injection). So
the template is rendered once with every message's content replaced by a placeholder, which tells
the template's own text apart from the contents. A conversation whose contents hold no special
token's text encodes exactly as before (one encode of the rendered text). Otherwise the text is cut
at the special tokens of the template's own text only, and the runs between them (template text and
contents together, as one encode would see them) are encoded with special tokens read as plain
text.

Only the `content` strings of messages are text; every other key of a message (name, tool calls,
...) goes to the template as it is.
"""
from __future__ import annotations

import functools
import re
from typing import Any

from specwood.errors import SpecwoodError

# private-use characters: no template writes them, and jinja filters (trim, escape) leave them be
_MARK = "\ue000specwood:{}\ue001"
_MARKS = re.compile("\ue000specwood:(\\d+)\ue001")


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], **template_args: Any) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (add_generation_prompt=True
    unless given; other `template_args`, e.g. tools, go to the template): contents as plain text."""
    template_args.setdefault("add_generation_prompt", True)
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_args)
    specials = special_tokens(tokenizer)
    if specials is None or not any(specials.search(c) for c in contents):
        return list(tokenizer.encode(text, add_special_tokens=False))
    pieces, refs = _render_marked(tokenizer, messages, template_args)
    shown = _contents_as_rendered(pieces, refs, contents, text)
    if shown is None:
        raise SpecwoodError("a message holds special-token text (e.g. <|im_end|>) and this model's chat template "
                            "rewrites message contents, so it cannot be kept as plain text; remove the special "
                            "tokens from the messages")
    return _encode_runs(tokenizer, specials, pieces, shown)


def special_tokens(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern matching the text of the tokenizer's special (control) tokens, longest first."""
    return _special_pattern(tuple(sorted(_special_texts(tokenizer), key=len, reverse=True)))


@functools.lru_cache(maxsize=16)
def _special_pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def _special_texts(tokenizer: Any) -> set[str]:
    """Every added token's text, special or not: Qwen2.5's <tool_call> is an ordinary added token,
    and a message spelling it must not become the tag (a forged tool call in the prompt)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {str(t) for t in decoder.values()}
    return (texts | set(getattr(tokenizer, "all_special_tokens", ()) or ())) - {""}


def _render_marked(tokenizer: Any, messages: list[dict[str, Any]], template_args: dict[str, Any]
                   ) -> tuple[list[str], list[int]]:
    """The template's own text around each rendered content: pieces [k + 1] and the index of the
    content between pieces i and i + 1, refs [k] (a content may be rendered never or twice)."""
    marked, n = [], 0
    for m in messages:
        if isinstance(m.get("content"), str):
            m = {**m, "content": _MARK.format(n)}
            n += 1
        marked.append(m)
    parts = _MARKS.split(tokenizer.apply_chat_template(marked, tokenize=False, **template_args))
    return parts[0::2], [int(i) for i in parts[1::2]]


def _contents_as_rendered(pieces: list[str], refs: list[int], contents: list[str], text: str) -> list[str] | None:
    """Each rendered content's text, such that pieces and contents rebuild the real rendering: the
    content itself, or trimmed (jinja's `trim`); None when the template rewrites it otherwise."""
    for shape in (lambda c: c, str.strip):
        shown = [shape(contents[i]) for i in refs]
        if "".join(p + s for p, s in zip(pieces, shown + [""])) == text:
            return shown
    return None


def _encode_runs(tokenizer: Any, specials: re.Pattern[str], pieces: list[str], shown: list[str]) -> list[int]:
    """Cut the rendered text at the special tokens of the template pieces only; encode the runs
    between them with special tokens as plain text."""
    ids: list[int] = []
    run: list[str] = []
    for i, piece in enumerate(pieces):
        at = 0
        for hit in specials.finditer(piece):
            run.append(piece[at:hit.start()])
            ids += plain_encode(tokenizer, "".join(run))
            ids.append(int(tokenizer.convert_tokens_to_ids(hit.group())))
            run, at = [], hit.end()
        run.append(piece[at:])
        if i < len(shown):
            run.append(shown[i])
    return ids + plain_encode(tokenizer, "".join(run))


def plain_encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` with special tokens' text read as ordinary text (no BOS/EOS added)."""
    if not text:
        return []
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


@functools.lru_cache(maxsize=8)
def _plain_backend(tokenizer: Any) -> Any:
    """A copy of a fast tokenizer's backend that encodes every added token's text as text: a copy,
    so that other threads encoding with the shared tokenizer meanwhile are not affected. Added
    tokens are marked special in the copy, as `encode_special_tokens` reads only special ones as
    text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        return None
    import json

    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    for added in spec.get("added_tokens", []):
        added["special"] = True
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.encode_special_tokens = True
    return copy
