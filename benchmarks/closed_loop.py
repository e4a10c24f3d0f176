"""The loadtest's traffic in one process, without HTTP: its prompts (long ones included) kept c
in flight (a new request joins as soon as one finishes), per method, with the newcomers' prefill
chunks packed into the decode step's target forward (`packed`) and, alternated in the same
process, in a forward of their own after it (`separate`), or packed with `auto` deciding as if
nothing rode along (`blind`; choose with `--policies`). Prints the level's wall time, decode
tok/s (tokens after each request's first over the wall time, as the loadtest counts them), TTFT
p50, the mean time of steps that carried prefill (and how many trees were drafted in them) and
of steps that did not.

    python benchmarks/closed_loop.py --methods ar,auto --concurrency 8 --limit 16 --max-tokens 64
    python benchmarks/closed_loop.py --methods auto --concurrency 4 --policies packed,blind
"""
from __future__ import annotations

import argparse
import statistics
import time

import specwood
import specwood.engine.scheduler as scheduler_module
from specwood.bench.load_requests import plan_requests
from specwood.bench.workload import load_workload
from specwood.engine.scheduler import Scheduler


class SeparateScheduler(Scheduler):
    """The newcomers' target prefill chunks in a forward of their own, before the decode forward."""

    def _forward_with_prefill(self, live, trees, failed, chunks):
        self._prefill_forward(self.target, self.cache, chunks, draft=False)
        return self._forward(live, trees, failed)


class BlindScheduler(Scheduler):
    """Packed, but the trees are chosen as if no prefill tokens rode in the forward."""

    def _decode(self, batch, newcomers=()):
        draft_trees = scheduler_module.draft_trees
        scheduler_module.draft_trees = lambda requests, size, failed, riding=0: draft_trees(requests, size, failed)
        try:
            super()._decode(batch, newcomers)
        finally:
            scheduler_module.draft_trees = draft_trees


POLICIES = {"packed": Scheduler, "separate": SeparateScheduler, "blind": BlindScheduler}


def run_level(engine, prepared, method: str, prompts, c: int, max_tokens: int, cls) -> dict:
    sched = cls(engine.target, max_batch=c, row_len=4096)
    mixed, plain, drafted = [], [], []  # step times; requests that drafted in steps with prefill

    def observe(r) -> None:
        (mixed if r.prefill_tokens else plain).append(r.draft_s + r.verify_s)
        if r.prefill_tokens:
            drafted.append(r.drafting)

    sched.observers.append(observe)
    todo = list(prompts)
    live: list = []
    done: list = []
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < c:
            p = todo.pop(0)
            live.append(sched.submit(engine.new_request(p.content, raw=p.raw, max_tokens=max_tokens, scheduler=sched,
                                                        prepared=prepared, method=method)))
        sched.step()
        done += [r for r in live if r.done.is_set()]
        live = [r for r in live if not r.done.is_set()]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.result.token_ids) - 1 for r in done)
    return {"wall": wall, "rate": tokens / wall, "ttft": statistics.median(r.result.stats["ttft_s"] for r in done),
            "mixed": statistics.mean(mixed) if mixed else float("nan"), "n_mixed": len(mixed), "drafted": sum(drafted),
            "plain": statistics.mean(plain) if plain else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--concurrency", default="8", help="levels, e.g. 4,8")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policies", default="packed,separate", help=f"alternated, of {','.join(POLICIES)}")
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    workload = load_workload("builtin", limit=args.limit)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = plan_requests(workload.prompts, levels)
    policies = [(name, POLICIES[name]) for name in args.policies.split(",")]
    print(f"{len(prompts)} requests, {args.max_tokens} new tokens each")
    print("| method | c | prefill forward | round | wall s | decode tok/s | TTFT p50 s "
          "| steps with prefill: n, mean s, trees drafted | other steps: mean s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        prepared = engine.prepare(method, {"progress": False} if method == "auto" else {})
        run_level(engine, prepared, method, prompts[:1], 1, 4, Scheduler)  # warm-up
        for c in levels:
            for rnd in range(args.rounds):
                for name, cls in policies:
                    r = run_level(engine, prepared, method, prompts, c, args.max_tokens, cls)
                    print(f"| {method} | {c} | {name} | {rnd + 1} | {r['wall']:.1f} | {r['rate']:.2f} | "
                          f"{r['ttft']:.2f} | "
                          f"{r['n_mixed']}, {r['mixed']:.3f}, {r['drafted']} | {r['plain']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
