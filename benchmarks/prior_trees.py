"""Seed paper 000, Table III / Fig. 6 analogue on this machine: AAT and decode tokens/s of the
prior-score tree vs width-based and depth-based trees at equal verification length x.

    python benchmarks/prior_trees.py --nodes 48 --levels 8 --xs 4,8,12,16,24,32 --max-tokens 48 \\
        --calib-tokens 96 --chat 12 --windows 4 --per-category 3

Scores come from greedy SD with the maximal tree on the planner's calibration set (chat prompts
of every kind plus raw code/prose windows); the comparison runs on held-out prompts: the built-in
workload's six short categories, `--per-category` prompts each. `--save-scores F` keeps the
scores; `--scores F` reuses them and skips the (long) collection.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import specwood
from specwood.planner.calibration import calibration_set
from specwood.planner.prior_tree import (PriorScores, collect_prior_scores, compare_tree_methods, held_out_prompts,
                                         paired_difference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=48)
    ap.add_argument("--levels", type=int, default=8)
    ap.add_argument("--xs", default="4,8,12,16,24,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--calib-tokens", type=int, default=96, help="tokens per calibration prompt")
    ap.add_argument("--chat", type=int, default=12, help="calibration chat prompts")
    ap.add_argument("--windows", type=int, default=4, help="calibration raw windows of 128 tokens")
    ap.add_argument("--per-category", type=int, default=3, help="held-out prompts per category")
    ap.add_argument("--scores", type=Path, help="reuse prior scores saved by --save-scores")
    ap.add_argument("--save-scores", type=Path, help="write the collected prior scores here (JSON)")
    args = ap.parse_args()
    engine = specwood.load()
    if args.scores:
        prior = PriorScores.from_dict(json.loads(args.scores.read_text()))
        print(f"prior scores from {args.scores}: {len(prior.layout)} nodes over {prior.levels} levels, "
              f"{prior.steps} steps, AAT of the maximal tree {prior.aat:.2f}")
    else:
        t0 = time.perf_counter()
        calib = calibration_set(engine, 128, args.windows, n_chat=args.chat)
        prior = collect_prior_scores(engine, calib, args.calib_tokens, args.nodes, args.levels)
        print(f"prior scores: maximal tree of {args.nodes} nodes over {args.levels} levels, {prior.steps} steps "
              f"on {args.chat} chat prompts + {args.windows} windows, AAT of the maximal tree {prior.aat:.2f} "
              f"({time.perf_counter() - t0:.0f} s)")
        if args.save_scores:
            args.save_scores.write_text(json.dumps(prior.to_dict()))
    names, ids = held_out_prompts(engine, per_category=args.per_category)
    engine.generate(ids[0], max_tokens=8)  # warm-up
    xs = [int(x) for x in args.xs.split(",") if int(x) <= len(prior.layout) + 1]
    rows = compare_tree_methods(engine, prior, xs, ids, args.max_tokens)
    print(f"held-out prompts ({len(names)}): {', '.join(names)}; {args.max_tokens} new tokens each, greedy\n")
    print("| x | prior AAT | width AAT | depth AAT | prior - width | prior - depth "
          "| prior tok/s | width tok/s | depth tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        dw, sw = paired_difference(r["prior_per_prompt"], r["width_per_prompt"])
        dd, sd = paired_difference(r["prior_per_prompt"], r["depth_per_prompt"])
        print(f"| {r['x']} | {r['prior']:.2f} | {r['width']:.2f} | {r['depth']:.2f} | {dw:+.2f} ± {sw:.2f} | "
              f"{dd:+.2f} ± {sd:.2f} | {r['prior_tok_s']:.2f} | {r['width_tok_s']:.2f} | {r['depth_tok_s']:.2f} |")
    print("\n(prior - width/depth: mean per-prompt AAT difference ± its standard error over the held-out prompts)")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("prior", "width", "depth")}
    print(f"mean AAT over x: prior {mean['prior']:.2f}, width {mean['width']:.2f}, depth {mean['depth']:.2f}")
    # Table III: each method at its own best x
    for k in ("prior", "width", "depth"):
        best = max(rows, key=lambda r: r[f"{k}_tok_s"])
        print(f"best {k}: x = {best['x']}, {best[f'{k}_tok_s']:.2f} tok/s (AAT {best[k]:.2f})")


if __name__ == "__main__":
    main()
