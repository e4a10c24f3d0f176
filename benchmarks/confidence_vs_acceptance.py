"""Is the target's confidence a free forecast of the draft's acceptance? (BENCHMARKS.md §7r)

For each prompt of the built-in workload up to --max-prompt tokens: greedy `ar` output, then one
forward of target and draft over prompt + output gives, at each output position, the target's
probability of its top token and whether the draft's greedy token equals the target's. Printed:
the target's mean confidence over the first 8 and 16 tokens, the share of the first 8 above 0.9,
the draft's agreement over the first 16 and all tokens, and the AAT a `chain` run reaches.

    python benchmarks/confidence_vs_acceptance.py
"""
from __future__ import annotations

import argparse

import torch

import specwood
from specwood.bench.workload import load_workload
from specwood.models.batch import RowInput, forward_rows


def every_position_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one causal forward over ids."""
    cache = model.new_cache(len(ids) + 8)
    pos = torch.arange(len(ids))
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return forward_rows(model, cache, [RowInput(0, torch.tensor(ids), pos, pos, causal, pos)])[0].float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=600, help="skip longer prompts (one forward holds them all)")
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    print("| prompt | prompt tokens | target conf, first 8 | first 16 | first 8 > 0.9 | draft agrees, first 16 "
          "| all | chain AAT |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for p in load_workload("builtin").prompts:
            prompt = engine.encode(p.content, p.raw)
            if len(prompt) > args.max_prompt:
                continue
            out = [int(t) for t in engine.generate(p.content, raw=p.raw, max_tokens=args.max_tokens).token_ids]
            n, ids = len(prompt), prompt + out
            at = slice(n - 1, n - 1 + len(out))
            conf = torch.softmax(every_position_logits(engine.target, ids)[at], -1).max(-1).values
            agree = (every_position_logits(engine.draft_model, ids)[at].argmax(-1) == torch.tensor(out)).float()
            chain = engine.generate(p.content, raw=p.raw, max_tokens=args.max_tokens, method="chain")
            print(f"| {p.id} | {n} | {conf[:8].mean():.3f} | {conf[:16].mean():.3f} "
                  f"| {(conf[:8] > 0.9).float().mean():.2f} | {agree[:16].mean():.3f} | {agree.mean():.3f} "
                  f"| {chain.stats['mean_accepted_tokens']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
