"""Decode speed with prefix reuse against without it, over HTTP (issue 42's "decode unchanged").

    python benchmarks/reuse_decode.py [--rounds 3] [--second-turn]

Servers alternate, one at a time (127.0.0.1, a free port, stopped afterwards): `specwood serve
--method ar --max-batch 1 --max-context 8192` with its default --kv-memory (reuse), then the same
with --kv-memory 0 (no reuse), for --rounds rounds. Each gets an untimed warm-up and then, for
four short prompts, either one fresh turn of 128 tokens (nothing to reuse: the server's own
overhead) or, with --second-turn, a first turn of 96 tokens and a second turn of 128 over the
history (reused by one server, prefilled by the other); the measured turn's decode tok/s (client
clock, after the first token), greedy, streamed. Prints every turn and the paired geometric-mean
ratio with a 95% interval.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn import chat_turn  # noqa: E402

from specwood.bench.server_process import ServerProcess, free_port, serve_command  # noqa: E402

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain what a mutex is, in a paragraph.",
           "Write a bash script that counts lines in every .py file under a directory.",
           "What is the difference between TCP and UDP?"]
FOLLOW_UP = "Now say the same in fewer words, then give one example."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--second-turn", action="store_true", help="measure a second turn over the history")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: none kept)")
    a = ap.parse_args()
    res: dict[str, list[float]] = {"reuse": [], "no reuse": []}
    for r in range(a.rounds):
        for label, kv in (("reuse", None), ("no reuse", "0")):
            port = free_port()
            cmd = serve_command(port, max_batch=1, max_context=8192) + ["--method", "ar"]
            cmd += ["--kv-memory", kv] if kv is not None else []
            log_path = Path(a.log_dir) / f"{label.replace(' ', '-')}-{r}.log" if a.log_dir else None
            with ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path=log_path, startup_timeout=600,
                               log=lambda m: None):
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as c:
                    chat_turn(c, [{"role": "user", "content": "Say hi."}], 8, None, 600)
                    for p in PROMPTS:
                        msgs = [{"role": "user", "content": p}]
                        if a.second_turn:
                            first = chat_turn(c, msgs, 96, None, 600)
                            msgs += [{"role": "assistant", "content": first["text"]},
                                     {"role": "user", "content": FOLLOW_UP}]
                        rec = chat_turn(c, msgs, 128, None, 600)
                        res[label].append(rec["decode_tok_s"])
                        print(f"round {r} {label:8s} {p[:32]:32s} {rec['decode_tok_s']:6.2f} tok/s, "
                              f"{rec['completion_tokens']} tokens, cached {rec['cached_tokens']} of "
                              f"{rec['prompt_tokens']}, ttft {rec['ttft_s']:.2f} s", flush=True)
    logs = [math.log(x / y) for x, y in zip(res["reuse"], res["no reuse"])]
    m, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    print(f"reuse {statistics.mean(res['reuse']):.2f} tok/s, no reuse {statistics.mean(res['no reuse']):.2f}; "
          f"paired ratio {math.exp(m):.3f} (95% {math.exp(m - 2 * se):.3f}-{math.exp(m + 2 * se):.3f}), n {len(logs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
