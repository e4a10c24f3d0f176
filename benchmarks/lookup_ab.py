"""`auto` with and without copying from the context, alternated per prompt in one process.

    python benchmarks/lookup_ab.py --dtype int8

One prompt per category of the built-in workload; prints decode tok/s, AAT, the steps that
copied, the tree sizes used and whether both runs emitted the same tokens (BENCHMARKS.md §7j).
"""
from __future__ import annotations

import argparse
import statistics

import specwood
from specwood.bench.workload import builtin_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = specwood.load(dtype=args.dtype, progress=False)
    prompts = {}
    for p in builtin_workload().prompts:
        prompts.setdefault(p.category, p)
    engine.generate(next(iter(prompts.values())).content, max_tokens=8, method="auto", progress=False)  # warm-up
    rates: dict[bool, list[float]] = {True: [], False: []}
    for category, p in prompts.items():
        runs = {}
        for lookup in (True, False):
            runs[lookup] = r = engine.generate(p.content, max_tokens=args.max_tokens, method="auto", lookup=lookup,
                                               progress=False)
            rates[lookup].append(r.stats["tokens_per_s"])
        cells = [f"{'copying' if k else 'no copying'} {r.stats['tokens_per_s']:.1f} tok/s AAT "
                 f"{r.stats.get('mean_accepted_tokens', 1.0):.2f} copied {r.stats.get('auto_lookup_steps', '-')} "
                 f"x {r.stats.get('auto_x_steps')}" for k, r in runs.items()]
        same = runs[True].token_ids == runs[False].token_ids
        print(f"{category}: " + " | ".join(cells) + (" | same tokens" if same else " | tokens differ"), flush=True)
    print(f"mean tok/s: copying {statistics.mean(rates[True]):.1f}, no copying {statistics.mean(rates[False]):.1f}")


if __name__ == "__main__":
    main()
