"""Two tenants on one server (issue 56): each at its own speed. The default pair behind
`specwood serve --method suffix` with two API keys; tenant A sends each request of the suffix
workload twice (cold, then warm: its own earlier answer drafts the repeat), then tenant B sends the
same requests: B finds nothing of A's (cold again, not slower), and its own repeat is warm. The
same sequence with one key for both shows what sharing would give B (warm at once).

    python benchmarks/two_tenants.py [--limit 1] [--max-tokens 128]

Per (tenant, pass): mean per-request tok/s (the server's `specwood_stats.tokens_per_s`), AAT and
`suffix_global_wins`; greedy, non-streamed chat requests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx

from specwood.bench.server_process import ServerProcess, free_port, serve_command

WORKLOADS = Path(__file__).resolve().parent / "suffix_workloads.jsonl"


def ask(base: str, key: str, messages: list, max_tokens: int) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0}, trust_env=False)
    r.raise_for_status()
    return r.json()["specwood_stats"]


def run(keys: tuple[str, str], items: list, max_tokens: int) -> dict[str, dict]:
    port = free_port()
    cmd = serve_command(port, max_batch=1) + ["--method", "suffix"]
    for k in sorted(set(keys)):
        cmd += ["--api-key", k]
    rows: dict[str, list] = {}
    with ServerProcess(cmd, f"http://127.0.0.1:{port}"):
        base = f"http://127.0.0.1:{port}"
        for tenant, key in (("A", keys[0]), ("B", keys[1])):
            for pass_ in ("first", "repeat"):
                for item in items:
                    rows.setdefault(f"{tenant} {pass_}", []).append(ask(base, key, item["messages"], max_tokens))
    return {k: {"tok_s": statistics.mean(s["tokens_per_s"] for s in v),
                "aat": statistics.mean(s.get("mean_accepted_tokens", 1.0) for s in v),
                "global_wins": sum(s.get("suffix_global_wins", 0) for s in v)} for k, v in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=1, help="items of each category")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    items, seen = [], {}
    for line in WORKLOADS.read_text().splitlines():
        item = json.loads(line)
        if seen.get(item["category"], 0) < args.limit and "messages" in item:
            seen[item["category"]] = seen.get(item["category"], 0) + 1
            items.append(item)
    print(f"{len(items)} requests ({', '.join(sorted(seen))}), {args.max_tokens} tokens, method suffix, c = 1")
    print("| keys | tenant, pass | tok/s | AAT | steps drafted from earlier answers |")
    print("|---|---|---:|---:|---:|")
    for label, keys in (("two tenants", ("key-a", "key-b")), ("one key for both", ("key-a", "key-a"))):
        for row, v in run(keys, items, args.max_tokens).items():
            print(f"| {label} | {row} | {v['tok_s']:.1f} | {v['aat']:.2f} | {v['global_wins']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
