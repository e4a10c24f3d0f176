"""Two source trees of specwood (e.g. main and a worktree of an earlier commit) on the same prompts,
in-process `specwood bench` runs alternated A B, B A, B A, A B, ... so that a host drifting in speed
weighs on both alike; then each method's decode tok/s and TTFT after ÷ before (geometric means over
the paired prompts, with a 95% interval) and how many greedy outputs are token-identical.

    python benchmarks/tree_ab.py before=/path/to/worktree after=/work/main --rounds 4 --out DIR
    python benchmarks/tree_ab.py before=... after=... --out DIR --report-only   # the summary again

The first tree named is the baseline. Each run is `python -m specwood.cli bench --workload W --methods M
--max-tokens N --out DIR/NAME_rK` in that tree (PYTHONPATH set to it); the log says when each ran and
the load beside it. Writes DIR/summary.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def order(round_no: int, a: str, b: str) -> list[str]:
    """A B, B A, B A, A B, ...: each pair of rounds cancels a linear drift."""
    return [a, b] if round_no % 4 in (0, 1) else [b, a]


def run(name: str, tree: Path, out: Path, round_no: int, args: argparse.Namespace) -> None:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    with open(out / "log", "a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} round {round_no} {name} load {' '.join(load)}\n")
    cmd = [sys.executable, "-m", "specwood.cli", "bench", "--workload", str(args.workload), "--methods", args.methods,
           "--max-tokens", str(args.max_tokens), "--out", str(out / f"{name}_r{round_no}")]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    with open(out / f"{name}_r{round_no}.log", "w") as f:
        rc = subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), stdout=f,
                            stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    with open(out / "log", "a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} done {name} rc {rc}\n")
    if rc:
        sys.exit(f"the bench in {tree} failed (exit {rc}): see {out / f'{name}_r{round_no}.log'}")


def geo_mean(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean and its 95% interval (normal on the logs)."""
    logs = [math.log(x) for x in ratios]
    mean = statistics.mean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def summary(out: Path, a: str, b: str, rounds: int) -> dict[str, dict[str, object]]:
    def rows(name: str, k: int) -> list[dict]:
        return json.loads((out / f"{name}_r{k}" / "results.json").read_text())

    result: dict[str, dict[str, object]] = {}
    methods = sorted({r["method"] for r in rows(a, 1)})
    for method in methods:
        speed, ttft, same, pairs = [], [], 0, 0
        per_run = {}
        for k in range(1, rounds + 1):
            base = {r["id"]: r for r in rows(a, k) if r["method"] == method}
            new = {r["id"]: r for r in rows(b, k) if r["method"] == method}
            per_run[f"{a}_r{k}"] = statistics.mean(r["tokens_per_s"] for r in base.values())
            per_run[f"{b}_r{k}"] = statistics.mean(r["tokens_per_s"] for r in new.values())
            for i in base:
                speed.append(new[i]["tokens_per_s"] / base[i]["tokens_per_s"])
                ttft.append(new[i]["ttft_s"] / base[i]["ttft_s"])
                same += new[i]["token_ids"] == base[i]["token_ids"]
                pairs += 1
        g, lo, hi = geo_mean(speed)
        result[method] = {"decode_ratio": round(g, 3), "decode_ratio_95": [round(lo, 3), round(hi, 3)],
                          "ttft_ratio": round(geo_mean(ttft)[0], 3), "identical": f"{same}/{pairs}",
                          "tokens_per_s_per_run": {n: round(v, 2) for n, v in per_run.items()}}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, metavar="NAME=TREE", help="the baseline first, then the tree compared with it")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", help="the target's weights (bench's --dtype); its default when not given")
    ap.add_argument("--workload", type=Path, default=ROOT / "benchmarks" / "heldout_prompts.jsonl")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per bench run")
    ap.add_argument("--report-only", action="store_true", help="summarise the runs already in --out")
    args = ap.parse_args()
    (a, tree_a), (b, tree_b) = (t.split("=", 1) for t in args.trees)
    trees = {a: Path(tree_a), b: Path(tree_b)}
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for k in range(1, args.rounds + 1):
            for name in order(k, a, b):
                run(name, trees[name], args.out, k, args)
    result = summary(args.out, a, b, args.rounds)
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    for method, r in result.items():
        lo, hi = r["decode_ratio_95"]  # type: ignore[misc]
        print(f"{method}: decode {b}/{a} {r['decode_ratio']} (95% {lo}-{hi}), TTFT {r['ttft_ratio']}, "
              f"greedy tokens identical {r['identical']}")


if __name__ == "__main__":
    main()
