"""The loadtest's maths: percentiles, tokens per chunk and per-token latencies, the numbers of one
(method, concurrency) level from its request records, and the speedups between levels (what they
mean: `specwood.bench.loadtest`'s module doc)."""
from __future__ import annotations

import math
from typing import Any, Sequence

AR = "ar"


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
    """The numbers of one (method, concurrency) level from its request records (see the module doc
    of `specwood.bench.loadtest`)."""
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
    modes = sorted({str(r["tokens_per_chunk"]) for r in good if r.get("tokens_per_chunk")})
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


def _fmt(x: Any, fmt: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{fmt}}{suffix}"


__all__ = ["percentile", "chunk_token_counts", "per_token_latencies", "summarize_level", "add_speedups"]
