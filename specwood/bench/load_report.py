"""The loadtest's outputs: the run's metadata (machine, server, workload), the result dict, and
what is written into --out: results.json, report.md and the loadtest.png plot."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from specwood.bench.load_inprocess import inprocess_comparison
from specwood.bench.load_requests import WARMUP_MESSAGES, WARMUP_TOKENS
from specwood.bench.load_stats import AR, _fmt

if TYPE_CHECKING:  # the driver imports this module
    from specwood.bench.loadtest import LoadTest

PLOT_NAME = "loadtest.png"


# ----------------------------------------------------------------------------------------- outputs
def machine_summary() -> dict[str, Any]:
    """The machine the loadtest ran on (the server's too when it was spawned here)."""
    from specwood.bench.harness import _cpu_flags, _cpu_model

    try:
        usable: int | None = len(os.sched_getaffinity(0))
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


__all__ = ["write_outputs", "markdown_report", "make_plot", "assemble", "build_meta"]
