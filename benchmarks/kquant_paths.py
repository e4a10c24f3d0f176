"""The k-quant linears' time by number of rows, on the VNNI kernel and (where this CPU has AMX and
the probe passed) on the AMX tiles: issue 39's T(x)/T(1) curve per type, at the default target's
shapes (Q4_K 8960 x 1536, the FFN's gate/up; Q6_K 1536 x 8960, its down projection; Q8_0 and
Q5_K 1536 x 1536). Each time is the best of `--repeats` calls after one warm-up.

`--target` also times T_v(x) of the default target at context 256 (the planner's
measure_verify_times, best of 5): what a tree or batch of x rows costs end to end.

Run it with PYTHONPATH pointing at another checkout to time that checkout's kernels on the same
shapes (the script uses only the layer classes every version has).

    python benchmarks/kquant_paths.py [--rows 1,2,4,8,16,32,64] [--repeats 20] [--target]
"""
from __future__ import annotations

import argparse
import platform
import time
from typing import Any, Callable

import torch

from specwood.models.q6k import Q6Linear, quantize_q6
from specwood.models.q8_0 import Q8Linear, quantize_q8
from specwood.models.w4a8 import Q4Linear, Q5Linear, Q5Weights, quantize_q4


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    q = quantize_q4(torch.randn(1536, 1536))
    return {
        "Q4_K 8960x1536": Q4Linear(quantize_q4(torch.randn(8960, 1536))),
        "Q6_K 1536x8960": Q6Linear(quantize_q6(torch.randn(1536, 8960))),
        "Q8_0 1536x1536": Q8Linear(quantize_q8(torch.randn(1536, 1536))),
        "Q5_K 1536x1536": Q5Linear(Q5Weights(q.codes * 2, q.sub_scales, q.sub_mins, q.super_scales, q.super_mins)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--target", action="store_true", help="also T_v(x) of the default target at context 256")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    print(f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| linear | path | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---:|" * len(rows))
    for name, lin in layers().items():
        paths = [("VNNI", lin.kernel)]
        tiles = getattr(lin, "tiles", None)
        if tiles is not None:
            paths.append((tiles.name, tiles.kernel))
        for path, kernel in paths:
            cells = []
            for r in rows:
                x = torch.randn(r, lin.in_features)
                cells.append(best_ms(lambda: getattr(kernel, lin.op)(x, lin.packed, lin.bias), a.repeats))
            print(f"| {name} | {path} | " + " | ".join(f"{c:.3f} ms ({c / cells[0]:.2f})" for c in cells) + " |")
    if a.target:
        import specwood
        from specwood.planner.profiler import measure_verify_times

        tv = measure_verify_times(specwood.load().target, rows, [256], 5, refine=False, progress=False)[256]
        print("| default target, T_v(x) at context 256 | as loaded | "
              + " | ".join(f"{tv[r] * 1e3:.1f} ms ({tv[r] / tv[rows[0]]:.2f})" for r in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
