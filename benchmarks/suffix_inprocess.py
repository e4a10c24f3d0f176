"""`auto` with and without its suffix source in ONE process (one starter plan for both), cold
(the global suffix cache cleared before each run), the same requests alternated: what the
suffix source adds, without the starter plan's timing noise between servers (issue 41).

    python benchmarks/suffix_inprocess.py [--categories code-edit,repeated] [--limit 4] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import specwood
from specwood.drafting.suffix_source import suffix_cache_for
from specwood.planner.starter import describe_starter_plan, starter_plan

WORKLOADS = Path(__file__).resolve().parent / "suffix_workloads.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--categories", default="code-edit,repeated")
    ap.add_argument("--limit", type=int, default=4, help="the first N requests (first turns only) over the categories")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    engine = specwood.load()
    wanted = a.categories.split(",")
    items = [json.loads(line) for line in WORKLOADS.read_text().splitlines() if line.strip()]
    items = [i for i in items if i["category"] in wanted][:a.limit]
    plan = starter_plan(engine, "dyspec")
    print(describe_starter_plan(plan), flush=True)
    for item in items:
        for _ in range(a.repeats):
            for suffix in (True, False):
                suffix_cache_for(engine).clear()
                out = engine.generate(item["messages"], max_tokens=a.max_tokens, method="auto", progress=False,
                                      suffix=suffix)
                s = out.stats
                print(f"{item['id']:8s} {'suffix' if suffix else 'no suffix':9s} {s['tokens_per_s']:6.1f} tok/s  "
                      f"model x steps {s.get('auto_x_steps')}  sources {s.get('auto_sources')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
