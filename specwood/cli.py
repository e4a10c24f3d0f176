"""The `specwood` command."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from specwood.engine.args import (add_executor_args, add_method_args, add_model_args, add_sampling_args,
                                  check_backend_args, load_engine, method_options)
from specwood.engine.executor import executor_name
from specwood.engine.executors import needs_draft_on, plugin_for
from specwood.errors import SpecwoodError
from specwood.sampling import params_from_flags


def cmd_generate(args: argparse.Namespace) -> int:
    check_backend_args(args)
    args.executor = getattr(args, "executor", None)
    plugin = plugin_for(args.executor)
    if plugin.generate_cli is not None:  # the pipeline's ranks start for the one request
        return plugin.generate_cli(args, load_engine)
    options = plugin.cli_options(args)  # checks that need no model first
    params = params_from_flags(args, **constraint_options(args))
    engine = load_engine(args, need_draft=needs_draft_on(args.executor, args.method))
    # a name the engine runs itself ("sequential"; None: the method decides, auto follows the plan)
    built = plugin.build(engine, options)
    executor: Any = built or args.executor
    prompt: Any = args.prompt
    if args.system and not args.raw:
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    try:
        result = engine.generate(prompt, params, max_tokens=args.max_tokens, stop=args.stop, method=args.method,
                                 raw=args.raw, on_text=stream, executor=executor, **method_options(args))
    finally:
        if built is not None:
            built.close()
    if args.json:
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "stats": result.stats}
        if result.logprobs is not None:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in result.logprobs]
        print(json.dumps(out))
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


def constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    """--grammar FILE (llguidance's Lark dialect), --json-schema FILE, --logprobs N as SamplingParams fields."""
    options: dict[str, Any] = {}
    if args.grammar is not None:
        import llguidance

        options["grammar"] = llguidance.LLMatcher.grammar_from_lark(_read_text(args.grammar, "--grammar"))
    if args.json_schema is not None:
        try:
            options["json_schema"] = json.loads(_read_text(args.json_schema, "--json-schema"))
        except json.JSONDecodeError as e:
            raise SpecwoodError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
    if args.logprobs is not None:
        options["logprobs"] = args.logprobs
    return options


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SpecwoodError(f"{flag} {path}: cannot read it ({e.strerror})") from None


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

    keys = list(args.api_key) if args.api_key else [os.environ["SPECWOOD_API_KEY"]] \
        if os.environ.get("SPECWOOD_API_KEY") is not None else []
    if any(not k.strip() for k in keys):
        raise SpecwoodError("--api-key (or SPECWOOD_API_KEY) is empty; give a key or leave it unset")
    if args.api_keys_file is not None:
        keys += read_keys_file(args.api_keys_file)
    hosts = names(args.allowed_hosts) if args.allowed_hosts is not None else None
    return Access(api_key=keys[0] if keys else None, more_keys=tuple(keys[1:]), key_scope=args.api_key_scope,
                  allowed_origins=names(args.allowed_origins), allowed_hosts=hosts)


def read_keys_file(path: str) -> list[str]:
    """The API keys of a keys file: one a line; blank lines and lines starting with '#' skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecwoodError(f"--api-keys-file {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise SpecwoodError(f"--api-keys-file {path}: holds no key (one key a line; '#' starts a comment)")
    bad = next((k for k in keys if any(c.isspace() for c in k)), None)
    if bad is not None:
        raise SpecwoodError(f"--api-keys-file {path}: a key holds whitespace (one key a line, nothing else on it)")
    return keys


def cmd_serve(args: argparse.Namespace) -> int:
    from specwood.serve.app import DEFAULT_MAX_CONTEXT, bind_socket, serve, server_config
    from specwood.serve.kv_memory import parse_size
    from specwood.serve.tenancy import Sharing

    # cheap checks first, so a typo or a busy port fails before the model load
    check_backend_args(args)
    plugin = plugin_for(args.executor)
    executor_options = plugin.cli_options(args)  # may name the method as the executor runs it
    need_draft = needs_draft_on(args.executor, args.method)
    access = access_of(args)
    # the scheduler and its KV cache, validated once (--max-batch, --max-queue, --request-timeout, --kv-memory)
    config = server_config(max_batch=args.max_batch, max_queue=args.max_queue,
                           kv_memory=parse_size(args.kv_memory) if args.kv_memory is not None else None,
                           shared_cache=args.shared_cache, request_timeout=args.request_timeout)
    if not 0 <= args.drain_timeout <= 3600:
        raise SpecwoodError(f"--drain-timeout must be between 0 and 3600 seconds, got {args.drain_timeout}")
    if not 0 < args.read_timeout <= 3600:
        raise SpecwoodError(f"--read-timeout must be between 0 and 3600 seconds, got {args.read_timeout}")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-connections", args.max_connections)):
        if value < 1:
            raise SpecwoodError(f"{flag} must be >= 1, got {value}")
    if args.max_context is None:
        # the sequential torch executor's rows grow within --kv-memory: the model's whole context;
        # the other executors and llama.cpp hold static rows of DEFAULT_MAX_CONTEXT
        grows = executor_name(args.executor) == "sequential" and args.backend == "torch"
        args.max_context = None if grows else DEFAULT_MAX_CONTEXT
    elif args.max_context < 2:
        raise SpecwoodError(f"--max-context must be >= 2, got {args.max_context}")
    sock = bind_socket(args.host, args.port)
    planner = None
    try:
        engine = load_engine(args, need_draft=need_draft)
        executor = plugin.build(engine, executor_options)
        if executor is None and args.method == "auto" and args.plan_in_background:
            planner = start_background_plan(args, engine)
        serve(engine, config, host=args.host, port=args.port, method=args.method, options=method_options(args),
              sock=sock, executor=executor, background=planner, max_body_bytes=args.max_body_bytes, access=access,
              drain_timeout=args.drain_timeout, read_timeout=args.read_timeout,
              max_connections=args.max_connections,
              sharing=Sharing(shared_cache=args.shared_cache, specwood_stats=args.specwood_stats))
    finally:
        sock.close()
        if planner is not None and planner.poll() is None:
            from specwood.serve.background import end_process_group

            end_process_group(planner)
    return 0


def start_background_plan(args: argparse.Namespace, engine: Any):
    """Without a measured plan, `auto` serves from the starter plan at once while `specwood plan`
    measures one in a niced child process; auto switches to it when it is stored. The server
    keeps the child stopped while it has requests (`serve(background=...)`)."""
    import os

    from specwood.engine.parallel_worker import time_forward
    from specwood.engine.processes import exit_with_parent
    from specwood.serve.background import Background
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
    # plain decoding timed here, on a quiet machine, before any request: a plan far from it is not stored
    step_ctx = min(128, engine.max_context - 1)
    cmd += ["--server-step-s", repr(time_forward(engine.target, step_ctx, 5)), "--server-step-ctx", str(step_ctx)]
    log = plans_dir() / "background-plan.log"
    print(f"specwood: no measured plan yet; measuring one in the background at low priority (log: {log})",
          file=sys.stderr)
    server = os.getpid()

    def in_child() -> None:  # low priority; killed with the server, even while it keeps it stopped
        os.nice(19)
        exit_with_parent(server)

    # its own process group: the server pauses it (and its workers) while busy
    return Background(cmd, log, "background plan (auto keeps its starter plan)", preexec_fn=in_child)


def build_parser() -> argparse.ArgumentParser:
    from specwood.version import __version__

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
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="constrain the output to a grammar in llguidance's Lark dialect (docs/processors.md)")
    g.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the output to a JSON schema")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N best alternatives (0..20)")
    add_executor_args(g, pipeline=True)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the embedded models")
    m.set_defaults(func=cmd_models)

    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server: POST /v1/chat/completions, /v1/completions; GET "
                                   "/v1/models, /health, /metrics. Requests are batched continuously; a request "
                                   "may pick another method with the body field \"method\". --max-context "
                                   "defaults to the model's whole context; the KV cache's --max-batch rows grow "
                                   "with the longest request within --kv-memory (the parallel and pipeline "
                                   "executors and llama.cpp targets: static rows of 4096).")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_model_args(s)
    add_method_args(s)
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a batch slot before new ones get 503 (default 64)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require this key ('Authorization: Bearer KEY', as OpenAI clients send it) on /v1/*; "
                        "give it several times for several tenants, whose requests never reuse each other's "
                        "cached work (docs/server.md, Isolation); default: $SPECWOOD_API_KEY, else none")
    s.add_argument("--api-keys-file", default=None,
                   help="a file of API keys, one a line ('#' comments): each key a tenant, as --api-key")
    s.add_argument("--no-shared-cache", dest="shared_cache", action="store_false",
                   help="no reuse across requests at all: no prefix cache, no suffix drafts from other requests' "
                        "answers, no prompt computed once for concurrent requests (docs/server.md, Isolation)")
    s.add_argument("--no-specwood-stats", dest="specwood_stats", action="store_false",
                   help="leave the per-request speculation statistics (specwood_stats: acceptance, which drafts "
                        "won, timings) out of responses; /metrics still counts them")
    s.add_argument("--api-key-scope", default="v1", choices=("v1", "all"),
                   help="v1: the key guards /v1/* (default); all: /health and /metrics too")
    s.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the server (CORS), e.g. "
                        "http://localhost:3000; default none: a request from a web page gets 403")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names the server answers to (default: loopback names when bound to "
                        "loopback, any otherwise)")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take, queue included, before it fails with 504 request_timeout "
                        "(default: no limit)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before they end (streams with "
                        "an error event and [DONE]); a second signal ends at once (default 30)")
    s.add_argument("--kv-memory", default=None,
                   help="bytes (or 512M, 4G, ...) of K/V the server holds: the cache rows of running requests "
                        "(they grow with the longest one, up to the model's context) and, in what they leave, "
                        "finished requests' K/V, so that a request sharing their prefix (the next turn of a chat, "
                        "a common system prompt) prefills only the rest; default: half the memory available at "
                        "start-up; 0: the default budget, but no reuse across requests")
    s.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 2 MiB)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's headers, then its body, may take to arrive; a slower body gets 408 "
                        "and a connection without headers is closed (default 30)")
    s.add_argument("--max-connections", type=int, default=256,
                   help="open connections served at once; requests on more get 503 (default 256)")
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
