"""`specwood bench`: argparse wiring. The lead's specwood/cli.py calls add_bench_parser(subparsers)
and dispatches to run_bench_cli(args)."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from specwood.engine.args import (
    HF_DRAFTS,
    add_executor_args,
    add_method_options,
    add_model_args,
    add_sampling_args,
    check_backend_args,
    load_engine,
    method_options,
    needs_draft,
)
from specwood.errors import SpecwoodError
from specwood.engine.executors import plugin_for
from specwood.methods import method_names, split_backend, split_executor

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
                   help="comma-separated methods: ar, auto, engine speculative methods, hf, hf-assisted, hf-pld, "
                        "llama.cpp (llama.cpp's plain decoding of the target GGUF; needs the llamacpp extra); "
                        "NAME@parallel runs NAME on the parallel executor, e.g. ar,duo,duo@parallel "
                        "(default: ar,auto)")
    add_sampling_args(p, max_tokens=128)
    add_model_args(p)
    add_executor_args(p, pipeline=True)
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts, picked round-robin over categories")
    p.add_argument("--categories", type=_csv, default=None, help="comma-separated categories to keep")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every prompt with every method N times, the methods in a rotated order each time, "
                        "and report the run with the median decode rate (all rates are kept in results.json; "
                        "default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_options(p.add_argument_group("method options (passed to speculative engine methods)"))
    add_fidelity_args(p.add_argument_group("weight fidelity (--fidelity)"))
    p.set_defaults(func=run_bench_cli)
    return p


def add_fidelity_args(g: Any) -> None:
    from specwood.bench.fidelity import DEFAULT_MODES, DEFAULT_TOKENS

    g.add_argument("--fidelity", action="store_true",
                   help="instead of the speed bench: teacher-force two texts shipped with Python (json/decoder.py, "
                        "the licence) through --target in every weight mode and llama.cpp, and report perplexity, "
                        "mean KL to the fp32 reference (the file's weights dequantised exactly) and top-1 agreement "
                        "(fidelity.json, fidelity.md, fidelity.png in --out)")
    g.add_argument("--fidelity-tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens of each text (default {DEFAULT_TOKENS})")
    g.add_argument("--fidelity-modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated weight modes, each passed to the loader as its dtype, plus llama.cpp; "
                        f"the fp32 reference always runs (default {','.join(DEFAULT_MODES)})")


def _check_method_backends(methods: list[str], args: argparse.Namespace) -> None:
    """'NAME@llama.cpp' rows need llama-cpp-python and the sequential executor; the Hugging Face
    baselines read the torch target."""
    from specwood.bench.hf_baseline import HF_METHODS
    from specwood.engine.backends import check_backends, resolve_backend

    if args.backend != "torch" and any(m in HF_METHODS for m in methods):
        raise SpecwoodError("the Hugging Face baselines (hf, hf-pld, hf-assisted) run the torch target; drop them "
                            "or use --backend torch (NAME@llama.cpp rows can run beside them)")
    for m in methods:
        name, backend = split_backend(m)
        if backend is not None:
            resolve_backend(backend, None)  # the missing extra: one line with the pip command
        executor = split_executor(name)[1] or args.executor
        check_backends(backend or args.backend, backend or args.draft_backend,
                       executor=None if name in HF_DRAFTS else executor)


def run_bench_cli(args: argparse.Namespace) -> int:
    """0 on success, 1 if some generations failed, 2 on a usage/model error, 130 on Ctrl-C."""
    from specwood.bench.harness import normalise_sampling, parse_methods, run_bench
    from specwood.bench.hf_baseline import HF_METHODS, require_transformers
    from specwood.bench.workload import load_workload

    if getattr(args, "fidelity", False):
        from specwood.bench.fidelity import run_fidelity_cli

        return run_fidelity_cli(args)
    try:
        # cheap checks first so a typo fails before a multi-GB model load
        methods = parse_methods(args.methods)
        check_backend_args(args)
        _check_method_backends(methods, args)
        # a bare method runs on --executor where the registry says it runs there (ar, the
        # baseline, stays sequential); NAME@executor picks one per row
        if args.executor not in (None, "sequential"):
            methods = [f"{m}@{args.executor}" if "@" not in m and m in method_names(args.executor) else m
                       for m in methods]
        executor_options: dict[str, dict[str, Any]] = {}
        for m in methods:
            name, executor = split_executor(m)
            if executor not in (None, "sequential"):
                plugin = plugin_for(executor)
                plugin.method(name, args)
                if executor not in executor_options:
                    executor_options[executor] = plugin.cli_options(args)
        sampling = normalise_sampling({"temperature": args.temperature, "top_p": args.top_p,
                                       "top_k": args.top_k, "seed": args.seed})
        if any(m in HF_METHODS for m in methods):
            require_transformers()
        if "llama.cpp" in methods:
            from specwood.models.llamacpp import import_llama_cpp

            import_llama_cpp()  # the missing extra fails now, not after the model load
        if args.max_tokens < 1:
            raise SpecwoodError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
        if args.repeats < 1:
            raise SpecwoodError(f"--repeats must be >= 1 (got {args.repeats})")
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
                            progress=not args.no_progress, executor_options=executor_options,
                            repeats=args.repeats)
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


# ------------------------------------------------------------------------------------ loadtest
DEFAULT_LOADTEST_OUT = "loadtest-out"
_SPAWN_ONLY = ("max_batch", "max_queue", "server_timeout")
_MODEL_ARGS = ("target", "draft", "dtype", "max_context")


def add_loadtest_parser(subparsers: Any) -> argparse.ArgumentParser:
    from specwood.engine.backends import DRAFT_DTYPE_CHOICES, DTYPE_CHOICES

    p = subparsers.add_parser(
        "loadtest",
        help="load-test the OpenAI-compatible server: aggregate tokens/s, TTFT and TBT vs concurrency",
        description="Send the workload's prompts (greedy, streaming) to `specwood serve` over HTTP with c "
                    "concurrent clients for every method and level c; write results.json, report.md and "
                    "loadtest.png into --out. Without --url it starts `specwood serve` on a free local port "
                    "(max batch = the largest level) and stops it at the end.",
    )
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels (default 1,2,4,8)")
    p.add_argument("--methods", default="ar,auto",
                   help="comma-separated methods, sent per request in the body field 'method' (default ar,auto)")
    p.add_argument("--workload", default="builtin",
                   help="a JSONL file (lines: id, category, messages|prompt) or 'builtin' (default)")
    p.add_argument("--limit", type=int, default=8,
                   help="at most N prompts, picked round-robin over categories (default 8)")
    p.add_argument("--categories", type=_csv, default=None, help="comma-separated categories to keep")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level, the same list for every level and method (default: max(prompts, "
                        "2 x the largest level), the prompts interleaved across categories and cycled)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--out", default=DEFAULT_LOADTEST_OUT, help=f"output directory (default ./{DEFAULT_LOADTEST_OUT})")
    p.add_argument("--url", default=None,
                   help="measure a running server (http://HOST:PORT) instead of starting one")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--warmup-timeout", type=float, default=1800.0,
                   help="seconds for each method's warm-up request (auto may profile first; default 1800)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request per method")
    p.add_argument("--max-total-requests", type=int, default=2000,
                   help="refuse plans with more requests than this in all (default 2000)")
    p.add_argument("--inprocess", action="store_true",
                   help="also run the c=1 requests through specwood.load(...).generate in this process "
                        "(server overhead; loads the model here, after the spawned server stopped)")
    p.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for per-chunk usage (stream_options.continuous_usage_stats), for servers that "
                        "reject it; tokens per chunk are then estimated from the text")
    p.add_argument("--no-progress", action="store_true", help="no per-request progress lines")
    g = p.add_argument_group("the spawned server (and the --inprocess engine)")
    g.add_argument("--target", default=None, help="registry name, .gguf file or HF folder (default: the server's)")
    g.add_argument("--draft", default=None, help="draft model name/path or 'none' (default: the server's)")
    g.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, help="default: the server's")
    g.add_argument("--draft-dtype", default=None, choices=DRAFT_DTYPE_CHOICES,
                   help="the draft's weight mode (default: the server's)")
    g.add_argument("--max-context", type=int, default=None, help="cap the context length")
    g.add_argument("--max-batch", type=int, default=None, help="server batch size (default: the largest level)")
    g.add_argument("--max-queue", type=int, default=None, help="server queue length (default: the server's)")
    g.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for the spawned server to be ready (default 900)")
    p.set_defaults(func=run_loadtest_cli)
    return p


def _given(args: argparse.Namespace, names: tuple[str, ...], defaults: dict[str, Any]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) != defaults.get(n)]


def _check_loadtest_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    from specwood.bench.harness import parse_methods
    from specwood.bench.load_requests import parse_concurrency

    concurrency = parse_concurrency(args.concurrency)
    methods = parse_methods(args.methods)
    from specwood.engine.args import HF_DRAFTS

    bench_only = [m for m in methods if m in HF_DRAFTS]
    if bench_only:
        raise SpecwoodError(f"{', '.join(bench_only)}: the Hugging Face and llama.cpp baselines run in "
                            "`specwood bench`, not in the server")
    for name in ("max_tokens", "requests", "limit", "max_total_requests", "max_batch", "max_queue", "max_context"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SpecwoodError(f"--{name.replace('_', '-')} must be >= 1 (got {v})")
    for name in ("request_timeout", "warmup_timeout", "server_timeout"):
        if not getattr(args, name) > 0:
            raise SpecwoodError(f"--{name.replace('_', '-')} must be > 0 seconds (got {getattr(args, name)})")
    if args.max_batch is not None and args.max_batch < max(concurrency):
        print(f"specwood loadtest: note: --max-batch {args.max_batch} < {max(concurrency)} clients: "
              "the server queues the rest", file=sys.stderr)
    if args.inprocess and 1 not in concurrency:
        raise SpecwoodError("--inprocess compares with the c=1 level: add 1 to --concurrency")
    if args.url:
        if not args.url.startswith(("http://", "https://")):
            raise SpecwoodError(f"--url must start with http:// or https:// (got '{args.url}')")
        spawn = _given(args, _SPAWN_ONLY, {"server_timeout": 900.0})
        if not args.inprocess:
            spawn += _given(args, _MODEL_ARGS, {})
        if spawn:
            raise SpecwoodError(f"{', '.join(spawn)} configure the spawned server; with --url the server is "
                                "already running (model options go to --inprocess only)")
    else:
        import importlib

        from specwood.methods import get_method

        importlib.import_module("specwood.planner.auto")  # registers the planner's methods (auto, prior)

        for m in methods:  # a typo fails now, not after minutes of model loading in the server
            get_method(m)
    return concurrency, methods


def _sigterm_as_interrupt() -> Any:
    """While the loadtest runs, SIGTERM unwinds like Ctrl-C (so the spawned server is stopped)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _load_inprocess_engine(args: argparse.Namespace, methods: list[str]) -> Any:
    from specwood.engine.api import load

    need = False
    for m in methods:
        try:
            need = need or needs_draft(m)
        except SpecwoodError:
            need = True
    draft = None if (args.draft == "none" or not need) else (args.draft or "auto")
    return load(args.target, draft, dtype=args.dtype or "auto", draft_dtype=args.draft_dtype or "auto",
                         max_context=args.max_context)


def run_loadtest_cli(args: argparse.Namespace) -> int:
    """0 on success, 1 if some requests failed, 2 on a usage/server error, 130 on Ctrl-C/SIGTERM."""
    import signal
    from pathlib import Path

    from specwood.bench import load_inprocess, load_report, server_process
    from specwood.bench import loadtest as lt
    from specwood.bench.workload import load_workload

    out = Path(args.out)
    old_sigterm = _sigterm_as_interrupt()
    try:
        concurrency, methods = _check_loadtest_args(args)
        workload = load_workload(args.workload, limit=args.limit, categories=args.categories)
        for note in workload.notes:
            print(f"specwood loadtest: {note}", file=sys.stderr)
        port = None if args.url else server_process.free_port()
        base_url = args.url or f"http://127.0.0.1:{port}"
        test = lt.LoadTest(base_url, workload, methods, concurrency, max_tokens=args.max_tokens,
                           n_requests=args.requests, request_timeout=args.request_timeout,
                           warmup=not args.no_warmup, warmup_timeout=args.warmup_timeout,
                           max_total_requests=args.max_total_requests,
                           continuous_usage=not args.no_continuous_usage, progress=not args.no_progress)
        run_info: dict[str, Any] = {"command": shlex.join(["specwood", *sys.argv[1:]])}
        if args.url:
            run_info["server"] = {"spawned": False}
            result = lt.execute(test, out, run_info)
        else:
            assert port is not None
            cmd = server_process.serve_command(port, max_batch=args.max_batch or max(concurrency),
                                               target=args.target, draft=args.draft, dtype=args.dtype,
                                               draft_dtype=args.draft_dtype, max_context=args.max_context,
                                               max_queue=args.max_queue)
            shown = ["specwood", *cmd[3:]] if cmd[1:3] == ["-m", "specwood.cli"] else cmd
            run_info["server"] = {"spawned": True, "command": shlex.join(shown), "argv": cmd,
                                  "log": "server.log"}
            with server_process.ServerProcess(cmd, base_url, log_path=out / "server.log",
                                              startup_timeout=args.server_timeout):
                result = lt.execute(test, out, run_info)
        if args.inprocess:
            print("specwood loadtest: loading the engine in this process (--inprocess) ...", file=sys.stderr)
            engine = _load_inprocess_engine(args, methods)
            rows = load_inprocess.run_inprocess(engine, test.requests, methods, args.max_tokens,
                                                warmup=not args.no_warmup)
            result = load_report.assemble(test, result["meta"], rows)
            load_report.write_outputs(out, result)
    except SpecwoodError as e:
        print(f"specwood: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specwood loadtest: interrupted; partial results in {out}", file=sys.stderr)
        return 130
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    print((out / "report.md").read_text(encoding="utf-8"))
    n_err = sum(1 for r in result["requests"] if r.get("error"))
    if n_err:
        print(f"specwood loadtest: {n_err} request(s) failed; see {out / 'report.md'}", file=sys.stderr)
        return 1
    return 0
