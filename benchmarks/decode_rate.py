"""`ar`'s decode rate through Engine.generate on the default pair: one warm-up, then `--repeats`
generations of `--tokens` tokens; prints each rate and the median. Run it once per checkout,
alternating, to compare two versions of the decode path on the same machine:

    (cd /tmp/before && PYTHONPATH=/tmp/before python /path/to/benchmarks/decode_rate.py before)
    python benchmarks/decode_rate.py after
"""
from __future__ import annotations

import argparse
import statistics

import specwood

PROMPT = "Write a Python function that parses an ISO date string and returns a datetime, with tests."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    engine = specwood.load(progress=False)
    engine.generate(PROMPT, max_tokens=16, method="ar")
    rates = [engine.generate(PROMPT, max_tokens=args.tokens, method="ar").stats["tokens_per_s"]
             for _ in range(args.repeats)]
    print(args.label, [round(r, 2) for r in rates], "median", round(statistics.median(rates), 2), specwood.__file__)


if __name__ == "__main__":
    main()
