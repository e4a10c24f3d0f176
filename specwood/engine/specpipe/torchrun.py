"""SpecPipe's torchrun entry point: one rank of the pipeline per process.

    torchrun --nproc-per-node M -m specwood.engine.specpipe.torchrun PROMPT [--mode specpipe|pp|specinfer] ...

Every rank loads its own layers (specwood.engine.specpipe.ranks.stage_ranges); rank 0 also loads the draft
and the tokenizer, runs the one job and prints its text.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch

from specwood.engine.api import Engine, check_device, resolve_dtype
from specwood.engine.args import add_model_args, add_sampling_args
from specwood.engine.specpipe.ranks import run_rank
from specwood.engine.specpipe.jobs import DRAFTED_MODES, MODES, Job, check_pipeline_args, stage_ranges, tree_nodes
from specwood.errors import SpecwoodError
from specwood.models.loader import load_checkpoint, load_tokenizer
from specwood.models.linears import int4_available
from specwood.models.registry import DEFAULT_TARGET, default_draft_for
from specwood.models.transformer import build_model
from specwood.engine.vocab import emit_limit
from specwood.sampling import params_from_flags




def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specwood.engine.specpipe.torchrun",
                                description="SpecPipe over torch.distributed; run under torchrun --nproc-per-node M")
    p.add_argument("prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--mode", choices=MODES, default="specpipe")
    p.add_argument("--stages", type=int, default=None, help="must equal the world size (default: it)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--shape", default="static", help="--mode specinfer: the tree shape (static = SpecInfer's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--raw", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: every rank loads its own layers; rank 0 also the draft and tokenizer."""
    args = _parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        stages = args.stages if args.stages is not None else world
        if stages != world:
            raise SpecwoodError(f"--stages {stages} does not match the {world} launched ranks "
                                f"(torchrun --nproc-per-node {stages}, or drop --stages)")
        check_pipeline_args(stages, args.width, args.topk)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = args.device if not args.device.startswith("cuda") else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        device = check_device(device)
        dtype = resolve_dtype(args.dtype, device)
        cfg = load_checkpoint(args.target or _default_target(), dtype=dtype, layers=range(0, 1))[0]
        check_pipeline_args(stages, args.width, args.topk, cfg.n_layers)
        layers = stage_ranges(cfg, stages)
    except SpecwoodError as e:
        if rank == 0:
            print(f"specwood: error: {e}", file=sys.stderr, flush=True)
        return 2
    target = args.target or _default_target()

    def build(r: int, rng: range) -> dict[str, Any]:
        c, sd, path = load_checkpoint(target, dtype=dtype, layers=rng)
        positions = min(args.max_context or c.max_position_embeddings, c.max_position_embeddings)
        parts: dict[str, Any] = {"stage": build_model(c, sd, dtype, device, layers=rng, max_positions=positions)}
        if r == 0:
            parts.update(_rank0_parts(args, target, c, path, device, dtype, positions))
        return parts

    result = run_rank(rank, world, build, layers, None, None, args.timeout, fingerprint=str(target))
    if rank == 0 and result is not None:
        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats}))
        else:
            s = result.stats
            print(f"\n[{s['method']} x{world} stages] {s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, "
                  f"TBT p50 {s['tbt_ms_p50']} ms, hits {s['hits']}, misses {s['misses']}, "
                  f"stall steps {s['stall_steps']}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _default_target() -> str:
    return DEFAULT_TARGET


def _rank0_parts(args: Any, target: str, cfg: Any, path: Any, device: str, dtype: torch.dtype,
                 positions: int) -> dict[str, Any]:
    tokenizer = load_tokenizer(path)
    parts: dict[str, Any] = {"tokenizer": tokenizer, "on_text": None if args.json else
                             (lambda s: (sys.stdout.write(s), sys.stdout.flush()))}
    if args.mode in DRAFTED_MODES:
        draft = default_draft_for(target) if args.draft == "auto" else args.draft
        if draft in (None, "none"):
            raise SpecwoodError(f"mode '{args.mode}' needs a draft model: pass --draft NAME|PATH (or --mode pp)")
        int4 = args.draft_dtype == "int4" or (args.draft_dtype == "auto" and device == "cpu" and int4_available())
        ddtype = torch.bfloat16 if int4 else dtype
        dcfg, dsd, _ = load_checkpoint(str(draft), dtype=ddtype)
        parts["draft"] = build_model(dcfg, dsd, ddtype, device, max_positions=positions, int4=int4)
    shim = SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(config=cfg))  # Engine's helpers, no Engine
    parts["eos_ids"] = Engine._eos_ids(shim)
    prompt = Engine.encode(shim, args.prompt, args.raw)
    max_tokens = min(args.max_tokens, positions - len(prompt))
    if max_tokens < 1:
        raise SpecwoodError(f"prompt has {len(prompt)} tokens but the context holds {positions}; shorten the prompt")
    params = params_from_flags(args, emit_limit=emit_limit(tokenizer, cfg.vocab_size))  # never a padding id
    tree = {"name": args.shape}
    parts["job"] = (Job(prompt, max_tokens, params, args.mode, args.width, args.topk, tree, tree_nodes(tree)), None)
    return parts


if __name__ == "__main__":
    sys.exit(main())
