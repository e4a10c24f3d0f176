"""`auto` against a variant of itself in ONE process (one starter plan for both), cold (the global
suffix cache cleared before each run), the same requests alternated (in turn first): what a change to suffix
drafting adds, without the starter plan's timing noise between servers (issue 41).

`--against no-suffix`: auto without its suffix source (prompt lookup and the draft model only).
`--against one-trust`: auto with one trust in suffix drafts for every match length (the rule
before SuffixTrust learnt it per match-length bucket).
A refinement is timed on its second turn (the first answered by `ar` beforehand, as history).

    python benchmarks/suffix_inprocess.py [--categories code-edit,repeated] [--limit 3] [--repeats 2]
        [--against no-suffix|one-trust]
"""
from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import specwood
from suffix import load_items, second_turn
from specwood.drafting.suffix_source import suffix_cache_for
from specwood.planner.starter import describe_starter_plan, starter_plan
from specwood.planner.suffix_choice import SuffixTrust

WORKLOADS = Path(__file__).resolve().parent / "suffix_workloads.jsonl"


@contextmanager
def one_trust() -> Iterator[None]:
    """SuffixTrust with a single match-length bucket at the old prior (0.85)."""
    saved = SuffixTrust.PRIORS
    SuffixTrust.PRIORS = {0: 0.85}
    try:
        yield
    finally:
        SuffixTrust.PRIORS = saved


@contextmanager
def as_is() -> Iterator[None]:
    yield


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
    ap.add_argument("--against", choices=("no-suffix", "one-trust"), default="no-suffix")
    a = ap.parse_args()
    engine = specwood.load()
    wanted = a.categories.split(",")
    items = [i for i in load_items(WORKLOADS, a.limit) if i["category"] in wanted]
    plan = starter_plan(engine, "dyspec")
    print(describe_starter_plan(plan), flush=True)
    variants = [("auto", {}, as_is), (a.against, {"suffix": False}, as_is) if a.against == "no-suffix"
                else (a.against, {}, one_trust)]
    ratios = []
    for item in items:
        messages = conversation(engine, item, a.max_tokens)
        for repeat in range(a.repeats):
            rate = {}
            for name, kwargs, setting in variants[::-1] if repeat % 2 else variants:  # drift hits both
                suffix_cache_for(engine).clear()
                with setting():
                    out = engine.generate(messages, max_tokens=a.max_tokens, method="auto", progress=False, **kwargs)
                s = out.stats
                rate[name] = s["tokens_per_s"]
                print(f"{item['id']:9s} {name:9s} {s['tokens_per_s']:6.1f} tok/s  model x steps {s.get('auto_x_steps')}"
                      f"  sources {s.get('auto_sources')}", flush=True)
            ratios.append(rate["auto"] / rate[a.against])
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"auto / {a.against}: geometric mean {gm:.3f}x over {len(ratios)} pairs "
          f"(per pair {min(ratios):.2f}-{max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
