"""What constrained neighbours cost a plain request (issue 40): one `specwood serve --max-batch 8`,
a probe client sending plain (unconstrained) chat requests while 7 other clients keep the batch
full, first with plain requests, then with the same requests constrained (JSON schemas, tool
calls). The probe's per-request decode tok/s in the two phases, and the constrained requests'
time in the grammar matcher (`grammar_mask_s`) as a share of their latency.

    python benchmarks/mixed_batch.py --out benchmarks/results/structured/mixed_DATE \\
        [--method auto] [--probe-requests 6] [--max-tokens 128] [--target T --draft D]

The probe's prompts are the JSON-extraction requests of benchmarks/structured_requests.jsonl
without their response_format (so the probe asks the same things in both phases); the others
cycle through the whole file, with (phase "constrained") or without (phase "plain") their
response_format/tools. Greedy. Phases alternate plain, constrained, plain, constrained
(--rounds 2) so drift of the machine shows. Writes results.json and report.md into --out.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured import DEFAULT_REQUESTS, body_of, load_requests  # noqa: E402

from specwood.bench.server_process import ServerProcess, free_port, serve_command  # noqa: E402

NEIGHBOURS = 7


def log(msg: str) -> None:
    print(f"[mixed_batch] {msg}", file=sys.stderr, flush=True)


def plain(req: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in req.items() if k not in ("response_format", "tools", "tool_choice", "parallel_tool_calls")}


def phase(base: str, reqs: list[dict[str, Any]], probes: list[dict[str, Any]], constrained: bool, method: str,
          max_tokens: int) -> dict[str, Any]:
    stop = threading.Event()
    neighbour_records: list[dict[str, Any]] = []

    def neighbour(k: int) -> None:
        with httpx.Client(base_url=base, timeout=900, trust_env=False) as client:
            i = k
            while not stop.is_set():
                req = reqs[i % len(reqs)]
                i += NEIGHBOURS
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions",
                                json=body_of(req if constrained else plain(req), max_tokens, method))
                if r.status_code == 200 and not stop.is_set():
                    stats = r.json().get("specwood_stats") or {}
                    neighbour_records.append({"latency_s": time.perf_counter() - t0,
                                              "mask_s": stats.get("grammar_mask_s"),
                                              "tokens": r.json()["usage"]["completion_tokens"]})

    threads = [threading.Thread(target=neighbour, args=(k,)) for k in range(NEIGHBOURS)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # the batch fills
    probe_records = []
    with httpx.Client(base_url=base, timeout=900, trust_env=False) as client:
        for req in probes:
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body_of(plain(req), max_tokens, method))
            r.raise_for_status()
            n = r.json()["usage"]["completion_tokens"]
            probe_records.append({"id": req["id"], "tokens": n, "tok_s": n / (time.perf_counter() - t0)})
    stop.set()
    for t in threads:
        t.join()
    masks = [r["mask_s"] / r["latency_s"] for r in neighbour_records if r.get("mask_s") is not None]
    return {"constrained": constrained, "probe": probe_records,
            "probe_tok_s": statistics.fmean(r["tok_s"] for r in probe_records),
            "neighbour_requests": len(neighbour_records),
            "neighbour_mask_share": statistics.fmean(masks) if masks else None}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--probe-requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = load_requests(a.requests, None)
    probes = [r for r in reqs if "response_format" in r][:a.probe_requests]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(port, max_batch=NEIGHBOURS + 1, max_context=2048, target=a.target, draft=a.draft) + [
        "--method", a.method]
    phases = []
    with ServerProcess(cmd, base, log_path=out / "server.log", log=log):
        with httpx.Client(base_url=base, timeout=300, trust_env=False) as client:  # warm-up
            client.post("/v1/chat/completions", json=body_of(reqs[0], 16, a.method)).raise_for_status()
        for rnd in range(a.rounds):
            for constrained in (False, True):
                p = phase(base, reqs, probes, constrained, a.method, a.max_tokens)
                p["round"] = rnd
                phases.append(p)
                log(f"round {rnd} {'constrained' if constrained else 'plain'} neighbours: probe "
                    f"{p['probe_tok_s']:.2f} tok/s, neighbours' mask share {p['neighbour_mask_share']}")
    plain_rate = statistics.fmean(p["probe_tok_s"] for p in phases if not p["constrained"])
    mixed_rate = statistics.fmean(p["probe_tok_s"] for p in phases if p["constrained"])
    shares = [p["neighbour_mask_share"] for p in phases if p["neighbour_mask_share"] is not None]
    result = {"command": shlex.join([sys.executable, *sys.argv]), "serve": shlex.join(cmd),
              "when": time.strftime("%Y-%m-%d %H:%M"), "phases": phases, "probe_plain_tok_s": plain_rate,
              "probe_mixed_tok_s": mixed_rate, "ratio": mixed_rate / plain_rate,
              "mask_share": statistics.fmean(shares) if shares else None}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# A plain request among {NEIGHBOURS} others, plain or constrained", "", f"`{result['command']}`", "",
             "| round | neighbours | probe tok/s | neighbours' time in the matcher |", "|---|---|---:|---:|"]
    for p in phases:
        share = p["neighbour_mask_share"]
        lines.append(f"| {p['round']} | {'constrained' if p['constrained'] else 'plain'} | {p['probe_tok_s']:.2f} | "
                     f"{'–' if share is None else f'{share:.2%}'} |")
    lines += ["", f"probe beside constrained / beside plain: {result['ratio']:.3f}x"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
