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

The measuring core (`LoadTest`, `stream_request`) runs against any base URL; `ServerProcess`
spawns ``specwood serve`` on a free port and always terminates it.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

from specwood.bench.workload import Prompt, Workload
from specwood.errors import SpecwoodError

AR = "ar"
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello in one short sentence."},)
WARMUP_TOKENS = 16
PLOT_NAME = "loadtest.png"

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"specwood loadtest: {msg}", file=sys.stderr, flush=True)


def _require_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise SpecwoodError("specwood loadtest needs httpx (pip install httpx)") from None
    return httpx


# ------------------------------------------------------------------------------------------ maths
def percentile(xs: Sequence[float | None], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no data."""
    v = sorted(float(x) for x in xs if x is not None and not math.isnan(float(x)))
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _mean(xs: Sequence[float | None]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)]
    return sum(v) / len(v) if v else None


def chunk_token_counts(chars: Sequence[int], n_tokens: int | None,
                       exact: Sequence[int | None] | None = None) -> tuple[list[int], str]:
    """Tokens carried by each content chunk, and how they were found: "exact" (the server's
    cumulative per-chunk usage), "one-per-chunk" (chunks = tokens, or no usage to say otherwise)
    or "estimated" (the usage total split over the chunks in proportion to their text; the first
    chunk, the prefill's token, gets one when there are more tokens than chunks)."""
    k = len(chars)
    if k == 0:
        return [], "one-per-chunk"
    if exact is not None and len(exact) == k and all(isinstance(e, int) and e >= 0 for e in exact) \
            and (n_tokens is None or sum(exact) <= n_tokens):  # type: ignore[arg-type]
        counts = [int(e) for e in exact]  # type: ignore[arg-type]
        if n_tokens is not None:  # tokens after the last text (e.g. cut by a stop string) join the last chunk
            counts[-1] += n_tokens - sum(counts)
        return counts, "exact"
    if n_tokens is None or n_tokens == k:
        return [1] * k, "one-per-chunk"
    if k == 1:
        return [n_tokens], "exact"
    if n_tokens > k:  # several tokens per chunk: the first chunk holds the prefill's single token
        head, tail_chars, rest = [1], list(chars[1:]), n_tokens - 1
        floor_one = True
    else:  # fewer tokens than chunks (a token's text split over chunks): some chunks carry none
        head, tail_chars, rest = [], list(chars), n_tokens
        floor_one = False
    total = sum(max(0, c) for c in tail_chars)
    ideal = [rest * max(0, c) / total if total else rest / len(tail_chars) for c in tail_chars]
    counts = [max(1, int(x)) if floor_one else int(x) for x in ideal]
    while sum(counts) < rest:
        i = max(range(len(counts)), key=lambda j: ideal[j] - counts[j])
        counts[i] += 1
    while sum(counts) > rest:
        i = min((j for j in range(len(counts)) if counts[j] > (1 if floor_one else 0)),
                key=lambda j: ideal[j] - counts[j])
        counts[i] -= 1
    return head + counts, "estimated"


def per_token_latencies(chunk_s: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token latencies (s) after the first chunk: a chunk of k tokens arriving `gap` after the
    previous token-bearing chunk gives k values gap/k (the engine's own TBT definition)."""
    out: list[float] = []
    if not chunk_s:
        return out
    prev = chunk_s[0]
    for t, k in zip(chunk_s[1:], chunk_tokens[1:]):
        if k <= 0:  # its time folds into the next chunk that carries tokens
            continue
        out.extend([(t - prev) / k] * k)
        prev = t
    return out


def inter_chunk_gaps(chunk_s: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(chunk_s, chunk_s[1:])]


def request_ok(r: dict[str, Any]) -> bool:
    """A request that completed (it may have produced no token: an immediate end of sequence)."""
    return not r.get("error")


def summarize_level(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The numbers of one (method, concurrency) level from its request records (see the module doc)."""
    good = [r for r in records if request_ok(r)]
    tokens = sum(int(r["completion_tokens"]) for r in good)
    decode_tokens = sum(max(0, int(r["completion_tokens"]) - 1) for r in good)
    tbt: list[float] = []
    itl: list[float] = []
    for r in good:
        tbt += per_token_latencies(r.get("chunk_s") or [], r.get("chunk_tokens") or [])
        itl += inter_chunk_gaps(r.get("chunk_s") or [])
    ttft = [r.get("ttft_s") for r in good]  # None for a request without content
    lat = [r.get("latency_s") for r in good]
    modes = sorted({r.get("tokens_per_chunk") for r in good if r.get("tokens_per_chunk")})
    decisions: dict[str, int] = {}
    for r in good:
        if r.get("auto_decision"):
            decisions[r["auto_decision"]] = decisions.get(r["auto_decision"], 0) + 1

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1e3

    # decode-busy time: the union of the requests' first-to-last-token intervals, so the prefill of
    # a prompt no other request is decoding beside does not count as decode time (it does when
    # requests decode meanwhile: the server really stalls them)
    spans = sorted(tuple(r["decode_span"]) for r in good if r.get("decode_span"))
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return {
        "requests": len(records),
        "ok": len(good),
        "decode_busy_s": busy,
        "decode_busy_tokens_per_s": decode_tokens / busy if busy > 0 else None,
        "errors": len(records) - len(good),
        "wall_s": wall_s,
        "completion_tokens": tokens,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / wall_s if wall_s > 0 and tokens else None,
        "tokens_per_s": tokens / wall_s if wall_s > 0 and tokens else None,
        "ttft_s_p50": percentile(ttft, 50),
        "ttft_s_p99": percentile(ttft, 99),
        "tbt_ms_p50": ms(percentile(tbt, 50)),
        "tbt_ms_p99": ms(percentile(tbt, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "latency_s_p50": percentile(lat, 50),
        "latency_s_p99": percentile(lat, 99),
        "request_decode_tokens_per_s_mean": _mean([r.get("decode_tokens_per_s") for r in good]),
        "server_tokens_per_s_mean": _mean([r.get("server_tokens_per_s") for r in good]),
        "mean_accepted_tokens": _mean([r.get("mean_accepted_tokens") for r in good]),
        "tokens_per_chunk": ",".join(m for m in modes if m) or None,
        "auto_decisions": decisions or None,
    }


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 and a is not None:
        return a / b
    return None


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """In place: each row's aggregate tokens/s vs the same method at the smallest concurrency
    (`scaling`, and `e2e_scaling` on plain tokens/s) and vs `ar` at the same concurrency
    (`speedup_vs_ar`, `e2e_speedup_vs_ar`)."""
    idx = {(r["method"], r["concurrency"]): r for r in rows}
    for r in rows:
        base_c = min(x["concurrency"] for x in rows if x["method"] == r["method"])
        base = idx[(r["method"], base_c)]
        r["scaling_base_concurrency"] = base_c
        r["scaling"] = _ratio(r.get("decode_tokens_per_s"), base.get("decode_tokens_per_s"))
        r["e2e_scaling"] = _ratio(r.get("tokens_per_s"), base.get("tokens_per_s"))
        ar = idx.get((AR, r["concurrency"]))
        r["speedup_vs_ar"] = _ratio(r.get("decode_tokens_per_s"), ar.get("decode_tokens_per_s")) if ar else None
        r["e2e_speedup_vs_ar"] = _ratio(r.get("tokens_per_s"), ar.get("tokens_per_s")) if ar else None


# ---------------------------------------------------------------------------------------- requests
def interleave(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Round-robin over categories (a1, b1, c1, a2, b2, ...), each category in its own order."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    rank = 0
    while len(out) < len(prompts):
        for ps in by_cat.values():
            if rank < len(ps):
                out.append(ps[rank])
        rank += 1
    return out


def plan_requests(prompts: Sequence[Prompt], concurrency: Sequence[int], n_requests: int | None = None) -> list[Prompt]:
    """The one request list every level and every method runs: the prompts interleaved across
    categories, cycled to `n_requests` (default: max(#prompts, 2 x the largest concurrency), so the
    largest level keeps all its clients busy most of the time)."""
    if not prompts:
        raise SpecwoodError("the workload has no prompts to run (check --categories / --limit)")
    order = interleave(prompts)
    n = n_requests if n_requests is not None else max(len(order), 2 * max(concurrency))
    if n < 1:
        raise SpecwoodError(f"--requests must be at least 1 (got {n})")
    return [order[i % len(order)] for i in range(n)]


def parse_concurrency(spec: str | Sequence[int]) -> list[int]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[int] = []
    for x in items:
        s = str(x).strip()
        if not s:
            continue
        try:
            c = int(s)
        except ValueError:
            raise SpecwoodError(f"--concurrency takes comma-separated integers, e.g. 1,2,4,8 (got '{s}')") from None
        if c < 1:
            raise SpecwoodError(f"--concurrency levels must be >= 1 (got {c})")
        out.append(c)
    if not out:
        raise SpecwoodError("--concurrency is empty (e.g. --concurrency 1,2,4,8)")
    return sorted(set(out))


def _error_text(body: bytes, status: int) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
        elif isinstance(obj, dict) and obj.get("detail"):
            text = str(obj["detail"])
    except (json.JSONDecodeError, AttributeError):
        pass
    text = " ".join(text.split())
    return f"HTTP {status}: {text[:300]}" if text else f"HTTP {status}"


def request_body(prompt: Prompt | None, method: str | None, max_tokens: int, model: str | None,
                 messages: Sequence[dict[str, str]] | None = None,
                 continuous_usage: bool = True) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one greedy streaming request: chat prompts go to /v1/chat/completions,
    raw ones to /v1/completions. `continuous_usage` asks for vLLM's per-chunk usage (cumulative
    completion tokens in every chunk: exact tokens per chunk)."""
    opts: dict[str, Any] = {"include_usage": True}
    if continuous_usage:
        opts["continuous_usage_stats"] = True
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": opts}
    if model:
        body["model"] = model
    if method:
        body["method"] = method
    if prompt is not None and prompt.raw:
        body["prompt"] = prompt.content
        return "/v1/completions", body
    body["messages"] = list(messages) if messages is not None else prompt.content  # type: ignore[union-attr]
    return "/v1/chat/completions", body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    delta = c.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return c.get("text") or ""


def finalize_record(rec: dict[str, Any], t_send: float, t_end: float, times: list[float], chars: list[int],
                    usage_cum: list[int | None], usage: dict[str, Any] | None, stats: dict[str, Any] | None) -> None:
    """Fill a request record from what its stream delivered (times are perf_counter readings)."""
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    n = int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else None
    exact: list[int | None] | None = None
    if usage_cum and all(u is not None for u in usage_cum):
        exact = [u - (usage_cum[i - 1] if i else 0) for i, u in enumerate(usage_cum)]  # type: ignore[operator]
        if n is None:
            n = usage_cum[-1]
    if n is None:
        rec["usage_missing"] = True
        n = len(times)
    counts, mode = chunk_token_counts(chars, n, exact)
    chunk_s = [t - t_send for t in times]
    rec.update(
        decode_span=(times[0], times[-1]) if len(times) > 1 else None,  # absolute: for the busy time
        latency_s=t_end - t_send,
        ttft_s=chunk_s[0] if chunk_s else None,
        completion_tokens=n,
        chunks=len(times),
        chunk_s=[round(t, 6) for t in chunk_s],
        chunk_tokens=counts,
        tokens_per_chunk=mode,
        decode_tokens_per_s=(n - 1) / (chunk_s[-1] - chunk_s[0]) if n > 1 and len(chunk_s) > 1
        and chunk_s[-1] > chunk_s[0] else None,
    )
    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
    if isinstance(stats, dict):
        rec["mean_accepted_tokens"] = stats.get("mean_accepted_tokens")
        rec["server_tokens_per_s"] = stats.get("tokens_per_s")
        rec["server_ttft_s"] = stats.get("ttft_s")
        if stats.get("auto") is not None:  # what `auto` decided for this request (e.g. "ar", "dyspec")
            rec["auto_decision"] = str(stats["auto"])
        rec["specwood_stats"] = stats


async def stream_request(client: Any, base_url: str, prompt: Prompt | None, method: str | None, max_tokens: int,
                         timeout: float, model: str | None = None,
                         messages: Sequence[dict[str, str]] | None = None,
                         continuous_usage: bool = True) -> dict[str, Any]:
    """Send one streaming request and time its chunks. Never raises for a failed request: the
    record gets an `error` (HTTP status and message, an error event in the stream, a timeout, a
    broken connection, no content)."""
    httpx = _require_httpx()
    path, body = request_body(prompt, method, max_tokens, model, messages, continuous_usage)
    rec: dict[str, Any] = {"error": None}
    times: list[float] = []
    chars: list[int] = []
    usage_cum: list[int | None] = []
    usage: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    finish: str | None = None
    finished = False  # saw [DONE]
    final_usage = False  # saw the usage-only chunk (include_usage) that ends a stream
    t_send = time.perf_counter()
    t_end = t_send

    def parse(data: str) -> Any:
        """The event's JSON, DONE for [DONE], or None while a multi-line event is incomplete."""
        if data.strip() == "[DONE]":
            return DONE
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            return None

    def handle(chunk: Any, data: str, now: float) -> bool:
        nonlocal usage, stats, finish, final_usage
        if chunk is DONE:
            return True
        if not isinstance(chunk, dict):
            raise _StreamError(f"malformed SSE data: {data[:120]!r}")
        if chunk.get("error"):
            err = chunk["error"]
            raise _StreamError(f"error in stream: {err.get('message') if isinstance(err, dict) else err}")
        text = _chunk_text(chunk)
        u = chunk.get("usage")
        st = chunk.get("specwood_stats") or (u.get("specwood_stats") if isinstance(u, dict) else None)
        if isinstance(st, dict):
            stats = st
        choices = chunk.get("choices") or []
        if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
            finish = choices[0]["finish_reason"]
        if text:
            times.append(now)
            chars.append(len(text))
            usage_cum.append(int(u["completion_tokens"]) if isinstance(u, dict)
                             and isinstance(u.get("completion_tokens"), int) else None)
        if isinstance(u, dict):
            usage = u
            if not choices:
                final_usage = True
        return False

    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", base_url.rstrip("/") + path, json=body) as resp:
                if resp.status_code != 200:
                    raise _StreamError(_error_text(await resp.aread(), resp.status_code))
                data_lines: list[str] = []
                t_event = 0.0
                done = False
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if not data_lines:
                            t_event = now
                        data_lines.append(line[5:].lstrip(" "))
                        # OpenAI-style servers put each JSON event on one line: dispatch it at once
                        data = "\n".join(data_lines)
                        chunk = parse(data)
                        if chunk is None:
                            continue  # more data lines to come (or a malformed event: see below)
                        data_lines = []
                        if handle(chunk, data, t_event):
                            done = True
                            break
                    elif not line.strip() and data_lines:  # end of an event that did not parse
                        data = "\n".join(data_lines)
                        data_lines = []
                        if handle(parse(data), data, t_event):
                            done = True
                            break
                if data_lines and not done:
                    data = "\n".join(data_lines)
                    done = handle(parse(data), data, t_event)
                finished = done
                t_end = time.perf_counter()
    except _StreamError as e:
        rec["error"] = str(e)
    except TimeoutError:
        rec["error"] = f"timeout: no complete response within {timeout:g} s"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if rec["error"] is None and not (finished or final_usage or finish is not None):
        rec["error"] = "the stream ended early (no [DONE], usage or finish_reason)"
    if rec["error"] is not None:
        rec["latency_s"] = time.perf_counter() - t_send
        rec["completion_tokens"] = 0
        return rec
    rec["finish_reason"] = finish
    finalize_record(rec, t_send, t_end, times, chars, usage_cum, usage, stats)
    return rec


class _StreamError(Exception):
    pass


DONE = object()  # the [DONE] event


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


def _fmt(x: Any, fmt: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{fmt}}{suffix}"


# ------------------------------------------------------------------------------------- in-process
def run_inprocess(engine: Any, requests: Sequence[Prompt], methods: Sequence[str], max_tokens: int, *,
                  warmup: bool = True, log: Log | None = _stderr) -> list[dict[str, Any]]:
    """The c=1 level without HTTP: the same requests, one after another, through
    `engine.generate` in this process, timed the same way (chunks = the engine's text callbacks).
    Returns one level row per method (with `records`)."""
    log = log or (lambda s: None)
    rows = []
    for m in methods:
        if warmup:
            log(f"in-process warm-up [{m}] ...")
            engine.generate(list(WARMUP_MESSAGES), max_tokens=min(WARMUP_TOKENS, max_tokens), method=m,
                            temperature=0.0)
        records = []
        t0 = time.perf_counter()
        for i, p in enumerate(requests):
            times: list[float] = []
            chars: list[int] = []

            def on_text(s: str) -> None:
                if s:
                    times.append(time.perf_counter())
                    chars.append(len(s))

            rec: dict[str, Any] = {"method": m, "concurrency": 1, "index": i, "id": p.id, "category": p.category,
                                   "error": None}
            t_send = time.perf_counter()
            try:
                res = engine.generate(p.content, raw=p.raw, max_tokens=max_tokens, method=m, temperature=0.0,
                                      on_text=on_text)
            except SpecwoodError as e:
                rec.update(error=str(e), completion_tokens=0, latency_s=time.perf_counter() - t_send)
                records.append(rec)
                continue
            t_end = time.perf_counter()
            stats = dict(res.stats or {})
            finalize_record(rec, t_send, t_end, times, chars, [],
                            {"completion_tokens": len(res.token_ids), "prompt_tokens": stats.get("prompt_tokens")},
                            stats)
            rec["finish_reason"] = res.finish_reason
            records.append(rec)
        wall = time.perf_counter() - t0
        row = {"method": m, "concurrency": 1, **summarize_level(records, wall), "records": records}
        log(f"in-process [{m}]: {_fmt(row['decode_tokens_per_s'], '.1f')} decode tok/s, "
            f"{_fmt(row['tokens_per_s'], '.1f')} tok/s, {wall:.1f} s")
        rows.append(row)
    return rows


def inprocess_comparison(http_rows: Sequence[dict[str, Any]],
                         inproc_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: HTTP c=1 vs in-process aggregate tokens/s (ratio < 1 = server overhead)."""
    http = {r["method"]: r for r in http_rows if r["concurrency"] == 1}
    out = []
    for r in inproc_rows:
        h = http.get(r["method"]) or {}
        ratio = _ratio(h.get("decode_tokens_per_s"), r.get("decode_tokens_per_s"))
        out.append({
            "method": r["method"],
            "http_decode_tokens_per_s": h.get("decode_tokens_per_s"),
            "inprocess_decode_tokens_per_s": r.get("decode_tokens_per_s"),
            "decode_ratio": ratio,
            "overhead_pct": None if ratio is None else 100 * (1 - ratio),
            "http_tokens_per_s": h.get("tokens_per_s"),
            "inprocess_tokens_per_s": r.get("tokens_per_s"),
            "e2e_ratio": _ratio(h.get("tokens_per_s"), r.get("tokens_per_s")),
            "http_ttft_s_p50": h.get("ttft_s_p50"),
            "inprocess_ttft_s_p50": r.get("ttft_s_p50"),
            "http_tbt_ms_p50": h.get("tbt_ms_p50"),
            "inprocess_tbt_ms_p50": r.get("tbt_ms_p50"),
        })
    return out


# ---------------------------------------------------------------------------------- server process
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_command(port: int, *, host: str = "127.0.0.1", max_batch: int, target: str | None = None,
                  draft: str | None = None, dtype: str | None = None, draft_dtype: str | None = None,
                  max_context: int | None = None, max_queue: int | None = None, python: str | None = None) -> list[str]:
    """`specwood serve ...` run with this interpreter (the same installation as the loadtest). No
    plan is measured in the background: it would compete with the requests being timed."""
    cmd = [python or sys.executable, "-m", "specwood.cli", "serve", "--host", host, "--port", str(port),
           "--max-batch", str(max_batch), "--no-plan-in-background"]
    for flag, v in (("--target", target), ("--draft", draft), ("--dtype", dtype), ("--draft-dtype", draft_dtype),
                    ("--max-context", max_context), ("--max-queue", max_queue)):
        if v is not None:
            cmd += [flag, str(v)]
    return cmd


class ServerProcess:
    """A server subprocess (its own process group) that is ready once GET /health answers 200.
    Use as a context manager: it is terminated (SIGTERM, then SIGKILL) on exit, errors and
    interrupts alike. Its output goes to `log_path` (and the last lines into error messages)."""

    def __init__(self, cmd: Sequence[str], base_url: str, *, log_path: str | os.PathLike[str] | None = None,
                 startup_timeout: float = 900.0, log: Log | None = _stderr, env: dict[str, str] | None = None) -> None:
        self.cmd = list(cmd)
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.log = log or (lambda s: None)
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=30)
        self.saw_listening = False
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"starting server: {shlex.join(self.cmd)}")
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                         start_new_session=True, env=self.env)
        except OSError as e:
            raise SpecwoodError(f"could not start the server ({self.cmd[0]}): {e}") from None
        self._reader = threading.Thread(target=self._read, name="specwood-loadtest-server-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        f = open(self.log_path, "w", encoding="utf-8") if self.log_path else None
        try:
            for line in self.proc.stdout:
                if f:
                    f.write(line)
                    f.flush()
                line = line.rstrip("\n")
                if line.strip():
                    self.tail.append(line)
                if "listening on http" in line:
                    self.saw_listening = True
        except (OSError, ValueError):
            pass
        finally:
            if f:
                f.close()

    def _last_line(self) -> str:
        lines = [ln for ln in self.tail if ln.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def wait_ready(self) -> None:
        httpx = _require_httpx()
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        where = f" (log: {self.log_path})" if self.log_path else ""
        while True:
            code = self.proc.poll()
            if code is not None:
                if self._reader:
                    self._reader.join(timeout=2)
                raise SpecwoodError(f"the server exited with code {code} before it was ready: "
                                    f"{self._last_line()}{where}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False)
                if r.status_code == 200:
                    self.log(f"server ready at {self.base_url}")
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SpecwoodError(f"the server was not ready within {self.startup_timeout:g} s "
                                    f"(GET {self.base_url}/health); last output: {self._last_line()}{where}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 15.0) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                p.wait(timeout=10)
        else:
            self._signal(signal.SIGKILL)  # stray children of an exited server, if any
        if self._reader:
            self._reader.join(timeout=5)
        if p.stdout:
            try:
                p.stdout.close()
            except OSError:
                pass

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        try:
            if hasattr(os, "killpg"):
                os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            else:  # pragma: no cover - not POSIX
                self.proc.terminate() if sig == signal.SIGTERM else self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass


# ----------------------------------------------------------------------------------------- outputs
def machine_summary() -> dict[str, Any]:
    """The machine the loadtest ran on (the server's too when it was spawned here)."""
    from specwood.bench.harness import _cpu_flags, _cpu_model

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu_model": _cpu_model(), "cpu_cores_logical": os.cpu_count(), "cpu_cores_usable": usable,
                            "cpu_flags": _cpu_flags(), "memory_gib": mem, "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    info["summary"] = (f"{info['cpu_model']}, {usable} usable cores, {mem} GiB RAM"
                       + (f", torch {info['torch']}" if info.get("torch") else "")
                       + (f", GPU {info['gpu']}" if info.get("gpu") else ""))
    return info


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else round(x, 6)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def build_meta(lt: LoadTest, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    info = dict(run_info or {})
    wl = lt.workload
    cats = list(dict.fromkeys(p.category for p in wl.prompts))
    meta: dict[str, Any] = {
        "command": info.pop("command", None) or shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "machine": machine_summary(),
        "server": {"url": lt.base_url, **lt.server_info, **(info.pop("server", None) or {})},
        "methods": lt.methods,
        "concurrency": lt.concurrency,
        "max_tokens": lt.max_tokens,
        "sampling": {"temperature": 0.0},
        "requests_per_level": len(lt.requests),
        "request_ids": [p.id for p in lt.requests],
        "request_timeout_s": lt.request_timeout,
        "continuous_usage_stats": lt.continuous_usage,
        "warmup": {"enabled": lt.warmup, "messages": list(WARMUP_MESSAGES),
                   "max_tokens": min(WARMUP_TOKENS, lt.max_tokens)},
        "workload": {
            "source": wl.source,
            "n_prompts": len(wl.prompts),
            "categories": {c: sum(p.category == c for p in wl.prompts) for c in cats},
            "notes": list(wl.notes),
            "summary": f"{wl.source}: {len(wl.prompts)} prompts in {len(cats)} categories, interleaved; "
                       f"{len(lt.requests)} requests per level (the same for every level and method)",
        },
    }
    meta.update(info)
    return meta


def _model_line(server: dict[str, Any]) -> str | None:
    model = server.get("model")
    data = (server.get("models") or {}).get("data") if isinstance(server.get("models"), dict) else None
    info = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    extra = [f"{k} {info[k]}" for k in ("draft", "default_method", "max_model_len") if info.get(k) is not None]
    return f"{model} ({', '.join(extra)})" if model and extra else model


def markdown_report(result: dict[str, Any], plots: Sequence[str] = ()) -> str:
    meta = result.get("meta") or {}
    rows = result.get("levels") or []
    server = meta.get("server") or {}
    out = ["# specwood loadtest", ""]
    info = [
        ("date", meta.get("date")),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
        ("server", (f"spawned: `{server['command']}`" if server.get("command") else f"{server.get('url')} (given)")),
        ("model", _model_line(server)),
        ("machine", (meta.get("machine") or {}).get("summary")),
        ("workload", (meta.get("workload") or {}).get("summary")),
        ("max tokens", meta.get("max_tokens")),
        ("sampling", "greedy (temperature 0), streaming (SSE) with usage"),
        ("concurrency", ", ".join(str(c) for c in meta.get("concurrency") or [])),
        ("elapsed", f"{meta['elapsed_s']:.0f} s" if isinstance(meta.get("elapsed_s"), (int, float)) else None),
    ]
    out += [f"- {k}: {v}" for k, v in info if v not in (None, "")]
    if meta.get("completed") is False:
        out.append("- **incomplete run** (interrupted or failed): the numbers cover the levels that finished")
    has_ar = any(r["method"] == AR for r in rows)
    bases = {r.get("scaling_base_concurrency") for r in rows}
    base_label = f"c={bases.pop()}" if len(bases) == 1 else "c=min"
    head = ["method", "c", "requests", "errors", "decode tok/s", "busy decode tok/s", "tok/s", f"x {base_label}"]
    if has_ar:
        head.append("x ar")
    head += ["TTFT p50 s", "TTFT p99 s", "TBT p50 ms", "TBT p99 ms", "ITL p50 ms", "AAT", "tokens", "wall s"]
    has_auto = any(r.get("auto_decisions") for r in rows)
    if has_auto:
        head.append("auto chose")
    out += ["", "## results", "", "| " + " | ".join(head) + " |",
            "|" + "|".join("---" if h in ("method", "auto chose") else "---:" for h in head) + "|"]
    for r in rows:
        cells = [r["method"], str(r["concurrency"]), str(r["requests"]), str(r["errors"]),
                 _fmt(r.get("decode_tokens_per_s"), ".1f"), _fmt(r.get("decode_busy_tokens_per_s"), ".1f"),
                 _fmt(r.get("tokens_per_s"), ".1f"), _fmt(r.get("scaling"), ".2f", "x")]
        if has_ar:
            cells.append(_fmt(r.get("speedup_vs_ar"), ".2f", "x"))
        cells += [_fmt(r.get("ttft_s_p50"), ".3f"), _fmt(r.get("ttft_s_p99"), ".3f"), _fmt(r.get("tbt_ms_p50"), ".1f"),
                  _fmt(r.get("tbt_ms_p99"), ".1f"), _fmt(r.get("itl_ms_p50"), ".1f"),
                  _fmt(r.get("mean_accepted_tokens"), ".2f"), str(r.get("completion_tokens", 0)),
                  _fmt(r.get("wall_s"), ".1f")]
        if has_auto:
            cells.append(", ".join(f"{k} x{v}" for k, v in (r.get("auto_decisions") or {}).items()))
        out.append("| " + " | ".join(cells) + " |")
    levels = sorted({r["concurrency"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    idx = {(r["method"], r["concurrency"]): r for r in rows}
    if rows:
        out += ["", f"## scaling: aggregate decode tok/s at c / the same method's at {base_label}", "",
                "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
        for m in methods:
            out.append(f"| {m} | " + " | ".join(_fmt((idx.get((m, c)) or {}).get("scaling"), ".2f", "x")
                                                 for c in levels) + " |")
    others = [m for m in methods if m != AR]
    if has_ar and others:
        out += ["", "## speedup vs ar: aggregate decode tok/s / ar's at the same c (e2e: plain tok/s)", "",
                "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
        for m in others:
            cells = []
            for c in levels:
                r = idx.get((m, c)) or {}
                cells.append(f"{_fmt(r.get('speedup_vs_ar'), '.2f', 'x')} "
                             f"(e2e {_fmt(r.get('e2e_speedup_vs_ar'), '.2f', 'x')})")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    comp = result.get("inprocess_comparison")
    if comp:
        out += ["", "## server overhead: HTTP c=1 vs `engine.generate` in the loadtest's process, same requests", "",
                "| method | HTTP decode tok/s | in-process decode tok/s | HTTP / in-process | HTTP tok/s | "
                "in-process tok/s | e2e ratio | TTFT p50 s HTTP / in-process | TBT p50 ms HTTP / in-process |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in comp:
            out.append(" | ".join([
                f"| {r['method']}", _fmt(r.get("http_decode_tokens_per_s"), ".2f"),
                _fmt(r.get("inprocess_decode_tokens_per_s"), ".2f"), _fmt(r.get("decode_ratio"), ".3f"),
                _fmt(r.get("http_tokens_per_s"), ".2f"), _fmt(r.get("inprocess_tokens_per_s"), ".2f"),
                _fmt(r.get("e2e_ratio"), ".3f"),
                f"{_fmt(r.get('http_ttft_s_p50'), '.3f')} / {_fmt(r.get('inprocess_ttft_s_p50'), '.3f')}",
                f"{_fmt(r.get('http_tbt_ms_p50'), '.1f')} / {_fmt(r.get('inprocess_tbt_ms_p50'), '.1f')}",
            ]) + " |")
    notes = [
        "c: concurrent streaming clients, each sending its next request when the previous one is done; every "
        "level and method runs the same request list.",
        "decode tok/s: sum over requests of (completion tokens - 1) / wall time of the level (first request sent "
        "to last response done); tok/s: all completion tokens / the same wall time; busy decode tok/s: the same "
        "tokens / the time at least one request was between its first and last token (a prefill while nothing "
        "decodes does not count; one while others decode does).",
        "TTFT: request sent to the first chunk with content (client clock). TBT: per-token latency, the gap "
        "between content chunks / the tokens in the later chunk (p50/p99 over all tokens of the level); "
        "ITL: the raw gaps between content chunks.",
        f"x {base_label}: aggregate decode tok/s / the same method's at the smallest level; x ar: / ar's at the "
        "same c (greedy and lossless: the methods generate the same tokens, so these are ratios of wall time).",
        "AAT: mean over requests of the server's specwood_stats.mean_accepted_tokens (tokens per target "
        "verification step).",
    ]
    if any(r.get("auto_decisions") for r in rows):
        notes.append("auto chose: the decoding `auto` picked per request (specwood_stats.auto), with counts.")
    modes = {m for r in rows for m in str(r.get("tokens_per_chunk") or "").split(",") if m}
    if "estimated" in modes:
        notes.append("tokens per chunk were estimated for some requests (the server's usage gives only the "
                     "total): TBT splits each chunk's gap over its estimated tokens.")
    out += [""] + [f"_{n}_" for n in notes]
    for n in (meta.get("workload") or {}).get("notes") or []:
        out.append(f"\n> note: {n}")
    errs = [r for r in result.get("requests") or [] if r.get("error")]
    if errs:
        out += ["", "## errors", ""] + [f"- {r['method']} c={r['concurrency']} {r['id']}: {r['error']}"
                                       for r in errs[:50]]
        if len(errs) > 50:
            out.append(f"- ... and {len(errs) - 50} more (results.json)")
    if plots:
        out += ["", "## plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


def make_plot(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Aggregate decode tok/s vs concurrency (left) and TBT p50 vs concurrency (right), per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(121), fig.add_subplot(122)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["concurrency"])
        for ax, key in ((ax1, "decode_tokens_per_s"), (ax2, "tbt_ms_p50")):
            pts = [(r["concurrency"], r[key]) for r in rs if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    for ax, title, ylabel in ((ax1, "Aggregate decode throughput", "tokens/s (all clients)"),
                              (ax2, "Per-token latency (TBT p50)", "ms per token")):
        if len(levels) > 1 and levels[-1] / levels[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if methods:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_outputs(out_dir: str | os.PathLike[str], result: dict[str, Any]) -> str:
    """results.json, the PNG plot (when some level has numbers) and report.md; returns the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    rows = result.get("levels") or []
    notes = (result.setdefault("meta", {}).setdefault("workload", {})).setdefault("notes", [])
    if any(r.get("decode_tokens_per_s") is not None or r.get("tbt_ms_p50") is not None for r in rows):
        try:
            plots.append(str(make_plot(rows, out / PLOT_NAME)))
        except ImportError:
            if "plots skipped: matplotlib is not installed" not in notes:
                notes.append("plots skipped: matplotlib is not installed")
    result["meta"]["outputs"] = ["results.json", "report.md", *[Path(p).name for p in plots]]
    (out / "results.json").write_text(json.dumps(_jsonable(result), indent=1, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
    md = markdown_report(result, plots)
    (out / "report.md").write_text(md, encoding="utf-8")
    return md


def assemble(lt: LoadTest, meta: dict[str, Any],
             inprocess_rows: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    rows = lt.level_rows()
    result: dict[str, Any] = {"meta": meta, "levels": rows, "requests": list(lt.records)}
    if inprocess_rows:
        result["inprocess"] = [{k: v for k, v in r.items() if k != "records"} for r in inprocess_rows]
        result["inprocess_requests"] = [rec for r in inprocess_rows for rec in r.get("records", [])]
        result["inprocess_comparison"] = inprocess_comparison(rows, inprocess_rows)
    return result


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


__all__ = ["LoadTest", "ServerProcess", "run_loadtest", "run_inprocess", "stream_request", "summarize_level",
           "percentile", "chunk_token_counts", "per_token_latencies", "plan_requests", "interleave",
           "parse_concurrency", "serve_command", "free_port", "write_outputs", "markdown_report", "make_plot",
           "add_speedups", "inprocess_comparison", "assemble", "build_meta", "execute"]
