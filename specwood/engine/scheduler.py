"""The one request lifecycle: a queue, admission, cancellation, each request's end (finished or
failed, alone), shutdown, per-step metrics, and the thread that steps -- for every executor.

A request waits in the queue until its executor has room (`Executor.free_slots`), is admitted
(`Executor.admit`), advances with every `step()` (`Executor.step`) and ends through the
scheduler's `_finish`/`_fail`, which release what it held and tell whoever waits. `step()` can be
driven by the caller (Engine.generate, tests) or by a loop (`start()` in a background thread,
`run_here()` in the calling one: the server). Executors: specwood.engine.executor.
"""
from __future__ import annotations

import collections
import concurrent.futures
import sys
import threading
import time
from typing import Any, Callable

from specwood.engine.config import TREE_ROOM, SchedulerConfig
from specwood.drafting.base import DraftSource
from specwood.engine.executor import Executor, QueueFullError
from specwood.engine.output import GenerationResult
from specwood.engine.protocols import EngineLike, Prompt
from specwood.engine.request import Request, State
from specwood.engine.step import StepRecord
from specwood.errors import DeadlineExceeded, SpecwoodError
from specwood.sampling import SamplingParams

RECOVERY_POLL_S = 1.0  # how often an idle loop looks at its executor's workers

__all__ = ["QueueFullError", "Scheduler", "SchedulerConfig", "TREE_ROOM"]


class Scheduler:
    """Requests' lifecycle on one executor: `config` gives its batch, queue and request timeout
    (the executor was built from the same config: `Engine.make_scheduler`). What the executor
    holds (a sequential executor's cache and pools) is the executor's: `scheduler.executor`."""

    def __init__(self, executor: Executor, config: SchedulerConfig = SchedulerConfig()):
        self.executor = executor
        self.config = config
        executor.bind(self._finish, self._fail)
        self.max_batch = config.max_batch
        self.max_queue = config.max_queue
        self.request_timeout_s = config.request_timeout_s  # every request's deadline unless submit names one
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.observers: list[Callable[[StepRecord], None]] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None  # the thread stepping (`start` or `run_here`)
        self._loop_done = threading.Event()
        self._stopping = False
        self.steps = 0
        # requests the step under way finished: told once the step's metrics are recorded, so a
        # client that scrapes /metrics after its answer sees the step that made it
        self._held: list[Request] | None = None
        self._stepping_thread: int | None = None
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []  # run_on_loop's

    # --- what the executor holds ----------------------------------------------------------------

    @property
    def row_len(self) -> int:
        return self.executor.row_len

    @property
    def tree_room(self) -> int:
        return self.executor.tree_room

    def room_for(self, prompt_len: int, max_tokens: int) -> int:
        return self.executor.room_for(prompt_len, max_tokens)

    def ensure_room(self, needed: int) -> None:
        self.executor.ensure_room(needed, idle=self.idle)

    def draft_source(self, model: Any) -> DraftSource | None:
        if self.executor.lacks_draft_pool(model):  # a large allocation: on the stepping thread (OpenMP, races)
            self.run_on_loop(lambda: self.executor.add_draft_pool(model))
        return self.executor.draft_source(model)

    def run_on_loop(self, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """`fn()` on the thread that steps (between steps), its result or its exception; at once
        where no thread steps or the caller is that thread. Torch work that a request needs
        before it runs goes here: a large op on another thread starts a second OpenMP team."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return fn()
        call: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, call))
            self._lock.notify()
        return call.result(timeout_s)

    def _run_calls(self, refuse: BaseException | None = None) -> None:
        """Run the queued `run_on_loop` calls, or fail each with `refuse` (the loop is ending)."""
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, call in calls:
            if not call.set_running_or_notify_cancel():
                continue
            if refuse is not None:
                call.set_exception(refuse)
                continue
            try:
                call.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                call.set_exception(e)

    @property
    def loop_died(self) -> bool:
        """Whether the thread that stepped it ended without `stop()` (/health answers 503)."""
        thread = self._thread
        return thread is not None and not thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the executor is down for good, or None while it serves (the server's /health)."""
        return self.executor.failure

    def make_request(self, engine: EngineLike, prompt: Prompt, params: SamplingParams | None = None,
                     **kwargs: Any) -> Request:
        """A request for this scheduler's executor (Engine.new_request's arguments)."""
        return self.executor.make_request(engine, prompt, params, scheduler=self, **kwargs)

    # --- queue counts ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def admission_load(self) -> int:
        """How many requests a newcomer will share decode steps with, itself included: those
        running and queued, capped by the batch. `auto` sizes its first decision by it."""
        return max(1, min(self.max_batch, self.num_running + self.num_waiting + 1))

    # --- admission ------------------------------------------------------------------------------

    def submit(self, request: Request, timeout_s: float | None = None) -> Request:
        """Queue a request (thread-safe); it joins the running batch at a coming step. It must end
        within `timeout_s` seconds (default: the scheduler's request_timeout_s; None: no limit),
        queue included, or it fails with DeadlineExceeded."""
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        if timeout_s is not None:
            if not timeout_s > 0:
                raise SpecwoodError(f"timeout_s must be > 0 seconds, got {timeout_s}")
            request.timeout_s, request.deadline = timeout_s, time.monotonic() + timeout_s
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting requests); retry later")
            self.waiting.append(request)
            self._lock.notify()
        return request

    def _expire(self) -> None:
        """Requests past their deadline take the cancellation path (an executor that ends its
        requests itself ends them at its next step); `_finish` then fails them."""
        with self._lock:
            requests = [*self.waiting, *self.running]
        for req in requests:
            req.check_deadline()

    def _drop_cancelled_waiting(self) -> None:
        """Queued requests whose client left end now, not when a row frees: their queue places go
        to new requests at once."""
        with self._lock:
            gone = [r for r in self.waiting if r.cancelled]
            for req in gone:
                self.waiting.remove(req)
        for req in gone:
            self._finish(req, cancelled=True)

    def _admit(self) -> None:
        with self._lock:
            while (self.waiting and len(self.running) < self.max_batch
                   and self.executor.free_slots(len(self.running)) > 0):
                req = self.waiting.popleft()
                if req.cancelled:
                    self._finish(req, cancelled=True)
                    continue
                req.state = State.PREFILL
                try:
                    self.executor.admit(req)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    self._fail(req, e)
                    continue
                req.t_admitted = time.perf_counter()
                self.running.append(req)

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit, drop cancelled requests, advance the running ones one step. False when idle."""
        self._expire()
        self._drop_cancelled_waiting()
        self._admit()
        for req in [r for r in self.running if r.cancelled]:
            if not self.executor.cancel_running(req):
                self._finish(req, cancelled=True)
        if not self.running:
            return False
        if self.executor.records_steps:
            self._held, self._stepping_thread = [], threading.get_ident()
        try:
            record = self.executor.step(list(self.running))
            self.steps += 1
            if record is not None:
                for observe in self.observers:
                    try:
                        observe(record)
                    except Exception:  # noqa: BLE001 - a metrics observer must not stop decoding
                        pass
        finally:
            held, self._held, self._stepping_thread = self._held or [], None, None
            for req in held:
                req.notify()
        return True

    # --- the end of a request -------------------------------------------------------------------

    def _finish(self, req: Request, cancelled: bool = False, result: GenerationResult | None = None) -> None:
        if req.expired and req.out.finish_reason in (None, "cancelled"):  # ended for its deadline alone
            made = len(req.out.token_ids)
            self._fail(req, DeadlineExceeded(
                f"the request ran past its {req.timeout_s:g} s deadline ({made} token{'s' if made != 1 else ''} "
                "generated); allow more time or ask for fewer tokens"))
            return
        self._release(req)
        if cancelled and not req.out.finished:
            req.out.finish_reason = "cancelled"
        held = self._held if self._stepping_thread == threading.get_ident() else None
        req.complete(result, notify=held is None)
        if held is not None:
            held.append(req)

    def _fail(self, req: Request, error: BaseException) -> None:
        try:
            self._release(req)
        except Exception:  # noqa: BLE001 - the request fails with its own error, not this one
            pass
        req.fail(error)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.executor.release(req)

    # --- driving ------------------------------------------------------------------------------

    def run_until_done(self, requests: list[Request]) -> None:
        """Step in the caller's thread until every one of `requests` has finished."""
        first_open = 0  # requests before it are done (done is for good): each step checks from there
        while True:
            while first_open < len(requests) and requests[first_open].done.is_set():
                first_open += 1
            if first_open == len(requests) or (not self.step() and not self.waiting):
                break

    def start(self) -> None:
        """Step in a background thread whenever there is work (a server in a thread, tests).
        A no-op while the scheduler is already stepping (`start` or `run_here`)."""
        if self._thread is not None:
            return
        self.executor.start()  # workers up (and measured) before the first request
        self._claim(threading.Thread(target=self._loop, name="specwood-scheduler", daemon=True)).start()

    def run_here(self, then: Callable[[], None] | None = None) -> None:
        """Step in the calling thread whenever there is work, until `stop()`; `then` runs once
        this thread owns the loop (`specwood serve` starts its HTTP thread there). The server
        decodes on its main thread because torch's OpenMP team works for the process's main
        thread without the futex hand-offs a second Python thread's team needs: decode steps
        measured ~10% slower on a background thread on the 2-core CPU (BENCHMARKS.md §4c)."""
        if self._thread is not None:
            raise SpecwoodError("the scheduler is already stepping in another thread")
        self.executor.start()
        self._claim(threading.current_thread())
        self._loop(then)

    def _claim(self, thread: threading.Thread) -> threading.Thread:
        self._stopping = False
        self._loop_done.clear()
        self._thread = thread
        return thread

    def _recover(self) -> None:
        try:
            self.executor.recover()
        except Exception as e:  # noqa: BLE001 - the loop goes on; /health keeps saying why
            print(f"specwood: could not bring the executor back: {e}", file=sys.stderr)
        if self.executor.recovering is not None:
            with self._lock:
                self._lock.wait(RECOVERY_POLL_S)

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop (after the step under way) and fail what is left; waits for it, unless
        called from the loop's own thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        thread = self._thread
        if thread is None:
            self.executor.close()  # never looped: nothing else will
        elif thread is not threading.current_thread():
            self._loop_done.wait(timeout)

    def _loop(self, then: Callable[[], None] | None = None) -> None:
        try:
            if then is not None:
                then()
            while True:
                with self._lock:
                    # idle: wake now and then to see whether the executor lost a worker
                    while (not self._stopping and self.idle and self.executor.recovering is None
                           and not self._calls):
                        self._lock.wait(RECOVERY_POLL_S)
                    if self._stopping:
                        break
                    recover = self.idle and not self._calls
                self._run_calls()
                if recover:  # outside the lock: a restart takes seconds, and submit must not wait
                    self._recover()
                    continue
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - never leave requests waiting on a dead loop
                    for req in list(self.running):
                        self._fail(req, e)
            for req in list(self.running) + list(self.waiting):
                self._fail(req, SpecwoodError("the server is shutting down"))
            self.waiting.clear()
            self._run_calls(refuse=SpecwoodError("the server is shutting down"))
        finally:
            try:
                self.executor.close()  # workers and ranks end with the loop
            except Exception:  # noqa: BLE001
                pass
            self._thread = None  # released before the event: once stop() returns, start() may run again
            self._loop_done.set()
