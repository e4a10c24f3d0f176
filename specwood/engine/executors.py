"""The executors a command or a call may name, as plug-ins: the one place that turns `--executor
NAME` (or `NAME@executor` in a bench's method list) into an executor.

What each method runs on is the method registry's to say (`Method.executors`, resolved by
`specwood.methods.method_on`); a plug-in here says which flags its executor reads, checks them
before any model loads (a typo fails in a second, not after minutes of loading), and builds the
executor for a loaded engine. `sequential` builds nothing: the engine's own scheduler runs it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from specwood.engine.executor import Executor, executor_name
from specwood.engine.parallel import EXECUTOR_OPTIONS, ParallelExecutor
from specwood.engine.parallel_args import check_cli_args as parallel_cli_options
from specwood.engine.specpipe.args import cmd_generate_pipeline, pipeline_cli_options
from specwood.engine.specpipe.launch import PipelineExecutor, generate_on_pipeline, pipeline_mode
from specwood.errors import SpecwoodError
from specwood.methods import get_method, method_on
from specwood.sampling import SamplingParams


# --- Engine.generate(..., executor="parallel" | a ParallelExecutor) ------------------------------


def engine_executor(engine: Any, **options: Any) -> ParallelExecutor:
    """The engine's own parallel executor (kept for the next call; a new one if the options differ)."""
    key = (options.get("draft_device", "cpu"), options.get("draft_threads"))
    cached = engine.__dict__.get("_parallel_executor")
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is not None:
        cached[1].close()
    ex = ParallelExecutor(engine, **options)
    engine.__dict__["_parallel_executor"] = (key, ex)
    return ex


def generate_parallel(engine: Any, executor: Any, prompt: Any, params: SamplingParams | None = None,
                      **kwargs: Any) -> Any:
    """Engine.generate with executor="parallel" (or a ParallelExecutor): DuoDecoding."""
    options = {k: kwargs.pop(k) for k in EXECUTOR_OPTIONS if k in kwargs}
    if isinstance(executor, ParallelExecutor):
        if options:
            raise SpecwoodError(f"pass {', '.join(options)} to ParallelExecutor(...), not to generate")
        ex = executor
    elif executor_name(executor) == "parallel":
        ex = engine_executor(engine, **options)
    else:
        raise SpecwoodError(f"unknown executor {executor!r} (use 'sequential', 'parallel' or 'pipeline')")
    return ex.generate(prompt, params, **kwargs)


@dataclass(frozen=True)
class ExecutorPlugin:
    name: str
    # the checks of its flags that need no model -> the options `build` takes
    cli_options: Callable[[argparse.Namespace], dict[str, Any]]
    # (engine, options) -> the executor (None: the engine's own sequential scheduler)
    build: Callable[[Any, dict[str, Any]], Executor | None]
    # `specwood generate` on it, where one request needs more than Engine.generate (the pipeline's ranks)
    generate_cli: Callable[[argparse.Namespace, Callable[..., Any]], int] | None = None
    # Engine.generate on it: (engine, executor or its name, prompt, params, **generate's arguments) -> result
    generate: Callable[..., Any] | None = None
    # (method, args) -> the method as it runs here, or one line saying why it cannot (a bench row)
    check_method: Callable[[str, argparse.Namespace], str] | None = None

    def method(self, name: str, args: argparse.Namespace) -> str:
        return self.check_method(name, args) if self.check_method is not None else method_on(self.name, name)


def _pipeline_method(name: str, args: argparse.Namespace) -> str:
    """A bench row on the pipeline: its mode, and a specinfer tree's options checked."""
    pipeline_mode(method_on("pipeline", name), args.budget, args.depth, args.threshold)
    return name


PLUGINS: dict[str, ExecutorPlugin] = {
    "sequential": ExecutorPlugin("sequential", lambda args: {}, lambda engine, options: None),
    "parallel": ExecutorPlugin("parallel", parallel_cli_options,
                               lambda engine, options: ParallelExecutor(engine, **options), generate=generate_parallel),
    "pipeline": ExecutorPlugin("pipeline", pipeline_cli_options,
                               lambda engine, options: PipelineExecutor(engine, **options),
                               generate_cli=cmd_generate_pipeline, check_method=_pipeline_method,
                               generate=generate_on_pipeline),
}


def plugin_for(executor: str | None) -> ExecutorPlugin:
    """The plug-in of `--executor` / executor=... (None: sequential); an unknown name fails in one line."""
    return PLUGINS[executor_name(executor)]


def needs_draft_on(executor: str | None, method: str) -> bool:
    """Whether `method`, run as it is on `executor`, drafts with the draft model."""
    name = executor_name(executor)
    return get_method(method_on(name, method) if name != "sequential" else method).loads_draft


def build_executor(executor: str | None, engine: Any, options: dict[str, Any]) -> Executor | None:
    return plugin_for(executor).build(engine, options)
