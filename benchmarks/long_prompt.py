"""A long prompt within the default KV budget (issue 42): `specwood serve` with its defaults (the
model's whole context, rows that grow within --kv-memory's default) answers a prompt of
--tokens tokens while a short request runs beside it, and the server's memory stays within the
budget.

    python benchmarks/long_prompt.py --out benchmarks/results/server/long_prompt_DATE \\
        [--tokens 16000] [--max-tokens 32] [--method auto] [--target T --draft D]

The long prompt is this repository's source text (Python files in order) cut to --tokens tokens
of the target's tokenizer, ending in a question about it; greedy, streamed. A short request
(64 tokens) is sent once the long one is under way, to show the rows growing while another
request runs. Reported: time to first token and decode tok/s of both, the server's peak RSS
(VmHWM), the rows' bytes and slots and the prefix cache's bytes from /metrics after each, and
the budget the server printed. Writes results.json and report.md into --out.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from specwood.bench.server_process import ServerProcess, free_port, serve_command

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[long_prompt] {msg}", file=sys.stderr, flush=True)


def source_text(tokenizer: Any, tokens: int) -> str:
    """This repository's Python source, cut to `tokens` tokens of `tokenizer`."""
    text = ""
    for path in sorted((REPO / "specwood").rglob("*.py")):
        text += f"\n# file: {path.relative_to(REPO)}\n" + path.read_text()
        if len(text) > tokens * 6:
            break
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def stream(base: str, prompt: str, max_tokens: int, method: str | None, timeout: float) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if method:
        body["method"] = method
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with httpx.Client(base_url=base, trust_env=False, timeout=timeout) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read()[:400]!r}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"error": str(chunk["error"])}
                usage = chunk.get("usage") or usage
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
    n = (usage or {}).get("completion_tokens") or 0
    return {"ttft_s": None if first is None else first - t0,
            "decode_tok_s": (n - 1) / (last - first) if n > 1 and last and first and last > first else None,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": n}


def kv_metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30, trust_env=False).text.splitlines():
        if line.startswith(("specwood:kv_row", "specwood:prefix_cache_bytes", "specwood:prefix_cache_budget")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from specwood.models.loader import load_tokenizer
    from specwood.models.registry import DEFAULT_TARGET, resolve_model

    tokenizer = load_tokenizer(a.target or resolve_model(DEFAULT_TARGET))  # what the server loads
    question = "\n\nWhich function in the code above is defined first? Answer with its name only."
    prompt = source_text(tokenizer, a.tokens) + question
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(port, max_batch=8, target=a.target, draft=a.draft) + ["--method", a.method]
    log(shlex.join(cmd))
    result: dict[str, Any] = {"command": shlex.join([sys.executable, *sys.argv]), "serve": shlex.join(cmd),
                              "when": time.strftime("%Y-%m-%d %H:%M")}
    with ServerProcess(cmd, base, log_path=out / "server.log", log=log) as server:
        result["metrics_start"] = kv_metrics(base)
        result["rss_start"] = peak_rss(server.proc.pid)
        long_result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: long_result.update(stream(base, prompt, a.max_tokens, a.method, a.timeout)))
        t.start()
        time.sleep(5.0)  # the long prompt is admitted and prefilling
        result["short"] = stream(base, "Write a haiku about caches.", 64, a.method, a.timeout)
        result["metrics_during"] = kv_metrics(base)
        log(f"short request beside the long one: {result['short']}")
        t.join()
        result["long"] = long_result
        result["metrics_after"] = kv_metrics(base)
        result["peak_rss"] = peak_rss(server.proc.pid)
        log(f"long request: {long_result}")
    budget = [ln for ln in (out / "server.log").read_text().splitlines() if "budget" in ln.lower()]
    result["server_budget_lines"] = budget[:5]
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# A {a.tokens}-token prompt within the default KV budget", "", f"`{result['command']}`", "",
             "| request | prompt tokens | TTFT s | decode tok/s | error |", "|---|---:|---:|---:|---|"]
    for name in ("long", "short"):
        r = result[name]
        lines.append(f"| {name} | {r.get('prompt_tokens')} | {r.get('ttft_s') and round(r['ttft_s'], 2)} | "
                     f"{r.get('decode_tok_s') and round(r['decode_tok_s'], 1)} | {r.get('error', '')} |")
    lines += ["", f"peak RSS {result['peak_rss']} bytes (at start {result['rss_start']})", "",
              "metrics at start / beside the long prompt / after:", "```",
              json.dumps([result["metrics_start"], result["metrics_during"], result["metrics_after"]], indent=1), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
