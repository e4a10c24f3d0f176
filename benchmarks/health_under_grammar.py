"""/health latency while the heaviest grammar requests we accept are admitted (issue 56, item 5).

A tiny random model with the default pair's real tokenizer (Qwen2.5's 151,665 tokens: a grammar
compiles against the real vocabulary) behind the real server on 127.0.0.1. Clients send tool
requests of 2 tools x 25 properties each with `n` = 8, each with schemas of its own (so every
request compiles), while a poller asks /health every 10 ms; the report gives /health's latency
(median, p99, max) and each tool request's latency. Compilation happens on worker threads
(`Engine.new_request` off the event loop), once per grammar and cache scope.

    python benchmarks/health_under_grammar.py [--requests 6] [--clients 2]
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import ServerThread  # noqa: E402

from specwood.engine.api import Engine  # noqa: E402
from specwood.models.config import ModelConfig  # noqa: E402
from specwood.models.loader import load_tokenizer  # noqa: E402
from specwood.models.registry import DEFAULT_TARGET  # noqa: E402
from specwood.models.transformer import Transformer  # noqa: E402
from specwood.serve.app import create_app, server_config  # noqa: E402


def heavy_body(i: int) -> dict:
    """2 tools x 25 properties, n = 8, named apart per request (each compiles afresh)."""
    def tool(t: int) -> dict:
        props = {f"field_{i}_{t}_{k}": ({"type": "string", "enum": [f"v{k}a", f"v{k}b"]} if k % 3 == 0 else
                                        {"type": "integer", "minimum": 0, "maximum": 999} if k % 3 == 1 else
                                        {"type": "string", "pattern": "^[a-z]{1,12}$"}) for k in range(25)}
        return {"type": "function", "function": {"name": f"tool_{i}_{t}", "parameters": {
            "type": "object", "properties": props, "required": list(props)}}}

    return {"messages": [{"role": "user", "content": f"Fill the form number {i}."}], "tools": [tool(0), tool(1)],
            "tool_choice": "required", "n": 8, "max_tokens": 4, "temperature": 0.7, "seed": i}


def serve_in_child(urls: "multiprocessing.Queue", stop: "multiprocessing.Event") -> None:
    """The server in a process of its own, as a deployment runs it (the clients' Python must not
    compete for its GIL)."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    vocab = max(len(tokenizer), 151_936)
    cfg = ModelConfig(arch="qwen2", vocab_size=vocab, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position_embeddings=4096, tie_embeddings=True, qkv_bias=True,
                      eos_token_ids=list(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])))
    torch.manual_seed(0)
    model = Transformer(cfg).eval().requires_grad_(False)
    engine = Engine(model, tokenizer, target_name="tiny-qwen-vocab")
    sched = engine.make_scheduler(server_config(max_batch=8, max_queue=64, kv_memory=256 << 20))
    srv = ServerThread(create_app(engine, sched, method="ar")).start()
    urls.put(srv.url)
    stop.wait()
    srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    urls, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve_in_child, args=(urls, stop))
    child.start()
    url = urls.get(timeout=300)
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                health.append(time.perf_counter() - t)
                time.sleep(0.01)

    latencies: list[float] = []
    lock = threading.Lock()
    todo = list(range(args.requests))

    def client() -> None:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                t = time.perf_counter()
                r = c.post("/v1/chat/completions", json=heavy_body(i))
                assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - t)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    quiet = len(health)
    workers = [threading.Thread(target=client) for _ in range(args.clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    poller.join()
    stop.set()
    child.join(60)
    loaded = sorted(health[quiet:])
    p99 = loaded[min(len(loaded) - 1, int(0.99 * len(loaded)))]
    print(f"{args.requests} tool requests (2 tools x 25 properties, n=8), {args.clients} clients: "
          f"request latency median {statistics.median(latencies):.2f} s, max {max(latencies):.2f} s")
    print(f"/health under them: {len(loaded)} polls, median {1e3 * statistics.median(loaded):.1f} ms, "
          f"p99 {1e3 * p99:.1f} ms, max {1e3 * loaded[-1]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
