"""What the suffix source costs per step at long contexts, with the global cache full (issue 41:
at most 1% of a target step at a 32k-token context).

Text: Python standard-library sources (real code, which repeats itself as code does), tokenised by
the default target's tokenizer. The global cache is filled to its default bound with earlier
"answers" (2k-token windows of that text); a request's context is the next `context` tokens; its
answer follows on, one step at a time, each step committing one token (a plain or model step) or
four (an accepted copy), as decode does. Timed per step: `SuffixSource.proposals` and auto's pick
of one (sync, the local and the global query, the trees, their trusted lengths) and auto's weighing of
the proposal (`SuffixOrModelShape.weigh`
with the plan's T_v and T_d); the first proposal, which indexes the whole context once, apart.
The target step it is compared with is this machine's T_v(1) from the starter plan at its longest
timed context (a step at 32k costs more: its attention reads 32k keys), so the share is an upper
bound.

    python benchmarks/suffix_cost.py [--contexts 1024,4096,16384,32768] [--steps 400]
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import specwood
from specwood.drafting.suffix_source import DEFAULT_CACHE_TOKENS, SuffixCache, SuffixSource
from specwood.planner.starter import starter_plan
from specwood.planner.suffix_choice import SUFFIX_DEPTH, SUFFIX_MIN_PROB, SUFFIX_NODES, SuffixOrModelShape, SuffixTrust


def stdlib_tokens(tokenizer, want: int) -> list[int]:
    """At least `want` tokens of the standard library's Python sources, file by file."""
    out: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out += tokenizer.encode(path.read_text(errors="replace"))
        if len(out) >= want:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS)
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    engine = specwood.load()
    plan = starter_plan(engine, "dyspec")
    text = stdlib_tokens(engine.tokenizer, a.cache_tokens + max(contexts) + 4 * a.steps + 1)
    cache = SuffixCache(a.cache_tokens)
    t0 = time.perf_counter()
    for start in range(0, a.cache_tokens, 2048):
        cache.add_answer([], text[start:start + 2048])
    fill_s = time.perf_counter() - t0
    tail = text[a.cache_tokens:]
    longest = max(plan.contexts)
    target_s = float(plan.t_v(longest, 1))
    print(f"global cache: {cache.size} tokens ({cache.answers} answers) filled in {fill_s:.1f} s; "
          f"target step T_v(1) at context {longest}: {1e3 * target_s:.1f} ms", flush=True)
    print("| context | first proposal (indexes the context) | propose per step, mean / p99 | weigh per step | "
          "both, share of a target step | steps with a proposal | local indexes built |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for ctx in contexts:
        stream = tail[:ctx + 4 * a.steps + 1]
        source = SuffixSource(cache, prompt_len=ctx, max_tokens=4 * a.steps + 1, eos_ids=())
        trust = SuffixTrust()
        t_v, t_d = plan.step_costs(ctx)
        shape = SuffixOrModelShape(source, object(), 3, 2.0, t_v, t_d, lambda m, src: trust.ratio(1, m, src))
        context, pos = stream[:ctx - 1], ctx  # the context before the root, extended in place as the engine does
        t0 = time.perf_counter()
        source.propose(context, stream[pos - 1], SUFFIX_NODES, SUFFIX_DEPTH, SUFFIX_MIN_PROB)
        first_s = time.perf_counter() - t0
        proposes, weighs, hits = [], [], 0
        for step in range(a.steps):
            moved = 4 if step % 4 == 3 else 1  # one step in four commits an accepted copy
            context.extend(stream[pos - 1:pos - 1 + moved])
            pos += moved
            t0 = time.perf_counter()
            draft = shape.pick(source.proposals(context, stream[pos - 1], SUFFIX_NODES, SUFFIX_DEPTH, SUFFIX_MIN_PROB))
            t1 = time.perf_counter()
            shape.weigh(draft)
            t2 = time.perf_counter()
            proposes.append(t1 - t0)
            weighs.append(t2 - t1)
            hits += draft.tree.size > 0
        proposes.sort()
        mean_p, p99 = sum(proposes) / len(proposes), proposes[int(0.99 * (len(proposes) - 1))]
        mean_w = sum(weighs) / len(weighs)
        print(f"| {ctx} | {1e3 * first_s:.1f} ms | {1e3 * mean_p:.3f} / {1e3 * p99:.3f} ms | {1e3 * mean_w:.3f} ms | "
              f"{100 * (mean_p + mean_w) / target_s:.2f}% | {hits} of {a.steps} | {source.builds} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
