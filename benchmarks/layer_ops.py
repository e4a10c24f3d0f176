"""The layer kernels (kernels/layer_ops.cpp) against torch's operators, alternated in one process.

Loads the default pair in one weight mode and points every module's `ops` at one implementation
and then the other, round after round:
  (1) forward: one forward of --rows tree tokens (a causal chain) after --context cached tokens,
      of the target and of the draft; ms, median of 11 per round; plus how far the two
      implementations' logits are apart;
  (2) tv: T_v(x) of the target as the planner measures it (random tree masks), at --tv-contexts
      (default 128 and 1,500) for --tv-rows;
  (3) attention: one call of the kernel attention alone (bf16, random data), in the target's and
      the draft's head shapes, at --attention-contexts for --attention-tokens query tokens (causal
      among themselves), min over rounds of the median of 50 calls (5 from 256 tokens); the kernels
      only;
  (4) prefill: the target prefilling a prompt of --prefill-tokens tokens (512-token chunks, as a
      request's prefill runs), tok/s, one value per round.
With --against REV the kernels as they were at git revision REV join as a third implementation;
--no-torch leaves torch's operators out (parts 1, 2 and 4 at long contexts take minutes on them).

    python benchmarks/layer_ops.py --parts forward,tv --dtype q4
    python benchmarks/layer_ops.py --parts tv --against 0c7540d
    python benchmarks/layer_ops.py --parts attention --against 0c7540d --rounds 3
    python benchmarks/layer_ops.py --parts attention,tv,prefill --against c7d2689 --no-torch \
        --tv-contexts 256,4096 --tv-rows 1,8,32,64 --attention-contexts 256,4096 \
        --attention-tokens 1,32,512 --prefill-tokens 4096 --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import specwood
from specwood.models.layer_ops import KERNEL, TORCH_OPS, KernelLayerOps, kernel_layer_ops


def bench_forward(models: dict, impls: dict, rows: list[int], context: int, rounds: int) -> None:
    print(f"\n## (1) one forward after {context} tokens, ms (median of 11; one value per round)\n")
    print("| model | rows | " + " | ".join(impls) + " | max logit difference, first two |")
    print("|---|---:|" + "---:|" * (len(impls) + 1))
    for label, model in models.items():
        cache = model.new_cache(context + max(rows) + 1)
        prompt = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0))
        model.use_ops(TORCH_OPS)
        model(prompt, torch.arange(context), None, cache, torch.arange(context))
        for x in rows:
            tokens = torch.randint(0, 1000, (1, x), generator=torch.Generator().manual_seed(x))
            pos = torch.arange(context, context + x)
            mask = torch.ones(x, context + x, dtype=torch.bool)
            mask[:, context:] = torch.ones(x, x, dtype=torch.bool).tril()
            times, logits = {name: [] for name in impls}, {}
            for _ in range(rounds):
                for name, ops in impls.items():
                    model.use_ops(ops)
                    logits[name] = model(tokens, pos, mask, cache, pos)
                    ts = []
                    for _ in range(11):
                        t0 = time.perf_counter()
                        model(tokens, pos, mask, cache, pos)
                        ts.append(time.perf_counter() - t0)
                    times[name].append(statistics.median(ts) * 1e3)
            outs = list(logits.values())
            apart = f"{(outs[0] - outs[1]).abs().max().item():.3f}" if len(outs) > 1 else "-"
            cells = " | ".join(" / ".join(f"{t:.1f}" for t in times[name]) for name in impls)
            print(f"| {label} | {x} | {cells} | {apart} |", flush=True)


def bench_tv(target: torch.nn.Module, impls: dict, rounds: int, contexts: list[int], xs: list[int]) -> None:
    from specwood.planner.profiler import measure_verify_times

    print("\n## (2) T_v(x) of the target, ms (measure_verify_times, 7 repeats)\n")
    print("| round | ops | ctx | " + " | ".join(f"x = {x}" for x in xs) + f" | T_v({xs[-1]}) / T_v({xs[0]}) |")
    print("|---:|---|---:|" + "---:|" * (len(xs) + 1))
    for r in range(rounds):
        for name, ops in impls.items():
            target.use_ops(ops)
            table = measure_verify_times(target, xs=xs, contexts=contexts, repeats=7, refine=False, progress=False)
            for ctx in contexts:
                row = table[ctx]
                print(f"| {r} | {name} | {ctx} | " + " | ".join(f"{row[x] * 1e3:.1f}" for x in xs)
                      + f" | {row[xs[-1]] / row[xs[0]]:.2f} |", flush=True)


def bench_prefill(target: torch.nn.Module, impls: dict, rounds: int, lengths: list[int]) -> None:
    from specwood.models.prefill import prefill

    print("\n## (4) prefill of the target, tok/s (512-token chunks; one value per round)\n")
    print("| prompt tokens | " + " | ".join(impls) + " |")
    print("|---:|" + "---:|" * len(impls))
    for n in lengths:
        prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        cache = target.new_cache(n + 1)
        rates: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(rounds):
            for name, ops in impls.items():
                target.use_ops(ops)
                cache.length = 0
                t0 = time.perf_counter()
                prefill(target, cache, prompt)
                rates[name].append(n / (time.perf_counter() - t0))
        print(f"| {n} | " + " | ".join(" / ".join(f"{x:.1f}" for x in rates[name]) for name in impls) + " |",
              flush=True)


def bench_attention(impls: dict, rounds: int, contexts: list[int], token_counts: list[int]) -> None:
    from specwood.models.transformer import cpu_attention_mask

    kernels = {name: ops for name, ops in impls.items() if hasattr(ops, "kernel")}
    print("\n## (3) kernel attention alone, bf16, us a call (min over rounds of the median of 50)\n")
    print("| heads (q / kv) | head dim | context | query tokens | " + " | ".join(kernels) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(kernels))
    g = torch.Generator().manual_seed(0)
    for heads, kv, dim in [(12, 2, 128), (14, 2, 64)]:  # the default target's and draft's
        for context in contexts:
            for tokens in token_counts:
                calls = 5 if tokens >= 256 else 50
                q = torch.randn(1, tokens, heads, dim, generator=g).bfloat16()
                k, v = (torch.randn(1, kv, context + tokens, dim, generator=g).bfloat16() for _ in range(2))
                mask = torch.ones(1, 1, tokens, context + tokens, dtype=torch.bool)
                mask[..., context:] = torch.ones(tokens, tokens, dtype=torch.bool).tril()
                bias = cpu_attention_mask(mask, heads // kv, torch.bfloat16)
                best = {name: float("inf") for name in kernels}
                for _ in range(rounds):
                    for name, ops in kernels.items():
                        ts = []
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            ops.kernel.attention(q, k, v, bias, dim ** -0.5)
                            ts.append(time.perf_counter() - t0)
                        best[name] = min(best[name], statistics.median(ts) * 1e6)
                print(f"| {heads} / {kv} | {dim} | {context} | {tokens} | "
                      + " | ".join(f"{best[name]:.0f}" for name in kernels) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="forward,tv", help="forward, tv, attention (comma-separated)")
    ap.add_argument("--dtype", default="q4", help="the target's weight mode (the draft's is --draft-dtype)")
    ap.add_argument("--draft-dtype", default="q4")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--against", help="git revision whose kernels join the comparison")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's operators out")
    ap.add_argument("--tv-contexts", default="128,1500")
    ap.add_argument("--tv-rows", default="1,2,4,8,16")
    ap.add_argument("--attention-contexts", default="300,1500")
    ap.add_argument("--attention-tokens", default="1,8")
    ap.add_argument("--prefill-tokens", default="1024,4096")
    args = ap.parse_args()
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    kernels = kernel_layer_ops()
    if kernels is None:
        raise SystemExit("the layer kernels cannot run here (no AVX512 or no C++ compiler)")
    impls = {"layer kernels": kernels} if args.no_torch else {"torch ops": TORCH_OPS, "layer kernels": kernels}
    parts = args.parts.split(",")
    if args.against:
        from q4_kernel_ab import build_old

        impls[f"kernels @{args.against}"] = KernelLayerOps(
            build_old(args.against, Path(tempfile.mkdtemp()), "specwood/models/kernels/layer_ops.cpp", KERNEL.cflags))
    def attention() -> None:
        bench_attention(impls, args.rounds, ints(args.attention_contexts), ints(args.attention_tokens))

    if parts == ["attention"]:  # no model needed
        attention()
        return
    engine = specwood.load(dtype=args.dtype, draft_dtype=args.draft_dtype, progress=False)
    print(f"# layer kernels against torch ops: target {args.dtype}, draft {args.draft_dtype}, "
          f"{torch.get_num_threads()} threads")
    with torch.no_grad():
        if "forward" in parts:
            bench_forward({"target": engine.target, "draft": engine.draft_model}, impls,
                          [int(r) for r in args.rows.split(",")], args.context, args.rounds)
        if "tv" in parts:
            bench_tv(engine.target, impls, max(1, args.rounds // 2), ints(args.tv_contexts), ints(args.tv_rows))
        if "attention" in parts:
            attention()
        if "prefill" in parts:
            bench_prefill(engine.target, impls, args.rounds, ints(args.prefill_tokens))


if __name__ == "__main__":
    main()
