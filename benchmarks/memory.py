"""Resident memory of target + draft against the shipped GGUF files' size (issue 12).

    python benchmarks/memory.py --backend llama.cpp --draft-backend llama.cpp
    python benchmarks/memory.py --dtype int8 --draft-backend llama.cpp
    python benchmarks/memory.py --dtype q4 --draft-dtype q4
    python benchmarks/memory.py                      # the default: bf16 target, int4 draft (torch)

One configuration per process (RSS only grows): load, one short dyspec request, then VmRSS, split
into anonymous memory (what the process allocated: weights copied or repacked, KV caches, torch's
heap) and file pages (the mapped GGUF files, shared libraries), with the RSS before loading
(interpreter, torch, tokenizer libraries) shown apart.
"""
from __future__ import annotations

import argparse
import os

import specwood
from specwood.models.registry import DEFAULT_TARGET, default_draft_for, resolve_model


def rss() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--draft-backend", default="torch")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft-dtype", default="auto")
    ap.add_argument("--max-context", type=int, default=4096)
    a = ap.parse_args()
    before = rss()
    engine = specwood.load(backend=a.backend, draft_backend=a.draft_backend, dtype=a.dtype,
                           draft_dtype=a.draft_dtype, max_context=a.max_context, progress=False)
    engine.generate("def f(x):", max_tokens=8, method="dyspec")
    after = rss()
    gguf = sum(os.path.getsize(resolve_model(m)) for m in (DEFAULT_TARGET, default_draft_for(DEFAULT_TARGET)))
    g = 2**30
    print(f"target {a.backend} ({a.dtype}), draft {a.draft_backend} ({a.draft_dtype}): "
          f"RSS {after['VmRSS'] / g:.2f} GiB "
          f"(anonymous {after['RssAnon'] / g:.2f}, file pages {after['RssFile'] / g:.2f}); before loading "
          f"{before['VmRSS'] / g:.2f} GiB; GGUF files {gguf / g:.2f} GiB; ratio {after['VmRSS'] / gguf:.2f}, "
          f"models only (RSS growth) {(after['VmRSS'] - before['VmRSS']) / gguf:.2f}")


if __name__ == "__main__":
    main()
