"""Structured output over HTTP (issue 40): JSON extraction and tool calling, `specwood serve`'s
constrained methods beside llama.cpp's `llama-server --jinja` with the same `response_format` and
`tools`, same client, greedy.

    python benchmarks/structured.py --out benchmarks/results/structured/DATE \\
        [--requests benchmarks/structured_requests.jsonl] [--methods ar,auto] [--max-tokens 256] \\
        [--concurrency 1,8] [--llama-server PATH] [--target T --draft D] [--limit N] [--rounds 1]

The requests (benchmarks/structured_requests.jsonl, written for this benchmark): `json-high`,
JSON-schema extractions that the grammar mostly forces (enums, fixed keys, booleans, bounded
integers); `json-low`, extractions into long free strings; `tools`, tool calls with
`tool_choice: "required"` and `parallel_tool_calls: false` (one intent each: a small model
allowed several calls tends to repeat the call until max_tokens). Each is an OpenAI chat body
(temperature 0, max_tokens N, not
streamed), sent by c closed-loop clients (c from --concurrency: a request list of max(#requests,
2c), cycled). Per server, method, level and category:
- tok/s: completion tokens / request latency (client clock), mean over requests; aggregate tok/s
  (all completion tokens / the level's wall time);
- schema-valid share: json: finish_reason "stop" and the content validates (jsonschema); tools:
  finish_reason "tool_calls", at least one call, each call's arguments valid under its tool;
- specwood's stats (`specwood_stats`): mean accepted tokens per step, and, where the engine reports
  them, the forced-token share, pruned nodes and mask time (keys with "forced", "pruned", "mask").
Ratios: auto / ar and auto / llama.cpp. Writes results.json and report.md into --out.

Servers run one at a time on 127.0.0.1 (free ports), always stopped afterwards. llama-server runs
only when --llama-server names its binary (`python -m specwood.bench.llama_server build` makes
one): `--jinja` (its tool-call support), -np c, the default target GGUF.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_compare import llama_command  # noqa: E402

from specwood.bench.server_process import ServerProcess, free_port, serve_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REQUESTS = REPO / "benchmarks" / "structured_requests.jsonl"
STAT_KEYS = ("forced", "pruned", "mask")


def log(msg: str) -> None:
    print(f"structured: {msg}", file=sys.stderr, flush=True)


def load_requests(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit:  # keep every category: the first `limit` of each
        seen: dict[str, int] = {}
        rows = [r for r in rows if seen.setdefault(r["category"], 0) < limit and not seen.update(
            {r["category"]: seen[r["category"]] + 1})]
    return rows


def body_of(req: dict[str, Any], max_tokens: int, method: str | None) -> dict[str, Any]:
    body = {"messages": req["messages"], "max_tokens": max_tokens, "temperature": 0}
    for k in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
        if k in req:
            body[k] = req[k]
    if method is not None:
        body["method"] = method
    return body


def check(req: dict[str, Any], answer: dict[str, Any]) -> tuple[bool, str]:
    """Whether the answer is what the request constrains it to be, and why not."""
    import jsonschema

    choice = answer["choices"][0]
    msg = choice.get("message") or {}
    if "tools" in req:
        calls = msg.get("tool_calls") or []
        if choice.get("finish_reason") != "tool_calls" or not calls:
            return False, f"no tool call (finish_reason {choice.get('finish_reason')})"
        specs = {t["function"]["name"]: t["function"].get("parameters", {}) for t in req["tools"]}
        for c in calls:
            name = c["function"]["name"]
            if name not in specs:
                return False, f"unknown tool {name}"
            try:
                jsonschema.validate(json.loads(c["function"]["arguments"]), specs[name])
            except (ValueError, jsonschema.ValidationError) as e:
                return False, f"arguments of {name}: {str(e).splitlines()[0]}"
        return True, ""
    if choice.get("finish_reason") != "stop":
        return False, f"finish_reason {choice.get('finish_reason')}"
    try:
        jsonschema.validate(json.loads(msg.get("content") or ""), req["response_format"]["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError) as e:
        return False, str(e).splitlines()[0]
    return True, ""


def run_level(base: str, reqs: Sequence[dict[str, Any]], method: str | None, c: int, max_tokens: int,
              timeout: float, tag: str) -> tuple[list[dict[str, Any]], float]:
    import httpx

    todo = list(enumerate(reqs))
    lock = threading.Lock()
    records: list[dict[str, Any]] = []

    def worker() -> None:
        with httpx.Client(base_url=base, timeout=timeout, trust_env=False) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    i, req = todo.pop(0)
                t0 = time.perf_counter()
                rec: dict[str, Any] = {"index": i, "id": req["id"], "category": req["category"]}
                try:
                    r = client.post("/v1/chat/completions", json=body_of(req, max_tokens, method))
                    rec["latency_s"] = time.perf_counter() - t0
                    if r.status_code != 200:
                        rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                    else:
                        answer = r.json()
                        n = (answer.get("usage") or {}).get("completion_tokens") or 0
                        ok, why = check(req, answer)
                        stats = answer.get("specwood_stats") or {}
                        rec.update(completion_tokens=n, tok_s=n / rec["latency_s"] if rec["latency_s"] > 0 else None,
                                   valid=ok, why=why, finish_reason=answer["choices"][0].get("finish_reason"),
                                   mean_accepted_tokens=stats.get("mean_accepted_tokens"),
                                   stats={k: v for k, v in stats.items() if any(s in k for s in STAT_KEYS)},
                                   answer=answer["choices"][0])
                except httpx.HTTPError as e:
                    rec["error"] = f"{type(e).__name__}: {e}"
                with lock:
                    records.append(rec)
                log(f"{tag} {rec['id']}: " + (rec["error"] if "error" in rec else
                                              f"{rec['completion_tokens']} tokens, {rec['tok_s']:.1f} tok/s, "
                                              f"{'valid' if rec['valid'] else 'INVALID ' + rec['why']}"))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(min(c, len(reqs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records.sort(key=lambda r: r["index"])
    return records, time.perf_counter() - t0


def _mean(xs: Sequence[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.fmean(v) if v else None


def summarize(records: Sequence[dict[str, Any]], walls: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    keys = list(dict.fromkeys((r["server"], r["method"], r["concurrency"]) for r in records))
    for server, method, c in keys:
        mine = [r for r in records if (r["server"], r["method"], r["concurrency"]) == (server, method, c)]
        for cat in ["all", *dict.fromkeys(r["category"] for r in mine)]:
            sel = [r for r in mine if cat == "all" or r["category"] == cat]
            good = [r for r in sel if "error" not in r]
            row = {"server": server, "method": method, "concurrency": c, "category": cat, "n": len(sel),
                   "errors": len(sel) - len(good), "tok_s": _mean([r.get("tok_s") for r in good]),
                   "valid_share": sum(bool(r.get("valid")) for r in good) / len(sel) if sel else None,
                   "mean_accepted_tokens": _mean([r.get("mean_accepted_tokens") for r in good])}
            for k in sorted({k for r in good for k in (r.get("stats") or {})}):
                row[k] = _mean([(r.get("stats") or {}).get(k) for r in good])
            if cat == "all":
                row["aggregate_tok_s"] = sum(r.get("completion_tokens") or 0 for r in good) / walls[
                    f"{server}/{method}/{c}"]
            rows.append(row)
    return rows


def report(rows: Sequence[dict[str, Any]]) -> str:
    def f(x: Any, spec: str = ".2f") -> str:
        return f"{x:{spec}}" if isinstance(x, (int, float)) else "–"

    extra = sorted({k for r in rows for k in r if any(s in k for s in STAT_KEYS)})
    head = ["server", "method", "c", "category", "n", "tok/s", "valid", "AAT", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["server"], r["method"], str(r["concurrency"]), r["category"], str(r["n"]),
                                        f(r["tok_s"], ".1f"), f(r["valid_share"], ".0%"),
                                        f(r["mean_accepted_tokens"]), *[f(r.get(k), ".3g") for k in extra]]) + " |")
    by = {(r["server"], r["method"], r["concurrency"]): r for r in rows if r["category"] == "all"}
    out = ["\n".join(lines), ""]
    for (_server, method, c), r in by.items():
        if method == "auto":
            for other in (("specwood", "ar"), ("llama.cpp", "plain")):
                o = by.get((*other, c))
                if o and o["tok_s"] and r["tok_s"]:
                    out.append(f"- c={c}: auto / {other[0]} {other[1]}: {r['tok_s'] / o['tok_s']:.2f}x")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS)
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests of each category")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--target", default=None, help="specwood serve --target (default: the default pair)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--ctx", type=int, default=2048, help="context per request (slot)")
    ap.add_argument("--llama-server", default=None, help="llama-server's binary: measure it too")
    ap.add_argument("--llama-target", default=None, help="its GGUF (default: the default target's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    reqs = load_requests(a.requests, a.limit)
    a.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    walls: dict[str, float] = {}

    def measure(base: str, server: str, method: str | None, cs: Sequence[int], rnd: int) -> None:
        for c in cs:
            todo = [reqs[i % len(reqs)] for i in range(max(len(reqs), 2 * c))]
            recs, wall = run_level(base, todo, method, c, a.max_tokens, a.timeout, f"[{server} {method or ''} c={c}]")
            m = method or "plain"
            walls[f"{server}/{m}/{c}"] = walls.get(f"{server}/{m}/{c}", 0.0) + wall  # pooled over rounds
            records.extend({**r, "server": server, "method": m, "concurrency": c, "round": rnd} for r in recs)

    for rnd in range(a.rounds):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = serve_command(port, max_batch=max(levels), max_context=a.ctx, target=a.target, draft=a.draft,
                            dtype=a.dtype)
        with ServerProcess(cmd, base, log_path=a.out / f"specwood-r{rnd + 1}.log", startup_timeout=a.startup_timeout,
                           log=log):
            for m in methods:
                run_level(base, reqs[:1], m, 1, 16, a.timeout, f"[warm-up {m}]")
                measure(base, "specwood", m, levels, rnd)
        if a.llama_server:
            from specwood.models.registry import DEFAULT_TARGET, resolve_model

            target = Path(a.llama_target) if a.llama_target else resolve_model(DEFAULT_TARGET)
            for c in levels:
                port = free_port()
                base = f"http://127.0.0.1:{port}"
                cmd = llama_command(Path(a.llama_server), port, target, threads=a.threads, ctx=a.ctx, slots=c,
                                    extra=["--jinja"])
                with ServerProcess(cmd, base, log_path=a.out / f"llama-c{c}-r{rnd + 1}.log",
                                   startup_timeout=a.startup_timeout, log=log):
                    run_level(base, reqs[:1], None, 1, 16, a.timeout, "[warm-up llama.cpp]")
                    measure(base, "llama.cpp", None, [c], rnd)
    rows = summarize(records, walls)
    (a.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                    "summary": rows, "records": records}, indent=1))
    text = report(rows)
    (a.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
