"""How fast could ANY draft copied from seen text make the suffix workloads, on this machine?
An oracle bound for issue 41's cold goals.

For each request of `benchmarks/suffix_workloads.jsonl` in the benchmark's cold order, the greedy
answer is generated here (`ar`, in process). At each step an oracle drafter proposes the longest
run of the answer's next tokens that occurs anywhere in the text a copying drafter could have seen
(the request's prompt, its answer so far and every earlier answer of the pass: the global tree's
contents), up to `--max-draft` tokens; verification accepts all of it (it is the answer) and adds
its bonus token. No real drafter does better: ours must also find the run from the text before
it, and pays for the nodes it proposes that are refused. The step costs what this process timed:
a plain step's measured time plus T_v(1 + L) - T_v(1) from the starter plan's timings (the wider
forward), nothing for drafting.

The bound per category is ar time / oracle time. With `--model-gain G`, steps where nothing can be
copied go G times faster (the draft model at its best), for the bound of model + copies.

    python benchmarks/suffix_bound.py [--limit 3] [--max-tokens 256] [--max-draft 47] [--model-gain 1.2] [--row-ms MS]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_rows import int8_peak_rate  # noqa: E402
from suffix import DEFAULT_WORKLOADS as WORKLOADS  # noqa: E402
from suffix import load_items, second_turn  # noqa: E402

import specwood  # noqa: E402
from specwood.planner.starter import starter_plan  # noqa: E402


def as_text(ids: list[int]) -> str:
    """Token ids as one character each, so `in` finds runs of tokens (ids map past the ASCII range)."""
    return "".join(chr(0x1000 + t) for t in ids)


def row_macs(model: Any) -> int:
    """The multiply-adds one verified row costs in the target's linears (its head included); a
    linear made of parts (a stacked qkv) counts through its parts."""
    linear = lambda m: hasattr(m, "in_features")  # noqa: E731
    return sum(m.in_features * m.out_features for m in model.modules()
               if linear(m) and not any(linear(c) for c in list(m.modules())[1:]))


def oracle_steps(answer: list[int], seen_before: str, prompt: list[int], max_draft: int) -> list[int]:
    """The drafted tokens each oracle step gets accepted (its step emits that many + 1)."""
    out, i, n = [], 0, len(answer)
    own = as_text(prompt)
    while i < n:
        seen = seen_before + "\u0000" + own + as_text(answer[:i])  # what a copying drafter has seen
        run = 0  # the draft is a[i:i+run]; the step emits it and its bonus token a[i+run]
        while i + run < n - 1 and run < max_draft and as_text(answer[i:i + run + 1]) in seen:
            run += 1
        out.append(run)
        i += run + 1
    return out


def bound(rows: list[dict[str, Any]], row_s: float | None, model_gain: float) -> float:
    """ar time over the oracle's: a step of L copied tokens costs a plain step plus the L extra
    rows' verify time (timed here, or `row_s` each); a step with nothing to copy a plain step
    divided by `model_gain`."""
    ar = oracle = 0.0
    for r in rows:
        plain, extra = r["plain_s"], r["extra_row_s"]
        ar += plain * r["tokens"]
        oracle += sum(plain + (extra[run] if row_s is None else row_s * run) if run else plain / model_gain
                      for run in r["runs"])
    return ar / oracle


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=Path, default=WORKLOADS)
    ap.add_argument("--limit", type=int, default=3, help="the first N items of each category (as suffix.py)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-draft", type=int, default=47, help="the longest chain one step verifies (T_v timed to 48)")
    ap.add_argument("--model-gain", type=float, default=1.2,
                    help="the draft model's speed-up on steps with nothing to copy (auto --no-suffix on open chat)")
    ap.add_argument("--row-ms", type=float,
                    help="a verify row's cost for the kernel's bound (default: the target's multiply-adds a row at "
                         "this chip's measured int8 peak, kquant_rows.py --peak)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    items = load_items(a.workloads, a.limit)
    engine = specwood.load()
    plan = starter_plan(engine, "dyspec")
    earlier = ""  # every answer given so far in the pass (the global tree's text)
    rows: list[dict[str, Any]] = []
    for item in items:
        messages = list(item["messages"])
        if item.get("followup"):  # a refine item's first turn: its answer is history and global text
            first = engine.generate(messages, max_tokens=a.max_tokens, method="ar")
            earlier += "\u0000" + as_text(first.token_ids)
            messages = second_turn(item, first.text)
        prompt = engine.encode(messages)
        t0 = time.perf_counter()
        out = engine.generate(messages, max_tokens=a.max_tokens, method="ar")
        wall = time.perf_counter() - t0
        answer = list(out.token_ids)
        steps = oracle_steps(answer, earlier, prompt, a.max_draft)
        earlier += "\u0000" + as_text(answer)
        decode_s = wall - float(out.stats.get("ttft_s") or 0.0)
        plain = decode_s / max(len(answer) - 1, 1)  # one plain step as it ran here
        ctx = len(prompt) + len(answer) // 2
        rows.append({"id": item["id"], "category": item["category"], "tokens": len(answer), "runs": steps,
                     "copied_share": sum(steps) / max(len(answer), 1), "plain_s": plain,
                     "extra_row_s": {run: float(plan.t_v(ctx, 1 + run)) - float(plan.t_v(ctx, 1))
                                     for run in set(steps)}})
        r = rows[-1]
        print(f"{item['id']:9s} {r['tokens']:4d} tokens, {len(steps):4d} oracle steps "
              f"({r['tokens'] / max(len(steps), 1):.1f} tokens/step), {100 * r['copied_share']:.0f}% copied, "
              f"bound {bound([r], None, 1.0):.2f}x ar", flush=True)
    if a.row_ms is None:
        a.row_ms = 1e3 * row_macs(engine.target) / int8_peak_rate()
    cases = [(None, 1.0), (None, a.model_gain), (a.row_ms * 1e-3, a.model_gain)]
    cases = list(dict.fromkeys(cases))
    name = lambda c: ("measured T_v" if c[0] is None else f"{c[0] * 1e3:g} ms a row") + f", model x{c[1]:g}"  # noqa: E731
    lines = ["| category | requests | tokens | tokens per oracle step | copied share | "
             + " | ".join(f"bound ({name(c)})" for c in cases) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(cases)]
    for cat in dict.fromkeys(r["category"] for r in rows):
        rs = [r for r in rows if r["category"] == cat]
        tok, st = sum(r["tokens"] for r in rs), sum(len(r["runs"]) for r in rs)
        lines.append(f"| {cat} | {len(rs)} | {tok} | {tok / max(st, 1):.2f} | "
                     f"{100 * sum(r['copied_share'] * r['tokens'] for r in rs) / max(tok, 1):.0f}% | "
                     + " | ".join(f"**{bound(rs, *c):.2f}x**" for c in cases) + " |")
    head = ("T_v(1, 2, 8, 16, 32, 48) at context 512, ms: "
            + ", ".join(f"{float(plan.t_v(512, x)) * 1e3:.1f}" for x in (1, 2, 8, 16, 32, 48))
            + f"; plain step as run here {1e3 * sum(r['plain_s'] for r in rows) / len(rows):.1f} ms; "
            f"max draft {a.max_draft}")
    print(head + "\n\n" + "\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        argv = vars(a) | {"workloads": str(a.workloads), "out": str(a.out)}
        (a.out / "bound.json").write_text(json.dumps({"argv": argv, "head": head, "rows": rows}, indent=1))
        (a.out / "bound.md").write_text(head + "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
