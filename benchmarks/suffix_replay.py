"""How good is the suffix drafter, per step, against the oracle? Issue 41's drafter gap, offline.

The greedy answers of `benchmarks/suffix_workloads.jsonl` (generated here with `ar` in the
benchmark's cold order, or read back with `--answers`) are replayed through the real suffix source
(`SuffixSource`, a global `SuffixCache` filled by the earlier answers, `SuffixTrust`) and auto's real
per-step weighing (`SuffixOrModelShape.weigh`), with T_v and T_d from the starter plan timed here.
Greedy verification of a deterministic tree is a walk along the answer, so every suffix step's
accepted length is exact; what the model would get is not replayed (no draft forward): a model
step is charged the plan's time per expected token and moves one token on.

Per category it prints the suffix steps, their proposed and accepted nodes, the share that got
nothing, the replayed rate against plain decoding (T_v(1) a token) and the oracle's
(benchmarks/suffix_bound.py's longest copyable run, all accepted) on the same T_v. It is a tool for
changing the drafter, not a speed figure: those come from benchmarks/suffix.py over HTTP.

    python benchmarks/suffix_replay.py [--limit 3] [--answers DIR] [--out DIR] [--rule one-trust|one-source-trust]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suffix import DEFAULT_WORKLOADS as WORKLOADS  # noqa: E402
from suffix import load_items, second_turn  # noqa: E402
from suffix_bound import as_text, oracle_steps  # noqa: E402
from suffix_inprocess import RULES  # noqa: E402

import specwood  # noqa: E402
from specwood.drafting.suffix_source import SuffixCache, SuffixSource  # noqa: E402
from specwood.planner.starter import starter_plan  # noqa: E402
from specwood.planner.store import Plan  # noqa: E402
from specwood.planner.suffix_choice import (SUFFIX_DEPTH, SUFFIX_MIN_PROB, SUFFIX_NODES,  # noqa: E402
                                            SuffixOrModelShape, SuffixTrust, cut, tested_weight)


def generate_answers(engine: Any, items: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """Each request's prompt and greedy answer (a refinement's first turn is a request of its own)."""
    out = []
    for item in items:
        messages = list(item["messages"])
        if item.get("followup"):
            first = engine.generate(messages, max_tokens=max_tokens, method="ar")
            out.append({"id": item["id"] + "/first", "category": item["category"], "scored": False,
                        "prompt": engine.encode(messages), "answer": list(first.token_ids)})
            messages = second_turn(item, first.text)
        answer = engine.generate(messages, max_tokens=max_tokens, method="ar")
        out.append({"id": item["id"], "category": item["category"], "scored": True,
                    "prompt": engine.encode(messages), "answer": list(answer.token_ids)})
        print(f"{item['id']:10s} {len(out[-1]['prompt']):5d} prompt, {len(out[-1]['answer']):4d} answer tokens",
              flush=True)
    return out


def walk(tree: Any, answer: list[int], start: int) -> list[int]:
    """Greedy verification of a deterministic tree rooted at answer[start - 1]: the accepted nodes."""
    node, accepted = 0, []
    for token in answer[start:]:
        node = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if node is None:
            break
        accepted.append(node)
    return accepted


def replay(rows: list[dict[str, Any]], plan: Any, eos: frozenset[int], use_model: bool) -> list[dict[str, Any]]:
    """Every request through the suffix source in order; per request its replayed steps."""
    cache = SuffixCache()
    results = []
    for r in rows:
        prompt, answer = r["prompt"], r["answer"]
        source = SuffixSource(cache, len(prompt), len(answer), eos_ids=eos)
        trust = SuffixTrust()
        # the first token comes from the prefill: plain decoding is charged a step for it, the replay nothing
        steps, time_s, i = [], 0.0, 1
        ar_s = float(plan.step_costs(len(prompt))[0](1)) if answer else 0.0
        while i < len(answer):
            context = prompt + answer[:i]
            ctx = len(context)
            t_v, t_d = plan.step_costs(ctx)
            ar_s += float(t_v(1))  # this step's token, decoded plainly
            d = plan.decide(ctx) if use_model else None
            x = d.x if d is not None and d.method == "sd" else 1
            aat = float(plan.aat_for(ctx)(x)) if x > 1 else 1.0
            shape = SuffixOrModelShape(source, object() if x > 1 else None, x, aat, t_v, t_d,
                                       lambda m, src: trust.ratio(1, m, src))
            proposal = shape.pick(source.proposals(context[:-1], context[-1], SUFFIX_NODES, SUFFIX_DEPTH,
                                                   SUFFIX_MIN_PROB))
            choice, k = shape.weigh(proposal)
            part = cut(proposal, k) if k else None
            accepted = walk(part.tree, answer, i) if part is not None else []
            if choice == "suffix":
                trust.record(1, tested_weight(part, accepted), len(accepted), part.match, part.source)
                time_s += float(t_v(1 + k))
                moved = len(accepted) + 1
            else:
                trust.relax(1)
                if choice == "none":
                    time_s += float(t_v(1))
                    moved = 1
                else:
                    cost = float(t_v(x + (k if choice == "both" else 0))) + float(t_d(x))
                    moved = len(accepted) + 1 if accepted else 1
                    time_s += cost if accepted else cost / aat
            whole = walk(proposal.tree, answer, i)  # had the whole proposal been verified (SuffixTrust's measure)
            steps.append({"choice": choice, "k": k, "accepted": len(accepted), "match": proposal.match,
                          "expected": round(proposal.expected, 2), "occurrences": proposal.occurrences,
                          "source": proposal.source, "whole_accepted": len(whole),
                          "whole_tested": round(tested_weight(proposal, whole), 3)})
            source.observe(answer[i + moved - 1] if i + moved - 1 < len(answer) else answer[-1])
            ar_s += (moved - 1) * float(t_v(1))  # plain decoding would have taken a step for each
            i += moved
        source.close()
        results.append({"id": r["id"], "category": r["category"], "scored": r["scored"], "tokens": len(answer),
                        "steps": steps, "time_s": time_s, "ar_s": ar_s})
    return results


def oracle_time(rows: list[dict[str, Any]], plan: Any) -> dict[str, float]:
    """Per scored request, the oracle's time on the same T_v (plain steps where nothing copies)."""
    seen, out = "", {}
    for r in rows:
        runs = oracle_steps(r["answer"], seen, r["prompt"], 47)
        seen += "\u0000" + as_text(r["answer"])
        ctx = len(r["prompt"]) + len(r["answer"]) // 2
        t_v, _ = plan.step_costs(ctx)
        out[r["id"]] = sum(float(t_v(1 + run)) for run in runs)
    return out


def acceptance_table(results: list[dict[str, Any]], after: int) -> list[str]:
    """What predicts a suffix proposal's acceptance, per source and match-length bucket, over the
    scored requests after the first `after` of each category (those the benchmarks do not time,
    where SuffixTrust's priors come from): had the whole proposal been verified, how often its
    first node was right and its trust (accepted over tested weight)."""
    buckets = SuffixTrust()  # its match-length buckets
    seen: dict[str, int] = {}
    cells: dict[tuple[str, int], list[float]] = {}
    for r in results:
        if not r["scored"]:
            continue
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] <= after:
            continue
        for s in r["steps"]:
            if s["expected"] > 0:
                c = cells.setdefault(buckets.key(s["match"], s["source"]), [0, 0, 0.0, 0])
                c[0] += 1
                c[1] += s["whole_accepted"] > 0
                c[2] += s["whole_tested"]
                c[3] += s["whole_accepted"]
    lines = [f"Proposals of the requests after the first {after} of each category, as if wholly verified:", "",
             "| source | match length | proposals | first node right | trust | accepted per proposal |",
             "|---|---|---:|---:|---:|---:|"]
    for (source, bucket), (n, first, tested, accepted) in sorted(cells.items()):
        lines.append(f"| {source} | {bucket}+ | {n} | {100 * first / n:.0f}% | {accepted / max(tested, 1e-9):.2f} | "
                     f"{accepted / n:.1f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=Path, default=WORKLOADS)
    ap.add_argument("--limit", type=int, default=3, help="the first N items of each category (as suffix.py)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--answers", type=Path,
                    help="an earlier run's --out: its answers and its plan's timings are used again")
    ap.add_argument("--no-model", action="store_true", help="weigh the suffix against plain decoding only")
    ap.add_argument("--rule", choices=sorted(RULES), default="as-is",
                    help="an earlier trust rule (benchmarks/suffix_inprocess.py's RULES) instead of today's")
    ap.add_argument("--table-after", type=int, default=3,
                    help="the acceptance table counts the requests after the first N of each category")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    engine = specwood.load()
    if a.answers:  # the same answers and T_v as that run, so two drafters compare exactly
        rows = json.loads((a.answers / "answers.json").read_text())["answers"]
        plan = Plan.from_dict(json.loads((a.answers / "plan.json").read_text()))
    else:
        plan = starter_plan(engine, "dyspec")
        rows = generate_answers(engine, load_items(a.workloads, a.limit), a.max_tokens)
    eos = frozenset(getattr(engine, "eos_token_ids", ()) or ())
    with RULES[a.rule]():
        results = replay(rows, plan, eos, not a.no_model)
    oracle = oracle_time(rows, plan)
    lines = ["| category | requests | tokens | steps | suffix steps | nodes per suffix step | accepted per suffix step "
             "| suffix steps with none | model / both / none steps | replay / plain | oracle / plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for cat in dict.fromkeys(r["category"] for r in results):
        rs = [r for r in results if r["category"] == cat and r["scored"]]
        st = [s for r in rs for s in r["steps"]]
        sx = [s for s in st if s["choice"] == "suffix"]
        count = lambda c: sum(s["choice"] == c for s in st)  # noqa: E731
        ar_s, t_s = sum(r["ar_s"] for r in rs), sum(r["time_s"] for r in rs)
        o_s = sum(oracle[r["id"]] for r in rs)
        lines.append(f"| {cat} | {len(rs)} | {sum(r['tokens'] for r in rs)} | {len(st)} | {len(sx)} | "
                     f"{sum(s['k'] for s in sx) / max(len(sx), 1):.1f} | "
                     f"{sum(s['accepted'] for s in sx) / max(len(sx), 1):.2f} | "
                     f"{100 * sum(s['accepted'] == 0 for s in sx) / max(len(sx), 1):.0f}% | "
                     f"{count('model')} / {count('both')} / {count('none')} | {ar_s / max(t_s, 1e-9):.2f}x | "
                     f"{ar_s / max(o_s, 1e-9):.2f}x |")
    table = acceptance_table(results, a.table_after)
    if len(table) > 4:
        lines += [""] + table
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "answers.json").write_text(json.dumps({"answers": rows}))
        (a.out / "plan.json").write_text(json.dumps(plan.to_dict()))
        (a.out / "replay.json").write_text(json.dumps(results, indent=1))
        (a.out / "replay.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
