"""SpecPipe vs plain pipeline parallelism on the same spawned stages (one process per stage, gloo on
127.0.0.1), greedy, interleaved per prompt; reports TBT p50 / mean, decode tok/s, hit rate, stalls
and per-stage compute / prune / transfer / wait times. PP + SpecInfer (a whole static tree per full
pass, SpecInfer's <1,1,3,1,1,1,1,1> shape by default, `--specinfer-shape`) runs on the same ranks too.

    python benchmarks/specpipe.py --tiny                       # tiny random models (seconds)
    python benchmarks/specpipe.py --stages 2 --limit 4 --max-tokens 48 --widths 2,4,8
      # the default pair: Qwen2.5-Coder 1.5B target split over 2 stages (1 core each), the 0.5B draft
      # (int4 on CPU) in-process on rank 0, sharing its core
    python benchmarks/specpipe.py --stages 2 --limit 4 --max-tokens 48 --widths 2 --concurrent 4
      # SpecPipe-DB: the 4 requests in flight at once vs the same 4 one after another (single-request
      # SpecPipe) on the same ranks: aggregate tokens/s (all new tokens / wall time), rounds alternated
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from specwood.engine.specpipe.launch import PipelineExecutor


def tiny_engine():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

    from specwood.engine.api import Engine

    target = make_tiny_model(seed=0, n_layers=4)
    return Engine(target, make_tiny_tokenizer(), draft=perturbed_copy(target, 0.3, seed=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead of the default pair")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--widths", default="2,4,8")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--specinfer-shape", default="static",
                    help="the PP + SpecInfer baseline's tree shape (static = SpecInfer's); 'none' skips it")
    ap.add_argument("--concurrent", type=int, default=0,
                    help="SpecPipe-DB: this many requests in flight at once vs one after another (first width)")
    ap.add_argument("--rounds", type=int, default=2, help="--concurrent: alternated rounds of each")
    args = ap.parse_args()
    if args.tiny:
        engine = tiny_engine()
        prompts = [(f"p{i}", p, True) for i, p in enumerate(["def add(a, b):", "Once upon a time",
                                                              "1, 2, 3, 4, 5, 1, 2, 3,", "import os\nimport"])]
    else:
        import specwood
        from specwood.bench.workload import load_workload

        engine = specwood.load(dtype=args.dtype, progress=False)
        prompts = [(p.id, p.content, p.raw) for p in load_workload("builtin", limit=args.limit).prompts]
    prompts = prompts[:args.limit]
    widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.concurrent:
        return concurrent_run(engine, prompts, args, widths[0])
    rows: dict[str, list[dict]] = defaultdict(list)
    with PipelineExecutor(engine, args.stages, width=widths[0], topk=args.topk) as ex:
        print(f"stages {[list(r)[:1] + list(r)[-1:] for r in ex.layers]}, {ex.threads} thread(s) per rank",
              file=sys.stderr)
        ex.generate(prompts[0][1], raw=prompts[0][2], max_tokens=4, mode="pp")  # warm-up
        for pid, text, raw in prompts:
            runs = [("pp", None)] + [("specinfer", None)] * (args.specinfer_shape != "none")
            runs += [("specpipe", w) for w in widths]
            ids = None
            for mode, w in runs:
                tree = {"name": args.specinfer_shape} if mode == "specinfer" else None
                res = ex.generate(text, raw=raw, max_tokens=args.max_tokens, mode=mode, width=w, tree=tree)
                ids = ids or res.token_ids
                if engine.dtype == torch.float32:  # lossless: exactly plain PP's tokens
                    assert res.token_ids == ids, f"{pid}: {mode} w={w} differs from plain PP"
                # in bf16 a level of w tokens can round differently from one token (a near-tie
                # flips), as for every method vs ar: counted, not asserted
                res.stats["same_as_pp"] = res.token_ids == ids
                name = {"pp": "pp", "specinfer": f"PP + SpecInfer ({args.specinfer_shape})"}.get(mode)
                rows[name or f"specpipe w={w} k={args.topk}"].append(res.stats)
            print(f"{pid}: done ({len(ids)} tokens)", file=sys.stderr)
    base = statistics.mean(s["tbt_ms_p50"] for s in rows["pp"])
    print(f"\n| method ({args.stages} stages) | TBT p50 ms | vs PP | tok/s | hit rate (SpecInfer: AAT) "
          "| stall steps / token | "
          "busy compute s (per stage) | prune s | transfer s | wait s | = PP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, ss in rows.items():
        tbt = statistics.mean(s["tbt_ms_p50"] for s in ss)
        tps = statistics.mean(s["tokens_per_s"] for s in ss)
        if "mean_accepted_tokens" in ss[0]:  # PP + SpecInfer: tokens per verified tree, not a hit rate
            hit = f"AAT {statistics.mean(s['mean_accepted_tokens'] for s in ss):.2f}"
        else:
            hit = f"{statistics.mean(s.get('hit_rate', 0.0) for s in ss):.2f}"
        stall = sum(s["stall_steps"] for s in ss) / max(1, sum(s["new_tokens"] for s in ss))
        per = list(zip(*[s["per_stage"] for s in ss]))
        agg = lambda key: "/".join(f"{sum(d[key] for d in st):.2f}" for st in per)  # noqa: E731
        comp = "/".join(f"{sum(d['compute_s'] + d['draft_s'] for d in st):.2f}" for st in per)
        print(f"| {name} | {tbt:.1f} | {tbt / base:.2f}x | {tps:.1f} | {hit} | {stall:.2f} | {comp} | "
              f"{agg('prune_s')} | {agg('transfer_s')} | {agg('sync_s')} | "
              f"{sum(s['same_as_pp'] for s in ss)}/{len(ss)} |")


def concurrent_run(engine, prompts, args, width: int) -> None:
    """SpecPipe-DB vs single-request SpecPipe: the same requests, in flight together vs in turn."""
    reqs = [{"prompt": text, "raw": raw} for _, text, raw in (prompts * args.concurrent)[:args.concurrent]]
    common = {"max_tokens": args.max_tokens, "mode": "specpipe", "width": width, "topk": args.topk}
    runs: dict[str, list[tuple[float, list]]] = defaultdict(list)
    with PipelineExecutor(engine, args.stages, width=width, topk=args.topk, max_lanes=args.concurrent) as ex:
        print(f"stages {[list(r)[:1] + list(r)[-1:] for r in ex.layers]}, {ex.threads} thread(s) per rank, "
              f"w={width} k={args.topk}, {len(reqs)} requests x {args.max_tokens} tokens", file=sys.stderr)
        ex.generate_many(reqs[:2], max_tokens=4, mode="specpipe", width=width)  # warm-up, both paths
        for rnd in range(args.rounds):
            for name in (("single", "db") if rnd % 2 == 0 else ("db", "single")):
                t0 = time.perf_counter()
                if name == "db":
                    res = ex.generate_many(reqs, **common)
                else:
                    res = [ex.generate(r["prompt"], raw=r["raw"], **common) for r in reqs]
                runs[name].append((time.perf_counter() - t0, res))
                print(f"round {rnd} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    same = sum(a.token_ids == b.token_ids for (_, ra), (_, rb) in zip(runs["single"], runs["db"])
               for a, b in zip(ra, rb))
    agg = {}
    print(f"\n| SpecPipe w={width} ({args.stages} stages) | requests in flight | new tokens | wall s | aggregate tok/s "
          "| per-request tok/s | TBT p50 ms | hit rate | stall steps / token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, flight in (("single-request", 1), ("SpecPipe-DB", args.concurrent)):
        rs = runs["single" if flight == 1 else "db"]
        tokens = sum(len(r.token_ids) for _, res in rs for r in res)
        wall = sum(t for t, _ in rs)
        stats = [r.stats for _, res in rs for r in res]
        agg[name] = tokens / wall
        stall = sum(s["stall_steps"] for s in stats) / max(1, sum(s["new_tokens"] for s in stats))
        print(f"| {name} | {flight} | {tokens} | {wall:.1f} | {agg[name]:.2f} | "
              f"{statistics.mean(s['tokens_per_s'] for s in stats):.2f} | "
              f"{statistics.mean(s['tbt_ms_p50'] for s in stats):.1f} | "
              f"{statistics.mean(s['hit_rate'] for s in stats):.2f} | {stall:.2f} |")
    print(f"\nSpecPipe-DB / single-request aggregate tok/s: {agg['SpecPipe-DB'] / agg['single-request']:.2f}x; "
          f"outputs identical in {same}/{len(reqs) * args.rounds} request pairs")


if __name__ == "__main__":
    main()
