"""Training text for `specwood train-drafter`, all of it on this machine: the Python standard
library's sources (code, comments and docstrings) and prompts built from templates and the
library's own docstrings and functions, for the target to answer -- chat-templated, as the
server sees them. None of it is a benchmark prompt (specwood/bench/data, benchmarks/).

Everything is chosen by a seeded random generator over sorted file lists: the same seed and
Python version give the same text.
"""
from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

# directories of the standard library that are tests, tools or vendored data, not library text
_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip",
         "tkinter", "pydoc_data", "encodings"}

CODE_TASKS = [
    "merges overlapping intervals given as (start, end) tuples", "returns the n-th Fibonacci number iteratively",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "flattens an arbitrarily nested list", "counts word frequencies in a text file and prints the top ten",
    "parses an ISO 8601 date string without using datetime.fromisoformat",
    "implements binary search on a sorted list and returns the insertion point",
    "reads a CSV file and returns the average of one numeric column",
    "validates an e-mail address with a regular expression", "rotates a square matrix by 90 degrees in place",
    "groups a list of words into anagram classes", "computes the edit distance between two strings",
    "generates all permutations of a list without itertools", "implements a stack with a max() in O(1)",
    "converts a Roman numeral to an integer", "finds the longest common prefix of a list of strings",
    "retries a function call with exponential backoff", "chunks an iterable into lists of size n",
    "topologically sorts a dependency graph given as a dict", "implements Dijkstra's shortest path with heapq",
    "serialises a binary tree to a string and back", "debounces calls to a function in an asyncio program",
    "computes a SHA-256 checksum of a large file in chunks", "renames every .jpeg file in a folder to .jpg",
    "finds duplicate files in a directory tree by content", "implements a trie with insert and prefix search",
    "converts a nested dict to a flat dict with dotted keys", "returns the k most common elements of a list",
    "implements run-length encoding and decoding", "checks whether a Sudoku board is valid",
]
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "SQL", "Bash"]
QUESTIONS = [
    "How do I keep basil alive on a windowsill in winter?", "What should I pack for a three-day hiking trip?",
    "Can you suggest a weekly plan to start running from zero?", "How do vaccines train the immune system?",
    "What is the difference between a virus and a bacterium?", "Why is the sky blue?",
    "Give me tips for a job interview for a junior data analyst role.", "How can I sleep better?",
    "What are good ways to save money on groceries?", "Explain compound interest with an example.",
    "How does a refrigerator keep things cold?", "What are the main causes of inflation?",
    "How do I politely decline a meeting invitation?", "Suggest a vegetarian dinner for four people.",
    "What is the difference between weather and climate?", "How do noise-cancelling headphones work?",
    "Write a short birthday message for a colleague who is retiring.", "How do I learn to touch type?",
    "What should I know before adopting a cat?", "How do solar panels produce electricity?",
    "Explain the difference between TCP and UDP.", "What is a good way to structure a README?",
    "How does garbage collection work in Python?", "What is the CAP theorem?",
    "When should I use a database index?", "How do I write a good commit message?",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese"]
FIELDS = [("name", "date", "amount"), ("title", "author", "year"), ("city", "temperature", "date"),
          ("product", "price", "quantity"), ("sender", "subject", "deadline")]


def stdlib_files() -> list[Path]:
    """The standard library's .py files outside tests and tools, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts[:-1]))


def stdlib_texts(rng: random.Random, max_chars: int) -> list[str]:
    """Whole standard-library source files in a seeded order, up to `max_chars` characters."""
    files = stdlib_files()
    rng.shuffle(files)
    texts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def _docstrings_and_functions(rng: random.Random, n_files: int) -> tuple[list[str], list[str]]:
    """Docstrings (prose) and function sources from a seeded sample of standard-library files."""
    docs, funcs = [], []
    files = stdlib_files()
    for f in rng.sample(files, min(n_files, len(files))):
        try:
            source = f.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source_lines(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and 300 <= len(doc) <= 2500:
                    docs.append(doc)
            if isinstance(node, ast.FunctionDef) and node.end_lineno and 6 <= node.end_lineno - node.lineno <= 40:
                funcs.append(source_segment(lines, node))
    return docs, [f for f in funcs if f]


# the line ends the parser counts (not str.splitlines', which also breaks at form feeds and the like)
_LINE_ENDS = re.compile(r"(?<=\n)|(?<=\r)(?!\n)")


def source_lines(source: str) -> list[str]:
    """`source` split after each line end as the parser numbers lines (each line keeps its end)."""
    return _LINE_ENDS.split(source)


def source_segment(lines: list[str], node: ast.stmt) -> str:
    """`ast.get_source_segment(source, node)` from the file's `source_lines`, which that function
    splits again at every call: for every function of a file that made building the training
    prompts quadratic in the file's length (~12 s of a small `train-drafter` run). Offsets are in
    UTF-8 bytes, as the parser gives them."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    end = node.end_col_offset
    if end is None or last >= len(lines):
        return ""
    if first == last:
        return lines[first].encode()[node.col_offset:end].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    return head + "".join(lines[first + 1:last]) + lines[last].encode()[:end].decode()


def training_prompts(rng: random.Random, n: int) -> list[list[dict[str, str]]]:
    """`n` chat prompts over the benchmark's kinds of work (code, chat, math, translation, JSON
    extraction, summaries, long code), built from the templates above and the standard library."""
    docs, funcs = _docstrings_and_functions(rng, 200)
    sentences = [s.strip() + "." for d in docs for s in d.replace("\n", " ").split(". ") if 60 <= len(s) <= 220]
    makers = [
        lambda: f"Write a {rng.choice(CODE_LANGUAGES)} function that {rng.choice(CODE_TASKS)}. Add a short docstring "
                "or comment and one usage example.",
        lambda: f"Explain what this function does and point out any edge cases:\n\n```python\n{rng.choice(funcs)}\n```",
        lambda: f"Add type hints and a docstring to this function, keeping its behaviour:\n\n```python\n"
                f"{rng.choice(funcs)}\n```",
        lambda: rng.choice(QUESTIONS),
        lambda: _word_problem(rng),
        lambda: f"Translate into {rng.choice(LANGUAGES)}:\n\n\"{' '.join(rng.sample(sentences, 2))}\"",
        lambda: f"Summarise this documentation in two or three sentences for a newcomer:\n\n{rng.choice(docs)}",
        lambda: f"Summarise the following in 3-4 bullet points:\n\n{rng.choice(docs)}\n\n{rng.choice(docs)}",
        lambda: _extraction(rng),
        lambda: "Review this module and suggest three improvements:\n\n```python\n"
                + "\n\n".join(rng.sample(funcs, 3)) + "\n```",
    ]
    return [[{"role": "user", "content": makers[i % len(makers)]()}] for i in range(n)]


def _word_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 40), rng.randint(2, 15), rng.randint(2, 9)
    kinds = [
        f"A baker makes {a} loaves an hour and sells them in bags of {c}. How many full bags does she fill in "
        f"{b} hours, and how many loaves are left over? Explain step by step.",
        f"A train travels {a * 10} km at {b * 10} km/h, then {c * 20} km at {(b + c) * 10} km/h. What is its average "
        "speed over the whole trip? Show your reasoning.",
        f"A jacket costs {a * 5} euros. It is discounted by {b * 2}% and then a {c}% sales tax is added. What is "
        "the final price? Work it out step by step.",
        f"Solve for x: {a}x + {b} = {c}x + {a * c}. Show each step.",
        f"How many ways can a committee of {c} be chosen from {a + c} people? Explain the formula you use.",
    ]
    return rng.choice(kinds)


def _extraction(rng: random.Random) -> str:
    fields = rng.choice(FIELDS)
    names = ["Ana Souza", "Lars Pettersen", "Mei Lin", "Tomasz Nowak", "Fatima Zahra", "John Okafor"]
    lines = [f"Entry {i + 1}: {rng.choice(names)} noted {rng.randint(2, 99)} units on {rng.randint(1, 28)} "
             f"{rng.choice(['March', 'June', 'October'])}, total {rng.randint(10, 999)}.{rng.randint(0, 99):02d} EUR."
             for i in range(rng.randint(3, 6))]
    return (f"Extract a JSON list of objects with the fields {', '.join(f'`{f}`' for f in fields)} from these notes "
            "(use null where a field is missing):\n\n" + "\n".join(lines))
