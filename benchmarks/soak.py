"""The long soak of `specwood serve` (issue 32 item 12): 5,000 mixed requests (streams,
cancellations mid-stream, bad input, chat and completions, concurrency up to the batch size) on
tiny random models served as a real process on 127.0.0.1; then the server's resident memory,
file descriptors, threads and free cache rows after a warm-up and at the end (specwood.bench.soak).
The default suite runs a shorter one (tests/test_server_reliability.py).

    python benchmarks/soak.py [--requests 5000] [--warmup 200] [--max-batch 4] [--method dyspec]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from specwood.bench.server_process import ServerProcess, free_port, serve_command
from specwood.bench.soak import Soak, print_progress
from specwood.models.testing import tiny_pair_folders


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--method", default="dyspec")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_pair_folders(tmp)
        port = free_port()
        cmd = serve_command(port, max_batch=args.max_batch, target=str(target), draft=str(draft), dtype="fp32")
        cmd += ["--method", args.method]
        with ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path=Path(tmp) / "server.log") as server:
            with Soak(server.base_url, server.proc.pid, concurrency=args.max_batch, seed=args.seed) as soak:
                report = soak.run(args.requests, warmup=args.warmup, progress=print_progress)
            alive = server.proc.poll() is None
    print(report.summary())
    print(f"statuses: {dict(sorted(report.statuses.items()))}; server alive at the end: {alive}")
    for failure in report.failures[:10]:
        print("failure:", failure)
    return 0 if report.server_errors == 0 and not report.failures and alive else 1


if __name__ == "__main__":
    sys.exit(main())
