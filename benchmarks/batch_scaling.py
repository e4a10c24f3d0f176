"""Decode throughput of the batched engine in one process (no HTTP): the same short prompts run
as one batch of c requests, for c in --concurrency, per method; prints aggregate decode tok/s.

    python benchmarks/batch_scaling.py --methods ar,auto --concurrency 1,2,4,8 --max-tokens 48
"""
from __future__ import annotations

import argparse
import time

import specwood
from specwood.bench.workload import load_workload
from specwood.engine.scheduler import SchedulerConfig

SHORT = ["code", "chat", "translation", "math", "json-extraction", "summarisation"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = specwood.load(progress=False)
    prompts = load_workload("builtin", categories=SHORT, limit=max(levels)).prompts
    print("| method | c | tokens | wall s | decode tok/s (aggregate) | x c=1 | mean AAT |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        name, _, opt = method.partition(":")  # "auto:nolookup" = auto without copying from the context
        prepared = engine.prepare(name, ({"progress": False, "lookup": opt != "nolookup"} if name == "auto" else {}))
        base = None
        warm = engine.make_scheduler(SchedulerConfig(max_batch=1, row_len=2048), drafts=())
        engine_req = engine.new_request("Say hi.", max_tokens=8, scheduler=warm, prepared=prepared, method=name)
        warm.submit(engine_req)
        warm.run_until_done([engine_req])
        for c in levels:
            sched = engine.make_scheduler(SchedulerConfig(max_batch=c, row_len=2048), drafts=())
            reqs = [engine.new_request(p.content, raw=p.raw, max_tokens=args.max_tokens, scheduler=sched,
                                       prepared=prepared, method=name) for p in prompts[:c]]
            for r in reqs:
                sched.submit(r)
            t0 = time.perf_counter()
            sched.run_until_done(reqs)
            wall = time.perf_counter() - t0
            first = max(r.result.stats["ttft_s"] for r in reqs)  # all prefilled together, then decoded
            tokens = sum(len(r.result.token_ids) for r in reqs)
            rate = (tokens - c) / (wall - first)
            base = base or rate
            aat = [r.result.stats.get("mean_accepted_tokens") for r in reqs if r.result.stats.get("mean_accepted_tokens")]
            print(f"| {method} | {c} | {tokens} | {wall:.1f} | {rate:.2f} | {rate / base:.2f}x | "
                  f"{sum(aat) / len(aat) if aat else float('nan'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
