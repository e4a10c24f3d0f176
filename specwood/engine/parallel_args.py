"""`--executor parallel` (DuoDecoding) on the command line and in the API: the draft worker's device
and threads checked before any model loads, and the one method it runs.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from specwood.errors import SpecwoodError
from specwood.methods import method_on


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_draft_device(device: str) -> str:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecwoodError(f"unknown draft device '{device}' (use cpu or cuda:N)") from None
    if d.type == "cpu":
        return "cpu"
    if d.type != "cuda":
        raise SpecwoodError(f"draft device '{device}' is not supported (use cpu or cuda:N)")
    if not torch.cuda.is_available():
        raise SpecwoodError(f"draft device '{device}' does not exist: CUDA is not available here "
                            "(use --draft-device cpu)")
    index = d.index or 0
    if index >= torch.cuda.device_count():
        raise SpecwoodError(f"draft device '{device}' does not exist: this machine has {torch.cuda.device_count()} "
                            f"CUDA device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return f"cuda:{index}"


def default_draft_threads(target_device: str | torch.device) -> int:
    """All cores but one beside a GPU target; half of them beside a CPU target."""
    cores = available_cores()
    return max(1, cores - 1) if torch.device(target_device).type != "cpu" else max(1, cores // 2)


def check_draft_threads(threads: int | None, target_device: str | torch.device) -> int:
    if threads is None:
        return default_draft_threads(target_device)
    cores = available_cores()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise SpecwoodError(f"draft threads must be a positive integer, got {threads!r}")
    if threads > cores:
        raise SpecwoodError(f"{threads} draft threads is more than the {cores} CPU core(s) this process may use "
                            f"(use --draft-threads 1..{cores})")
    return threads


def parallel_method(method: str | None) -> str:
    """The method the parallel executor runs: duo (the sequential defaults 'ar'/'auto' mean duo)."""
    return method_on("parallel", method or "duo")


def check_cli_args(args: Any) -> dict[str, Any]:
    """`--executor parallel` on generate, bench and serve: the checks that need no model; the
    worker options for ParallelExecutor(engine, **options). A command that names one method
    (generate, serve) gets it as the parallel executor runs it in `args.method`."""
    if args.draft in (None, "none"):
        raise SpecwoodError("executor 'parallel' needs a draft model; pass --draft NAME|PATH (not 'none')")
    if hasattr(args, "method"):
        args.method = parallel_method(args.method)
    return {"draft_device": check_draft_device(args.draft_device),
            "draft_threads": check_draft_threads(args.draft_threads, args.device), "draft_dtype": args.draft_dtype}
