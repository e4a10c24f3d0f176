"""`specwood bench`: argparse wiring. The lead's specwood/cli.py calls add_bench_parser(subparsers)
and dispatches to run_bench_cli(args)."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from specwood.cli import add_method_options, add_model_args, add_sampling_args, load_engine, method_options, needs_draft
from specwood.errors import SpecwoodError

DEFAULT_OUT = "bench-out"


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark decoding methods on a workload (tokens/s, speedup vs ar, AAT)",
        description="Run every method on every prompt of a workload in one process and write "
                    "results.json, run.json, report.md and PNG plots into --out.",
    )
    p.add_argument("--workload", default="builtin",
                   help="a JSONL file (lines: id, category, messages|prompt) or 'builtin' (default)")
    p.add_argument("--methods", default="ar,auto",
                   help="comma-separated methods: ar, auto, engine speculative methods, hf, hf-assisted, hf-pld "
                        "(default: ar,auto)")
    add_sampling_args(p, max_tokens=128)
    add_model_args(p)
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts, picked round-robin over categories")
    p.add_argument("--categories", type=_csv, default=None, help="comma-separated categories to keep")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_options(p.add_argument_group("method options (passed to speculative engine methods)"))
    p.set_defaults(func=run_bench_cli)
    return p


def run_bench_cli(args: argparse.Namespace) -> int:
    """0 on success, 1 if some generations failed, 2 on a usage/model error, 130 on Ctrl-C."""
    from specwood.bench.harness import normalise_sampling, parse_methods, run_bench
    from specwood.bench.hf_baseline import HF_METHODS, require_transformers
    from specwood.bench.workload import load_workload

    try:
        # cheap checks first so a typo fails before a multi-GB model load
        methods = parse_methods(args.methods)
        sampling = normalise_sampling({"temperature": args.temperature, "top_p": args.top_p,
                                       "top_k": args.top_k, "seed": args.seed})
        if any(m in HF_METHODS for m in methods):
            require_transformers()
        if args.max_tokens < 1:
            raise SpecwoodError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
        workload = load_workload(args.workload, limit=args.limit, categories=args.categories)
        for note in workload.notes:
            print(f"specwood bench: {note}", file=sys.stderr)

        # a draft costs memory and load time: only load it when some method drafts with it
        engine = load_engine(args, need_draft=any(needs_draft(m) for m in methods))
        run_info = {"argv": ["specwood", *sys.argv[1:]],
                    "command": shlex.join(["specwood", *sys.argv[1:]]),
                    "dtype_requested": args.dtype, "max_context": args.max_context}
        records = run_bench(engine, workload, methods, args.out, sampling=sampling,
                            method_options=method_options(args), max_tokens=args.max_tokens,
                            run_info={k: v for k, v in run_info.items() if v is not None},
                            progress=not args.no_progress)
    except SpecwoodError as e:
        print(f"specwood bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specwood bench: interrupted; partial results in {args.out}", file=sys.stderr)
        return 130
    from pathlib import Path

    print((Path(args.out) / "report.md").read_text(encoding="utf-8"))
    n_err = sum(1 for r in records if r.get("error"))
    if n_err:
        print(f"specwood bench: {n_err} generation(s) failed; see report.md", file=sys.stderr)
        return 1
    return 0
