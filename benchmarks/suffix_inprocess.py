"""`auto` against a variant of itself in ONE process (one starter plan for both), the same requests
alternated (in turn first): what a change to suffix drafting adds, without the starter plan's
timing noise between servers (issue 41).

`--against no-suffix`: auto without its suffix source (prompt lookup and the draft model only).
`--against one-trust`: auto with one trust in suffix drafts for every match length and source.
`--against one-source-trust`: auto with one trust per match length for both sources and the
local or global proposal taken by its raw expected length (the rule before §23b).
The global suffix cache is cleared before each run; `--fill-global` then fills it with the
answers of every request timed before this one (what a server's cache holds in the benchmark's
cold order; greedy answers, so the same for both variants). A refinement is timed on its second
turn (the first answered by `ar` beforehand, as history).

    python benchmarks/suffix_inprocess.py [--categories code-edit,repeated] [--limit 3] [--repeats 2]
        [--against no-suffix|one-trust|one-source-trust] [--fill-global]
"""
from __future__ import annotations

import argparse
import math
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

import specwood
from suffix import load_items, second_turn
from specwood.drafting.suffix_source import suffix_cache_for
from specwood.planner.starter import describe_starter_plan, starter_plan
from specwood.planner.suffix_choice import SuffixOrModelShape, SuffixTrust

WORKLOADS = Path(__file__).resolve().parent / "suffix_workloads.jsonl"


OLD_PER_MATCH = {0: 0.7, 4: 0.85, 8: 0.9, 16: 0.95}  # SuffixTrust's priors before §23b, both sources


@contextmanager
def sources_as_one(by_match: dict[int, float]) -> Iterator[None]:
    """The rule before §23b: one trust per match-length bucket for both sources (learnt together,
    from `by_match`'s priors), and the local or global proposal taken by its raw expected length."""
    saved = SuffixTrust.PRIORS, SuffixTrust.key, SuffixOrModelShape.pick
    SuffixTrust.PRIORS = {"local": by_match, "global": by_match}
    SuffixTrust.key = lambda self, match, source: saved[1](self, match, "local")
    SuffixOrModelShape.pick = lambda self, proposals: max(proposals, key=lambda d: d.expected)
    try:
        yield
    finally:
        SuffixTrust.PRIORS, SuffixTrust.key, SuffixOrModelShape.pick = saved


RULES: dict[str, Callable[[], Any]] = {
    "as-is": nullcontext,
    "one-trust": lambda: sources_as_one({0: 0.85}),  # before §22b
    "one-source-trust": lambda: sources_as_one(OLD_PER_MATCH),  # before §23b
}


def conversation(engine: Any, item: dict[str, Any], max_tokens: int) -> list[dict[str, str]]:
    messages = list(item["messages"])
    if item.get("followup"):
        first = engine.generate(messages, max_tokens=max_tokens, method="ar")
        messages = second_turn(item, first.text)
    return messages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--categories", default="code-edit,repeated")
    ap.add_argument("--limit", type=int, default=3, help="the first N requests of each category (as suffix.py)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--against", choices=("no-suffix", "one-trust", "one-source-trust"), default="no-suffix")
    ap.add_argument("--fill-global", action="store_true", help="the global cache holds the earlier requests' answers")
    a = ap.parse_args()
    engine = specwood.load()
    wanted = a.categories.split(",")
    items = [i for i in load_items(WORKLOADS, a.limit) if i["category"] in wanted]
    plan = starter_plan(engine, "dyspec")
    print(describe_starter_plan(plan), flush=True)
    variants = [("auto", {}, RULES["as-is"]), (a.against, {"suffix": False}, RULES["as-is"]) if a.against == "no-suffix"
                else (a.against, {}, RULES[a.against])]
    cache = suffix_cache_for(engine)
    earlier: list[tuple[list[int], list[int]]] = []  # (prompt, answer) of the requests timed so far
    ratios = []
    for item in items:
        messages = conversation(engine, item, a.max_tokens)
        for repeat in range(a.repeats):
            rate = {}
            for name, kwargs, setting in variants[::-1] if repeat % 2 else variants:  # drift hits both
                cache.clear()
                for prompt_ids, answer_ids in earlier if a.fill_global else ():
                    cache.add_answer(prompt_ids, answer_ids)
                with setting():
                    out = engine.generate(messages, max_tokens=a.max_tokens, method="auto", progress=False, **kwargs)
                s = out.stats
                rate[name] = s["tokens_per_s"]
                print(f"{item['id']:9s} {name:9s} {s['tokens_per_s']:6.1f} tok/s  model x steps {s.get('auto_x_steps')}"
                      f"  sources {s.get('auto_sources')}", flush=True)
            ratios.append(rate["auto"] / rate[a.against])
        earlier.append((list(engine.encode(messages)), list(out.token_ids)))
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"auto / {a.against}: geometric mean {gm:.3f}x over {len(ratios)} pairs "
          f"(per pair {min(ratios):.2f}-{max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
