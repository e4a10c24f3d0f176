"""Validate the planner on this machine: for every context bucket of the stored plan, sweep the
verification length x (x = 1 is plain autoregressive decoding, x > 1 the plan's method with
budget x - 1) and compare the plan's choice with the best measured x and its predicted speedup.

    specwood plan --method dyspec            # builds and stores the plan first
    python benchmarks/planner_validation.py --method dyspec --xs 1,2,3,4,6,8,12,16,24 --prompts 2 --max-tokens 48

Prompts of each bucket's length are cut from the built-in long-code workload prompts (raw code
continuation), so the context really has that many tokens when decoding starts.
"""
from __future__ import annotations

import argparse
import statistics

import specwood
from specwood.bench.workload import load_workload
from specwood.planner.plan import get_plan


def bucket_prompts(engine, ctx: int, n: int) -> list[list[int]]:
    sources = [p for p in load_workload("builtin", categories=["long-code", "long-summary"]).prompts]
    out = []
    for p in sources:
        ids = engine.encode(p.content, raw=True) if p.raw else engine.encode(p.content)
        if len(ids) >= ctx:
            out.append(ids[:ctx])
    if not out:
        raise SystemExit(f"no built-in prompt is {ctx} tokens long")
    return (out * n)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="dyspec")
    ap.add_argument("--xs", default="1,2,3,4,6,8,12,16,24")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    engine = specwood.load()
    plan = get_plan(engine, args.method)
    if plan is None:
        raise SystemExit(f"no stored plan; run `specwood plan --method {args.method}` first")
    xs = [int(x) for x in args.xs.split(",")]
    print("| context | x | tokens/s | speedup vs x=1 |\n|---:|---:|---:|---:|")
    summary = []
    for choice in plan.choices:
        ctx = choice.context
        prompts = bucket_prompts(engine, ctx, args.prompts)
        sweep = sorted(set(xs) | {choice.x})
        tps: dict[int, float] = {}
        for x in sweep:
            runs = []
            for ids in prompts:
                kw = {} if x == 1 else {"method": args.method, "budget": x - 1}
                r = engine.generate(ids, max_tokens=args.max_tokens, **kw)
                runs.append(r.stats["tokens_per_s"])
            tps[x] = statistics.mean(runs)
            print(f"| {ctx} | {x} | {tps[x]:.2f} | {tps[x] / tps[1]:.2f}x |", flush=True)
        best = max(tps, key=tps.get)
        summary.append((ctx, choice.x, tps[choice.x], best, tps[best], choice.speedup, tps[choice.x] / tps[1]))
    print("\n| context | plan x | tok/s at plan x | best x | best tok/s | plan / best | predicted speedup | measured speedup | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx, x, t, bx, bt, pred, meas in summary:
        print(f"| {ctx} | {x} | {t:.2f} | {bx} | {bt:.2f} | {t / bt:.2f} | {pred:.2f}x | {meas:.2f}x | "
              f"{100 * (pred - meas) / meas:+.0f}% |")


if __name__ == "__main__":
    main()
