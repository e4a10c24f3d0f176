"""How long it takes rows to grow (issue 42, item 2): `KVCache.grow` on the default pair's K/V
shapes (target 28 layers x 2 KV heads x 128, draft 24 x 2 x 64, bf16), 8 rows, filled, from the
base row (4,096 tokens + the tree room) to the sizes a long request takes them to.

    python benchmarks/kv_growth.py [--rows 8] [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from specwood.models.cache import KVCache

SHAPES = (("target 1.5B", 28, 2, 128), ("draft 0.5B", 24, 2, 64))
GROWTHS = ((5121, 10242), (10242, 20484), (5121, 17152))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("| pool | slots a row, before -> after | GB before -> after | ms (best of %d) | all |" % a.repeats)
    print("|---|---|---|---:|---|")
    for label, layers, heads, dim in SHAPES:
        for before, after in GROWTHS:
            times = []
            for _ in range(a.repeats):
                pool = KVCache(layers, heads, dim, before, batch=a.rows, dtype=torch.bfloat16)
                pool.k.normal_()
                pool.v.normal_()
                gb_before = pool.nbytes / 1e9
                t = time.perf_counter()
                pool.grow(after, a.rows)
                times.append(time.perf_counter() - t)
                gb_after = pool.nbytes / 1e9
                del pool
            print(f"| {label} | {before:,} -> {after:,} | {gb_before:.2f} -> {gb_after:.2f} | "
                  f"{min(times) * 1e3:.0f} | {', '.join(f'{x * 1e3:.0f}' for x in times)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
