"""`--executor pipeline` on the command line (generate, serve, bench): the pipeline mode, its tree
and top-k from the arguments, checked before any model loads; `specwood generate --executor pipeline`.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

from specwood.drafting.shapes import MODEL_SHAPES
from specwood.engine.specpipe.jobs import DRAFTED_MODES, check_pipeline_args, tree_nodes
from specwood.engine.specpipe.launch import generate_pipeline
from specwood.errors import SpecwoodError
from specwood.sampling import params_from_flags


def cli_mode(args: Any) -> tuple[str, dict[str, Any] | None, int]:
    """The pipeline mode of `generate|serve --executor pipeline` (--pipeline-mode; specinfer: --method
    names the tree shape, static = SpecInfer's by default; --budget/--depth), its tree and top-k.
    Checks that need no model, so bad input fails before anything loads."""
    mode, topk = args.pipeline_mode, args.topk if args.topk is not None else 4
    check_pipeline_args(args.stages, args.width, topk)
    tree = None
    if mode == "specinfer":
        name = "static" if args.method in ("auto", "specinfer") else args.method
        if name not in MODEL_SHAPES:
            shapes = ", ".join(MODEL_SHAPES)
            raise SpecwoodError(f"--pipeline-mode specinfer drafts a tree shape ({shapes}), not method '{args.method}'")
        tree = {"name": name, **{k: getattr(args, k) for k in ("budget", "depth", "threshold")
                                 if getattr(args, k, None) is not None}}
        tree_nodes(tree)  # bad options fail here, before any process starts
    elif args.method not in ("auto", "ar", "specpipe"):
        raise SpecwoodError(f"executor 'pipeline' runs SpecPipe (or plain PP with --pipeline-mode pp), not method "
                            f"'{args.method}'; drop --method")
    if mode in DRAFTED_MODES and args.draft in (None, "none"):
        raise SpecwoodError(f"--pipeline-mode {mode} needs a draft model; pass --draft NAME|PATH or use "
                            "--pipeline-mode pp")
    return mode, tree, topk


def pipeline_cli_options(args: Any) -> dict[str, Any]:
    """`--executor pipeline`'s flags checked before any model loads; PipelineExecutor's options.
    A command that names one method (serve: --method with --pipeline-mode) gets it as the pipeline
    names it (specpipe, pp, or the specinfer tree's shape) in `args.method`, its default; a bench
    checks each of its methods itself (pipeline_mode)."""
    topk = args.topk if args.topk is not None else 4
    if getattr(args, "method", None) is None:  # bench: --methods, each checked as it runs
        check_pipeline_args(args.stages, args.width, topk)
        return {"stages": args.stages, "width": args.width, "topk": topk}
    mode, tree, topk = cli_mode(args)
    args.method = tree["name"] if tree is not None else mode
    options = {"stages": args.stages, "width": cli_width(args, mode), "topk": topk}
    if getattr(args, "max_batch", None) is not None:  # serve: requests in flight
        options["max_lanes"] = args.max_batch
    return options


def cli_width(args: Any, mode: str) -> int | str:
    """--width, where "auto" is only measured for SpecPipe (the other modes do not use it)."""
    return args.width if mode == "specpipe" or args.width != "auto" else 8


def cmd_generate_pipeline(args: Any, load_engine: Callable[..., Any]) -> int:
    """`specwood generate --executor pipeline --stages M [--width W|auto --topk K] [--pipeline-mode pp|specinfer]`."""
    mode, tree, topk = cli_mode(args)
    engine = load_engine(args, need_draft=mode in DRAFTED_MODES)
    prompt: Any = args.prompt
    if args.system and not args.raw:
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = generate_pipeline(engine, prompt, params_from_flags(args), stages=args.stages, width=cli_width(args, mode),
                               topk=topk, mode=mode, max_tokens=args.max_tokens, stop=args.stop, raw=args.raw,
                               on_text=stream, tree=tree)
    s = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": s}))
    else:
        w = f" w={s['width']}" + (" (auto)" if "width_choice" in s else "") if mode == "specpipe" else ""
        print(f"\n[{mode}{w} x{s['stages']} stages] {s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, TTFT "
              f"{s['ttft_s']:.3f}s, TBT p50 {s['tbt_ms_p50']} ms, steps {s['pipeline_steps']}, hits {s['hits']}, "
              f"misses {s['misses']}, stall steps {s['stall_steps']}, finish={result.finish_reason}", file=sys.stderr)
    return 0
