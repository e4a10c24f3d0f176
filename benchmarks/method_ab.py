"""A few methods on chosen prompts of the built-in workload, alternated in one process: decode
tok/s, TTFT, AAT and what `auto` decided, per round. For questions like "would drafting have paid
on this prompt, where `auto` decoded plainly?" (BENCHMARKS.md §7q) or "what does auto's late
draft add?" (§7r). A method may carry options: `auto:late_draft=False`.

    python benchmarks/method_ab.py --categories json-extraction,translation --methods ar,auto,dyspec,chain
    python benchmarks/method_ab.py --categories json-extraction,summarisation --all-prompts --rounds 1 \\
        --methods ar,auto,auto:late_draft=False
    python benchmarks/method_ab.py --prompts benchmarks/heldout_prompts.jsonl \\
        --ids ho-code-token-bucket,ho-long-summary-postmortem --methods ar,auto --max-tokens 128

With `--prompts` (JSONL files, comma-separated) and `--ids`, those prompts instead of the built-in
workload's. Each generation runs in a cache scope of its own (`--shared-scope`: all in one), so none
drafts from an earlier answer to the same prompt. After the rows, each method's decode tok/s over the first method's, per prompt and
overall (the geometric mean of the per-round ratios, each measured beside the other).
"""
from __future__ import annotations

import argparse
import ast
import math
import os
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
    ap.add_argument("--prompts", default=None, help="JSONL workload(s) instead of the built-in one (with --ids)")
    ap.add_argument("--ids", default=None, help="comma-separated prompt ids of --prompts, in this order")
    ap.add_argument("--shared-scope", action="store_true",
                    help="let each generation reuse the earlier ones' work (prefix K/V, suffix drafts from their "
                         "answers: a repeated prompt's answer is then copied); default: each in a scope of its own")
    args = ap.parse_args()
    engine = specwood.load(progress=False)  # the defaults, as `specwood bench` without --dtype
    if args.prompts:
        by_id = {p.id: p for p in load_workload(args.prompts).prompts}
        ids = args.ids.split(",") if args.ids else list(by_id)
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise SystemExit(f"--ids: no prompt {', '.join(missing)} in {args.prompts}")
        prompts = [by_id[i] for i in ids]
    else:
        cats = args.categories.split(",")
        workload = load_workload("builtin", limit=None if args.all_prompts else args.limit).prompts
        prompts = [p for p in workload if p.category in cats]
        if not args.all_prompts:
            prompts = [next(p for p in prompts if p.category == c) for c in cats]
    methods = [(spec, *method_and_options(spec)) for spec in args.methods.split(",")]
    print("| prompt | prompt tokens | round | method | decode tok/s | TTFT s | AAT | auto chose | x: steps | sources "
          "| draft from token | target conf | draft s | = first | load |")
    print("|---|---:|---:|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|")
    ratios: dict[str, dict[str, list[float]]] = {spec: {} for spec, _, _ in methods[1:]}
    for p in prompts:
        for rnd in range(args.rounds):
            first = None
            # alternate the order each round, so neither method always runs first on a warm cache
            order = methods if rnd % 2 == 0 else methods[::-1]
            rates = {}
            for spec, method, options in order:
                scope = "" if args.shared_scope else f"{p.id}/{rnd}/{spec}"
                r = engine.run(engine.new_request(p.content, raw=p.raw, max_tokens=args.max_tokens, method=method,
                                                  cache_scope=scope, **options))
                s = r.stats
                rates[spec] = s["tokens_per_s"]
                first = first if first is not None else r.token_ids
                aat, draft_s, conf = s.get("mean_accepted_tokens"), s.get("draft_s"), s.get("auto_target_confidence")
                xs = " ".join(f"{x}:{n}" for x, n in (s.get("auto_x_steps") or {}).items())
                sources = " ".join(f"{k}:{n}" for k, n in (s.get("auto_sources") or {}).items() if n)
                print(f"| {p.id} | {s.get('prompt_tokens', '–')} | {rnd} | {spec} | {s['tokens_per_s']:.1f} | "
                      f"{s['ttft_s']:.2f} | {'–' if aat is None else f'{aat:.2f}'} | {s.get('auto') or '–'} | "
                      f"{xs or '–'} | {sources or '–'} | {s.get('auto_draft_from_token') or '–'} | "
                      f"{'–' if conf is None else f'{conf:.3f}'} | "
                      f"{'–' if draft_s is None else f'{draft_s:.2f}'} | {r.token_ids == first} | "
                      f"{os.getloadavg()[0]:.1f} |", flush=True)
            for spec, _, _ in methods[1:]:
                ratios[spec].setdefault(p.id, []).append(rates[spec] / rates[methods[0][0]])
    print(f"\n| method | prompt | decode tok/s ÷ {methods[0][0]} per round | geometric mean |")
    print("|---|---|---|---:|")
    for spec, by_prompt in ratios.items():
        every = []
        for pid, rs in by_prompt.items():
            every += rs
            print(f"| {spec} | {pid} | {', '.join(f'{r:.3f}' for r in rs)} | {geomean(rs):.3f} |")
        print(f"| {spec} | all | | {geomean(every):.3f} |")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


if __name__ == "__main__":
    main()
