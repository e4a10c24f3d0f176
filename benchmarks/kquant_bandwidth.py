"""Read bandwidth of each weight type's kernel at one row (a decode step's shape): an 8960 x 1536
linear (the default target's gate/up size) in Q4_K, Q5_K, Q6_K and Q8_0, six copies called in turn
so the weights come from DRAM, best of five passes; and a plain 1 GiB torch read (sum) beside them
as the machine's reference at that moment (its memory speed drifts; compare within one run).

    python benchmarks/kquant_bandwidth.py
"""
import time

import torch

from specwood.models.q6k import Q6Linear, quantize_q6
from specwood.models.q8_0 import Q8Linear, quantize_q8
from specwood.models.w4a8 import Q4Linear, Q5Linear, Q5Weights, quantize_q4


def best_seconds(fn, reps: int = 5, inner: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def main() -> None:
    torch.manual_seed(0)
    n, k = 8960, 1536
    w = torch.randn(n, k)
    q4 = quantize_q4(w)
    kinds = {"Q4_K": Q4Linear(q4), "Q5_K": Q5Linear(Q5Weights(q4.codes * 2, *q4[1:])),
             "Q6_K": Q6Linear(quantize_q6(w)), "Q8_0": Q8Linear(quantize_q8(w))}
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    with torch.inference_mode():
        s = best_seconds(lambda: big.sum(), reps=3, inner=2)
        print(f"torch sum over 1 GiB: {big.numel() * 4 / s / 1e9:.1f} GB/s (threads: {torch.get_num_threads()})")
        x = torch.randn(1, k)
        for name, lin in kinds.items():
            copies = [type(lin)(lin.weights) for _ in range(6)]
            s = best_seconds(lambda: [c(x) for c in copies]) / len(copies)
            size = lin.packed.numel()
            print(f"{name}: {s * 1e3:.3f} ms a call, {size / 1e6:.1f} MB ({size * 8 / (n * k):.3f} bits a weight), "
                  f"{size / s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
