"""fp32 linears on the CPU: F.linear (MKL) against oneDNN's matmul (OneDnnLinear) by row count, on the
layer shapes of the default 1.5B target, and the per-call overhead on small weights.

    python benchmarks/fp32_linears.py [--out FILE.json]
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/fp32_linears.py   # oneDNN as an AVX2-only CPU runs it

Each shape gets enough distinct random weights (~400 MB) that no call finds its weight in cache, as a
model's layers do not. Milliseconds are summed over the four shapes (one layer's linears); small
weights are timed in microseconds a call.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from specwood.models.linears import onednn_linear
from specwood.planner.machine import machine_record

# the 1.5B target's wqkv (q alone and k, v apart here), w13 / w2 halves: one layer's matmuls
LAYER_SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]
ROWS = [1, 2, 3, 4, 6, 8, 12, 32, 64, 256]
SMALL = [(64, 64), (512, 256), (1024, 512)]


def per_call_ms(fn, calls: int, repeats: int = 6) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {s: [torch.randn(*s) for _ in range(max(2, int(4e8 // (s[0] * s[1] * 4))))] for s in LAYER_SHAPES}
    result: dict[str, object] = {**machine_record(), "threads": torch.get_num_threads(), "layer_ms": {}, "small_us": {}}
    print("rows  F.linear ms  oneDNN ms  ratio   (one layer's four shapes)")
    for rows in ROWS:
        plain = fast = 0.0
        for shape, ws in weights.items():
            x = torch.randn(rows, shape[1])
            plain += per_call_ms(lambda: [F.linear(x, w) for w in ws], len(ws))
            fast += per_call_ms(lambda: [onednn_linear(x, w) for w in ws], len(ws))
        result["layer_ms"][rows] = {"F.linear": round(plain, 3), "oneDNN": round(fast, 3)}  # type: ignore[index]
        print(f"{rows:4d}  {plain:11.2f}  {fast:9.2f}  {plain / fast:5.2f}")
    print("small weights, one row: F.linear us / oneDNN us")
    for shape in SMALL:
        w, x = torch.randn(*shape), torch.randn(1, shape[1])
        a = per_call_ms(lambda: [F.linear(x, w) for _ in range(200)], 200, 10) * 1e3
        b = per_call_ms(lambda: [onednn_linear(x, w) for _ in range(200)], 200, 10) * 1e3
        result["small_us"][f"{shape[0]}x{shape[1]}"] = {"F.linear": round(a, 2), "oneDNN": round(b, 2)}  # type: ignore[index]
        print(f"{shape}: {a:.1f} / {b:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
