"""Validate the planner on this machine: for every context bucket of the stored plan, sweep the
verification length x (x = 1 is plain autoregressive decoding, x > 1 the plan's method with
budget x - 1), run `--method auto` on the same prompts, and compare both the plan's static
choice and auto with the best fixed x, and the plan's predicted speedup with the measured one.

    specwood plan --method dyspec            # builds and stores the plan first
    python benchmarks/planner_validation.py --method dyspec --xs 1,3,4,5,6,8,12,16 --prompts 4 --max-tokens 48

Prompts of each bucket's length are cut from the built-in long-code and long-summary workload
prompts (raw continuation, alternating between the two), so the context really has that many
tokens when decoding starts. These are evaluation prompts, not the planner's calibration set.
"""
from __future__ import annotations

import argparse
import statistics

from specwood.bench.workload import load_workload

from _common import engine_and_plan


def bucket_prompts(engine, ctx: int, n: int) -> list[list[int]]:
    by_cat: dict[str, list[list[int]]] = {}
    for p in load_workload("builtin", categories=["long-code", "long-summary"]).prompts:
        ids = engine.encode(p.content, raw=True) if p.raw else engine.encode(p.content)
        if len(ids) >= ctx:
            by_cat.setdefault(p.category, []).append(ids[:ctx])
    if not by_cat:
        raise SystemExit(f"no built-in prompt is {ctx} tokens long")
    mixed = [ids for group in zip(*by_cat.values()) for ids in group]  # alternate categories
    return (mixed * n)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="dyspec")
    ap.add_argument("--xs", default="1,3,4,5,6,8,12,16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    engine, plan = engine_and_plan(args.method)
    xs = [int(x) for x in args.xs.split(",")]
    warm = bucket_prompts(engine, 64, 1)[0]  # first calls allocate and page in weights: keep them out
    for kw in ({}, {"method": args.method, "budget": 4}, {"method": "auto", "shape": args.method}):
        engine.generate(warm, max_tokens=8, **kw)
    print("| context | run | tokens/s | speedup vs x=1 | AAT |\n|---:|---:|---:|---:|---:|")
    summary = []
    for choice in plan.choices:
        ctx = choice.context
        prompts = bucket_prompts(engine, ctx, args.prompts)
        runs_wanted: list[tuple[str, dict]] = [(str(x), {} if x == 1 else {"method": args.method, "budget": x - 1})
                                               for x in sorted(set(xs) | {choice.x})]
        runs_wanted.append(("auto", {"method": "auto", "shape": args.method}))
        speeds: dict[str, list[float]] = {name: [] for name, _ in runs_wanted}
        aats: dict[str, list[float]] = {name: [] for name, _ in runs_wanted}
        for ids in prompts:  # every run on one prompt, then the next: drift of a shared machine hits all alike
            for name, kw in runs_wanted:
                r = engine.generate(ids, max_tokens=args.max_tokens, **kw)
                speeds[name].append(r.stats["tokens_per_s"])
                aats[name].append(r.stats.get("mean_accepted_tokens", 1.0))
        tps = {name: statistics.mean(v) for name, v in speeds.items()}
        for name, _ in runs_wanted:
            print(f"| {ctx} | {name if name == 'auto' else 'x=' + name} | {tps[name]:.2f} | "
                  f"{tps[name] / tps['1']:.2f}x | {statistics.mean(aats[name]):.2f} |", flush=True)
        fixed = {int(k): v for k, v in tps.items() if k != "auto"}
        best = max(fixed, key=fixed.get)
        summary.append((ctx, choice.x, fixed[choice.x], tps["auto"], best, fixed[best], choice.speedup,
                        fixed[choice.x] / fixed[1]))
    print("\n| context | plan x | tok/s at plan x | auto tok/s | best fixed x | best tok/s | plan / best | "
          "auto / best | predicted speedup | measured at plan x | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx, x, t, ta, bx, bt, pred, meas in summary:
        print(f"| {ctx} | {x} | {t:.2f} | {ta:.2f} | {bx} | {bt:.2f} | {t / bt:.2f} | {ta / bt:.2f} | {pred:.2f}x | "
              f"{meas:.2f}x | {100 * (pred - meas) / meas:+.0f}% |")


if __name__ == "__main__":
    main()
