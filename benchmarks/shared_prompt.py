"""A shared system prompt across concurrent requests (issue 42): one `specwood serve --max-batch 8`,
8 chat requests sent at once, each the same ~1,000-token system prompt (the first characters of
specwood/engine/scheduler.py as a document to answer questions about) and its own question. The
prompt is computed once when the requests that arrive together find the first one's row (or its
cached entry): the sum of `usage.prompt_tokens_details.cached_tokens`, and the prompt tokens less
the target's prefix-cache hits on /metrics, show it. Then the same 8 requests again on a server with `--kv-memory 0`
(no reuse) for the time to first token each pays without it.

    python benchmarks/shared_prompt.py --out benchmarks/results/server/shared_prompt_DATE \\
        [--method ar] [--requests 8] [--doc-chars 4200] [--max-tokens 16]

Greedy, streamed (TTFT on the client's clock). Writes results.json and report.md into --out.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from specwood.bench.server_process import ServerProcess, free_port, serve_command

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["What does submit do?", "How are rows freed?", "What is TREE_ROOM for?", "Name the public methods.",
             "How does cancellation work?", "What happens on an error?", "How is the batch chosen?",
             "What does step return?", "Which locks are taken?", "What is max_queue?"]


def log(msg: str) -> None:
    print(f"[shared_prompt] {msg}", file=sys.stderr, flush=True)


def one(base: str, system: str, question: str, max_tokens: int, method: str) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "method": method}
    t0, ttft, usage = time.perf_counter(), None, {}
    with httpx.Client(timeout=900) as c, c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf'^{re.escape(name)}(?:{{model="target"}})? ([0-9.e+-]+)$', text, re.M):
        total += float(m.group(1))
    return total


def run_server(extra: list[str], label: str, a: argparse.Namespace, system: str, out: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(port, max_batch=a.requests, max_context=4096) + ["--method", a.method] + extra
    with ServerProcess(cmd, base, log_path=out / f"{label}.log", log=log):
        one(base, "You are terse.", "hi", 2, a.method)  # warm-up, a prompt sharing nothing
        before = httpx.get(f"{base}/metrics").text
        results: list[dict[str, Any]] = [{} for _ in range(a.requests)]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, one(base, system, QUESTIONS[i % len(QUESTIONS)], a.max_tokens, a.method))) for i in range(a.requests)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = httpx.get(f"{base}/metrics").text
    row = {"server": label, "wall_s": wall, "requests": results,
           "prompt_tokens": sum(r["prompt_tokens"] for r in results),
           "cached_tokens": sum(r["cached_tokens"] for r in results),
           "mean_ttft_s": statistics.mean(r["ttft_s"] for r in results),
           "max_ttft_s": max(r["ttft_s"] for r in results)}
    for name in ("specwood:prefix_cache_hits_total", "specwood:prompt_tokens_total"):
        row[name] = metric(after, name) - metric(before, name)
    row["prefilled_tokens"] = row["specwood:prompt_tokens_total"] - row["specwood:prefix_cache_hits_total"]
    log(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'requests'})}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--doc-chars", type=int, default=4200)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = (REPO / "specwood" / "engine" / "scheduler.py").read_text()[:a.doc_chars]
    system = "Answer questions about this code in one sentence.\n\n" + doc
    rows = [run_server([], "reuse", a, system, out), run_server(["--kv-memory", "0"], "no reuse", a, system, out)]
    (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = [f"`python {' '.join(sys.argv)}`", "",
             "| server | requests | prompt tokens | cached tokens "
             "| prefilled tokens (/metrics: prompt less cache hits) | mean TTFT | max TTFT | wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['server']} | {a.requests} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{r['prefilled_tokens']:.0f} | {r['mean_ttft_s']:.2f} s | {r['max_ttft_s']:.2f} s | "
                     f"{r['wall_s']:.1f} s |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
