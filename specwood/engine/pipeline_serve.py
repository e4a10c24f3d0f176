"""`specwood serve --executor pipeline`: the server's scheduler on a `PipelineExecutor`
(SpecPipe-DB). Up to `max_batch` requests are in flight in the pipeline at once; each joins at
the pipeline's next step and leaves when it is done, and the next queued request takes its lane
(continuous batching). Past `max_queue` waiting requests the server answers 503.

A request's "method" picks the pipeline mode: specpipe (or auto), pp (or ar), specinfer, or a tree
shape for PP + SpecInfer (`pipeline_mode`); the server's default is the one it started with.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from specwood.engine.pipeline_launch import PipelineExecutor, PipelineRequest, pipeline_mode
from specwood.engine.request import Drafter, QueueCounts, Request, State
from specwood.errors import ContextLengthError, SpecwoodError

CANCEL_POLL_S = 0.05  # how often cancelled requests (clients gone) are looked for
TREE_ROOM = 64  # the server's margin between a row and the context; the pipeline sizes its rows itself


class PipelineMethods:
    """The server's method table on the pipeline (the app's `_Methods` interface)."""

    def __init__(self, default: str, options: dict[str, Any] | None = None):
        from specwood.drafting.shapes import SHAPES
        from specwood.engine.pipeline_launch import PIPELINE_METHODS

        self.options = {k: v for k, v in (options or {}).items() if v is not None}
        self.default = self._check(default)[0]
        self.names = [*PIPELINE_METHODS, *(s for s in SHAPES if s != "pld")]  # what a request may name

    def _check(self, name: str) -> tuple[str, tuple[str, dict[str, Any] | None]]:
        from specwood.serve.protocol import ProtocolError

        o = self.options
        try:
            mode, tree = pipeline_mode(name, o.get("budget"), o.get("depth"), o.get("threshold"))
        except SpecwoodError as e:
            raise ProtocolError(str(e), param="method", code="unsupported_method") from None
        return name, (mode, tree)

    def cached(self, name: str | None) -> tuple[str, Any]:
        return self._check(self.default if name is None else name)

    def prepare(self, name: str) -> tuple[str, Any]:
        return self._check(name)


class PipelineScheduler(QueueCounts):
    """The server's scheduler on the pipeline executor; the interface the app uses of `Scheduler`."""

    def __init__(self, executor: PipelineExecutor, *, max_batch: int = 8, max_queue: int = 64,
                 method: str = "specpipe", options: dict[str, Any] | None = None):
        self.executor = executor
        self.engine = executor.engine
        self.max_batch = min(max_batch, executor.max_lanes)
        self.max_queue = max_queue
        self.tree_room = TREE_ROOM
        self.row_len = int(self.engine.max_context) + self.tree_room
        self.methods = PipelineMethods(method, options)
        self.observers: list[Callable[[Any], None]] = []  # no per-step records on this executor
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, PipelineRequest] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def failure(self) -> str | None:
        """Why the pipeline is down for good (a rank died or failed), or None while it serves."""
        return self.executor.failed

    def room_for(self, prompt_len: int, max_tokens: int) -> int:
        return prompt_len + max_tokens + self.tree_room

    def ensure_room(self, needed: int) -> None:
        if needed - self.tree_room > self.engine.max_context:
            raise ContextLengthError(f"the request needs {needed - self.tree_room} context tokens but the model holds "
                                     f"{self.engine.max_context}; shorten the prompt or lower max_tokens")

    def draft_source(self, model: Any) -> Any:
        return None  # rank 0 drafts; no request-side source

    def make_request(self, prompt: Any, *, method: str | None = None, prepared: Any = None, **kwargs: Any) -> Request:
        """A request for the pipeline (the server's `engine.new_request` stand-in); `prepared` is
        what `PipelineMethods` gave for its method: (mode, specinfer tree)."""
        _, (mode, tree) = self.methods.cached(method) if prepared is None else (method, prepared)
        req = self.engine.new_request(prompt, method=mode, scheduler=self,
                                      prepared=lambda sources, prompt_len, max_tokens, load=1: Drafter(), **kwargs)
        req.pipeline = (mode, tree)
        return req

    def submit(self, request: Request) -> None:
        from specwood.engine.scheduler import QueueFullError

        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self.waiting.append(request)
        self._admit()

    def _admit(self) -> None:
        """Hand queued requests to the pipeline while it has free lanes."""
        while True:
            with self._lock:
                if not self.waiting or len(self.running) >= self.max_batch or self._stopping.is_set():
                    return
                req = self.waiting.popleft()
                req.state, req.t_admitted = State.DECODE, time.perf_counter()
                self.running[req] = None  # a lane is taken from now on
            mode, tree = req.pipeline
            p = req.params
            try:
                pr = self.executor.submit(
                    req.prompt_ids, max_tokens=req.max_tokens, temperature=p.temperature, top_p=p.top_p,
                    top_k=p.top_k, seed=p.seed, stop=req.out.stop or None, on_text=req.out.on_text, mode=mode,
                    tree=tree, on_finish=lambda pr, req=req: self._finished(req, pr))
            except BaseException as e:  # noqa: BLE001 - the pipeline is down: this request fails
                self._finished(req, None, e)
                continue
            with self._lock:
                if req in self.running:  # (not finished already)
                    self.running[req] = pr

    def _finished(self, req: Request, pr: PipelineRequest | None, error: BaseException | None = None) -> None:
        with self._lock:
            self.running.pop(req, None)
        error = error or (pr.error if pr is not None else None)
        if error is not None:
            req.fail(error)
        else:
            req.result, req.state = pr.result, State.FINISHED
            req._notify()
        self._admit()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._watch, name="specwood-pipeline", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Cancelled requests (their clients went away) leave: queued ones at once, running ones
        at the pipeline's next step."""
        while not self._stopping.wait(CANCEL_POLL_S):
            with self._lock:
                queued = [r for r in self.waiting if r.cancelled]
                for r in queued:
                    self.waiting.remove(r)
                running = [pr for r, pr in self.running.items() if r.cancelled and pr is not None]
            for r in queued:
                r.fail(SpecwoodError("cancelled"))
            for pr in running:
                if not getattr(pr, "cancel_sent", False):
                    pr.cancel_sent = True
                    try:
                        self.executor.cancel(pr)
                    except SpecwoodError:
                        pass

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for r in waiting:
            r.fail(SpecwoodError("the server is shutting down"))
        self.executor.close()  # fails what is still running
