"""What the largest stop list a request may carry (16 strings of 512 characters, the server's
limit) costs a decode step: the default pair, `ar`, greedy, the same prompts with and without
the list (strings that never occur), runs interleaved.

    python benchmarks/stop_strings.py [--prompts 4] [--max-tokens 128] [--rounds 3]

Prints decode tok/s of both and their ratio (issue 32's goal: the list slows a step by < 5%).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import specwood
from specwood.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = specwood.load(draft=None, progress=False)
    rows = [json.loads(line) for line in (Path(__file__).parent / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = [engine.encode(r["messages"]) for r in rows if "messages" in r][: args.prompts]
    rnd = random.Random(0)
    # printable characters a reply never contains in a row: no stop string ever matches
    stops = ["\x07" + "".join(rnd.choice("~^`|") for _ in range(MAX_STOP_CHARS - 1)) for _ in range(MAX_STOP_STRINGS)]
    engine.generate(prompts[0], max_tokens=8)
    rates: dict[str, list[float]] = {"none": [], "16x512": []}
    for r in range(args.rounds):
        for name in (("none", "16x512") if r % 2 == 0 else ("16x512", "none")):
            for p in prompts:
                out = engine.generate(p, max_tokens=args.max_tokens, stop=stops if name == "16x512" else None)
                rates[name].append(out.stats["tokens_per_s"])
    # the stop check's own cost, without the VM's drift: the same token stream through OutputStream
    import time

    from specwood.engine.output import OutputStream

    tokens = engine.generate(prompts[0], max_tokens=args.max_tokens).token_ids
    cost = {}
    for name, stop in (("none", None), ("16x512", stops)):
        out = OutputStream(engine.tokenizer, 1, 10 ** 6, set(), stop)
        t0 = time.perf_counter()
        for _ in range(20):
            for t in tokens:
                out.push_step([t])
        cost[name] = (time.perf_counter() - t0) / (20 * len(tokens))
    extra_ms = 1000 * (cost["16x512"] - cost["none"])
    print(f"the stop check adds {extra_ms:.3f} ms a token ({1000 * cost['none']:.3f} ms without); a plain decode "
          f"step here takes {1000 / statistics.mean(rates['none']):.1f} ms: "
          f"{extra_ms * statistics.mean(rates['none']) / 10:.2f}%")
    a, b = statistics.mean(rates["none"]), statistics.mean(rates["16x512"])
    print(f"decode tok/s without stop strings {a:.2f}, with {MAX_STOP_STRINGS} of {MAX_STOP_CHARS} characters {b:.2f}: "
          f"{b / a:.3f}x ({len(rates['none'])} requests each, {args.max_tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
