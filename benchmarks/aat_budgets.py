"""AAT of dyspec vs sequoia vs static (SpecInfer shape) at equal node budgets.

    python benchmarks/aat_budgets.py --budgets 16,32,64 --limit 8 --max-tokens 64 [--temperature 0.6]

Runs every shape on the same built-in prompts with the default pair and prints a markdown table
of mean accepted tokens per target forward (AAT, bonus token included) and tokens/s. The static
tree is SpecInfer's branching <1,1,3,1,1,1,1,1>, widened level by level (from the root down) until
it holds the budget, then cut to the budget in BFS order.
"""
from __future__ import annotations

import argparse
import statistics

import specwood
from specwood.bench.workload import load_workload
from specwood.drafting.shapes import SPECINFER_BRANCHING, static_layout


def widened_specinfer(budget: int) -> list[int]:
    branching = list(SPECINFER_BRANCHING)
    level = 0
    while len(static_layout(branching, budget + 1)) < budget:
        branching[level % len(branching)] += 1
        level += 1
    return branching


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = specwood.load()
    prompts = load_workload("builtin", limit=args.limit).prompts
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        configs = {"dyspec": {}, "sequoia": {}, "static": {"branching": widened_specinfer(budget)}}
        for method, extra in configs.items():
            aat, tps = [], []
            for p in prompts:
                r = engine.generate(p.content, raw=p.raw, max_tokens=args.max_tokens, method=method, budget=budget,
                                    temperature=args.temperature, seed=args.seed, **extra)
                aat.append(r.stats["mean_accepted_tokens"])
                tps.append(r.stats["tokens_per_s"] or 0.0)
            rows.append((budget, method, statistics.mean(aat), statistics.mean(tps), extra.get("branching")))
            print(f"budget {budget:3d} {method:8s} AAT {rows[-1][2]:.2f} tok/s {rows[-1][3]:.2f}", flush=True)
    print("\n| budget | method | AAT | tokens/s | tree |\n|---:|---|---:|---:|---|")
    for budget, method, a, t, br in rows:
        print(f"| {budget} | {method} | {a:.2f} | {t:.2f} | {'<' + ','.join(map(str, br)) + '>' if br else ''} |")


if __name__ == "__main__":
    main()
