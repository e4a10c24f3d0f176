"""The loadtest's requests: the request plan (prompts interleaved across categories, cycled), the
concurrency levels, the OpenAI request bodies, and one streaming request over HTTP, timed per chunk
into a request record (`stream_request`, `finalize_record`)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Callable, Sequence

from specwood.bench.load_stats import chunk_token_counts
from specwood.bench.workload import Prompt
from specwood.errors import SpecwoodError

WARMUP_MESSAGES = ({"role": "user", "content": "Say hello in one short sentence."},)
WARMUP_TOKENS = 16

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"specwood loadtest: {msg}", file=sys.stderr, flush=True)


def _require_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise SpecwoodError("specwood loadtest needs httpx (pip install httpx)") from None
    return httpx


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
                 continuous_usage: bool = True, cache_salt: str | None = None) -> tuple[str, dict[str, Any]]:
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
    if cache_salt:  # a cache scope of its own: nothing another request left (prefix K/V, answers) is reused
        body["cache_salt"] = cache_salt
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
                         continuous_usage: bool = True, cache_salt: str | None = None) -> dict[str, Any]:
    """Send one streaming request and time its chunks. Never raises for a failed request: the
    record gets an `error` (HTTP status and message, an error event in the stream, a timeout, a
    broken connection, no content)."""
    httpx = _require_httpx()
    path, body = request_body(prompt, method, max_tokens, model, messages, continuous_usage, cache_salt)
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


__all__ = ["stream_request", "plan_requests", "interleave", "parse_concurrency"]
