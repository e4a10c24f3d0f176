"""Aggregate benchmark records into a markdown report and PNG plots.

Conventions (kept in one place so the table, the plots and the tests agree):
- tokens/s of a generation = decode throughput (tokens after the first / time after the first, the
  engine's definition); e2e tokens/s = all new tokens / wall time of the whole call.
- tokens/s of a group = mean over its prompts (every prompt weighs the same, whatever its length).
- speedup of method M over baseline B in a group = mean tokens/s of M / mean tokens/s of B, both
  over the prompts of the group that BOTH have a value ("ratio of tokens/s on the same prompts").
- AAT = mean over prompts of `mean_accepted_tokens` (tokens emitted per target verification step).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

OVERALL = "overall"
AR = "ar"
BASELINES = ("hf", "hf-assisted", "llama.cpp")  # "vs X" columns appear when X ran


def ok(r: dict[str, Any]) -> bool:
    """A generation that ran (it may still lack a decode rate, e.g. when it emitted one token)."""
    return not r.get("error") and bool(r.get("new_tokens"))


def _pos(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 and not math.isnan(x)


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def ordered_unique(xs: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(xs))


def _by_key(records: Sequence[dict[str, Any]], method: str, category: str | None) -> dict[str, dict[str, Any]]:
    """Successful records of one method (and category; None = all), keyed by prompt id."""
    return {r["id"]: r for r in records
            if r["method"] == method and (category is None or r["category"] == category) and ok(r)}


def speedup(records: Sequence[dict[str, Any]], method: str, baseline: str,
            category: str | None = None, key: str = "tokens_per_s") -> float | None:
    """Mean `key` of `method` over mean `key` of `baseline`, on the prompts where both have it."""
    a, b = _by_key(records, method, category), _by_key(records, baseline, category)
    common = [k for k in a if k in b and _pos(a[k].get(key)) and _pos(b[k].get(key))]
    if not common:
        return None
    num = _mean(a[k][key] for k in common)
    den = _mean(b[k][key] for k in common)
    return num / den if num is not None and den else None


def _strip_eos(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


def ar_for(method: str, methods: Sequence[str]) -> str:
    """The ar row a method's output must equal: 'ar@B' for a 'NAME@B' row when it ran, else 'ar'."""
    name, _, backend = str(method).rpartition("@")
    own = f"{AR}@{backend}"
    return own if name and own in methods else AR


def agreement(records: Sequence[dict[str, Any]], method: str, category: str | None = None,
              baseline: str = AR, eos: Sequence[int] = ()) -> tuple[int, int] | None:
    """(prompts whose tokens equal the baseline's, prompts compared); a trailing EOS is ignored
    because engines differ in whether they return it."""
    a, b = _by_key(records, method, category), _by_key(records, baseline, category)
    common = [k for k in a if k in b]
    if not common:
        return None
    same = sum(_strip_eos(a[k].get("token_ids") or [], eos) == _strip_eos(b[k].get("token_ids") or [], eos)
               for k in common)
    return same, len(common)


def summary_rows(records: Sequence[dict[str, Any]], *, greedy: bool = True,
                 eos: Sequence[int] = ()) -> list[dict[str, Any]]:
    """One row per (category, method) plus an 'overall' row per method, as plain numbers."""
    methods = ordered_unique(r["method"] for r in records)
    categories = ordered_unique(r["category"] for r in records)
    rows: list[dict[str, Any]] = []
    for cat in [*categories, OVERALL]:
        c = None if cat == OVERALL else cat
        for m in methods:
            rs = [r for r in records if r["method"] == m and (c is None or r["category"] == c)]
            if not rs:
                continue
            good = [r for r in rs if ok(r)]
            row: dict[str, Any] = {
                "category": cat,
                "method": m,
                "n": len(good),
                "errors": len(rs) - len(good),
                "tokens_per_s": _mean(r.get("tokens_per_s") for r in good),
                "e2e_tokens_per_s": _mean(r.get("e2e_tokens_per_s") for r in good),
                "new_tokens": _mean(r.get("new_tokens") for r in good),
                "ttft_s": _mean(r.get("ttft_s") for r in good),
                "prefill_tokens_per_s": _mean(r.get("prefill_tokens_per_s") for r in good),
                "tbt_ms_p50": _mean(r.get("tbt_ms_p50") for r in good),
                "mean_accepted_tokens": _mean(r.get("mean_accepted_tokens") for r in good),
                "acceptance_rate": _mean(r.get("acceptance_rate") for r in good),
                "speedup_vs_ar": speedup(records, m, AR, c) if AR in methods else None,
                "e2e_speedup_vs_ar": speedup(records, m, AR, c, "e2e_tokens_per_s") if AR in methods else None,
            }
            for base in BASELINES:
                if base in methods:
                    row[f"vs_{base}"] = speedup(records, m, base, c)
            if greedy and ar_for(m, methods) in methods and m != ar_for(m, methods):
                row["same_as_ar"] = agreement(records, m, c, baseline=ar_for(m, methods), eos=eos)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- markdown
def _f(x: Any, fmt: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{fmt}}{suffix}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    methods = ordered_unique(r["method"] for r in rows)
    has_ar = AR in methods
    bases = [b for b in BASELINES if b in methods]
    has_agree = any("same_as_ar" in r for r in rows)
    has_acc = any(r.get("acceptance_rate") is not None for r in rows)
    has_err = any(r.get("errors") for r in rows)
    head = ["category", "method", "n", "tokens/s"]
    if has_ar:
        head.append("speedup vs ar")
    head += [f"vs {b}" for b in bases]
    head += ["AAT"] + (["accept rate"] if has_acc else []) + ["e2e tok/s"]
    if has_ar:
        head.append("e2e speedup")
    head += ["TTFT s", "prefill tok/s", "TBT p50 ms", "new tokens"]
    if has_agree:
        head.append("= ar (greedy)")
    if has_err:
        head.append("errors")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        cat = f"**{r['category']}**" if r["category"] == OVERALL else r["category"]
        cells = [cat, r["method"], str(r["n"]), _f(r["tokens_per_s"], ".1f")]
        if has_ar:
            cells.append(_f(r.get("speedup_vs_ar"), ".2f", "x"))
        cells += [_f(r.get(f"vs_{b}"), ".2f", "x") for b in bases]
        cells.append(_f(r.get("mean_accepted_tokens"), ".2f"))
        if has_acc:
            cells.append(_f(None if r.get("acceptance_rate") is None else 100 * r["acceptance_rate"], ".0f", "%"))
        cells.append(_f(r.get("e2e_tokens_per_s"), ".1f"))
        if has_ar:
            cells.append(_f(r.get("e2e_speedup_vs_ar"), ".2f", "x"))
        cells += [_f(r.get("ttft_s"), ".3f"), _f(r.get("prefill_tokens_per_s"), ".1f"), _f(r.get("tbt_ms_p50"), ".1f"),
                  _f(r.get("new_tokens"), ".0f")]
        if has_agree:
            ag = r.get("same_as_ar")
            cells.append("" if r["method"] == AR else ("–" if ag is None else f"{ag[0]}/{ag[1]}"))
        if has_err:
            cells.append(str(r.get("errors", 0)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speedup_pivot(rows: Sequence[dict[str, Any]]) -> str | None:
    """Compact view: speedup vs ar, methods x categories."""
    if not any(r["method"] == AR for r in rows):
        return None
    cats = ordered_unique(r["category"] for r in rows)
    methods = [m for m in ordered_unique(r["method"] for r in rows) if m != AR]
    if not methods:
        return None
    idx = {(r["category"], r["method"]): r for r in rows}
    lines = ["| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for m in methods:
        cells = [_f((idx.get((c, m)) or {}).get("speedup_vs_ar"), ".2f", "x") for c in cats]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(records: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None,
                    plots: Sequence[str] = ()) -> str:
    meta = meta or {}
    sampling = meta.get("sampling") or {}
    greedy = not sampling.get("temperature")
    rows = summary_rows(records, greedy=greedy, eos=meta.get("eos_token_ids") or ())
    out = ["# specwood bench", ""]
    info = [
        ("date", meta.get("date")),
        ("target", meta.get("target")),
        ("draft", meta.get("draft")),
        ("dtype / device", " / ".join(str(x) for x in (meta.get("dtype"), meta.get("device")) if x)),
        ("machine", (meta.get("machine") or {}).get("summary")),
        ("workload", (meta.get("workload") or {}).get("summary")),
        ("max tokens", meta.get("max_tokens")),
        ("sampling", ", ".join(f"{k}={v}" for k, v in sampling.items() if v is not None) or None),
        ("method options", ", ".join(f"{k}={v}" for k, v in (meta.get("method_options") or {}).items()) or None),
    ]
    out += [f"- {k}: {v}" for k, v in info if v not in (None, "")]
    if meta.get("completed") is False:
        out.append("- **incomplete run** (interrupted): numbers cover the generations that finished")
    out += ["", markdown_table(rows), ""]
    notes = [
        "tokens/s: decode throughput (tokens after the first / time after the first token), mean over prompts; "
        "e2e tok/s: new tokens / wall time of the whole call (tokenising, prefill, decode).",
    ]
    if (meta.get("repeats") or 1) > 1:
        notes.append(f"each prompt ran {meta['repeats']} times with every method, the methods in a rotated order; "
                     "each figure is from the run with the median decode rate (all rates: results.json, "
                     "`tokens_per_s_runs`).")
    if any(r["method"] == AR for r in rows):
        notes.append("speedup: mean tokens/s of the method / mean tokens/s of `ar` on the same prompts, same run "
                     "(e2e speedup: the same with e2e tok/s).")
    notes.append("AAT: mean tokens emitted per target verification step (for hf-assisted/hf-pld: per assisted step).")
    if greedy and any("same_as_ar" in r for r in rows):
        notes.append("= ar: prompts whose greedy output is token-identical to `ar` (lossless check).")
    out += [f"_{n}_" for n in notes]
    pivot = speedup_pivot(rows)
    if pivot:
        out += ["", "## speedup vs ar", "", pivot]
    for n in (meta.get("workload") or {}).get("notes") or []:
        out.append(f"\n> note: {n}")
    varied = [r for r in records if r.get("same_tokens_every_run") is False]
    if varied:
        out += ["", "## outputs that changed between repeats", ""] + [f"- {r['id']} / {r['method']}" for r in varied]
    errs = [r for r in records if r.get("error")]
    if errs:
        out += ["", "## errors", ""] + [f"- {r['id']} / {r['method']}: {r['error']}" for r in errs[:50]]
    if plots:
        out += ["", "## plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- plots
def _grouped_bars(path: Path, groups: list[str], series: dict[str, list[float | None]], title: str,
                  ylabel: str, hline: float | None = None) -> Path:
    # Figure + Agg canvas directly: no pyplot global state, no display needed
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.1 * len(groups) * max(1, len(series)) ** 0.5 + 2), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [0.0 if v is None else v for v in vals]
        bars = ax.bar(xs, ys, width=width, label=name)
        for b, v in zip(bars, vals):
            if v is not None:
                ax.annotate(f"{v:.2f}" if v < 10 else f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def make_plots(records: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """tokens_per_s.png always; speedup_vs_ar.png when ar and another method ran; aat.png when
    some method reports AAT. Returns the files written."""
    out = Path(out_dir)
    rows = summary_rows(records, greedy=False)
    groups = [*ordered_unique(r["category"] for r in records), OVERALL]
    methods = ordered_unique(r["method"] for r in records)
    idx = {(r["category"], r["method"]): r for r in rows}

    def series(key: str, ms: list[str]) -> dict[str, list[float | None]]:
        return {m: [(idx.get((g, m)) or {}).get(key) for g in groups] for m in ms}

    written = [_grouped_bars(out / "tokens_per_s.png", groups, series("tokens_per_s", methods),
                             "Decode throughput", "tokens/s (mean over prompts)")]
    others = [m for m in methods if m != AR]
    if AR in methods and others:
        written.append(_grouped_bars(out / "speedup_vs_ar.png", groups, series("speedup_vs_ar", others),
                                     "Speedup vs autoregressive (same prompts, same run)", "x ar tokens/s",
                                     hline=1.0))
    aat_methods = [m for m in methods if any((idx.get((g, m)) or {}).get("mean_accepted_tokens") is not None
                                             for g in groups)]
    if aat_methods:
        written.append(_grouped_bars(out / "aat.png", groups, series("mean_accepted_tokens", aat_methods),
                                     "Average accepted tokens per verification step", "AAT", hline=1.0))
    return written
