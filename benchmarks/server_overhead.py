"""Server overhead at concurrency 1, measured fairly: the same request over HTTP (a `specwood serve`
subprocess) and through `engine.generate` in this process, ALTERNATED request by request.

Why alternate: on a shared VM the machine's speed drifts by a third within a minute (another
guest on the same physical cores), so two runs one after the other (the loadtest's `--inprocess`)
can differ for reasons that have nothing to do with the server. Pairs taken seconds apart see the
same machine. Both sides are idle while the other runs (the server's scheduler thread sleeps).

    python benchmarks/server_overhead.py --limit 6 --max-tokens 64 --method ar
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

import specwood
from specwood.bench.load_inprocess import run_inprocess
from specwood.bench.load_requests import _require_httpx, interleave, stream_request
from specwood.bench.server_process import ServerProcess, free_port, serve_command
from specwood.bench.workload import load_workload


async def http_one(base: str, prompt, method: str, max_tokens: int, model: str) -> dict:
    httpx = _require_httpx()
    async with httpx.AsyncClient(timeout=None) as client:
        return await stream_request(client, base, prompt, method, max_tokens, timeout=600.0, model=model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    a = ap.parse_args()
    prompts = interleave([p for p in load_workload("builtin").prompts if not p.category.startswith("long-")])[:a.limit]
    engine = specwood.load(progress=False, max_context=4096)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pairs: list[tuple[float, float]] = []
    inside: list[float] = []  # the server's own tokens/s over in-process
    # serve_command: no plan building in the background (it would run while the in-process side decodes)
    cmd = serve_command(port, max_batch=a.max_batch, max_context=4096) + ["--method", a.method]
    with ServerProcess(cmd, base, log=None):
        model = str(engine.target_name)
        asyncio.run(http_one(base, prompts[0], a.method, 8, model))  # warm-up, both sides
        run_inprocess(engine, prompts[:1], [a.method], 8, warmup=False, log=None)
        for rnd in range(a.rounds):
            for i, p in enumerate(prompts):
                order = ("http", "local") if (i + rnd) % 2 == 0 else ("local", "http")
                got = {}
                for side in order:
                    if side == "http":
                        rec = asyncio.run(http_one(base, p, a.method, a.max_tokens, model))
                        if rec.get("error"):
                            raise SystemExit(f"{p.id}: {rec['error']}")
                        # the server's own clock: its decode steps, without delivery
                        got["server"] = rec.get("server_tokens_per_s") or float("nan")
                    else:
                        rec = run_inprocess(engine, [p], [a.method], a.max_tokens, warmup=False,
                                            log=None)[0]["records"][0]
                    got[side] = rec["decode_tokens_per_s"]
                pairs.append((got["http"], got["local"]))
                inside.append(got["server"] / got["local"])
                print(f"round {rnd} {p.id}: HTTP {got['http']:.2f} (server's own clock {got['server']:.2f}) / "
                      f"in-process {got['local']:.2f} decode tok/s = {got['http'] / got['local']:.3f}",
                      file=sys.stderr, flush=True)
    ratios = [h / loc for h, loc in pairs]
    print(f"\n{a.method}, {len(pairs)} alternated pairs, {a.max_tokens} new tokens: HTTP "
          f"{statistics.mean(h for h, _ in pairs):.2f} vs in-process {statistics.mean(loc for _, loc in pairs):.2f} "
          f"decode tok/s; per-pair ratio mean {statistics.mean(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; the server's own clock over in-process: median "
          f"{statistics.median(inside):.3f} (below 1: the decode steps themselves are slower in the server)")


if __name__ == "__main__":
    main()
