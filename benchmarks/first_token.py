"""Time to first token of `auto` against `ar` over HTTP (issue 58 item 3: `auto`'s first token
as early as `ar`'s), for one or more source trees of specwood, servers alternated.

    python benchmarks/first_token.py --trees main=/work/main,ttft=/work/wt/ttft --rounds 2 --limit 12

Per round and tree (the trees' order alternating from round to round): one `specwood serve` on
the default pair (127.0.0.1, a free port, PYTHONPATH=the tree, no background plan), an untimed
warm-up request per method (auto's starter plan is timed then), then each short held-out prompt
(benchmarks/heldout_prompts.jsonl without the long-* categories) sent once with each "method"
(ar, auto, and dyspec, which always drafts with the model), one at a time, the order alternating
from prompt to prompt. Streaming chat
requests, greedy, asking for `max_tokens` tokens (128: auto weighs its draft's prefill by them);
each with a fresh `cache_salt`, so that no request reuses the K/V of another method's request on
the same prompt. TTFT: request sent to the first content chunk (client clock); the client then
leaves (the server cancels the rest), or with --to-end reads on: total, to the stream's end.
Reported per tree: TTFT p50 per method, its ratio to ar's and the median of the per-prompt ratios
to ar, and the same for the total time; the load average and the cores other processes used
(sampled idle before each server's start).
The servers inherit this environment (e.g. OMP_NUM_THREADS=1 on a crowded machine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

from specwood.bench.load_requests import _chunk_text, _require_httpx, interleave, request_body
from specwood.bench.server_process import ServerProcess, free_port, serve_command
from specwood.bench.workload import load_workload
from specwood.planner.machine import others_cores

REPO = Path(__file__).resolve().parent.parent


async def timed_request(client, base: str, prompt, method: str, max_tokens: int, to_end: bool = True) -> dict:
    # a fresh cache scope: nothing cached by the other method's request is reused
    path, body = request_body(prompt, method, max_tokens, None, continuous_usage=False, cache_salt=uuid.uuid4().hex)
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", base + path, json=body, timeout=600.0) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{method}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data:
                continue
            if data == "[DONE]":
                break
            if first is None and _chunk_text(json.loads(data)):
                first = time.perf_counter()
                if not to_end:  # the server cancels the rest when the client leaves
                    break
    end = time.perf_counter()
    if not to_end:
        await asyncio.sleep(0.3)  # the cancelled request leaves the server before the next one
    return {"method": method, "ttft_s": (first or end) - t0, "total_s": end - t0 if to_end else None}


async def one_server(tree: str, prompts, methods: list[str], max_tokens: int, round_no: int, log_dir: Path,
                     to_end: bool) -> list[dict]:
    httpx = _require_httpx()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree}
    with ServerProcess(serve_command(port, max_batch=8), f"http://127.0.0.1:{port}", env=env,
                       log_path=log_dir / f"server-{Path(tree).name}-{round_no}.log"):
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=None) as client:
            for method in methods:  # warm-up: kernels, auto's starter plan
                await timed_request(client, base, prompts[0], method, max_tokens)
            out = []
            for i, prompt in enumerate(prompts):
                order = methods if (i + round_no) % 2 == 0 else methods[::-1]
                for method in order:
                    rec = await timed_request(client, base, prompt, method, max_tokens, to_end)
                    out.append({**rec, "prompt": prompt.id})
    return out


def summary(recs: list[dict]) -> dict:
    """Per time (TTFT, total): each method's p50, and each other method's p50 and median paired
    (same prompt, same round) ratio to ar's."""
    methods = list(dict.fromkeys(r["method"] for r in recs))
    by = {m: {(r["prompt"], r.get("round")): r for r in recs if r["method"] == m} for m in methods}
    row: dict = {}
    for what in ("ttft_s", "total_s"):
        if any(r[what] is None for r in recs):
            continue
        p50 = {m: statistics.median(r[what] for r in by[m].values()) for m in methods}
        row[what] = {f"{m}_p50": round(p50[m], 4) for m in methods}
        for m in methods:
            if m != "ar":
                paired = [by[m][k][what] / by["ar"][k][what] for k in by["ar"] if k in by[m]]
                row[what][f"{m}/ar_p50"] = round(p50[m] / p50["ar"], 3)
                row[what][f"{m}/ar_paired_median"] = round(statistics.median(paired), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=f"this={REPO}", help="name=path,...: specwood source trees to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="what each request asks for (auto weighs its draft by it)")
    ap.add_argument("--to-end", action="store_true", help="read every answer to its end (total time too); "
                    "by default the client leaves after the first token")
    ap.add_argument("--methods", default="ar,auto,dyspec", help="ar first; dyspec always drafts with the model")
    ap.add_argument("--out", default=None, help="write every record and the summary as JSON here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the server is stopped on the way out
    trees = dict(item.split("=", 1) for item in a.trees.split(","))
    prompts = interleave([p for p in load_workload(str(REPO / "benchmarks" / "heldout_prompts.jsonl")).prompts
                          if not p.category.startswith("long-")])[:a.limit]
    log_dir = Path(a.out).parent if a.out else Path("/tmp")
    records: dict[str, list[dict]] = {name: [] for name in trees}
    machine: list[dict] = []
    for round_no in range(a.rounds):
        names = list(trees) if round_no % 2 == 0 else list(trees)[::-1]
        for name in names:
            machine.append({"round": round_no, "tree": name, "loadavg": os.getloadavg(),
                            "others_cores": others_cores(1.0)})
            recs = asyncio.run(one_server(trees[name], prompts, a.methods.split(","), a.max_tokens, round_no, log_dir,
                                          a.to_end))
            records[name] += [{**r, "round": round_no} for r in recs]
            print(f"round {round_no} {name}: {json.dumps(summary(recs))} (load {machine[-1]['loadavg'][0]:.2f}, "
                  f"others {machine[-1]['others_cores']})", file=sys.stderr, flush=True)
    result = {"summary": {name: summary(recs) for name, recs in records.items()}, "machine": machine,
              "prompts": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds, "records": records}
    print(json.dumps(result["summary"], indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
