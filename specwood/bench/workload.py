"""Benchmark workloads: JSONL files of prompts, and the built-in mixed workload.

A workload line is a JSON object with ``id``, ``category`` (optional, defaults to "default") and
exactly one of ``messages`` (a chat: list of ``{"role", "content"}``, rendered with the model's chat
template) or ``prompt`` (raw text, tokenised as is). Other keys are ignored, so a workload can carry
references or notes.

The built-in workload is ``data/builtin.jsonl`` (short chat prompts in six categories) plus two
long-context categories built at load time from files of the running Python's standard library:
``long-code`` (complete a function given a few thousand characters of real source before it) and
``long-summary`` (summarise a few pages of prose). Those are located through the imported stdlib
modules, and skipped with a note when a file is missing (e.g. stripped-down Python installs).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from specwood.errors import SpecwoodError

BUILTIN_NAME = "builtin"
BUILTIN_FILE = Path(__file__).with_name("data") / "builtin.jsonl"
DEFAULT_CATEGORY = "default"

# Long prompts are capped in characters (the workload is tokenizer-agnostic). Measured with the
# Qwen2.5 tokenizer: ~4.3 chars/token for this stdlib Python, ~3.7 for the LICENSE/docs prose (tables,
# indentation), so both land at ~1300-1400 tokens: long context, yet affordable per prompt on a CPU.
LONG_CODE_CHARS = 5600
LONG_PROSE_CHARS = 5000


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None

    @property
    def raw(self) -> bool:
        """Raw prompts skip the chat template."""
        return self.prompt is not None

    @property
    def content(self) -> str | list[dict[str, str]]:
        """What ``engine.generate`` / ``engine.encode`` take."""
        if self.prompt is not None:
            return self.prompt
        return [dict(m) for m in self.messages or ()]

    def as_raw(self) -> "Prompt":
        """The prompt as raw text, for a model without a chat template (a base model): the
        messages' contents, one after another."""
        if self.prompt is not None:
            return self
        return Prompt(self.id, self.category,
                      prompt="\n\n".join(str(m.get("content", "")) for m in self.messages or ()))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "category": self.category}
        if self.prompt is not None:
            d["prompt"] = self.prompt
        else:
            d["messages"] = self.content
        return d


@dataclass
class Workload:
    prompts: list[Prompt]
    source: str
    notes: list[str] = field(default_factory=list)  # e.g. built-in prompts skipped, and why

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))

    def __len__(self) -> int:
        return len(self.prompts)


# ----------------------------------------------------------------------------------------- parsing
def _fail(where: str, msg: str) -> SpecwoodError:
    return SpecwoodError(f"workload {where}: {msg}")


def parse_record(obj: Any, where: str) -> Prompt:
    """One decoded JSONL line -> Prompt; raises a one-line SpecwoodError naming the line."""
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a JSON object, got {type(obj).__name__}")
    pid = obj.get("id")
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid).strip() == "":
        raise _fail(where, "missing or empty 'id' (a string)")
    category = obj.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise _fail(where, "'category' must be a non-empty string")
    has_msgs, has_prompt = "messages" in obj, "prompt" in obj
    if has_msgs == has_prompt:
        raise _fail(where, "needs exactly one of 'messages' (chat) or 'prompt' (raw text)")
    if has_prompt:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise _fail(where, "'prompt' must be a non-empty string")
        return Prompt(id=str(pid), category=category.strip(), prompt=text)
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise _fail(where, "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    clean: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _fail(where, f"messages[{i}] must be an object with string 'role' and 'content'")
        clean.append({"role": m["role"], "content": m["content"]})
    return Prompt(id=str(pid), category=category.strip(), messages=tuple(clean))


def parse_lines(lines: Iterable[str], source: str) -> list[Prompt]:
    """Parse JSONL text lines (blank lines allowed); ids must be unique."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fail(where, f"invalid JSON ({e.msg} at column {e.colno})") from None
        p = parse_record(obj, where)
        if p.id in seen:
            raise _fail(where, f"duplicate id '{p.id}' (first used on line {seen[p.id]})")
        seen[p.id] = lineno
        prompts.append(p)
    return prompts


def load_jsonl(path: str | os.PathLike[str]) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise SpecwoodError(f"workload file not found: {p} (pass a .jsonl file or 'builtin')")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecwoodError(f"workload {p}: not UTF-8 text") from None
    prompts = parse_lines(text.splitlines(), str(p))
    if not prompts:
        raise SpecwoodError(f"workload {p}: no prompts (expected one JSON object per line)")
    return prompts


# ------------------------------------------------------------------------------- built-in workload
def _stdlib_dir() -> Path:
    # os.py always sits in the stdlib directory, also in venvs (sys.prefix would point at the venv)
    return Path(os.path.dirname(os.__file__))


def _module_file(module: str) -> Path | None:
    try:
        mod = __import__(module, fromlist=["_"])
    except ImportError:
        return None
    f = getattr(mod, "__file__", None)
    return Path(f) if f and f.endswith(".py") and os.path.isfile(f) else None


def _cut_at_line(text: str, max_chars: int, from_end: bool) -> str:
    """At most max_chars of text, cut on a line boundary (the end, or the start when from_end)."""
    if len(text) <= max_chars:
        return text
    if from_end:
        chunk = text[-max_chars:]
        nl = chunk.find("\n")
        return chunk[nl + 1:] if nl >= 0 else chunk
    chunk = text[:max_chars]
    nl = chunk.rfind("\n")
    return chunk[: nl + 1] if nl > 0 else chunk


def _completion_point(src: str, anchor: str) -> int | None:
    """Index just after the signature (and docstring, if any) of the def starting at `anchor`,
    so the model is asked to write the body of a real function."""
    i = src.find(anchor)
    if i < 0:
        return None
    # the signature may span several lines: it ends at the first line ending with ':'
    j = i
    while True:
        nl = src.find("\n", j)
        if nl < 0:
            return None
        if src[j:nl].rstrip().endswith(":"):
            break
        j = nl + 1
    end = nl + 1
    rest = src[end:]
    stripped = rest.lstrip()
    for q in ('"""', "'''"):
        if stripped.startswith(q):
            close = stripped.find(q, 3)
            if close >= 0:
                line_end = stripped.find("\n", close)
                end += (len(rest) - len(stripped)) + (line_end + 1 if line_end >= 0 else len(stripped))
            break
    return end


# (prompt id, module, anchor of the function to complete)
_LONG_CODE = (
    ("long-code-textwrap", "textwrap", "    def _wrap_chunks(self, chunks):"),
    ("long-code-shlex", "shlex", "    def read_token(self):"),
)


def _long_code_prompts(notes: list[str]) -> list[Prompt]:
    out: list[Prompt] = []
    for pid, module, anchor in _LONG_CODE:
        path = _module_file(module)
        if path is None:
            notes.append(f"skipped built-in prompt '{pid}': the stdlib source of '{module}' was not found")
            continue
        src = path.read_text(encoding="utf-8", errors="replace")
        cut = _completion_point(src, anchor)
        if cut is None:  # another Python version: still a long real file, continued at a line boundary
            cut = len(_cut_at_line(src, LONG_CODE_CHARS + 1500, from_end=False))
        body = _cut_at_line(src[:cut], LONG_CODE_CHARS, from_end=True)
        try:
            rel = path.relative_to(_stdlib_dir()).as_posix()
        except ValueError:
            rel = path.name
        header = f"# File: Lib/{rel} (CPython standard library)\n# ...\n"
        out.append(Prompt(id=pid, category="long-code", prompt=header + body))
    return out


def _license_text() -> str | None:
    # LICENSE.txt lives in the stdlib directory on most installs; fall back to the installation root
    import sys

    for base in (_stdlib_dir(), Path(sys.base_prefix), Path(sys.prefix)):
        for name in ("LICENSE.txt", "LICENSE"):
            f = base / name
            if f.is_file():
                return f.read_text(encoding="utf-8", errors="replace")
    return None


def _docs_text() -> str | None:
    """Prose from the stdlib's bundled language reference (pydoc_data), else module docstrings."""
    try:
        from pydoc_data.topics import topics

        parts = [topics[k] for k in ("with", "exceptions", "assert") if k in topics]
        if parts:
            return "\n\n".join(parts)
    except Exception:  # absent or malformed in minimal installs
        pass
    docs = []
    for module in ("argparse", "textwrap", "shlex", "json", "csv", "pickle"):
        try:
            doc = (__import__(module).__doc__ or "").strip()
        except ImportError:
            continue
        if doc:
            docs.append(doc)
    return "\n\n".join(docs) if sum(map(len, docs)) > 1500 else None  # -OO strips docstrings


def _long_summary_prompts(notes: list[str]) -> list[Prompt]:
    out: list[Prompt] = []
    sources = (
        ("long-summary-license", _license_text,
         "Summarise the following document in about 150 words: what it is, the history it describes "
         "and the main terms a user of the software must respect.", "Python's LICENSE file"),
        ("long-summary-docs", _docs_text,
         "Summarise the following technical documentation for a developer in 6-8 bullet points, "
         "keeping the most important rules and caveats.", "Python documentation text (pydoc_data)"),
    )
    for pid, getter, instruction, what in sources:
        text = getter()
        if not text:
            notes.append(f"skipped built-in prompt '{pid}': {what} was not found in this Python install")
            continue
        body = _cut_at_line(text, LONG_PROSE_CHARS, from_end=False).strip()
        msg = f"{instruction}\n\n<document>\n{body}\n</document>"
        out.append(Prompt(id=pid, category="long-summary", messages=({"role": "user", "content": msg},)))
    return out


def builtin_workload() -> Workload:
    if not BUILTIN_FILE.is_file():
        raise SpecwoodError(f"built-in workload data is missing ({BUILTIN_FILE}); reinstall specwood")
    prompts = parse_lines(BUILTIN_FILE.read_text(encoding="utf-8").splitlines(), "builtin")
    notes: list[str] = []
    prompts += _long_code_prompts(notes)
    prompts += _long_summary_prompts(notes)
    return Workload(prompts=prompts, source=BUILTIN_NAME, notes=notes)


# ------------------------------------------------------------------------------------- selection
def select(prompts: Sequence[Prompt], *, limit: int | None = None,
           categories: Sequence[str] | None = None) -> list[Prompt]:
    """Filter by category, then keep at most `limit` prompts picked round-robin over categories
    (so a small limit still samples every category), in the workload's original order."""
    chosen = list(prompts)
    if categories:
        wanted = [c.strip() for c in categories if c.strip()]
        known = set(p.category for p in chosen)
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise SpecwoodError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"the workload has: {', '.join(dict.fromkeys(p.category for p in prompts))}"
            )
        chosen = [p for p in chosen if p.category in set(wanted)]
    if limit is not None:
        if limit < 1:
            raise SpecwoodError(f"--limit must be at least 1 (got {limit})")
        by_cat: dict[str, list[int]] = {}
        for i, p in enumerate(chosen):
            by_cat.setdefault(p.category, []).append(i)
        picked: list[int] = []
        rank = 0
        while len(picked) < min(limit, len(chosen)):
            for idx in by_cat.values():
                if rank < len(idx) and len(picked) < limit:
                    picked.append(idx[rank])
            rank += 1
        chosen = [chosen[i] for i in sorted(picked)]
    return chosen


def load_workload(spec: str | os.PathLike[str], *, limit: int | None = None,
                  categories: Sequence[str] | None = None) -> Workload:
    """'builtin' or a path to a JSONL file (or several, comma-separated: their prompts in turn),
    filtered by categories and limit."""
    if str(spec) == BUILTIN_NAME:
        wl = builtin_workload()
    else:
        wl = Workload(prompts=[p for one in str(spec).split(",") if one.strip() for p in load_jsonl(one.strip())],
                      source=str(spec))
    wl.prompts = select(wl.prompts, limit=limit, categories=categories)
    return wl
