"""The q4 kernel of this checkout against the one of an earlier git revision, alternated in one process.

Builds `specwood/models/kernels/q4_vnni.cpp` as it was at --against (torch cpp_extension, into a
temporary folder) beside the current build, then alternates the two over
  (1) one linear of the default target's shapes (8960x1536, 1536x8960), cold: the weights rotate
      over copies beyond the caches; ms per call, median of --calls, best of --rounds rounds;
  (2) T_v(x) of the real default target in the q4 weight mode (ctx --context, random tree masks),
      the same model with every Q4Linear pointed at one kernel and then the other; ms, median.
Both kernels must give bit-identical outputs (checked on every shape and row count).

    python benchmarks/q4_kernel_ab.py --against 4eeef14
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specwood.models import w4a8

REPO = Path(__file__).resolve().parents[1]
SOURCE = "specwood/models/kernels/q4_vnni.cpp"


def build_old(rev: str, folder: Path, source: str = SOURCE, cflags: list[str] | None = None):
    """`source` (a kernel file of this repository) as it was at `rev`, built into `folder`."""
    from torch.utils.cpp_extension import load

    text = subprocess.run(["git", "show", f"{rev}:{source}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout
    stem = Path(source).stem
    src = folder / f"{stem}_old.cpp"
    src.write_text(text)
    return load(name=f"specwood_{stem}_old", sources=[str(src)], build_directory=str(folder),
                extra_cflags=w4a8.KERNEL_CFLAGS if cflags is None else cflags, verbose=False)


def bench_linears(kernels: dict, rows: list[int], calls: int, rounds: int) -> None:
    print(f"\n## (1) one linear, cold, ms per call (median of {calls}, best of {rounds} alternated rounds)\n")
    print("| N x K | rows | " + " | ".join(kernels) + " | new / old |")
    print("|---|---:|" + "---:|" * (len(kernels) + 1))
    for n, k in [(8960, 1536), (1536, 8960)]:
        copies = [w4a8.pack_q4(*w4a8.quantize_q4(torch.randn(n, k) * 0.02)) for _ in range(12)]  # ~100 MB
        for r in rows:
            x = torch.randn(r, k).to(torch.bfloat16)
            best: dict[str, float] = {}
            outs = {}
            for _ in range(rounds):
                for name, mod in kernels.items():
                    samples = []
                    for i in range(calls):
                        p = copies[i % len(copies)]
                        t0 = time.perf_counter()
                        outs[name] = mod.q4_linear(x, p[0], p[1], p[2], torch.empty(0))
                        samples.append(time.perf_counter() - t0)
                    best[name] = min(best.get(name, float("inf")), statistics.median(samples) * 1e3)
            ref = next(iter(outs.values()))
            assert all(torch.equal(ref, o) for o in outs.values()), "the kernels disagree"
            names = list(kernels)
            print(f"| {n}x{k} | {r} | " + " | ".join(f"{best[m]:.3f}" for m in names)
                  + f" | {best[names[-1]] / best[names[0]]:.2f} |", flush=True)


def bench_tv(kernels: dict, xs: list[int], context: int, rounds: int) -> None:
    import specwood
    from specwood.planner.profiler import _verify_callable, random_tree

    model = specwood.load(draft=None, dtype="q4", progress=False).target
    linears = [m for m in model.modules() if isinstance(m, w4a8.Q4Linear)]
    gen = torch.Generator().manual_seed(0)
    samples: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        cache = model.new_cache(context + max(xs) + 1)
        cache.k.normal_()
        cache.v.normal_()
        cache.length = context
        fns = {x: _verify_callable(model, cache, context, random_tree(x, gen, model.config.vocab_size, "tree"))
               for x in xs}
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, mod in kernels.items():
                for lin in linears:
                    lin.kernel = mod
                for x, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    samples.setdefault((name, x), []).append(time.perf_counter() - t0)
    print(f"\n## (2) T_v(x) of the default target, q4, ctx {context}, ms (median of {rounds}; / T_v(1))\n")
    print("| kernel | " + " | ".join(f"x={x}" for x in xs) + " |")
    print("|---|" + "---:|" * len(xs))
    for name in kernels:
        t = {x: statistics.median(samples[(name, x)]) * 1e3 for x in xs}
        print(f"| {name} | " + " | ".join(f"{t[x]:.1f} ({t[x] / t[xs[0]]:.2f})" for x in xs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="git revision of the kernel to compare with")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--xs", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tv-rounds", type=int, default=9)
    ap.add_argument("--parts", default="linears,tv")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {f"old ({args.against})": build_old(args.against, Path(tmp)), "new": w4a8.require_q4()}
        if "linears" in args.parts:
            bench_linears(kernels, [int(r) for r in args.rows.split(",")], args.calls, args.rounds)
        if "tv" in args.parts:
            bench_tv(kernels, [int(x) for x in args.xs.split(",")], args.context, args.tv_rounds)


if __name__ == "__main__":
    main()
