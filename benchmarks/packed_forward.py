"""What a decode step costs beside a prefill chunk: one target forward of a chunk alone, of 8
one-token decode rows alone, and of both packed into one forward (`forward_rows` puts them in
separate padded blocks), every row over 600 cached tokens; min of 3 after a warm-up.

    python benchmarks/packed_forward.py                # the default target, bf16
    python benchmarks/packed_forward.py --dtype int8   # W8A8
"""
from __future__ import annotations

import argparse
import time

import torch

import specwood
from specwood.models.batch import RowInput, forward_rows
from specwood.models.prefill import prefill_input

CACHED = 600


def best_of(f, reps: int = 3) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunks", default="64,128,256,512")
    args = ap.parse_args()
    model = specwood.load(progress=False, dtype=args.dtype, draft=None).target
    cache = model.new_cache(2048, 9)
    cache.lengths = [CACHED] * 9
    prompt = torch.randint(0, 1000, (CACHED + 1024,)).tolist()
    pos = torch.arange(CACHED, CACHED + 1)
    decode = [RowInput(r, torch.tensor([7]), pos, pos, torch.ones(1, CACHED + 1, dtype=torch.bool), torch.arange(1))
              for r in range(8)]
    print(f"{model.weight_mode} target, {CACHED} cached tokens a row")
    print("| chunk | chunk alone ms (ms/token) | with 8 decode rows packed ms | chunk + 8 rows in two forwards ms |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        rows = best_of(lambda: forward_rows(model, cache, decode))
        for n in (int(c) for c in args.chunks.split(",")):
            chunk = [prefill_input(8, prompt, CACHED, CACHED + n)]
            alone = best_of(lambda: forward_rows(model, cache, chunk))
            packed = best_of(lambda: forward_rows(model, cache, decode + chunk))
            print(f"| {n} | {alone * 1e3:.0f} ({alone / n * 1e3:.2f}) | {packed * 1e3:.0f} "
                  f"| {(alone + rows) * 1e3:.0f} |", flush=True)
    print(f"8 decode rows alone: {rows * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
