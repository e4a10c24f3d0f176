"""A few methods on chosen prompts of the built-in workload, alternated in one process: decode
tok/s, TTFT, AAT and what `auto` decided, per round. For questions like "would drafting have paid
on this prompt, where `auto` decoded plainly?" (BENCHMARKS.md §7q) or "what does auto's late
draft add?" (§7r). A method may carry options: `auto:late_draft=False`.

    python benchmarks/method_ab.py --categories json-extraction,translation --methods ar,auto,dyspec,chain
    python benchmarks/method_ab.py --categories json-extraction,summarisation --all-prompts --rounds 1 \\
        --methods ar,auto,auto:late_draft=False
"""
from __future__ import annotations

import argparse
import ast
from typing import Any

import specwood
from specwood.bench.workload import load_workload


def method_and_options(spec: str) -> tuple[str, dict[str, Any]]:
    """'auto:late_draft=False;lookup=True' -> ('auto', {'late_draft': False, 'lookup': True})."""
    method, _, opts = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(";")):
        key, _, value = item.partition("=")
        options[key] = ast.literal_eval(value)
    return method, options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="json-extraction,translation")
    ap.add_argument("--methods", default="ar,auto,dyspec,chain",
                    help="comma-separated; options after ':', ';'-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=8, help="the workload's first N prompts (as specwood bench --limit)")
    ap.add_argument("--all-prompts", action="store_true", help="every prompt of the categories, not the first")
    args = ap.parse_args()
    engine = specwood.load(progress=False)  # the defaults, as `specwood bench` without --dtype
    cats = args.categories.split(",")
    workload = load_workload("builtin", limit=None if args.all_prompts else args.limit).prompts
    prompts = [p for p in workload if p.category in cats]
    if not args.all_prompts:
        prompts = [next(p for p in prompts if p.category == c) for c in cats]
    methods = [(spec, *method_and_options(spec)) for spec in args.methods.split(",")]
    print("| prompt | round | method | decode tok/s | TTFT s | AAT | auto chose | draft from token | target conf "
          "| draft s | = first |")
    print("|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for p in prompts:
        for rnd in range(args.rounds):
            first = None
            for spec, method, options in methods:
                r = engine.generate(p.content, raw=p.raw, max_tokens=args.max_tokens, method=method, **options)
                s, first = r.stats, first if first is not None else r.token_ids
                aat, draft_s, conf = s.get("mean_accepted_tokens"), s.get("draft_s"), s.get("auto_target_confidence")
                print(f"| {p.id} | {rnd} | {spec} | {s['tokens_per_s']:.1f} | {s['ttft_s']:.2f} | "
                      f"{'–' if aat is None else f'{aat:.2f}'} | {s.get('auto') or '–'} | "
                      f"{s.get('auto_draft_from_token') or '–'} | {'–' if conf is None else f'{conf:.3f}'} | "
                      f"{'–' if draft_s is None else f'{draft_s:.2f}'} | {r.token_ids == first} |", flush=True)


if __name__ == "__main__":
    main()
