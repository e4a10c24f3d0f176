"""A few methods on chosen prompts of the built-in workload, alternated in one process: decode
tok/s, TTFT, AAT and what `auto` decided, per round. For questions like "would drafting have paid
on this prompt, where `auto` decoded plainly?" (BENCHMARKS.md §7q).

    python benchmarks/method_ab.py --categories json-extraction,translation --methods ar,auto,dyspec,chain
"""
from __future__ import annotations

import argparse

import specwood
from specwood.bench.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="json-extraction,translation")
    ap.add_argument("--methods", default="ar,auto,dyspec,chain")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=8, help="the workload's first N prompts (as specwood bench --limit)")
    args = ap.parse_args()
    engine = specwood.load(progress=False)  # the defaults, as `specwood bench` without --dtype
    prompts = {p.category: p for p in load_workload("builtin", limit=args.limit).prompts}
    print("| category | round | method | decode tok/s | TTFT s | AAT | auto chose | draft s |")
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for cat in args.categories.split(","):
        for rnd in range(args.rounds):
            for method in args.methods.split(","):
                s = engine.generate(list(prompts[cat].messages), max_tokens=args.max_tokens, method=method).stats
                aat, draft_s = s.get("mean_accepted_tokens"), s.get("draft_s")
                print(f"| {cat} | {rnd} | {method} | {s['tokens_per_s']:.1f} | {s['ttft_s']:.2f} | "
                      f"{'–' if aat is None else f'{aat:.2f}'} | {s.get('auto') or '–'} | "
                      f"{'–' if draft_s is None else f'{draft_s:.2f}'} |", flush=True)


if __name__ == "__main__":
    main()
