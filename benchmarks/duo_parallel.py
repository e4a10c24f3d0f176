"""DuoDecoding on this machine, one process, same prompts, interleaved per prompt: `ar`, sequential
`duo` (multi-sequence drafting, draft then verify) and the parallel executor (draft worker on its
own cores), the latter at its hardware-aware budget gamma = round(c) and at fixed gamma = c-2 ..
c+2 (the paper's Table 3 analogue). Greedy; decode tok/s (tokens after the first / time after the
first) and TTFT, means over prompts.

    python benchmarks/duo_parallel.py --limit 6 --max-tokens 64
    python benchmarks/duo_parallel.py --long 1 --max-tokens 64   # + a ~1.1k-token prompt (TTFT)
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import specwood
from specwood.bench.workload import load_workload
from specwood.engine.parallel import ParallelExecutor

DESIGN = Path(__file__).resolve().parents[2] / "shared" / "DESIGN.md"


def long_prompt(chars: int = 4200) -> str:
    text = DESIGN.read_text()[:chars] if DESIGN.is_file() else Path(__file__).read_text() * 4
    return "Summarise the following design notes in three sentences.\n\n" + text[:chars]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=0, help="also run N ~1.1k-token prompts (TTFT)")
    ap.add_argument("--budget", type=int, default=6, help="sequential duo's budget")
    ap.add_argument("--spread", type=int, default=2, help="parallel at fixed gamma = c-spread .. c+spread")
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    prompts = [(p.id, p.content, p.raw) for p in load_workload("builtin", limit=args.limit).prompts]
    prompts += [(f"long-{i}", long_prompt(4200 + 97 * i), True) for i in range(args.long)]
    ex = ParallelExecutor(engine, verbose=False)
    ex.start()
    c = ex.c_startup
    gamma = max(1, round(c))
    fixed = sorted({g for g in range(gamma - args.spread, gamma + args.spread + 1) if g >= 1})
    print(f"cost coefficient at start-up c = {c:.2f} (target step {ex._t_target * 1e3:.1f} ms beside the draft, "
          f"draft token {ex._t_draft * 1e3:.1f} ms beside the target); worker {ex.worker_info}", flush=True)
    runs = [("ar", lambda p, raw: engine.generate(p, raw=raw, max_tokens=args.max_tokens, method="ar")),
            (f"duo (sequential, budget {args.budget})",
             lambda p, raw: engine.generate(p, raw=raw, max_tokens=args.max_tokens, method="duo", budget=args.budget)),
            ("duo parallel (gamma = round(c), re-measured)",
             lambda p, raw: ex.generate(p, raw=raw, max_tokens=args.max_tokens))]
    runs += [(f"duo parallel, fixed gamma {g}",
              lambda p, raw, g=g: ex.generate(p, raw=raw, max_tokens=args.max_tokens, budget=g)) for g in fixed]
    for _name, run in runs:  # warm-up
        run("Say hello in one short sentence.", False)
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for pid, content, raw in prompts:
        ref = None
        for name, run in runs:
            res = run(content, raw)
            s = res.stats
            kind = "long" if pid.startswith("long") else "short"
            rows[kind, name]["tps"].append(s["tokens_per_s"])
            rows[kind, name]["ttft"].append(s["ttft_s"])
            rows[kind, name]["aat"].append(s.get("mean_accepted_tokens", 1.0))
            rows[kind, name]["gamma"].append(s.get("gamma_mean"))
            rows[kind, name]["idle"].append((s.get("draft_idle_s"), s.get("target_idle_s")))
            ref = ref or res.token_ids
            rows[kind, name]["same"].append(res.token_ids == ref)
            print(f"{pid:>24} {name:<44} {s['tokens_per_s']:6.2f} tok/s  TTFT {s['ttft_s']:.3f} s", flush=True)
    ex.close()
    for kind in ("short", "long"):
        names = [n for k, n in rows if k == kind]
        if not names:
            continue
        ar = statistics.mean(rows[kind, "ar"]["tps"])
        print(f"\n{kind} prompts ({len(rows[kind, 'ar']['tps'])}), greedy, {args.max_tokens} new tokens")
        print("| run | decode tok/s | x ar | TTFT s | AAT | mean gamma | = ar |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name in names:
            r = rows[kind, name]
            tps = statistics.mean(r["tps"])
            gam = [g for g in r["gamma"] if g is not None]
            print(f"| {name} | {tps:.2f} | {tps / ar:.2f}x | {statistics.mean(r['ttft']):.3f} | "
                  f"{statistics.mean(r['aat']):.2f} | {statistics.mean(gam) if gam else float('nan'):.2f} | "
                  f"{sum(r['same'])}/{len(r['same'])} |")


if __name__ == "__main__":
    main()
