"""Multi-turn chats over HTTP (issue 42): what a user waits for on the 2nd..nth turn of a
conversation, `specwood serve` with prefix reuse, without it (--kv-memory 0), and llama.cpp's
`llama-server` (its default prompt cache, one slot per conversation) when its binary is given.

    python benchmarks/multiturn.py --out benchmarks/results/server/multiturn_DATE \\
        [--methods ar,auto] [--llama-server PATH] [--turns 5] [--max-tokens 128] [--doc-chars 5000]

Three conversations (or --conversations N) of --turns turns each, one over a long document (the
first --doc-chars characters of a source file of this repository); each turn's request carries the
whole history, the server's own earlier answers included; greedy, --max-tokens new tokens a turn,
streamed. Conversations run one after another, one server at a time (127.0.0.1, a free port,
always stopped afterwards). Reported per server and turn: time to first token (client clock),
decode tok/s after the first token, prompt tokens and the cached ones the server reports
(usage.prompt_tokens_details.cached_tokens; llama-server's timings.cache_n where it gives them),
and from specwood's /metrics the prefix cache's hit rate and bytes held after the run.

Writes results.json and report.md into --out. A smoke run: --target/--draft tiny GGUFs or
--turns 2 --max-tokens 8 --doc-chars 400 --conversations 1.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from specwood.bench.server_process import ServerProcess, free_port, serve_command

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "specwood" / "engine" / "scheduler.py"

CONVERSATIONS: list[tuple[str, list[str]]] = [
    ("code", ["Write a Python function that checks whether a string is a palindrome.",
              "Now make it ignore spaces and punctuation.",
              "Add type hints and a docstring.",
              "Write three pytest tests for it.",
              "How would you make it work for a very long string streamed from disk?"]),
    ("explain", ["What is a hash table? Answer briefly.",
                 "How are collisions handled?",
                 "What is the load factor and why does it matter?",
                 "Compare open addressing and chaining in a few sentences.",
                 "Which one does Python's dict use?"]),
    ("document", ["Here is a source file:\n\n{doc}\n\nSummarise what this module does.",
                  "Which class is the most important one here, and why?",
                  "List the public methods of that class.",
                  "What happens to a request whose client disconnects?",
                  "Suggest one improvement to this code."]),
]


def log(msg: str) -> None:
    print(f"[multiturn] {msg}", file=sys.stderr, flush=True)


def chat_turn(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int, method: str | None,
              timeout: float) -> dict[str, Any]:
    """One streamed turn: its text, time to first token, decode rate and usage."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if method is not None:
        body["method"] = method
    t0 = time.perf_counter()
    first = last = None
    text, usage, timings, pieces = "", None, None, 0
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"error in stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text += delta
                    pieces += 1
    completion = (usage or {}).get("completion_tokens")
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings:
        cached = timings.get("cache_n")
    decode = (completion - 1) / (last - first) if completion and completion > 1 and last and last > first else None
    return {"text": text, "ttft_s": (first - t0) if first is not None else None, "decode_tok_s": decode,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": completion,
            "cached_tokens": cached}


def run_conversations(base: str, convs: Sequence[tuple[str, list[str]]], doc: str, a: argparse.Namespace,
                      method: str | None) -> list[dict[str, Any]]:
    records = []
    # a connection per turn: llama-server closes kept-alive connections after a few requests, and
    # a turn sent on one it is closing fails (RemoteProtocolError); localhost connects in ~1 ms
    with httpx.Client(base_url=base, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        chat_turn(client, [{"role": "user", "content": "Say hi."}], 8, method, a.request_timeout)  # warm-up
        for name, turns in convs:
            messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
            for i, user in enumerate(turns[:a.turns]):
                messages.append({"role": "user", "content": user.format(doc=doc)})
                rec = chat_turn(client, messages, a.max_tokens, method, a.request_timeout)
                messages.append({"role": "assistant", "content": rec.pop("text")})
                rec.update(conversation=name, turn=i + 1)
                records.append(rec)
                log(f"{name} turn {i + 1}: ttft {rec['ttft_s']:.2f} s, prompt {rec['prompt_tokens']}, "
                    f"cached {rec['cached_tokens']}")
    return records


def metrics_of(base: str) -> dict[str, float]:
    """specwood's prefix cache counters (sums over labels)."""
    out: dict[str, float] = {}
    text = httpx.get(base + "/metrics", timeout=30, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("specwood:prefix_cache_"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + ("[" + name.split("{")[1].rstrip("}") + "]" if "{" in name else "")
            out[key] = float(value)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in records if r["turn"] > 1 and r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in later)
    cached = sum(r["cached_tokens"] or 0 for r in later)
    decode = [r["decode_tok_s"] for r in records if r["decode_tok_s"]]
    return {"mean_ttft_turn1_s": statistics.mean(r["ttft_s"] for r in records if r["turn"] == 1),
            "mean_ttft_later_s": statistics.mean(r["ttft_s"] for r in later) if later else None,
            "later_hit_rate": cached / prompt if prompt else None,
            "mean_decode_tok_s": statistics.mean(decode) if decode else None}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Multi-turn chats over HTTP", "", f"`{result['command']}`", "",
             "| server | mean TTFT turn 1 | mean TTFT turns 2.. | cached share of later prompts | decode tok/s |",
             "|---|---:|---:|---:|---:|"]

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    for label, run in result["servers"].items():
        s = run["summary"]
        lines.append(f"| {label} | {f(s['mean_ttft_turn1_s'])} s | {f(s['mean_ttft_later_s'])} s | "
                     f"{f(s['later_hit_rate'], '.0%')} | {f(s['mean_decode_tok_s'], '.1f')} |")
    lines += ["", "Per turn (TTFT s / prompt tokens / cached):", ""]
    for label, run in result["servers"].items():
        lines.append(f"- {label}:")
        for conv in dict.fromkeys(r["conversation"] for r in run["records"]):
            turns = [r for r in run["records"] if r["conversation"] == conv]
            lines.append(f"  - {conv}: " + ", ".join(
                f"{r['ttft_s']:.2f}/{r['prompt_tokens']}/{r['cached_tokens']}" for r in turns))
        if run.get("metrics"):
            lines.append("  - /metrics: " + ", ".join(f"{k.split(':')[1]} {v:g}" for k, v in run["metrics"].items()))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="ar,auto", help="specwood methods, each a server run with reuse")
    ap.add_argument("--no-reuse-baseline", default="ar",
                    help="method run once more with --kv-memory 0 (our own server without reuse; '' to skip)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: run it too (one slot)")
    ap.add_argument("--target", default=None, help="target model (default: the default pair's)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=len(CONVERSATIONS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--doc-chars", type=int, default=5000)
    ap.add_argument("--ctx", type=int, default=8192, help="context per conversation (both servers)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads")
    ap.add_argument("--kv-memory", default=None, help="specwood serve --kv-memory (default: its own)")
    ap.add_argument("--request-timeout", type=float, default=1200.0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = DOC.read_text()[:a.doc_chars]
    # the document conversation first: the longest prompts
    convs = sorted(CONVERSATIONS, key=lambda c: c[0] != "document")[:a.conversations]
    result: dict[str, Any] = {"command": shlex.join([sys.executable, *sys.argv]), "servers": {}}
    runs = [(f"specwood {m}", m, a.kv_memory) for m in a.methods.split(",") if m]
    if a.no_reuse_baseline:
        runs.append((f"specwood {a.no_reuse_baseline} (no reuse)", a.no_reuse_baseline, "0"))
    for label, method, kv in runs:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = serve_command(port, max_batch=1, max_context=a.ctx, target=a.target, draft=a.draft, dtype=a.dtype)
        cmd += ["--method", method] + (["--kv-memory", kv] if kv is not None else [])
        log(f"{label}: {shlex.join(cmd)}")
        with ServerProcess(cmd, base, log_path=out / f"{label.replace(' ', '_')}.log",
                           startup_timeout=a.startup_timeout, log=log):
            records = run_conversations(base, convs, doc, a, method)
            result["servers"][label] = {"command": shlex.join(cmd), "records": records,
                                        "summary": summarize(records), "metrics": metrics_of(base)}
        (out / "results.json").write_text(json.dumps(result, indent=1))  # kept if a later server fails
    if a.llama_server:
        from specwood.models.registry import DEFAULT_TARGET, resolve_model

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        target = a.target or str(resolve_model(DEFAULT_TARGET))
        cmd = [a.llama_server, "-m", target, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
               "-tb", str(a.threads), "-c", str(a.ctx), "-np", "1"]
        log(f"llama-server: {shlex.join(cmd)}")
        with ServerProcess(cmd, base, log_path=out / "llama-server.log", startup_timeout=a.startup_timeout, log=log):
            records = run_conversations(base, convs, doc, a, None)
            result["servers"]["llama-server"] = {"command": shlex.join(cmd), "records": records,
                                                 "summary": summarize(records)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
