"""`specwood bench`: argparse wiring. The lead's specwood/cli.py calls add_bench_parser(subparsers)
and dispatches to run_bench_cli(args)."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from specwood.errors import SpecwoodError

DEFAULT_OUT = "bench-out"


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


# methods that run without a draft model (everything else drafts with one)
NO_DRAFT_METHODS = ("ar", "pld", "early-exit", "hf", "hf-pld")


def needs_draft(method: str) -> bool:
    return method not in NO_DRAFT_METHODS


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark decoding methods on a workload (tokens/s, speedup vs ar, AAT)",
        description="Run every method on every prompt of a workload in one process and write "
                    "results.json, run.json, report.md and PNG plots into --out.",
    )
    p.add_argument("--workload", default="builtin",
                   help="a JSONL file (lines: id, category, messages|prompt) or 'builtin' (default)")
    p.add_argument("--methods", default="ar",
                   help="comma-separated methods: ar, engine speculative methods, hf, hf-assisted, hf-pld "
                        "(default: ar)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    # the same model options as `specwood generate`
    p.add_argument("--target", default=None, help="registry name, .gguf file or HF folder (default: qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--draft", default="auto",
                   help="draft model name/path; 'auto' = the target's default draft; 'none' = no draft. "
                        "Loaded only when a method needs it")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto = bf16 on CPUs with AVX512-BF16/AMX and on GPUs, else fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (default: the model's)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts, picked round-robin over categories")
    p.add_argument("--categories", type=_csv, default=None, help="comma-separated categories to keep")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("method options (passed to speculative engine methods)")
    g.add_argument("--budget", type=int, default=None, help="tree node budget")
    g.add_argument("--depth", type=int, default=None, help="max tree depth / draft length")
    g.add_argument("--topk", type=int, default=None, help="children per expanded node")
    g.add_argument("--threshold", type=float, default=None, help="probability threshold for tree expansion")
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

        import specwood

        # a draft costs memory and load time: only load it when some method drafts with it
        draft = args.draft if any(needs_draft(m) for m in methods) and args.draft not in (None, "none") else None
        engine = specwood.load(args.target, draft, dtype=args.dtype, device=args.device,
                               max_context=args.max_context)
        method_options = {k: getattr(args, k, None) for k in ("budget", "depth", "topk", "threshold")}
        run_info = {"argv": ["specwood", *sys.argv[1:]],
                    "command": shlex.join(["specwood", *sys.argv[1:]]),
                    "dtype_requested": args.dtype, "max_context": args.max_context}
        records = run_bench(engine, workload, methods, args.out, sampling=sampling,
                            method_options=method_options, max_tokens=args.max_tokens,
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


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m specwood.bench.cli ...) until the top-level CLI wires it in."""
    parser = argparse.ArgumentParser(prog="specwood")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
