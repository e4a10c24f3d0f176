"""Resident memory of target + draft against the shipped GGUF files' size (issue 12).

    python benchmarks/memory.py --backend llama.cpp --draft-backend llama.cpp
    python benchmarks/memory.py --dtype int8 --draft-backend llama.cpp
    python benchmarks/memory.py                      # the default: bf16 target, int4 draft (torch)

One configuration per process (RSS only grows): load, one short dyspec request, then VmRSS.
"""
from __future__ import annotations

import argparse
import os

import specwood
from specwood.models.registry import DEFAULT_TARGET, default_draft_for, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--draft-backend", default="torch")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-context", type=int, default=4096)
    a = ap.parse_args()
    engine = specwood.load(backend=a.backend, draft_backend=a.draft_backend, dtype=a.dtype,
                           max_context=a.max_context, progress=False)
    engine.generate("def f(x):", max_tokens=8, method="dyspec")
    with open("/proc/self/status") as f:
        rss = int(f.read().split("VmRSS:")[1].split()[0]) * 1024
    gguf = sum(os.path.getsize(resolve_model(m)) for m in (DEFAULT_TARGET, default_draft_for(DEFAULT_TARGET)))
    print(f"target {a.backend} ({a.dtype}), draft {a.draft_backend}: RSS {rss / 2**30:.2f} GiB, "
          f"GGUF files {gguf / 2**30:.2f} GiB, ratio {rss / gguf:.2f}")


if __name__ == "__main__":
    main()
