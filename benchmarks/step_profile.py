"""Where a batched decode step's time goes, per method: drafting, the target forward and the rest
(verification, commits, bookkeeping), from the scheduler's own step records. The same short
prompts run as one batch of c requests (as in batch_scaling.py); methods alternate per round.

    python benchmarks/step_profile.py --methods ar,auto --concurrency 8 --rounds 3
"""
from __future__ import annotations

import argparse
import time

import specwood
from specwood.bench.workload import load_workload
from specwood.engine.request import State
from specwood.engine.scheduler import SchedulerConfig
from specwood.engine.step import StepRecord

SHORT = ["code", "chat", "translation", "math", "json-extraction", "summarisation"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    prompts = load_workload("builtin", categories=SHORT, limit=args.concurrency).prompts
    print("| round | method | decode tok/s | steps | mean B | rows / step | drafting requests / step | "
          "drafting ms / step | forward ms / step | rest ms / step | auto's drafting price ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rnd in range(1, args.rounds + 1):
        for method in args.methods.split(","):
            prepared = engine.prepare(method, {"progress": False} if method == "auto" else {})
            sched = engine.make_scheduler(SchedulerConfig(max_batch=args.concurrency, row_len=2048), drafts=())
            records: list[StepRecord] = []
            sched.observers.append(records.append)
            reqs = [engine.new_request(p.content, raw=p.raw, max_tokens=args.max_tokens, scheduler=sched,
                                       prepared=prepared, method=method) for p in prompts]
            for r in reqs:
                sched.submit(r)
            decode_s, steps = 0.0, []
            while not all(r.done.is_set() for r in reqs):  # time only steps where every request decodes
                plain = all(r.state is State.DECODE for r in sched.running) and not sched.waiting
                n = len(records)
                t = time.perf_counter()
                sched.step()
                if plain and len(records) > n:
                    decode_s += time.perf_counter() - t
                    steps.append(records[-1])
            emitted = sum(sum(a + 1 for _, a, _ in r.drafts) for r in steps)
            k = max(len(steps), 1)
            costs = getattr(reqs[0].drafter.shape, "draft_costs", None)  # auto's DraftCostTracker
            draft = sum(r.draft_s for r in steps) / k
            fwd = sum(r.verify_s for r in steps) / k
            print(f"| {rnd} | {method} | {emitted / max(decode_s, 1e-9):.1f} | {len(steps)} | "
                  f"{sum(r.batch_size for r in steps) / k:.1f} | {sum(r.tokens for r in steps) / k:.1f} | "
                  f"{sum(sum(s > 0 for s, _, _ in r.drafts) for r in steps) / k:.2f} | {draft * 1e3:.1f} | "
                  f"{fwd * 1e3:.1f} | {decode_s / k * 1e3 - (draft + fwd) * 1e3:.1f} | "
                  f"{f'{costs.ratio:.2f}' if costs is not None else '–'} |", flush=True)


if __name__ == "__main__":
    main()
