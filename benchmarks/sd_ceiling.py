"""How fast can speculative decoding be on this machine? The ceiling implied by the measured
costs of the stored plan (T_v(x): one target forward over x tokens, T_d(x): drafting a tree of
x - 1 nodes as measured while calibrating -- a dyspec tree spends at most one draft forward per
node, so for a chain, which needs exactly one per node, this is optimistic) for a chain whose
tokens are each accepted with probability a:

    AAT(k) = (1 - a^(k+1)) / (1 - a),   speedup(k) = AAT(k) * T_v(1) / (T_v(k+1) + T_d(k+1))

    specwood plan --method dyspec --quick      # measures T_v and T_d (stored)
    python benchmarks/sd_ceiling.py
"""
from __future__ import annotations

import argparse

from _common import engine_and_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="dyspec")
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    engine, plan = engine_and_plan(args.method)
    ctx = args.context
    t1 = plan.t_v(ctx, 1)
    print(f"plan {plan.key.device}, context {ctx}: T_v(1) = {1000 * t1:.0f} ms")
    print("| x | T_v(x) / T_v(1) | T_d(x) / T_v(1) |\n|---:|---:|---:|")
    for x in (2, 4, 6, 8, 12, 16):
        print(f"| {x} | {plan.t_v(ctx, x) / t1:.2f} | {plan.t_d(ctx, x) / t1:.2f} |")
    alphas = (0.8, 0.85, 0.9, 0.95, 0.98, 1.0)
    print("\n| per-token acceptance a | best chain length k | AAT | speedup ceiling |\n|---:|---:|---:|---:|")
    for a in alphas:
        best = (0.0, 0, 0.0)
        for k in range(1, 32):
            aat = k + 1.0 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
            s = aat * t1 / (plan.t_v(ctx, k + 1) + plan.t_d(ctx, k + 1))
            best = max(best, (s, k, aat))
        print(f"| {a:.2f} | {best[1]} | {best[2]:.2f} | {best[0]:.2f}x |")


if __name__ == "__main__":
    main()
