"""The server's caches at scale (issue 56, item 6): prefix-cache lookup and store time as entries
grow, and the global suffix index's memory and append rate, against the code before issue 56
(--old-ref: the scanning prefix cache and the tuple-keyed suffix index).

Prefix cache: N entries (N = 10, 1,000, 100,000) of 16-64 tokens on a tiny KV pool (1 layer,
1 KV head, head dim 1: 8 bytes a token, so 100,000 entries fit), each a system prompt of 64
(8-24 tokens) and a random rest, ids from a 150k vocabulary. `restore`: a new prompt on one of
the system prompts, its longest cached prefix copied into a row. `store`: a new entry with the
budget full, so each store evicts the least recently used. The old cache is filled by appending
its entries directly (its own store scans every entry: O(N^2) to fill).

Suffix index: tracemalloc's count after filling the default 2^19-token global index twice over
with answers of 200-600 tokens (Zipf-distributed ids, and uniform ones: nearly every anchor new),
and `extend` of 100,000 tokens.

    PYTHONPATH=. python benchmarks/prefix_cache_scale.py [--entries 10,1000,100000] [--old-ref REF]
        [--no-old] [--no-suffix]

(PYTHONPATH=.: the checkout's specwood, where the installed one is another worktree.)
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from specwood.bench.harness import machine_info
from specwood.models.cache import KVCache
from specwood.models.prefix_cache import PrefixCache
from specwood.planner.profiler import median_time

REPO = Path(__file__).resolve().parents[1]
VOCAB = 150_000
OLD_REF = "b1ac195"  # the last commit with the scanning prefix cache and the tuple-keyed suffix index


def old_module(ref: str, path: str, name: str) -> ModuleType | None:
    """A module as it was at `ref` (git show), or None where git cannot give it."""
    try:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{path}"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(text, f"{ref}:{path}", "exec"), module.__dict__)  # noqa: S102 - our own file, as it was
    return module


# --- the prefix cache ---------------------------------------------------------------------------------

def sequences(rnd: random.Random, n: int, stems: list[list[int]]) -> list[list[int]]:
    out = []
    for _ in range(n):
        stem = rnd.choice(stems)
        rest = rnd.randrange(max(1, 16 - len(stem)), 64 - len(stem) + 1)
        out.append(stem + [rnd.randrange(VOCAB) for _ in range(rest)])
    return out


def prefix_case(cls: type, n: int, old: ModuleType | None, repeats: int) -> tuple[float, float]:
    """Median (restore, store) seconds with `n` entries held."""
    rnd = random.Random(n)
    stems = [[rnd.randrange(VOCAB) for _ in range(rnd.randrange(8, 25))] for _ in range(64)]
    pool = KVCache(n_layers=1, n_kv_heads=1, head_dim=1, max_len=64, batch=2)
    pool.k.normal_(), pool.v.normal_()
    cache = cls(10 ** 12)
    held = sequences(rnd, n, stems)
    if old is not None:  # the old store scans every entry: append its entries as its store would
        clock = itertools.count()
        for toks in held:
            k, v = pool.slots_of(0, 0, len(toks))
            cache.entries.append(old.Entry(id(pool), old.token_array(toks), k.clone(), v.clone(), next(clock)))
            cache.nbytes += len(toks) * pool.bytes_per_slot
        cache._clock = clock
    else:
        for toks in held:
            pool.lengths[0] = len(toks)
            cache.store(pool, 0, toks)
    cache.set_budget(cache.nbytes)  # full: each store below evicts
    queries = sequences(rnd, repeats, stems)
    fresh = iter(sequences(rnd, repeats, stems))
    q = iter(queries)
    restore = median_time(lambda: cache.restore(pool, 1, next(q), 64), repeats, warmup=0)

    def store() -> None:
        toks = next(fresh)
        pool.lengths[0] = len(toks)
        cache.store(pool, 0, toks)

    return restore, median_time(store, repeats, warmup=0)


def prefix_table(counts: list[int], old_ref: str | None) -> None:
    old = old_module(old_ref, "specwood/models/prefix_cache.py", "old_prefix_cache") if old_ref else None
    print("| entries | restore | store |" + (f" restore at {old_ref} | store at {old_ref} |" if old else ""))
    print("|---:|---:|---:|" + ("---:|---:|" if old else ""))
    for n in counts:
        r, s = prefix_case(PrefixCache, n, None, 200)
        row = f"| {n:,} | {r * 1e6:.1f} us | {s * 1e6:.1f} us |"
        if old is not None:
            r0, s0 = prefix_case(old.PrefixCache, n, old, max(3, min(200, 20_000 // n)))
            row += f" {r0 * 1e6:,.1f} us | {s0 * 1e6:,.1f} us |"
        print(row, flush=True)


# --- the suffix index ----------------------------------------------------------------------------------

def answers(rng: np.random.Generator, total: int, zipf: bool) -> list[list[int]]:
    out, n = [], 0
    while n < total:
        length = int(rng.integers(200, 601))
        ids = (rng.zipf(1.2, length) - 1) % VOCAB if zipf else rng.integers(0, VOCAB, length)
        out.append(ids.tolist())
        n += length + 5
    return out


def suffix_table(old_ref: str | None) -> None:
    from specwood.drafting import suffix_index
    from specwood.drafting.suffix_source import DEFAULT_CACHE_TOKENS

    versions = [("now", suffix_index)]
    old = old_module(old_ref, "specwood/drafting/suffix_index.py", "old_suffix_index") if old_ref else None
    if old is not None:
        versions.append((f"at {old_ref}", old))
    cap = DEFAULT_CACHE_TOKENS
    rng = np.random.default_rng(0)
    streams = {"Zipf ids": answers(rng, 2 * cap, True), "uniform ids": answers(rng, 2 * cap, False)}
    stream = ((rng.zipf(1.2, 100_000) - 1) % VOCAB).tolist()
    print(f"| suffix index ({cap:,} tokens) | held, Zipf ids | held, uniform ids | extend 100k tokens | find |")
    print("|---|---:|---:|---:|---:|")
    for label, module in versions:
        held = {}
        for name, docs in streams.items():
            tracemalloc.start()
            index = module.SuffixIndex(cap)
            for d in docs:
                index.end_document()
                index.extend(d[:4] + d)
                index.end_document()
            held[name] = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            del index

        def extend() -> None:
            module.SuffixIndex(cap).extend(stream)

        index = module.SuffixIndex(cap)
        index.extend(stream)
        tails = [stream[i - 24:i] for i in range(1000, 100_000, 997)]

        def find() -> None:
            for tail in tails:
                index.find(tail, 16)

        find_s = median_time(find, 5, warmup=0) / len(tails)
        print(f"| {label} | {held['Zipf ids'] / 2 ** 20:.1f} MiB | {held['uniform ids'] / 2 ** 20:.1f} MiB | "
              f"{median_time(extend, 3, warmup=0) * 1e3:.1f} ms | {find_s * 1e6:.1f} us |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", default="10,1000,100000", help="prefix cache sizes, comma-separated")
    ap.add_argument("--old-ref", default=OLD_REF, help="the git ref of the old implementations")
    ap.add_argument("--no-old", action="store_true", help="skip the old implementations")
    ap.add_argument("--no-suffix", action="store_true", help="skip the suffix index")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = machine_info()
    print(f"{m['cpu_model']}, {m['cpu_cores_usable']} cores usable, Python {m['python']}, torch {m['torch']}\n")
    old_ref = None if a.no_old else a.old_ref
    prefix_table([int(x) for x in a.entries.split(",")], old_ref)
    if not a.no_suffix:
        print()
        suffix_table(old_ref)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
