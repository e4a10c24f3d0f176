"""The `specwood` command."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from specwood.errors import SpecwoodError

METHOD_OPTIONS = ("budget", "depth", "topk", "threshold", "shape")


# the bench's baselines (Hugging Face generate, llama.cpp; not engine methods) and whether they draft with a model
HF_DRAFTS = {"hf": False, "hf-pld": False, "hf-assisted": True, "llama.cpp": False}


def needs_draft(method: str) -> bool:
    """Whether to load the draft model for `method` (from the method registry)."""
    from specwood.methods import get_method, split_executor

    if method in HF_DRAFTS:
        return HF_DRAFTS[method]
    name, executor = split_executor(method)
    if executor == "pipeline":  # every pipeline method but plain PP drafts (engine/pipeline_launch.py)
        return name not in ("pp", "ar")
    return executor == "parallel" or get_method(name).loads_draft


def add_executor_args(p: argparse.ArgumentParser, pipeline: bool = False) -> None:
    p.add_argument("--executor", choices=["sequential", "parallel"] + (["pipeline"] if pipeline else []), default=None,
                   help="parallel = DuoDecoding: the draft model in a worker process on --draft-device, drafting "
                        "while the target verifies (method duo; needs a draft). Default: sequential, except that "
                        "auto runs parallel where `specwood plan` measured it fastest")
    p.add_argument("--draft-device", default="cpu", help="parallel executor: the draft's device, cpu or cuda:N")
    p.add_argument("--draft-threads", type=int, default=None,
                   help="parallel executor: CPU threads (and pinned cores) of the draft worker (default: all cores "
                        "but one beside a GPU target, half of them beside a CPU target); the target gets the rest")
    if pipeline:  # SpecPipe (specwood/engine/pipeline.py); --topk is shared with the method options
        p.add_argument("--stages", type=int, default=2, help="pipeline executor: target stages, one process each")
        p.add_argument("--width", type=width_arg, default="auto",
                       help="pipeline executor: tree width w (nodes per level); auto (default) = the planner's "
                            "argmin of E(T) = t(w) + (1 - P(w))(m - 1)t(w), measured once and stored")
        p.add_argument("--pipeline-mode", choices=["specpipe", "pp", "specinfer"], default="specpipe",
                       help="pipeline executor: specpipe (one tree level per step), pp (plain, no speculation) or "
                            "specinfer (PP + a whole static tree per pass; --method picks the shape, default static)")


def width_arg(value: str) -> int | str:
    """--width: a number, or auto."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {value!r}") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    from specwood.engine.backends import DRAFT_DTYPE_CHOICES, DTYPE_CHOICES

    p.add_argument("--target", default=None, help="registry name, .gguf file or HF folder (default: qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--draft", default="auto",
                   help="draft model name/path; 'auto' = the target's default draft; 'none' = no draft. "
                        "Loaded only when the method drafts with a model")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto = q4 for a GGUF of Q4_K weights (the default pair) on CPUs with AVX512-VNNI, else bf16 on "
                        "CPUs with AVX512-BF16/AMX and on GPUs, else fp32; q4 = the GGUF's Q4_K, Q5_K, Q6_K and "
                        "Q8_0 weights as the file stores them (Q4_0/Q5_0 as Q8_0, exactly; other types in bf16, one "
                        "line names them) times int8 activations "
                        "per 32 inputs, on specwood's AVX512-VNNI kernel (CPU): closer to the file than llama.cpp "
                        "(KL against the file's weights: 0.0009 on code, llama.cpp 0.0086; BENCHMARKS.md §9); q4-lite = "
                        "every linear in 4 bits (Q6_K requantised): 10%% fewer bytes a step, lossier (KL 0.016, "
                        "~18x q4's); int8 = W8A8 linears (int8 weights, per-token "
                        "int8 activations). Every method is token-identical to ar in every mode")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPE_CHOICES,
                   help="auto = q4-lite on CPUs with AVX512-VNNI, else int4 weights on other CPUs (drafts "
                        "never change the output, only the speed), else --dtype")
    p.add_argument("--head", default=None,
                   help="a feature-level draft head for --method head: a file from `specwood train-drafter`, an "
                        "EAGLE-1/EAGLE-2 head folder (config.json + weights) trained for this target, or auto (the "
                        "head shipped for a registry target)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (default: the model's)")
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    from specwood.engine.backends import BACKEND_CHOICES

    p.add_argument("--backend", default="torch", choices=BACKEND_CHOICES,
                   help="the target's runtime: torch (default), llama.cpp (llama-cpp-python on the GGUF file as it "
                        "is, CPU, one request at a time) or auto (the configuration `specwood plan --choose-config` "
                        "measured fastest here, both models' backends and weight modes; without one, llama.cpp "
                        "for a GGUF when it is installed)")
    p.add_argument("--draft-backend", default="torch", choices=BACKEND_CHOICES, help="the draft's runtime (as --backend)")


def check_backend_args(args: argparse.Namespace) -> None:
    """Resolve --backend/--draft-backend and refuse unsupported combinations before any model loads."""
    from specwood.engine.backends import RuntimeConfig, check_backends, resolve_runtime

    draft = None if args.draft in (None, "none") else args.draft
    if draft == "auto":
        from specwood.models.registry import DEFAULT_TARGET, default_draft_for

        draft = default_draft_for(str(args.target or DEFAULT_TARGET))
    asked = RuntimeConfig(getattr(args, "backend", "torch"), args.dtype, getattr(args, "draft_backend", "torch"),
                          args.draft_dtype)
    runtime, note = resolve_runtime(asked, args.target, draft, args.device)
    if note:
        print(f"[load] {note}", file=sys.stderr)
    check_backends(runtime.backend, runtime.draft_backend, dtype=runtime.dtype, draft_dtype=runtime.draft_dtype,
                   device=args.device, executor=getattr(args, "executor", None))
    args.backend, args.draft_backend, args.dtype, args.draft_dtype = (runtime.backend, runtime.draft_backend,
                                                                      runtime.dtype, runtime.draft_dtype)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def add_method_args(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--method", default=default,
                   help="auto (default: the planner's choice of AR or dyspec and its tree size for this hardware; "
                        "the first run profiles for a few minutes), ar, chain, static, sequoia, eagle, dyspec, "
                        "dyspec-threshold, pld, early-exit (experimental: no trained exit adapter, slower than ar), prior, duo")
    add_method_options(p)


def add_method_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=int, default=None, help="tree nodes per step (speculative methods)")
    p.add_argument("--depth", type=int, default=None, help="maximum tree depth")
    p.add_argument("--topk", type=int, default=None, help="branching for top-k shapes (eagle)")
    p.add_argument("--threshold", type=float, default=None, help="dyspec-threshold expansion threshold in (0,1)")
    p.add_argument("--shape", default=None,
                   help="the tree shape of a method that drafts with any (head, early-exit): chain, eagle, dyspec, ...")


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in METHOD_OPTIONS if getattr(args, k, None) is not None}


def load_engine(args: argparse.Namespace, need_draft: bool = True):
    import specwood

    draft = None if (args.draft in (None, "none") or not need_draft) else args.draft
    return specwood.load(args.target, draft, dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
                         max_context=args.max_context, backend=getattr(args, "backend", "torch"),
                         draft_backend=getattr(args, "draft_backend", "torch"), head=getattr(args, "head", None))


def cmd_generate(args: argparse.Namespace) -> int:
    check_backend_args(args)
    if getattr(args, "executor", None) == "pipeline":
        from specwood.engine.pipeline_launch import cmd_generate_pipeline

        return cmd_generate_pipeline(args, load_engine)
    parallel = getattr(args, "executor", None) == "parallel"
    if parallel:  # DuoDecoding (specwood/engine/parallel.py): checks that need no model first
        from specwood.engine.parallel import check_cli_args, parallel_method

        args.method = parallel_method(args.method)
        worker = check_cli_args(args)
    engine = load_engine(args, need_draft=needs_draft(args.method))
    executor: Any = getattr(args, "executor", None)  # None: the method decides (auto follows the plan)
    if parallel:
        from specwood.engine.parallel import ParallelExecutor

        executor = ParallelExecutor(engine, **worker)
    prompt: Any = args.prompt
    if args.system and not args.raw:
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    try:
        result = engine.generate(
            prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop, method=args.method, raw=args.raw, on_text=stream, executor=executor,
            **method_options(args),
        )
    finally:
        if parallel:
            executor.close()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": result.stats}))
    else:
        s = result.stats
        line = (f"[{s['method']}] {s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, TTFT {s['ttft_s']:.3f}s, "
                f"TBT p50 {s['tbt_ms_p50']} ms, finish={result.finish_reason}")
        if "mean_accepted_tokens" in s:
            line += f", AAT {s['mean_accepted_tokens']:.2f}, acceptance {s['acceptance_rate']:.2f}"
        if s.get("executor") == "parallel":
            line += (f", parallel: {s['iterations']} iterations, gamma {s['gamma_mean']:.1f}, sequences "
                     f"{s['sequences_mean']:.1f}, idle draft {s['draft_idle_s']:.3f}s target {s['target_idle_s']:.3f}s")
        print("\n" + line, file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specwood.models.registry import REGISTRY, cache_dir, model_cache_dir

    print(f"cache: {cache_dir()}")
    for spec in REGISTRY.values():
        path = model_cache_dir(spec.name) / spec.filename
        state = "assembled" if path.exists() else "not assembled"
        print(f"{spec.name:32s} {spec.role:6s} {spec.size / 2**20:8.1f} MiB  {state}  {spec.description}")
    return 0


def access_of(args: argparse.Namespace) -> Any:
    """The server's access rules from its flags (specwood.serve.guard.Access)."""
    from specwood.serve.guard import Access

    def names(value: str | None) -> tuple[str, ...]:
        return tuple(v.strip() for v in (value or "").split(",") if v.strip())

    if args.api_key is not None and not args.api_key.strip():
        raise SpecwoodError("--api-key (or SPECWOOD_API_KEY) is empty; give a key or leave it unset")
    hosts = names(args.allowed_hosts) if args.allowed_hosts is not None else None
    return Access(api_key=args.api_key, key_scope=args.api_key_scope, allowed_origins=names(args.allowed_origins),
                  allowed_hosts=hosts)


def cmd_serve(args: argparse.Namespace) -> int:
    from specwood.serve.app import DEFAULT_MAX_CONTEXT, bind_socket, serve

    # cheap checks first, so a typo or a busy port fails before the model load
    check_backend_args(args)
    parallel = args.executor == "parallel"
    if parallel:  # DuoDecoding serves method duo in lock-step batches
        from specwood.engine.parallel import check_cli_args, parallel_method

        args.method = parallel_method(args.method)
        worker = check_cli_args(args)
    pipeline = None
    if args.executor == "pipeline":  # SpecPipe-DB: requests join and leave between pipeline steps
        from specwood.engine.pipeline_launch import check_serve_args

        args.method, pipeline = check_serve_args(args)
    need_draft = needs_draft(f"{args.method}@pipeline" if pipeline else args.method)
    access = access_of(args)
    if not 0 <= args.drain_timeout <= 3600:
        raise SpecwoodError(f"--drain-timeout must be between 0 and 3600 seconds, got {args.drain_timeout}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise SpecwoodError(f"{flag} must be >= 1, got {value}")
    if args.max_context is None:
        args.max_context = DEFAULT_MAX_CONTEXT
    elif args.max_context < 2:
        raise SpecwoodError(f"--max-context must be >= 2, got {args.max_context}")
    sock = bind_socket(args.host, args.port)
    planner = None
    try:
        engine = load_engine(args, need_draft=need_draft)
        executor = None
        if parallel:
            from specwood.engine.parallel import ParallelExecutor

            executor = ParallelExecutor(engine, **worker)
        elif pipeline is not None:
            from specwood.engine.pipeline_launch import PipelineExecutor

            executor = PipelineExecutor(engine, max_lanes=args.max_batch, **pipeline)
        elif args.method == "auto" and args.plan_in_background:
            planner = start_background_plan(args, engine)
        serve(engine, host=args.host, port=args.port, method=args.method, options=method_options(args),
              max_batch=args.max_batch, max_queue=args.max_queue, sock=sock, executor=executor,
              background=planner, max_body_bytes=args.max_body_bytes, access=access, drain_timeout=args.drain_timeout)
    finally:
        sock.close()
        if planner is not None and planner.poll() is None:
            from specwood.serve.app import end_process_group

            end_process_group(planner)
    return 0


def start_background_plan(args: argparse.Namespace, engine: Any):
    """Without a measured plan, `auto` serves from the starter plan at once while `specwood plan`
    measures one in a niced child process; auto switches to it when it is stored. The server
    keeps the child stopped while it has requests (`serve(background=...)`)."""
    import os
    import subprocess

    from specwood.engine.processes import exit_with_parent
    from specwood.planner import load_plan, plan_key_for
    from specwood.planner.store import DEFAULT_METHOD, plans_dir

    if (engine.draft_model is None or engine.backend != "torch"  # `specwood plan` measures torch models
            or load_plan(plan_key_for(engine, DEFAULT_METHOD)) is not None):
        return None
    cmd = [sys.executable, "-m", "specwood.cli", "plan", "--method", DEFAULT_METHOD, "--quick",
           "--dtype", args.dtype, "--draft-dtype", args.draft_dtype, "--torch-device", args.device, "--no-plots"]
    if args.target:
        cmd += ["--target", str(args.target)]
    if args.draft not in (None, "auto"):
        cmd += ["--draft", str(args.draft)]
    log = plans_dir() / "background-plan.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"specwood: no measured plan yet; measuring one in the background at low priority (log: {log})",
          file=sys.stderr)
    server = os.getpid()

    def in_child() -> None:  # low priority; killed with the server, even while it keeps it stopped
        os.nice(19)
        exit_with_parent(server)

    with open(log, "w") as out:  # its own process group: the server pauses it (and its workers) while busy
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=in_child, start_new_session=True)


def build_parser() -> argparse.ArgumentParser:
    from specwood import __version__

    parser = argparse.ArgumentParser(prog="specwood", description="Lossless tree speculative decoding for LLMs.")
    parser.add_argument("--version", action="version", version=f"specwood {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    add_model_args(g)
    add_sampling_args(g)
    add_method_args(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_executor_args(g, pipeline=True)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the embedded models")
    m.set_defaults(func=cmd_models)

    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server: POST /v1/chat/completions, /v1/completions; GET "
                                   "/v1/models, /health, /metrics. Requests are batched continuously; a request "
                                   "may pick another method with the body field \"method\". --max-context "
                                   "defaults to 4096 here (the KV cache holds --max-batch rows of it).")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_model_args(s)
    add_method_args(s)
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a batch slot before new ones get 503 (default 64)")
    s.add_argument("--api-key", default=os.environ.get("SPECWOOD_API_KEY"),
                   help="require this key ('Authorization: Bearer KEY', as OpenAI clients send it) on /v1/*; "
                        "default: $SPECWOOD_API_KEY, else none")
    s.add_argument("--api-key-scope", default="v1", choices=("v1", "all"),
                   help="v1: the key guards /v1/* (default); all: /health and /metrics too")
    s.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the server (CORS), e.g. "
                        "http://localhost:3000; default none: a request from a web page gets 403")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names the server answers to (default: loopback names when bound to "
                        "loopback, any otherwise)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before they end (streams with "
                        "an error event and [DONE]); a second signal ends at once (default 30)")
    s.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 2 MiB)")
    add_executor_args(s, pipeline=True)
    s.add_argument("--no-plan-in-background", dest="plan_in_background", action="store_false",
                   help="with --method auto and no measured plan, do not measure one in a niced child process "
                        "(auto serves from the starter plan meanwhile and switches when it is stored)")
    s.set_defaults(func=cmd_serve)

    from specwood.bench.cli import add_bench_parser, add_loadtest_parser
    from specwood.planner.cli import add_plan_parser

    add_bench_parser(sub)
    add_loadtest_parser(sub)
    add_plan_parser(sub)
    from specwood.train_drafter import add_train_drafter_parser

    add_train_drafter_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecwoodError as e:
        print(f"specwood: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwood: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
