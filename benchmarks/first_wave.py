"""Time to first token when many requests arrive at once: the loadtest's first wave (its first c
prompts, long ones included) submitted together to one Scheduler, per method, with the
scheduler's prefill sharing and, alternated in the same process, the one it replaced (every
newcomer up to PREFILL_CHUNK tokens a step with nobody decoding, 64 tokens in all while others
decode; `--no-old` skips it). Prints each request's prompt length and first-token time, and the
wave's decode rate.

    python benchmarks/first_wave.py --methods ar,auto --concurrency 8 --max-tokens 64
"""
from __future__ import annotations

import argparse
import statistics
import time

import specwood
from specwood.bench.load_requests import plan_requests
from specwood.bench.workload import load_workload
from specwood.engine.scheduler import Scheduler
from specwood.models.prefill import PREFILL_CHUNK


class OldShareScheduler(Scheduler):
    """The prefill sharing before: PREFILL_CHUNK per newcomer with nobody decoding, else 64 in all."""

    def prefill_share(self, newcomers: int, decoding: bool) -> tuple[int, int]:
        return (self.prefill_chunk_tokens, self.prefill_chunk_tokens) if decoding else \
            (PREFILL_CHUNK, PREFILL_CHUNK * newcomers)


def run_wave(engine, prepared, method: str, prompts, c: int, max_tokens: int, cls) -> dict:
    sched = cls(engine.target, max_batch=c, row_len=4096)
    reqs = [engine.new_request(p.content, raw=p.raw, max_tokens=max_tokens, scheduler=sched, prepared=prepared,
                               method=method) for p in prompts[:c]]
    for r in reqs:
        sched.submit(r)
    t0 = time.perf_counter()
    sched.run_until_done(reqs)
    wall = time.perf_counter() - t0
    ttft = [r.result.stats["ttft_s"] for r in reqs]
    tokens = sum(len(r.result.token_ids) - 1 for r in reqs)
    return {"lens": [len(r.prompt_ids) for r in reqs], "ttft": ttft, "wall": wall, "rate": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-old", action="store_true", help="only the current prefill sharing")
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    workload = load_workload("builtin", limit=16)
    prompts = plan_requests(workload.prompts, [args.concurrency])[:args.concurrency]
    policies = [("now", Scheduler)] + ([] if args.no_old else [("old", OldShareScheduler)])
    print("| method | prefill | round | TTFT s per request (prompt tokens) | TTFT p50 s | wall s "
          "| tok/s after first, over the wave |")
    print("|---|---|---:|---|---:|---:|---:|")
    for method in args.methods.split(","):
        prepared = engine.prepare(method, {"progress": False} if method == "auto" else {})
        run_wave(engine, prepared, method, prompts, 1, 4, Scheduler)  # warm-up
        for rnd in range(args.rounds):
            for name, cls in policies:
                r = run_wave(engine, prepared, method, prompts, args.concurrency, args.max_tokens, cls)
                cells = ", ".join(f"{t:.1f} ({n})" for t, n in zip(r["ttft"], r["lens"]))
                print(f"| {method} | {name} | {rnd + 1} | {cells} | {statistics.median(r['ttft']):.1f} | "
                      f"{r['wall']:.1f} | {r['rate']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
