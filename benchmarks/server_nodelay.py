"""A short answer's latency over HTTP with the server's socket bound as before §37 (Nagle's
algorithm left on: asyncio sets TCP_NODELAY only on sockets that name IPPROTO_TCP) and as
`specwood.serve.app.bind_socket` binds it now.

    python benchmarks/server_nodelay.py --out benchmarks/results/server/nodelay_2026-11-29

Each round starts `serve` on the chosen target (default: the default pair's target, `ar`) once per
binding, in alternated order, and sends the same requests one at a time over one keep-alive
connection: non-streaming completions of --max-tokens tokens, then streaming ones (time to the
first token and to the end). Writes results.json and prints a table of medians.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["Name a prime number.", "What is the capital of France?", "Say hello in Spanish.",
           "Give one word that rhymes with cat.", "What colour is the sky on a clear day?"]

_SERVER = """
import socket, sys
import specwood
from specwood.serve.app import bind_socket, serve
binding, target = sys.argv[1], sys.argv[2]
if binding == "nagle":  # as bind_socket bound it before: proto 0, so asyncio left Nagle on
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
else:
    sock = bind_socket("127.0.0.1", 0)
print("port", sock.getsockname()[1], flush=True)
engine = specwood.load(target=None if target == "default" else target, draft="none", progress=False)
serve(engine, sock=sock, method="ar")
"""


def start(binding: str, target: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, binding, target], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    port = None
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("port "):
            port = int(line.split()[1])
        if "listening on" in line:
            break
        if time.monotonic() > deadline:
            break
    if port is None or proc.poll() is not None:
        raise SystemExit(f"the {binding} server did not start")
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(url: str, max_tokens: int, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"json_s": [], "stream_first_s": [], "stream_end_s": []}
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        body = {"prompt": "warm up", "max_tokens": 2, "temperature": 0}
        http.post("/v1/completions", json=body).raise_for_status()
        for _ in range(repeats):
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                t0 = time.perf_counter()
                http.post("/v1/completions", json=body).raise_for_status()
                out["json_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                first = None
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - t0
                out["stream_first_s"].append(first or float("nan"))
                out["stream_end_s"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default="default", help="a model the server loads (default: the default pair's)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4, help="passes over the prompts per server")
    ap.add_argument("--rounds", type=int, default=2, help="each binding this many times, alternated")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[float]]] = {"nagle": {}, "nodelay": {}}
    for r in range(args.rounds):
        for binding in (("nagle", "nodelay") if r % 2 == 0 else ("nodelay", "nagle")):
            proc, url = start(binding, args.target)
            try:
                for k, v in measure(url, args.max_tokens, args.repeats).items():
                    results[binding].setdefault(k, []).extend(v)
            finally:
                stop(proc)
    summary = {b: {k: statistics.median(v) for k, v in m.items()} for b, m in results.items()}
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "host": socket.gethostname(), "summary": summary,
                                                       "samples": results}, indent=1))
    print(f"{'median (s)':<16}" + "".join(f"{k:>16}" for k in summary["nagle"]))
    for b, m in summary.items():
        print(f"{b:<16}" + "".join(f"{v:>16.4f}" for v in m.values()))


if __name__ == "__main__":
    main()
