"""Writes benchmarks/heldout_long.jsonl: long-context held-out prompts (2k-16k tokens of the default
pair's tokenizer) for benchmarks/server_compare.py (issue 58, item 4).

The documents are texts every Debian/Python machine carries (license texts under
/usr/share/common-licenses and CPython 3.11's standard library), so the set is reproducible, and
the questions were written for this benchmark, never tuned on. Three kinds:
- long-summary: summarise a license or a module;
- long-completion: a module cut in the middle of a function, "continue the code";
- long-qa: questions whose answers lie somewhere in the document.
The committed JSONL is what the benchmark reads; this script only says how it was made.

    python benchmarks/make_long_prompts.py [--out benchmarks/heldout_long.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def doc(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def cut_in_function(source: str, fraction: float) -> str:
    """The source up to a line inside a function body near `fraction` of the file."""
    lines = source.splitlines(keepends=True)
    at = int(len(lines) * fraction)
    while at < len(lines) and not lines[at].startswith("        "):
        at += 1
    return "".join(lines[:at + 1])


def prompts() -> list[dict]:
    out = []

    def chat(pid: str, category: str, text: str) -> None:
        out.append({"id": pid, "category": category, "messages": [{"role": "user", "content": text}]})

    chat("lc-summary-apache", "long-summary", "Here is a software license:\n\n" + doc(LICENSES / "Apache-2.0") +
         "\n\nSummarise in five bullet points what this license allows, what it requires from someone who "
         "redistributes modified versions, and what it says about patents.")
    chat("lc-summary-lgpl21", "long-summary", doc(LICENSES / "LGPL-2.1") +
         "\n\nExplain to a developer in plain words, in one paragraph, when an application that links to a "
         "library under this license must itself be released under it, and when it need not.")
    chat("lc-summary-gpl3", "long-summary", "Read this license carefully.\n\n" + doc(LICENSES / "GPL-3") +
         "\n\nWrite a short summary (at most 150 words) of the obligations it places on someone who ships the "
         "software inside a consumer device.")
    chat("lc-summary-statistics", "long-summary", "```python\n" + doc(STDLIB / "statistics.py") + "\n```\n\n"
         "Summarise what this module offers, grouped by kind of function, in a short list.")
    chat("lc-complete-textwrap", "long-completion", "Continue this Python file from where it stops; write only "
         "the code that follows.\n\n```python\n" + cut_in_function(doc(STDLIB / "textwrap.py"), 0.55))
    chat("lc-complete-fractions", "long-completion", "Continue this Python file from where it stops; write only "
         "the code that follows.\n\n```python\n" + cut_in_function(doc(STDLIB / "fractions.py"), 0.6))
    chat("lc-complete-heapq", "long-completion", "Continue this Python file from where it stops; write only "
         "the code that follows.\n\n```python\n" + cut_in_function(doc(STDLIB / "heapq.py"), 0.7))
    chat("lc-complete-dataclasses", "long-completion", "Continue this Python file from where it stops; write "
         "only the code that follows.\n\n```python\n" + cut_in_function(doc(STDLIB / "dataclasses.py"), 0.8))
    chat("lc-qa-mpl", "long-qa", doc(LICENSES / "MPL-2.0") + "\n\nQuestions about the license above: (1) How long "
         "after a violation is fixed do the rights come back? (2) What is a 'Larger Work'? (3) Which section "
         "deals with incompatible secondary licenses? Answer each in one or two sentences.")
    chat("lc-qa-gfdl", "long-qa", doc(LICENSES / "GFDL-1.3") + "\n\nAccording to this license, what must be "
         "done with the section titled 'History' when a modified version is published, and what is an "
         "'Invariant Section'? Quote the relevant sentences.")
    chat("lc-qa-shlex-heapq", "long-qa", "Two modules of a standard library follow.\n\n```python\n" +
         doc(STDLIB / "shlex.py") + "\n```\n\n```python\n" + doc(STDLIB / "heapq.py") + "\n```\n\n"
         "Which function of the second module merges several sorted inputs, and what does its `key` argument "
         "do? In the first module, what does `punctuation_chars` change? Answer briefly.")
    chat("lc-qa-dataclasses", "long-qa", "```python\n" + doc(STDLIB / "dataclasses.py") + "\n```\n\nIn this "
         "module, what exception is raised when a field without a default follows a field with a default, and "
         "which function checks it? What does `frozen=True` generate?")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "heldout_long.jsonl"))
    args = ap.parse_args()
    rows = prompts()
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
