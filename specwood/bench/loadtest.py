"""`specwood loadtest`: throughput and latency of the OpenAI-compatible server under concurrent load.

For every concurrency level c and every method, the same list of requests (the workload's prompts,
interleaved across categories, cycled to a fixed count) is sent to the server over HTTP by c
closed-loop streaming clients (asyncio + httpx): each client sends its next request as soon as its
previous one finished. Methods run on the same server, chosen per request by the non-standard
``"method"`` body field; levels are measured in turn (c1: m1, m2, ...; c2: m1, m2, ...), so a slow
drift of the machine hits every method alike. Each method gets one untimed warm-up request first.

Measured per request (client clock, ``time.perf_counter``):
- TTFT: request sent -> first SSE chunk with non-empty content;
- completion tokens: ``usage.completion_tokens`` of the final chunk (``stream_options.include_usage``);
- per-token latencies (TBT): the gap between consecutive content chunks divided by the tokens in the
  later chunk (a speculative step streams several tokens in one chunk). Tokens per chunk are exact
  when the server sends a cumulative ``usage`` in every chunk (requested with vLLM's
  ``stream_options.continuous_usage_stats``, which specwood serve honours), one per chunk when
  chunks = tokens, else estimated from each chunk's share of the text (the total is always the
  usage count);
- ITL: the raw gaps between content chunks;
- AAT: ``specwood_stats.mean_accepted_tokens`` of the final chunk.

Per level: decode tokens/s = sum over requests of (completion tokens - 1, the tokens after each
request's first) / wall time of the level (first request sent -> last response done); tokens/s =
all completion tokens / the same wall time; TTFT and TBT p50/p99 over all requests / tokens.
Speedups: a method at c vs the same method at the smallest c, and a method vs ``ar`` at the same c.

The driver is here: `LoadTest` runs the levels against any base URL, `execute` and `run_loadtest`
run it and write the outputs. The rest of the loadtest lives beside it: the maths in `load_stats`,
the requests and `stream_request` in `load_requests`, the outputs in `load_report`, the in-process
comparison in `load_inprocess`, and `server_process.ServerProcess`, which spawns ``specwood serve``
on a free port and always terminates it.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Sequence

from specwood.bench.load_report import assemble, build_meta, write_outputs
from specwood.bench.load_requests import (WARMUP_MESSAGES, WARMUP_TOKENS, Log, _require_httpx, _stderr,
                                          parse_concurrency, plan_requests, stream_request)
from specwood.bench.load_stats import _fmt, add_speedups, summarize_level
from specwood.bench.workload import Prompt, Workload
from specwood.errors import SpecwoodError

DEFAULT_CONCURRENCY = (1, 2, 4, 8)


# ------------------------------------------------------------------------------------------ driver
class LoadTest:
    """Runs `methods` x `concurrency` levels against a server at `base_url`; collects request
    records in `self.records` and level rows in `self.levels` as it goes (so an interrupted run
    still has everything that finished)."""

    def __init__(self, base_url: str, workload: Workload | Sequence[Prompt], methods: Sequence[str],
                 concurrency: Sequence[int] = DEFAULT_CONCURRENCY, *, max_tokens: int = 64,
                 n_requests: int | None = None, request_timeout: float = 600.0, warmup: bool = True,
                 warmup_timeout: float = 1800.0, max_total_requests: int = 2000, model: str | None = None,
                 continuous_usage: bool = True, idle_wait_s: float = 60.0, log: Log | None = _stderr,
                 progress: bool = True) -> None:
        if not isinstance(workload, Workload):
            workload = Workload(prompts=list(workload), source="(in memory)")
        self.workload = workload
        self.base_url = base_url.rstrip("/")
        self.methods = list(dict.fromkeys(m.strip() for m in methods if m and m.strip()))
        if not self.methods:
            raise SpecwoodError("no methods given (e.g. --methods ar,auto)")
        self.concurrency = parse_concurrency(concurrency)
        if max_tokens < 1:
            raise SpecwoodError(f"--max-tokens must be >= 1 (got {max_tokens})")
        for name, v in (("--request-timeout", request_timeout), ("--warmup-timeout", warmup_timeout)):
            if not v > 0:
                raise SpecwoodError(f"{name} must be > 0 seconds (got {v})")
        self.max_tokens = max_tokens
        self.requests = plan_requests(workload.prompts, self.concurrency, n_requests)
        total = len(self.requests) * len(self.methods) * len(self.concurrency)
        if total > max_total_requests:
            raise SpecwoodError(
                f"{total} requests planned ({len(self.requests)} per level x {len(self.methods)} methods x "
                f"{len(self.concurrency)} levels), over the limit of {max_total_requests}; lower --requests, "
                "--limit or the levels, or raise --max-total-requests")
        self.request_timeout = request_timeout
        self.warmup = warmup
        self.warmup_timeout = warmup_timeout
        self.model = model
        self.continuous_usage = continuous_usage
        self.idle_wait_s = idle_wait_s
        self.log = log or (lambda s: None)
        self.progress = progress
        self.records: list[dict[str, Any]] = []
        self.levels: list[dict[str, Any]] = []
        self.server_info: dict[str, Any] = {}

    def max_tokens_for(self, p: Prompt) -> int:
        own = getattr(p, "max_tokens", None)
        return int(own) if isinstance(own, int) and own > 0 else self.max_tokens

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        httpx = _require_httpx()
        limits = httpx.Limits(max_connections=max(self.concurrency) + 4,
                              max_keepalive_connections=max(self.concurrency) + 4)
        timeout = httpx.Timeout(max(self.request_timeout, self.warmup_timeout), connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            await self._probe(client)
            if self.warmup:
                for m in self.methods:
                    self.log(f"warm-up [{m}] ...")
                    t0 = time.perf_counter()
                    r = await stream_request(client, self.base_url, None, m, min(WARMUP_TOKENS, self.max_tokens),
                                             self.warmup_timeout, self.model, messages=WARMUP_MESSAGES,
                                             continuous_usage=self.continuous_usage)
                    if r.get("error"):
                        raise SpecwoodError(f"warm-up request for method '{m}' failed: {r['error']}")
                    self.log(f"warm-up [{m}] done in {time.perf_counter() - t0:.1f} s")
            for c in self.concurrency:
                for m in self.methods:
                    await self._level(client, m, c)

    async def _probe(self, client: Any) -> None:
        """Model id (for the `model` field) and server facts for the report; both optional."""
        for key, path in (("models", "/v1/models"), ("health", "/health")):
            try:
                r = await client.get(self.base_url + path, timeout=30.0)
                if r.status_code == 200:
                    self.server_info[key] = r.json()
            except Exception:  # a server without these endpoints can still be measured
                pass
        if self.model is None:
            models = self.server_info.get("models")
            data = models.get("data") if isinstance(models, dict) else None
            if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
                self.model = str(data[0]["id"])
        self.server_info["model"] = self.model

    async def _wait_idle(self, client: Any) -> None:
        """Before a level: wait (bounded) until the server reports no running or waiting request
        (GET /health with `running`/`waiting`, as specwood serve gives), so a request the client
        gave up on cannot slow down the next level. Servers without those fields: no wait."""
        deadline = time.monotonic() + self.idle_wait_s
        while True:
            try:
                r = await client.get(self.base_url + "/health", timeout=10.0)
                h = r.json() if r.status_code == 200 else {}
            except Exception:
                return
            busy = [h.get(k) for k in ("running", "waiting") if isinstance(h, dict)]
            if not all(isinstance(b, int) for b in busy) or not any(busy):
                return
            if time.monotonic() > deadline:
                self.log(f"the server still has {busy[0]} running / {busy[1]} waiting requests after "
                         f"{self.idle_wait_s:g} s; measuring anyway")
                return
            await asyncio.sleep(0.2)

    async def _level(self, client: Any, method: str, c: int) -> None:
        n = len(self.requests)
        tag = f"[{method} c={c}]"
        await self._wait_idle(client)
        self.log(f"{tag} {n} requests, {c} concurrent clients ...")
        todo = iter(enumerate(self.requests))
        records: list[dict[str, Any]] = []
        done = 0
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal done
            for i, p in todo:
                t_start = time.perf_counter()
                r = await stream_request(client, self.base_url, p, method, self.max_tokens_for(p),
                                         self.request_timeout, self.model, continuous_usage=self.continuous_usage)
                rec = {"method": method, "concurrency": c, "index": i, "id": p.id, "category": p.category,
                       "start_s": round(t_start - t0, 6), **r}
                records.append(rec)
                self.records.append(rec)
                done += 1
                if self.progress:
                    if rec.get("error"):
                        self.log(f"{tag} {done}/{n} {p.id} failed: {rec['error']}")
                    else:
                        aat = rec.get("mean_accepted_tokens")
                        self.log(f"{tag} {done}/{n} {p.id} ({p.category}): {rec['completion_tokens']} tokens, "
                                 f"TTFT {rec['ttft_s']:.2f} s, {rec['latency_s']:.2f} s"
                                 + (f", AAT {aat:.2f}" if isinstance(aat, (int, float)) else ""))

        await asyncio.gather(*(worker() for _ in range(min(c, n))))
        wall = time.perf_counter() - t0
        records.sort(key=lambda r: r["index"])
        row = {"method": method, "concurrency": c, **summarize_level(records, wall)}
        self.levels.append(row)
        self.log(f"{tag} done: {_fmt(row['decode_tokens_per_s'], '.1f')} decode tok/s, "
                 f"{_fmt(row['tokens_per_s'], '.1f')} tok/s, TTFT p50 {_fmt(row['ttft_s_p50'], '.2f')} s, "
                 f"TBT p50 {_fmt(row['tbt_ms_p50'], '.1f')} ms, AAT {_fmt(row['mean_accepted_tokens'], '.2f')}, "
                 f"{row['errors']} errors, {wall:.1f} s")

    def level_rows(self) -> list[dict[str, Any]]:
        rows = [dict(r) for r in self.levels]
        add_speedups(rows)
        order = {m: i for i, m in enumerate(self.methods)}
        rows.sort(key=lambda r: (order.get(r["method"], len(order)), r["concurrency"]))
        return rows


def execute(lt: LoadTest, out_dir: str | os.PathLike[str] | None = None,
            run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `lt` and (with `out_dir`) write results.json, report.md and loadtest.png; the outputs
    are written also when the run is interrupted or fails midway (meta.completed = false)."""
    t0 = time.perf_counter()
    completed = False
    try:
        lt.run()
        completed = True
    finally:
        meta = build_meta(lt, run_info)
        meta["completed"] = completed
        meta["elapsed_s"] = round(time.perf_counter() - t0, 3)
        result = assemble(lt, meta)
        if out_dir is not None and (lt.records or completed):
            write_outputs(out_dir, result)
    return result


def run_loadtest(base_url: str, workload: Workload | Sequence[Prompt], methods: Sequence[str],
                 concurrency: Sequence[int] = DEFAULT_CONCURRENCY, out_dir: str | os.PathLike[str] | None = None, *,
                 run_info: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Measure a running server at `base_url`: `LoadTest(...)` (kwargs: max_tokens, n_requests,
    request_timeout, warmup, warmup_timeout, max_total_requests, model, log, progress) + `execute`.
    Returns {"meta", "levels" (one row per method x concurrency, with speedups), "requests"}."""
    return execute(LoadTest(base_url, workload, methods, concurrency, **kwargs), out_dir, run_info)


__all__ = ["LoadTest", "run_loadtest", "execute"]
