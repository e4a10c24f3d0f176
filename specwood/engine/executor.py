"""The executor interface: where a scheduler's requests run.

One `Scheduler` (specwood.engine.scheduler) owns every request's lifecycle -- the queue, admission,
cancellation, the end of a request (finished or failed, alone), shutdown, per-step metrics and the
thread that steps -- whatever runs the models. An executor only says how many requests it can take,
takes one (`admit`), advances the running ones (`step`) and gives back what one held (`release`),
the way vLLM's v1 executors differ only in where their workers run:

- `sequential` (specwood.engine.sequential): batched steps in this process, continuous batching;
  `RunnerExecutor` (specwood.engine.runner) the same step on a one-sequence runner (llama.cpp).
- `parallel` (specwood.engine.parallel, DuoDecoding): the draft model in a worker process, drafting
  while the target verifies; requests run in lock-step batches.
- `pipeline` (specwood.engine.specpipe.launch, SpecPipe): the target's layers over rank processes.

An executor ends a request through the callbacks the scheduler binds (`finish`, `fail`); the
scheduler releases it and tells whoever waits. Executor-specific state stays in the executor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

from specwood.errors import SpecwoodError

if TYPE_CHECKING:
    from specwood.engine.output import GenerationResult
    from specwood.engine.request import Request
    from specwood.engine.step import StepRecord
    from specwood.models.prefix_cache import PrefixCache
    from specwood.sampling import SamplingParams

FinishCallback = Callable[..., None]  # finish(request, result=None)
FailCallback = Callable[["Request", BaseException], None]


EXECUTORS = ("sequential", "parallel", "pipeline")  # what `--executor` and executor=... may name


def executor_name(executor: "str | Executor | None") -> str:
    """The name of an executor given by name or as an object (None: sequential); the one place
    that reads what `--executor` / Engine.generate(executor=...) asked for."""
    if executor is None:
        return "sequential"
    if isinstance(executor, Executor):
        return executor.name
    name = str(executor).strip().lower()
    if name not in EXECUTORS:
        raise SpecwoodError(f"unknown executor {executor!r} (use {', '.join(repr(e) for e in EXECUTORS)})")
    return name


class QueueFullError(SpecwoodError):
    """The scheduler's queue is full: try again later."""


class Executor(ABC):
    """Where requests run; driven by one Scheduler (see the module's docstring)."""

    name: str = ""
    tree_room: int = 0  # cache slots a request keeps beyond prompt + new tokens for a tree
    row_len: int = 0  # the longest request (in cache slots) it can hold now

    kv_budget: int | None = None  # bytes its cache rows and prefix cache hold together (None: static rows)

    @property
    def max_row_len(self) -> int:
        """The longest request (in cache slots) it can ever hold (rows that grow: more than row_len)."""
        return self.row_len

    # --- what it holds, for /health and /metrics ------------------------------------------------

    @property
    def free_rows(self) -> int | None:
        """Cache rows free now; None where it holds none in this process (the pipeline's ranks)."""
        return None

    def rows_bytes(self) -> int:
        """Bytes its K/V cache rows take now (0 where they live elsewhere)."""
        return 0

    @property
    def prefix_cache(self) -> "PrefixCache | None":
        """The finished requests' K/V it keeps for reuse (specwood.models.prefix_cache), if any."""
        return None

    # steps in the scheduler's own thread (the server's main thread): False for an executor whose
    # work runs in other processes and whose step mostly waits (signals reach only the main thread)
    steps_in_caller: bool = True
    # its step is one decode step whose StepRecord it returns: the scheduler answers the requests it
    # finished once the record is observed (metrics). False for an executor whose step runs a whole
    # batch (an early finisher must not wait for the rest) or records nothing
    records_steps: bool = False

    def bind(self, finish: FinishCallback, fail: FailCallback) -> None:
        """The scheduler's ends of a request: `finish(req, result=None)`, `fail(req, error)`."""
        self._on_finish, self._on_fail = finish, fail

    def finish(self, req: "Request", result: "GenerationResult | None" = None) -> None:
        self._on_finish(req, result=result)

    def fail(self, req: "Request", error: BaseException) -> None:
        self._on_fail(req, error)

    # --- capacity and room ------------------------------------------------------------------

    @abstractmethod
    def free_slots(self, running: int) -> int:
        """How many more requests it takes now, with `running` requests admitted."""

    def room_for(self, prompt_len: int, max_tokens: int) -> int:
        """Cache slots a request needs (prompt, new tokens, the largest tree)."""
        return prompt_len + max_tokens + self.tree_room

    @abstractmethod
    def ensure_room(self, needed: int, idle: bool = True) -> None:
        """Raise ContextLengthError if a request of `needed` slots cannot fit (`idle`: nothing is
        queued or running, so the executor may grow its pools)."""

    def draft_source(self, model: Any) -> Any:
        """A draft source for one request on `model` (None where the executor drafts itself)."""
        return None

    def lacks_draft_pool(self, model: Any) -> bool:
        """Whether `model` needs a KV pool that `add_draft_pool` must make first (on the stepping
        thread: Scheduler.draft_source sees to it)."""
        return False

    def add_draft_pool(self, model: Any) -> None:
        """Allocate `model`'s KV pool, within the executor's memory budget (stepping thread only)."""

    def make_request(self, engine: Any, prompt: Any, params: "SamplingParams | None" = None, *, scheduler: Any,
                     **kwargs: Any) -> "Request":
        """A request for this executor (Engine.new_request's arguments); an executor that keeps
        state per request makes it here."""
        return engine.new_request(prompt, params, scheduler=scheduler, **kwargs)

    # --- the lifecycle ----------------------------------------------------------------------

    @abstractmethod
    def admit(self, req: "Request") -> None:
        """Take a queued request (rows, lanes); raising fails that request alone."""

    @abstractmethod
    def step(self, running: list["Request"]) -> "StepRecord | None":
        """Advance the running requests; each one that ends goes through `finish` or `fail`."""

    @abstractmethod
    def release(self, req: "Request") -> None:
        """Give back what `req` held (idempotent)."""

    def cancel_running(self, req: "Request") -> bool:
        """A running request's client went away. True: the executor ends it itself at its next
        step; False: the scheduler ends it now."""
        return False

    @property
    def failure(self) -> str | None:
        """Why the executor is down for good (a dead pipeline rank), or None while it serves."""
        return None

    @property
    def recovering(self) -> str | None:
        """Why it cannot serve right now while it brings itself back (a dead draft worker that it
        restarts), or None. `/health` answers 503 with it meanwhile."""
        return None

    def recover(self) -> None:
        """Bring back what `recovering` names; the scheduler calls it while no request runs (a
        step recovers by itself)."""

    def start(self) -> None:
        """Get ready before the first request (start workers, measure)."""

    def close(self) -> None:
        """Stop workers; the executor takes no more requests."""
