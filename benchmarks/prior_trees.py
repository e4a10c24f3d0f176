"""Seed paper 000, Table III / Fig. 6 analogue on this machine: AAT and decode tokens/s of the
prior-score tree vs width-based and depth-based trees at equal verification length x.

    python benchmarks/prior_trees.py --nodes 32 --levels 6 --xs 4,8,12,16,24,32 --max-tokens 48

Scores come from greedy SD with the maximal tree on the planner's calibration set (chat prompts
plus raw code/prose windows); the comparison runs on held-out prompts: the built-in workload's
six short categories, one prompt each.
"""
from __future__ import annotations

import argparse
import time

import specwood
from specwood.planner.plan import calibration_set
from specwood.planner.prior_tree import collect_prior_scores, compare_tree_methods, held_out_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--levels", type=int, default=6)
    ap.add_argument("--xs", default="4,8,12,16,24,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--calib-tokens", type=int, default=None, help="tokens per calibration prompt (default --max-tokens)")
    ap.add_argument("--chat", type=int, default=4, help="calibration chat prompts")
    ap.add_argument("--windows", type=int, default=2, help="calibration raw windows of 128 tokens")
    args = ap.parse_args()
    engine = specwood.load()
    t0 = time.perf_counter()
    calib = calibration_set(engine, 128, args.windows, n_chat=args.chat)
    prior = collect_prior_scores(engine, calib, args.calib_tokens or args.max_tokens, args.nodes, args.levels)
    print(f"prior scores: maximal tree of {args.nodes} nodes over {args.levels} levels, {prior.steps} steps, "
          f"AAT of the maximal tree {prior.aat:.2f} ({time.perf_counter() - t0:.0f} s)")
    names, ids = held_out_prompts(engine)
    engine.generate(ids[0], max_tokens=8)  # warm-up
    xs = [int(x) for x in args.xs.split(",") if int(x) <= args.nodes + 1]
    rows = compare_tree_methods(engine, prior, xs, ids, args.max_tokens)
    print(f"held-out prompts: {', '.join(names)}; {args.max_tokens} new tokens each, greedy\n")
    print("| x | prior AAT | width AAT | depth AAT | prior tok/s | width tok/s | depth tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['x']} | {r['prior']:.2f} | {r['width']:.2f} | {r['depth']:.2f} | {r['prior_tok_s']:.2f} | "
              f"{r['width_tok_s']:.2f} | {r['depth_tok_s']:.2f} |")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("prior", "width", "depth")}
    print(f"\nmean AAT over x: prior {mean['prior']:.2f}, width {mean['width']:.2f}, depth {mean['depth']:.2f}")


if __name__ == "__main__":
    main()
