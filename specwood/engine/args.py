"""Command-line arguments shared by every command that loads models (generate, serve, bench, plan,
the pipeline's torchrun entry): the models and their weight modes, backends, sampling, methods and
executors, and loading the engine they describe."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from specwood.engine.api import Engine, load
from specwood.engine.backends import (BACKEND_CHOICES, DRAFT_DTYPE_CHOICES, DTYPE_CHOICES, RuntimeConfig,
                                      check_backends, resolve_runtime)
from specwood.engine.executors import needs_draft_on
from specwood.methods import split_executor
from specwood.models.registry import DEFAULT_TARGET, default_draft_for

METHOD_OPTIONS = ("budget", "depth", "topk", "threshold", "shape", "suffix_cache_tokens", "suffix")


# the bench's baselines (Hugging Face generate, llama.cpp; not engine methods) and whether they draft with a model
HF_DRAFTS = {"hf": False, "hf-pld": False, "hf-assisted": True, "llama.cpp": False}


def needs_draft(method: str) -> bool:
    """Whether to load the draft model for `method` (from the method registry)."""
    if method in HF_DRAFTS:
        return HF_DRAFTS[method]
    name, executor = split_executor(method)
    return needs_draft_on(executor, name)


def add_executor_args(p: argparse.ArgumentParser, pipeline: bool = False) -> None:
    p.add_argument("--executor", choices=["sequential", "parallel"] + (["pipeline"] if pipeline else []), default=None,
                   help="parallel = DuoDecoding: the draft model in a worker process on --draft-device, drafting "
                        "while the target verifies (method duo; needs a draft). Default: sequential, except that "
                        "auto runs parallel where `specwood plan` measured it fastest")
    p.add_argument("--draft-device", default="cpu", help="parallel executor: the draft's device, cpu or cuda:N")
    p.add_argument("--draft-threads", type=int, default=None,
                   help="parallel executor: CPU threads (and pinned cores) of the draft worker (default: all cores "
                        "but one beside a GPU target, half of them beside a CPU target); the target gets the rest")
    if pipeline:  # SpecPipe (specwood/engine/specpipe/ranks.py); --topk is shared with the method options
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
    p.add_argument("--target", default=None,
                   help="registry name, .gguf file or HF folder (default: qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--draft", default="auto",
                   help="draft model name/path; 'auto' = the target's default draft; 'none' = no draft. "
                        "Loaded only when the method drafts with a model")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto = q4 for a GGUF of Q4_K weights (the default pair) on CPUs with AVX512-VNNI or AVX2, "
                        "else bf16 on CPUs with AVX512-BF16/AMX and on GPUs, else fp32; "
                        "q4 = the GGUF's Q4_K, Q5_K, Q6_K and "
                        "Q8_0 weights as the file stores them (Q4_0/Q5_0 as Q8_0, exactly; other types in bf16, one "
                        "line names them) times int8 activations "
                        "per 32 inputs, on specwood's AVX512-VNNI kernel (or its AVX2 build, same bits) (CPU): "
                        "closer to the file than llama.cpp "
                        "(KL against the file's weights: 0.0009 on code, llama.cpp 0.0086; BENCHMARKS.md §9); "
                        "q4-lite = "
                        "every linear in 4 bits (Q6_K requantised): 10%% fewer bytes a step, lossier (KL 0.016, "
                        "~18x q4's); int8 = W8A8 linears (int8 weights, per-token "
                        "int8 activations). Every method is token-identical to ar in every mode")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPE_CHOICES,
                   help="auto = q4-lite on CPUs with AVX2 or AVX512, else int4 weights on other CPUs (drafts "
                        "never change the output, only the speed), else --dtype")
    p.add_argument("--head", default=None,
                   help="a feature-level draft head for --method head: a file from `specwood train-drafter`, an "
                        "EAGLE-1/EAGLE-2 head folder (config.json + weights) trained for this target, or auto (the "
                        "head shipped for a registry target)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (default: the model's)")
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="torch", choices=BACKEND_CHOICES,
                   help="the target's runtime: torch (default), llama.cpp (llama-cpp-python on the GGUF file as it "
                        "is, CPU, one request at a time) or auto (the configuration `specwood plan --choose-config` "
                        "measured fastest here, both models' backends and weight modes; without one, llama.cpp "
                        "for a GGUF when it is installed)")
    p.add_argument("--draft-backend", default="torch", choices=BACKEND_CHOICES,
                   help="the draft's runtime (as --backend)")


def check_backend_args(args: argparse.Namespace) -> None:
    """Resolve --backend/--draft-backend and refuse unsupported combinations before any model loads."""
    draft = None if args.draft in (None, "none") else args.draft
    if draft == "auto":
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
                        "dyspec-threshold, pld, suffix, early-exit (experimental: no trained exit adapter, "
                        "slower than ar), prior, duo")
    add_method_options(p)


def add_method_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=int, default=None, help="tree nodes per step (speculative methods)")
    p.add_argument("--depth", type=int, default=None, help="maximum tree depth")
    p.add_argument("--topk", type=int, default=None, help="branching for top-k shapes (eagle)")
    p.add_argument("--threshold", type=float, default=None, help="dyspec-threshold expansion threshold in (0,1)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None,
                   help="bound of the global suffix cache (suffix, auto): the server's earlier answers, oldest "
                        "overwritten first (default 524288 tokens)")
    p.add_argument("--no-suffix", dest="suffix", action="store_false", default=None,
                   help="auto: no suffix-tree drafts (the draft model and one prompt-lookup chain only, as "
                        "before suffix drafts came in)")
    p.add_argument("--shape", default=None,
                   help="the tree shape of a method that drafts with any (head, early-exit): chain, eagle, dyspec, ...")


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in METHOD_OPTIONS if getattr(args, k, None) is not None}


def load_engine(args: argparse.Namespace, need_draft: bool = True) -> Engine:
    draft = None if (args.draft in (None, "none") or not need_draft) else args.draft
    return load(args.target, draft, dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
                max_context=args.max_context, backend=getattr(args, "backend", "torch"),
                draft_backend=getattr(args, "draft_backend", "torch"), head=getattr(args, "head", None))
