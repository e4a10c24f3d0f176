"""The int8 (W8A8) and q4 (W4A8) weight modes against bf16 and int4, on this CPU.

(1) kernels: one linear of the default target's shapes (N x K = 8960x1536, 1536x8960, 1536x1536,
    256x1536 for k/v) at n = 1, 2, 4, 8, 16, 32 rows, ms per call, for
      bf16      PackedLinear (what the model runs today),
      int4      Int4Linear (int4 kernel up to 3 rows, its int8 copy above),
      int8      Int8Linear (the whole forward: per-token quantisation, qlinear kernel, rescale; bf16 in/out),
      int8-mm   Int8Linear on its _int_mm kernel,
      q4        Q4Linear (specwood's AVX512-VNNI kernel: 4-bit weights, per-token int8 activations),
    and, as the raw kernels behind the choice (no activation quantisation or rescale):
      mm-s8     torch._int_mm int8 x int8 (the weight as the transposed view of [N, K]),
      mm-s8-kn  the same with a contiguous [K, N] weight,
      mm-u8     torch._int_mm uint8 x int8,
      qlinear   torch.ops.onednn.qlinear_pointwise, prepacked weight, u8 input (zero point 128), fp32 out,
      w8a16     torch._weight_int8pack_mm (weight-only int8, bf16 activations; for reference).
    "cold" rotates over copies of the weight totalling > 256 MB, so every call reads its weight
    from DRAM as in a real forward (L3 here is 32 MB: one 8960x1536 bf16 weight nearly fits);
    "hot" repeats one weight (what a one-matrix micro-benchmark measures).
(2) T_v(x)/T_v(1), x = 1..32, of the real target (ctx 128, random tree masks) in bf16, int8 and q4.
(3) `ar` decode tok/s of the real target in bf16, int8 and q4, 3 short prompts, 64 new tokens.

    python benchmarks/int8_linear.py                      # all three, 2 threads
    python benchmarks/int8_linear.py --parts kernels --mode cold
    python benchmarks/int8_linear.py --parts tv,ar --head   # int8 also with an int8 vocabulary head
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from specwood.models.linears import Int4Linear, Int8Linear, PackedLinear, qlinear_available, quantize_rows_int8
from specwood.models.w4a8 import Q4Linear, q4_available

SHAPES = [(8960, 1536), (1536, 8960), (1536, 1536), (256, 1536)]
ROWS = [1, 2, 4, 8, 16, 32]
COLD_BYTES = 256 << 20


def _kernels(w: torch.Tensor) -> dict[str, tuple[object, callable]]:
    """name -> (state built once from bf16 weight w [N, K], fn(state, x) -> out)."""
    n, k = w.shape
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight.data = w
    mm = Int8Linear(lin, "int_mm")
    out: dict[str, tuple[object, callable]] = {
        "bf16": (PackedLinear(lin), lambda m, x: m(x.x)),
        "int4": (Int4Linear(lin), lambda m, x: m(x.x)),
        "int8": (Int8Linear(lin), lambda m, x: m(x.x)),  # qlinear where available
        "int8-mm": (mm, lambda m, x: m(x.x)),
        **({"q4": (Q4Linear.from_linear(lin), lambda m, x: m(x.x))} if q4_available() else {}),
        "mm-s8": (mm.qweight, lambda qw, x: torch._int_mm(x.q, qw.t())),
        "mm-s8-kn": (mm.qweight.t().contiguous(), lambda qw, x: torch._int_mm(x.q, qw)),
        "mm-u8": (mm.qweight, lambda qw, x: torch._int_mm(x.u, qw.t())),
    }
    if qlinear_available():
        q = Int8Linear(lin, "qlinear")
        # uint8 input (the per-token int8 values + 128, zero point 128, scale 1: the per-token scale
        # is applied after); an int8 input runs oneDNN's reference (non-JIT) kernel, ~100x slower
        out["qlinear"] = ((q.packed, q.scales, q.zero_points), lambda s, x: torch.ops.onednn.qlinear_pointwise(
            x.u, 1.0, 128, s[0], s[1], s[2], None, 1.0, 0, torch.float32, "none", [], ""))
    if hasattr(torch, "_weight_int8pack_mm"):
        out["w8a16"] = ((mm.qweight, mm.scales.to(torch.bfloat16)),
                        lambda s, x: torch._weight_int8pack_mm(x.x, s[0], s[1]))
    return out


def _make_input(rows: int, k: int) -> SimpleNamespace:
    """bf16 activations x and, for the raw kernels, their int8 (q) and uint8 (u) quantisations."""
    x = torch.randn(rows, k).to(torch.bfloat16)
    q, _ = quantize_rows_int8(x)
    return SimpleNamespace(x=x, q=q, u=(q.to(torch.int16) + 128).to(torch.uint8))


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def bench_kernels(mode: str, reps: int) -> None:
    print(f"\n## (1) one linear, ms per call ({mode}; {torch.get_num_threads()} threads, median of {reps})\n")
    for n, k in SHAPES:
        copies = 1 if mode == "hot" else max(2, -(-COLD_BYTES // (n * k * 2)))
        torch.manual_seed(0)
        states: dict[str, list] = {}
        fns: dict[str, callable] = {}
        for _ in range(copies):
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            for name, (state, fn) in _kernels(w).items():
                states.setdefault(name, []).append(state)
                fns[name] = fn
            del w
        gc.collect()
        print(f"### {n}x{k} (N x K){'' if copies == 1 else f', {copies} copies'}\n")
        print("| rows | " + " | ".join(fns) + " |")
        print("|---:|" + "---:|" * len(fns))
        for rows in ROWS:
            x = _make_input(rows, k)
            cells = []
            for name, fn in fns.items():
                it = iter(range(1 << 62))
                st = states[name]
                def call(fn=fn, st=st, it=it, x=x):
                    return fn(st[next(it) % len(st)], x)

                cells.append(f"{_time(call, reps):.3f}")
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
        print()
        del states, fns
        gc.collect()


def _load(dtype: str, head: bool):
    import specwood

    if not head:
        return specwood.load(draft=None, dtype=dtype, progress=False)
    # int8 with an int8 head: load as specwood.load does, then quantise the head too
    engine = specwood.load(draft=None, dtype="int8", progress=False)
    out = engine.target.output
    if isinstance(out, PackedLinear):
        lin = nn.Linear(out.in_features, out.out_features, bias=False, dtype=torch.bfloat16)
        lin.weight.data = out.weight
        out = lin
    engine.target.output = Int8Linear(out)
    gc.collect()
    return engine


def _modes(args) -> list[tuple[str, str, bool]]:
    modes = [("bf16", "bf16", False), ("int8", "int8", False)] + ([("q4", "q4", False)] if q4_available() else [])
    if args.head:
        modes.append(("int8+head", "int8", True))
    return modes


def bench_tv(args) -> None:
    from specwood.planner.profiler import measure_verify_times

    xs = list(range(1, 33))
    table = {}
    for label, dtype, head in _modes(args):
        engine = _load(dtype, head)
        t = measure_verify_times(engine.target, xs=xs, contexts=(128,), repeats=args.tv_repeats, refine=False,
                                 progress=False)[128]
        table[label] = t
        del engine
        gc.collect()
    labels = list(table)
    print(f"\n## (2) T_v(x) of the real target, ctx 128, {torch.get_num_threads()} threads (ms, and / T_v(1))\n")
    print("| x | " + " | ".join(f"{lb} ms | {lb} /T_v(1)" for lb in labels) + " |")
    print("|---:|" + "---:|---:|" * len(labels))
    for x in xs:
        print(f"| {x} | " + " | ".join(f"{table[lb][x] * 1e3:.1f} | {table[lb][x] / table[lb][1]:.2f}" for lb in labels)
              + " |")


PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain in two sentences what a hash table is.",
           "Translate to French: The weather is nice today and we are going to the beach."]


def bench_ar(args) -> None:
    rows = []
    for label, dtype, head in _modes(args):
        engine = _load(dtype, head)
        engine.generate("Hello", max_tokens=8, method="ar")  # warm-up
        rates, outs = [], []
        for p in PROMPTS:
            r = engine.generate(p, max_tokens=64, method="ar")
            rates.append(r.stats["tokens_per_s"])
            outs.append(r.token_ids)
        checks = []
        for method in args.check_methods.split(",") if args.check_methods else []:
            same = sum(engine.generate(p, max_tokens=64, method=method).token_ids == o for p, o in zip(PROMPTS, outs))
            checks.append(f"{method} {same}/{len(PROMPTS)}")
        rows.append((label, rates, outs, checks))
        del engine
        gc.collect()
    ref = rows[0][2]
    print(f"\n## (3) ar decode tok/s, 64 new tokens, {torch.get_num_threads()} threads\n")
    print("| mode | " + " | ".join(f"prompt {i + 1}" for i in range(len(PROMPTS))) +
          " | mean | tokens equal to bf16's (prefix) | identical to own ar |")
    print("|---|" + "---:|" * (len(PROMPTS) + 2) + "---|")
    for label, rates, outs, checks in rows:
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
                  for o, r in zip(outs, ref)]
        print(f"| {label} | " + " | ".join(f"{r:.2f}" for r in rates) + f" | {statistics.mean(rates):.2f} | "
              f"{prefix} | {', '.join(checks) or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="kernels,tv,ar")
    ap.add_argument("--mode", default="cold,hot", help="kernel timing: cold (weights from DRAM), hot, or both")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--tv-repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="store_true", help="also int8 with the vocabulary head in int8")
    ap.add_argument("--check-methods", default="", help="also check these methods token-identical to ar, e.g. dyspec")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    if "kernels" in parts:
        with torch.inference_mode():
            for mode in args.mode.split(","):
                bench_kernels(mode, args.reps)
    if "tv" in parts:
        bench_tv(args)
    if "ar" in parts:
        bench_ar(args)


if __name__ == "__main__":
    main()
