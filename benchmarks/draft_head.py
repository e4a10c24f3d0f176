"""The feature-level draft head against the 0.5B draft model, in process, per category of the
held-out prompts: AAT, acceptance by depth, drafting time per draft forward (T_d) against the
target's one-token step (T_v(1)), and decode tok/s against `ar` (same engine, same prompts,
greedy, one request at a time; every output checked token-identical to ar's).

    python benchmarks/draft_head.py --head PATH [--prompts benchmarks/heldout_prompts.jsonl]
        [--max-tokens 128] [--configs "head:chain:depth=4,head:eagle,chain:depth=4"] [--out DIR]

A config is METHOD[:SHAPE][:KEY=VALUE...]: `head:chain:depth=4` is the head drafting a 4-token
chain, `head:eagle` the head with EAGLE-2's tree (its defaults), `chain:depth=4` the draft
model's chain.
Writes results.json and report.md into --out (default: print the report only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import specwood  # noqa: E402
from specwood.bench.harness import machine_info  # noqa: E402


def machine_line() -> str:
    m = machine_info()
    return (f"{m['cpu_model']}, {m['cpu_cores_usable']} cores ({', '.join(m['cpu_flags'])}), "
            f"torch {m['torch']} with {m['torch_threads']} threads")


def parse_config(text: str) -> tuple[str, dict]:
    """METHOD[:SHAPE][:KEY=VALUE...]: `head:eagle:budget=8:topk=2`, `chain:depth=4`."""
    method, *parts = text.split(":")
    options: dict = {}
    for part in parts:
        if "=" in part:
            key, value = part.split("=", 1)
            options[key] = int(value) if value.isdigit() else float(value)
        else:
            options["shape"] = part
    return method, options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parent / "heldout_prompts.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default="head:chain:depth=4,head:eagle,chain:depth=4")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = specwood.load(head=args.head, progress=False)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    configs = [parse_config(c) for c in args.configs.split(",")]
    engine.generate("warm up", max_tokens=8)
    for method, options in configs:
        engine.generate("warm up", max_tokens=8, method=method, **options)
    records = []
    for i, row in enumerate(rows):
        prompt = row.get("messages") or row.get("prompt")
        ids = engine.encode(prompt) if isinstance(prompt, list) else engine.encode(prompt, raw=True)
        ref = engine.generate(ids, max_tokens=args.max_tokens)
        records.append({"category": row["category"], "config": "ar", "tokens_per_s": ref.stats["tokens_per_s"]})
        for (method, options), name in zip(configs, args.configs.split(",")):
            out = engine.generate(ids, max_tokens=args.max_tokens, method=method, **options)
            if out.token_ids != ref.token_ids:
                raise SystemExit(f"{name} differs from ar on prompt {row.get('id', i)}: a lossless bug")
            s = out.stats
            steps = max(s.get("spec_steps", 0), 1)
            forwards = steps * max(s.get("mean_tree_depth", 1.0), 1.0)
            records.append({"category": row["category"], "config": name, "tokens_per_s": s["tokens_per_s"],
                            "aat": s.get("mean_accepted_tokens", 1.0), "by_depth": s.get("acceptance_by_depth", []),
                            "draft_ms_per_forward": 1000 * s.get("draft_s", 0.0) / forwards,
                            "verify_ms_per_step": 1000 * s.get("verify_s", 0.0) / steps})
        print(f"[{i + 1}/{len(rows)}] {row['category']}: " + ", ".join(
            f"{r['config']} {r['tokens_per_s']:.1f}" for r in records[-1 - len(configs):]), file=sys.stderr)
    report = render(records, args, engine)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(records, indent=1))
        (out / "report.md").write_text(report)
    return 0


def render(records: list[dict], args: argparse.Namespace, engine) -> str:
    names = ["ar"] + args.configs.split(",")
    cats = sorted({r["category"] for r in records})
    by = defaultdict(list)
    for r in records:
        by[(r["config"], r["category"])].append(r)
        by[(r["config"], "all")].append(r)
    lines = [f"# draft head vs draft model, {time.strftime('%Y-%m-%d')}", "",
             f"{machine_line()}; head {args.head}; {args.max_tokens} new tokens, greedy, one request at a time", "",
             "| config | " + " | ".join(cats + ["all"]) + " |", "|---|" + "---:|" * (len(cats) + 1)]
    for name in names:
        cells = []
        for cat in cats + ["all"]:
            rs = by[(name, cat)]
            tps = statistics.mean(r["tokens_per_s"] for r in rs)
            ar = statistics.mean(r["tokens_per_s"] for r in by[("ar", cat)])
            aat = f", AAT {statistics.mean(r['aat'] for r in rs):.2f}" if name != "ar" else ""
            cells.append(f"{tps:.1f} ({tps / ar:.2f}x{aat})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    t_v1 = 1000 / statistics.mean(r["tokens_per_s"] for r in by[("ar", "all")])
    lines += ["", f"T_v(1), a plain step: {t_v1:.1f} ms (1 / ar's tok/s).", "",
              "| config | T_d per draft forward (ms) | T_d / T_v(1) | verify per step (ms) "
              "| acceptance by depth (all) |",
              "|---|---:|---:|---:|---|"]
    for name in names[1:]:
        rs = by[(name, "all")]
        depth = max(len(r["by_depth"]) for r in rs)
        acc = [statistics.mean(r["by_depth"][d] for r in rs if len(r["by_depth"]) > d) for d in range(depth)]
        t_d = statistics.mean(r["draft_ms_per_forward"] for r in rs)
        verify_ms = statistics.mean(r["verify_ms_per_step"] for r in rs)
        lines.append(f"| {name} | {t_d:.2f} | {t_d / t_v1:.3f} | {verify_ms:.1f} | "
                     + ", ".join(f"{a:.2f}" for a in acc) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
