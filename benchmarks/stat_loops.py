"""The statistical tests' request loops, timed outside pytest: CPU seconds per loop of the parallel
executor's G-test (its main process and its draft worker apart), the pipeline's in-process G-tests
and one engine-level law case. What the suite's time (docs/testing.md) is made of, one loop at a
time, with the tests' own helpers, models and sample streams.

    python benchmarks/stat_loops.py [--parallel N] [--pipeline N] [--engine N] [--out FILE]

Each loop runs once to warm up on a few hundred requests, then is timed (wall and CPU); the heap is
frozen first as the tests' `frozen_heap` fixture does. One torch thread, as in the suite.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parallel_loop(n: int, case: str) -> dict[str, float]:
    import test_parallel as T
    from conftest import make_tiny_tokenizer

    from specwood.engine.api import Engine
    from specwood.sampling import SamplingParams

    target = T.make_tiny_model(vocab_size=T.V, seed=3)
    engine = Engine(target, make_tiny_tokenizer(), draft=T.perturbed_copy(target, 0.3, seed=4), target_name="tiny32",
                    draft_name="tiny32-draft")
    engine.eos_token_ids = {T.EOS}
    ex = T.executor(engine)
    options, temperature = T.STAT_CASES[case]
    params = SamplingParams(temperature=temperature)
    try:
        T.run_requests(ex, options, params, 512, stream=0)
        gc.collect()
        gc.freeze()
        pid = ex._worker().pid
        w0, m0, t0 = _cpu_of(pid), time.process_time(), time.perf_counter()
        T.run_requests(ex, options, params, n, stream=0)
        return {"requests": n, "wall_s": time.perf_counter() - t0, "main_cpu_s": time.process_time() - m0,
                "worker_cpu_s": _cpu_of(pid) - w0}
    finally:
        ex.close()
        gc.unfreeze()


def pipeline_loop(n: int, mode: str) -> dict[str, float]:
    import test_pipeline as T

    T.sampled_pipeline_counts(mode, 500)
    gc.collect()
    gc.freeze()
    c0, t0 = time.process_time(), time.perf_counter()
    T.sampled_pipeline_counts(mode, n)
    gc.unfreeze()
    return {"requests": n, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def engine_loop(n: int, method: str, cache: Path) -> dict[str, float]:
    import test_engine_statistics as T

    from specwood.sampling import SamplingParams

    os.environ["SPECWOOD_CACHE"] = str(cache)  # the plans the tests store go to a private folder
    engine = T.make_stat_engine()
    params = SamplingParams(temperature=1.0)
    T.run_requests(engine, method, params, 512, stream=0)
    gc.collect()
    gc.freeze()
    c0, t0 = time.process_time(), time.perf_counter()
    T.run_requests(engine, method, params, n, stream=0)
    gc.unfreeze()
    return {"requests": n, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", type=int, default=20_000, help="requests of the parallel G-test loop (0: skip)")
    ap.add_argument("--pipeline", type=int, default=5_000, help="requests of each pipeline loop (0: skip)")
    ap.add_argument("--engine", type=int, default=10_000, help="requests of the engine's chain law loop (0: skip)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    if args.parallel:
        for case in ("single", "multi"):
            results[f"parallel {case}"] = parallel_loop(args.parallel, case)
    if args.pipeline:
        for mode in ("specinfer", "specpipe"):
            results[f"pipeline {mode}"] = pipeline_loop(args.pipeline, mode)
    if args.engine:
        with tempfile.TemporaryDirectory() as cache:
            results["engine chain"] = engine_loop(args.engine, "chain", Path(cache))
    for name, r in results.items():
        cpu = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in r.items() if k.endswith("cpu_s"))
        rate = r["requests"] / r["wall_s"]
        print(f"{name}: {int(r['requests'])} requests in {r['wall_s']:.2f} s ({rate:.0f}/s); {cpu}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
