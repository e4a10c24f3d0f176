"""Where a decode step of the default target goes, per weight mode: the time inside each k-quant
linear kind and shape (forward hooks around every KQuantLinear) against the whole step.

    python benchmarks/linear_profile.py q4        # or q4-lite

64 greedy tokens of one chat prompt, three runs, the fastest kept; ms per token.
"""
import collections
import sys
import time

import specwood
from specwood.models.w4a8 import KQuantLinear, StackedLinear

mode = sys.argv[1]
e = specwood.load(None, None, dtype=mode, max_context=4096, progress=False)
acc = collections.defaultdict(float)
cnt = collections.Counter()
t0 = {}


def name_of(m):
    if isinstance(m, StackedLinear):
        return None
    kind = type(m).__name__
    return f"{kind} {m.out_features}x{m.in_features}"


def pre(m, i):
    t0[id(m)] = time.perf_counter()


def post(m, i, o):
    acc[name_of(m)] += time.perf_counter() - t0[id(m)]
    cnt[name_of(m)] += 1


for m in e.target.modules():
    if isinstance(m, KQuantLinear):
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
prompt = [{"role": "user", "content": "Explain how a hash map handles collisions, with a short Python example."}]
e.generate(prompt, max_tokens=8)
best = None
for _ in range(3):
    acc.clear()
    cnt.clear()
    t = time.perf_counter()
    r = e.generate(prompt, max_tokens=64)
    wall = time.perf_counter() - t
    rate = r.stats["tokens_per_s"]
    if best is None or rate > best[0]:
        best = (rate, dict(acc), dict(cnt), wall, len(r.token_ids))
rate, a, c, wall, n = best
steps = n  # one forward a token (prefill included once)
print(f"{mode}: decode {rate:.1f} tok/s, wall {wall:.2f}s for {n} tokens")
tot = sum(a.values())
for k in sorted(a, key=lambda k: -a[k]):
    print(f"  {k:32s} {a[k] / n * 1e3:7.2f} ms/token  ({c[k] // n} calls/token)")
print(f"  {'all k-quant linears':32s} {tot / n * 1e3:7.2f} ms/token; everything: {wall / n * 1e3:7.2f} ms/token")
