"""The loadtest's server-overhead comparison: the c=1 level run through `engine.generate` in this
process (`run_inprocess`, timed like the HTTP requests) and its ratios to the HTTP c=1 level
(`inprocess_comparison`)."""
from __future__ import annotations

import time
from typing import Any, Sequence

from specwood.bench.load_requests import WARMUP_MESSAGES, WARMUP_TOKENS, Log, _stderr, finalize_record
from specwood.bench.load_stats import _fmt, _ratio, summarize_level
from specwood.bench.workload import Prompt
from specwood.engine.protocols import EngineLike
from specwood.errors import SpecwoodError


# ------------------------------------------------------------------------------------- in-process
def run_inprocess(engine: EngineLike, requests: Sequence[Prompt], methods: Sequence[str], max_tokens: int, *,
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


__all__ = ["run_inprocess", "inprocess_comparison"]
