"""The OpenAI-compatible HTTP server: `create_app(engine, scheduler)` and `serve(...)`.

Requests become engine Requests submitted to one continuous-batching Scheduler, which steps in
its own thread; its callbacks (text deltas, the end of a request) are bridged into the event loop
with `loop.call_soon_threadsafe`. A client that goes away cancels its request, which frees its
cache rows at the scheduler's next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specwood.constrain import grammars
from specwood.engine.protocols import EngineLike, is_token_ids
from specwood.engine.specpipe.launch import PipelineExecutor
from specwood.engine.request import Request
from specwood.engine.scheduler import TREE_ROOM, QueueFullError, Scheduler
from specwood.errors import ContextLengthError, DeadlineExceeded, GrammarError, SamplingParamsError, SpecwoodError
from specwood.methods import MethodTable
from specwood.sampling import SEED_LIMIT
from specwood.serve import protocol as P
from specwood.serve.background import pause_while_busy
from specwood.serve.connections import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, uvicorn_limits
from specwood.serve.guard import TENANT_KEY, Access, guard_app
from specwood.serve.kv_memory import budget_warning, default_kv_memory
from specwood.serve.metrics import ServerMetrics
from specwood.serve.openapi import chat_body, completion_body, generation_operation
from specwood.serve.pipeline_methods import PipelineMethods
from specwood.serve.prompt_limits import PromptLimit
from specwood.serve.protocol import GenerationRequest, ProtocolError
from specwood.serve.structured import (TokenBytes, ToolCallText, chat_logprobs,
                                       completion_logprobs)
from specwood.serve.tenancy import Sharing

RETRY_AFTER_S = 1
QUEUE_SAMPLE_S = 0.005  # period of the queue-time sampler while requests wait for admission
DEFAULT_MAX_CONTEXT = 4096  # `specwood serve --executor parallel|pipeline` or on llama.cpp without --max-context
EXECUTOR_POLL_S = 0.5  # how often the server looks whether its executor went down
DEFAULT_DRAIN_S = 30.0  # on SIGTERM, how long running requests may take to finish
logger = logging.getLogger("specwood.serve")


def _log(msg: str) -> None:
    print(f"specwood serve: {msg}", file=sys.stderr, flush=True)


class _Methods(MethodTable):
    """Prepared method factories, one per method name: the server's default prepared at start-up,
    the others on first use (off the event loop) and cached."""

    def __init__(self, engine: EngineLike, default: str, options: dict[str, Any] | None):
        from specwood.methods import get_method, method_names

        self.engine = engine
        self.options = {k: v for k, v in (options or {}).items() if v is not None}
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}
        name = get_method(default).name
        try:
            factory = engine.prepare(name, self.options)
        except SpecwoodError as e:
            if name != "auto":
                raise
            # auto is "the planner's choice of AR or speculation": without a usable plan, AR
            _log(f"warning: method auto is unavailable ({e}); requests without a method decode with ar")
            name, factory = "ar", engine.prepare("ar", {})
        self.default = name
        self._cache[name] = factory
        self.names = method_names()  # what a request may name

    def cached(self, name: str | None) -> tuple[str, Any] | None:
        if name is None:
            return self.default, self._cache[self.default]
        key = self._key(name)
        return (key, self._cache[key]) if key in self._cache else None

    def _key(self, name: str) -> str:
        from specwood.methods import get_method

        try:
            return get_method(name).name
        except SpecwoodError as e:
            raise ProtocolError(str(e), param="method", code="unknown_method") from None

    def prepare(self, name: str) -> tuple[str, Any]:
        """Blocking: prepare `name` once (options of the server that it takes) and cache it."""
        from specwood.methods import options_for

        key = self._key(name)
        with self._lock:
            if key not in self._cache:
                try:
                    self._cache[key] = self.engine.prepare(key, options_for(key, self.options))
                except SpecwoodError as e:
                    raise ProtocolError(str(e), param="method", code="unsupported_method") from None
            return key, self._cache[key]


class _Job:
    """One request's bridge from the scheduler thread into the event loop: its items go to a
    queue that the `n` choices of one HTTP request share, tagged with the choice's index."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[Any, ...]], index: int = 0):
        self.loop = loop
        self.queue = queue
        self.index = index
        self.req: Request | None = None
        self.logprobs_sent = 0  # entries of req.out.logprobs already put in a chunk

    @property
    def request(self) -> Request:
        """Its request (made before it is queued)."""
        if self.req is None:
            raise RuntimeError(f"choice {self.index} has no request yet")
        return self.req

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (*item, self.index))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def on_text(self, delta: str) -> None:  # scheduler thread
        req = self.req
        self._put(("text", (delta, len(req.out.token_ids) if req is not None else None, self.new_logprobs())))

    def new_logprobs(self) -> list[Any] | None:
        """The logprob entries pushed since the last call (read on the scheduler thread while it
        runs, on the event loop once it is done), or None without logprobs."""
        entries = self.req.out.logprobs if self.req is not None else None
        if entries is None:
            return None
        new = entries[self.logprobs_sent:]
        self.logprobs_sent += len(new)
        return new

    def on_finish(self, req: Request) -> None:  # scheduler thread
        self._put(("done", None))


def _usage(reqs: list[Request], completion_tokens: int) -> dict[str, Any]:
    """The usage of the choices of one request (the prompt counted once): prompt tokens that none
    of them computed (the prefix cache's) as OpenAI's cached_tokens."""
    return P.usage(len(reqs[0].prompt_ids), completion_tokens, min(getattr(r, "cached_tokens", 0) for r in reqs))


def _failure_status(req: Request) -> tuple[int, str]:
    """The HTTP status and error code of a failed request: 504 for one past its deadline."""
    if isinstance(req.exception, DeadlineExceeded):
        return 504, "request_timeout"
    return 500, "generation_failed"


def create_app(engine: EngineLike, scheduler: Scheduler, *, method: str = "auto", options: dict[str, Any] | None = None,
               model_name: str | None = None, max_body_bytes: int = P.DEFAULT_MAX_BODY_BYTES,
               access: Access = Access(), read_timeout: float = DEFAULT_READ_TIMEOUT_S,
               sharing: Sharing = Sharing()) -> FastAPI:
    """The FastAPI app serving `engine` through `scheduler` (started and stopped by the app's
    lifespan; a scheduler already started is left running until the app stops). `method`
    (with `options`) is the default method, prepared now; a request may name another with the
    non-standard body field "method"; a body over `max_body_bytes` gets a 413, one that has not
    arrived `read_timeout` seconds after its headers a 408; `access` says who may call it (API
    keys, origins, Host names: specwood.serve.guard); `sharing` who reuses whose cached work
    (specwood.serve.tenancy). Raises SpecwoodError for a bad default method."""
    # the context a request may use: the engine's, or less where the scheduler's rows are shorter
    tree_room = scheduler.tree_room
    max_context = min(int(engine.max_context), int(scheduler.executor.max_row_len) - tree_room)
    budget = getattr(scheduler.executor, "kv_budget", None)
    why = (f" (the KV budget of {budget} bytes, --kv-memory, holds {max_context} in each of {scheduler.max_batch} "
           f"cache rows; the model's own context is {int(engine.max_context)})"
           if budget is not None and max_context < int(engine.max_context) else "")
    if max_context < 2:
        raise SpecwoodError(f"the scheduler's cache rows ({scheduler.row_len} slots, {tree_room} kept for trees) "
                            "leave no room for a request; build it with row_len = max_context + TREE_ROOM")
    # the pipeline runs its own modes; every other executor the method registry's methods
    methods: MethodTable = (PipelineMethods(method, options) if isinstance(scheduler.executor, PipelineExecutor)
                            else _Methods(engine, method, options))
    name = model_name or str(engine.target_name or "specwood")
    metrics = ServerMetrics(scheduler, name)
    scheduler.observers.append(metrics.observe_step)
    vocab = int(engine.target_config.vocab_size)
    prompt_limit = PromptLimit(getattr(engine, "tokenizer", None), max_context, why)
    created = P.now()
    tool_format = grammars.ToolFormat.of(engine.tokenizer)  # the tool-call tags, as the vocabulary has them
    prepare_grammars = getattr(engine, "prepare_grammars", None)
    if prepare_grammars is not None:  # not inside the first grammar request, where its GIL stalls every other
        prepare_grammars()
    token_bytes = TokenBytes(engine.tokenizer)

    submitted = asyncio.Event()  # wakes the queue-time sampler (set on the event loop)

    async def sample_queue_times() -> None:
        while True:
            if not metrics.has_pending:
                submitted.clear()
                await submitted.wait()
            await asyncio.sleep(QUEUE_SAMPLE_S)
            metrics.sample_admissions()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        sampler = asyncio.create_task(sample_queue_times())
        try:
            yield
        finally:
            sampler.cancel()
            prompt_limit.close()
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="specwood", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.scheduler, app.state.metrics, app.state.methods = engine, scheduler, metrics, methods

    # --- errors: always the OpenAI shape, never a 422 ------------------------------------------

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: HTTPRequest, exc: ProtocolError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(P.error_body(f"invalid request: {first.get('msg', exc)}", 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(P.error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    # --- plain endpoints ----------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        thread = getattr(scheduler, "_thread", None)
        if thread is not None and not thread.is_alive():
            return JSONResponse(P.error_body("the scheduler thread has stopped", 503), status_code=503)
        failure = scheduler.failure  # an executor down for good (a dead pipeline rank)
        if failure:
            return JSONResponse(P.error_body(f"the executor is down: {failure}", 503), status_code=503)
        recovering = scheduler.executor.recovering  # a dead draft worker, restarting
        if recovering:
            return JSONResponse(P.error_body(f"the executor is recovering: {recovering}", 503), status_code=503,
                                headers={"Retry-After": "5"})
        cache = getattr(scheduler.executor, "cache", None)  # the pipeline's ranks hold theirs elsewhere
        return JSONResponse({"status": "ok", "model": name, "running": scheduler.num_running,
                             "waiting": scheduler.num_waiting,
                             "free_rows": cache.free_rows if cache is not None else None})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "specwood", "root": name,
             "max_model_len": max_context, "draft": getattr(engine, "draft_name", None),
             "default_method": methods.default}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    # --- generation ---------------------------------------------------------------------------

    chat_schema = generation_operation(chat_body(name, methods.names, max_context))
    completion_schema = generation_operation(completion_body(name, methods.names, vocab, max_context))

    @app.post("/v1/chat/completions", openapi_extra=chat_schema)
    async def chat_completions(request: HTTPRequest) -> Response:
        return await _generate(request, "chat")

    @app.post("/v1/completions", openapi_extra=completion_schema)
    async def completions(request: HTTPRequest) -> Response:
        return await _generate(request, "completion")

    async def _generate(http: HTTPRequest, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            raw = await _read_body(http, max_body_bytes, read_timeout)
        except ClientDisconnect:  # the client went away mid-upload: a cancelled request, not an error
            metrics.upload_dropped()
            logger.debug("a client disconnected before its request body arrived")
            return Response(status_code=499)
        # parsing, the chat template and tokenisation take a while for a large body: off the event
        # loop, so /health and every stream go on meanwhile
        body, g = await asyncio.to_thread(_parse, raw, kind)
        if g.model is not None and g.model != name:
            raise ProtocolError(f"the model '{g.model}' does not exist; this server serves '{name}'", param="model",
                                code="model_not_found")
        found = methods.cached(g.method)
        if found is None:  # (a named method: None gets the default, always ready)
            found = await asyncio.to_thread(methods.prepare, g.method or methods.default)
        method_name, prepared = found
        # a prompt too long to fit is refused before it is tokenized; large ones on their own thread
        prompt_ids = await prompt_limit.run(g, _encode)
        max_tokens = g.max_tokens
        room = max_context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room if kind == "chat" else min(P.COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            field = "max_completion_tokens" if "max_completion_tokens" in body and body["max_completion_tokens"] \
                is not None else "max_tokens"
            raise ProtocolError(f"this model's maximum context length is {max_context} tokens{why}; you requested "
                                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} to "
                                f"generate): lower {field} or shorten the prompt", param=field,
                                code="context_length_exceeded")
        loop, rid = asyncio.get_running_loop(), P.new_id(kind)
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        scope = sharing.scope_of(http.scope.get(TENANT_KEY, ""), g.cache_salt)
        # the n choices: requests of their own, sharing the prompt's prefill. Built off the event
        # loop (a grammar compiles, a draft pool may be allocated), queued on it.
        jobs = [_Job(loop, queue, i) for i in range(g.n)]
        await asyncio.to_thread(_make_requests, g, prompt_ids, max_tokens, method_name, prepared, jobs, arrival, rid,
                                scope)
        for i, job in enumerate(jobs):
            try:
                _submit(job, arrival)
            except BaseException:
                for queued in jobs[:i]:  # the choices already queued end with the one refused
                    queued.request.cancel()
                for unqueued in jobs[i + 1:]:
                    unqueued.request.drafter.close()
                raise
        if g.stream:
            return StreamingResponse(_stream(http, g, kind, rid, jobs, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(http, g, kind, rid, [job.request for job in jobs], queue)

    def _make_requests(g: GenerationRequest, prompt_ids: list[int], max_tokens: int, method_name: str,
                       prepared: Any, jobs: list[_Job], arrival: float, rid: str, scope: str | None) -> None:
        """Each choice's request (choice i seeded seed + i), not yet queued (a worker thread)."""
        made: list[Request] = []
        try:
            for job in jobs:
                job.req = _make_request(g, prompt_ids, max_tokens, method_name, prepared, job, arrival,
                                        rid if g.n == 1 else f"{rid}-{job.index}", scope)
                made.append(job.req)
        except BaseException:
            for req in made:  # nothing queued yet: give back what the drafters hold
                req.drafter.close()
            raise

    def _make_request(g: GenerationRequest, prompt_ids: list[int], max_tokens: int, method_name: str,
                      prepared: Any, job: _Job, arrival: float, request_id: str, scope: str | None) -> Request:
        def on_finish(req: Request) -> None:  # scheduler thread
            metrics.request_finished(req, arrival)
            job.on_finish(req)

        extra = g.sampling_options()  # only what is set: a plain request takes the plain path
        if g.grammar is not None:
            extra["grammar"] = g.grammar
        seed = None if g.seed is None else (g.seed + job.index) % SEED_LIMIT
        try:
            return scheduler.make_request(engine, prompt_ids, max_tokens=max_tokens, temperature=g.temperature,
                                          top_p=g.top_p, top_k=g.top_k, seed=seed, stop=g.stop or None,
                                          method=method_name, raw=g.raw, on_text=job.on_text if g.stream else None,
                                          prepared=prepared, on_finish=on_finish, request_id=request_id,
                                          cache_scope=scope, **extra)
        except SpecwoodError as e:
            raise ProtocolError(str(e), param=_param_of(e), code=_code_of(e)) from None

    def _submit(job: _Job, arrival: float) -> Request:
        """One choice's request into the scheduler's queue (on the event loop)."""
        req = job.req
        assert req is not None
        metrics.request_submitted(req, arrival)
        submitted.set()
        try:
            scheduler.submit(req)
        except QueueFullError as e:
            metrics.request_rejected(req)
            req.drafter.close()
            raise ProtocolError(str(e), code="queue_full", status=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return req

    def _parse(raw: bytes, kind: str) -> tuple[dict[str, Any], GenerationRequest]:
        body = P.parse_json(raw)
        g = P.parse_chat_request(body) if kind == "chat" else P.parse_completion_request(body)
        bad = [t for t in g.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{vocab - 1})",
                                param="logit_bias")
        if g.calls_tools:  # the tools' grammar needs the tokenizer's tags: built here, not in protocol
            try:
                g.grammar = grammars.tools_grammar(g.tools or [], g.tool_choice, tool_format, g.parallel_tool_calls,
                                                   content=g.json_schema)
            except GrammarError as e:
                raise ProtocolError(f"tools: {e}", param="tools", code="invalid_tools") from None
        return body, g

    def _encode(g: GenerationRequest) -> list[int]:
        if is_token_ids(g.prompt):
            ids = list(g.prompt)  # token ids
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ProtocolError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        else:
            try:
                ids = engine.encode(g.prompt, raw=g.raw, tools=g.tool_specs or None,
                                    template_kwargs=g.template_kwargs or None)
            except SpecwoodError as e:
                raise ProtocolError(str(e), param="messages" if g.kind == "chat" else "prompt") from None
            except Exception as e:  # noqa: BLE001 - e.g. a chat template that rejects the conversation
                raise ProtocolError(f"could not encode the prompt: {type(e).__name__}: {e}",
                                    param="messages" if g.kind == "chat" else "prompt") from None
        param = "messages" if g.kind == "chat" else "prompt"
        if not ids:
            raise ProtocolError("the prompt is empty", param=param)
        if len(ids) >= max_context:
            raise ProtocolError(f"the prompt has {len(ids)} tokens but this model's maximum context length is "
                                f"{max_context} tokens{why} (the prompt and at least one new token); shorten the "
                                "prompt",
                                param=param, code="context_length_exceeded")
        return ids

    def shown_stats(res: Any) -> dict[str, Any] | None:
        """The specwood_stats a response carries: None (left out) under --no-specwood-stats."""
        return res.stats if sharing.specwood_stats else None

    def _logprobs(kind: str, entries: list[Any] | None, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        return chat_logprobs(entries, token_bytes) if kind == "chat" else completion_logprobs(entries, token_bytes,
                                                                                             offset)

    def _tool_calls_reader(g: GenerationRequest) -> ToolCallText:
        """The reader of a choice's tool calls (with a response_format, the answer is JSON or calls)."""
        return ToolCallText(tool_format, engine.tokenizer, calls_first=g.json_schema is not None)

    def _answer(g: GenerationRequest, res: Any) -> tuple[str, str, list[Any] | None]:
        """A finished choice's text, finish reason and parsed tool calls (finish_reason "tool_calls",
        unless the answer ran out of tokens after them)."""
        text, finish, calls = res.text, res.finish_reason, None
        if g.calls_tools:
            text, parsed = _tool_calls_reader(g).finish(res.text, res.token_ids)
            if parsed:
                calls, finish = P.tool_call_objects(parsed), "tool_calls" if finish == "stop" else finish
        return text, finish, calls

    async def _complete(http: HTTPRequest, g: GenerationRequest, kind: str, rid: str, reqs: list[Request],
                        queue: asyncio.Queue[tuple[Any, ...]]) -> Response:
        left = len(reqs)  # non-streamed: the only items are each choice's "done"
        gone = asyncio.ensure_future(_until_disconnect(http))
        item: asyncio.Future[tuple[Any, ...]] | None = None
        try:
            while left:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    break
                left -= 1
        finally:
            gone.cancel()
            if item is not None and not item.done():
                item.cancel()
            for req in reqs:
                if not req.done.is_set():
                    req.cancel()  # the client went away (or the server is stopping)
        if not all(req.done.is_set() for req in reqs):
            return Response(status_code=499)  # nobody is listening
        failed = next((req for req in reqs if req.error is not None), None)
        if failed is not None and failed.error is not None:
            status, code = _failure_status(failed)
            return JSONResponse(P.error_body(failed.error, status, code=code), status_code=status)
        results = [req.outcome() for req in reqs]
        usage = _usage(reqs, sum(len(res.token_ids) for res in results))
        body: dict[str, Any] = {}
        for i, res in enumerate(results):
            text, finish, calls = _answer(g, res)
            one = P.completion_response(kind, rid, P.now(), name, text, finish, usage,
                                        shown_stats(res) if i == 0 else None,
                                        tool_calls=calls, logprobs=_logprobs(kind, res.logprobs))
            if i == 0:
                body = one
            else:
                body["choices"].append({**one["choices"][0], "index": i})
        return JSONResponse(body)

    async def _stream(http: HTTPRequest, g: GenerationRequest, kind: str, rid: str, jobs: list[_Job],
                      queue: asyncio.Queue[tuple[Any, ...]]) -> AsyncIterator[str]:
        t = P.now()
        reqs = [job.request for job in jobs]
        with_usage = g.include_usage or g.continuous_usage

        def chunk(index: int, **kw: Any) -> str:
            n = kw.pop("tokens", None)
            u = _usage([reqs[index]], n) if g.continuous_usage and n is not None else None
            body = P.stream_chunk(kind, rid, t, name, usage_=u, with_usage=with_usage, **kw)
            body["choices"][0]["index"] = index
            return P.sse(body)

        # starlette also cancels this generator when the client goes (ASGI < 2.4 servers such as
        # uvicorn); watching here too covers a request still queued on any server
        gone = asyncio.ensure_future(_until_disconnect(http))
        item: asyncio.Future[tuple[Any, ...]] | None = None
        calls_texts = [_tool_calls_reader(g) if g.calls_tools else None for _ in jobs]
        offsets = [0] * len(jobs)  # per choice: characters of its text covered by the logprobs sent (completions)

        def logprobs(i: int, entries: list[Any] | None) -> dict[str, Any] | None:
            out = _logprobs(kind, entries, offsets[i])
            if out is not None and kind != "chat":
                offsets[i] += sum(len(t) for t in out["tokens"])
            return out

        try:
            if kind == "chat":
                for i in range(len(reqs)):
                    yield chunk(i, role=True, tokens=0)
            left = len(reqs)
            while left:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return
                what, value, i = item.result()
                calls_text = calls_texts[i]
                if what == "text":
                    delta, n, entries = value
                    if calls_text is not None:  # (tags that are tokens are found in the token ids)
                        delta = calls_text.feed(delta, reqs[i].out.token_ids[:n] if calls_text.by_tokens else None)
                        calls = calls_text.call_deltas()  # each call's name, then its arguments as they come
                        if calls:
                            yield chunk(i, tool_calls=calls, tokens=n)
                        if not delta and not entries:
                            continue
                    yield chunk(i, text=delta, tokens=n, logprobs=logprobs(i, entries))
                    continue
                left -= 1
                req = reqs[i]
                if req.error is not None:
                    status, code = _failure_status(req)
                    yield P.sse(P.error_body(req.error, status, code=code))
                    yield P.sse("[DONE]")
                    return
                res = req.result
                assert res is not None
                finish = res.finish_reason
                if calls_text is not None:
                    rest, parsed = calls_text.finish(res.text, res.token_ids)
                    if rest:
                        yield chunk(i, text=rest, tokens=len(res.token_ids))
                    rest_calls = calls_text.final_call_deltas(parsed)
                    if rest_calls:
                        yield chunk(i, tool_calls=rest_calls, tokens=len(res.token_ids))
                    if parsed:
                        finish = "tool_calls" if finish == "stop" else finish
                yield chunk(i, text=None if kind == "chat" else "", finish_reason=finish, tokens=len(res.token_ids),
                            logprobs=logprobs(i, jobs[i].new_logprobs()))
            if g.include_usage:
                total = sum(len(req.outcome().token_ids) for req in reqs)
                yield P.sse(P.usage_chunk(kind, rid, t, name, _usage(reqs, total), shown_stats(reqs[0].outcome())))
            yield P.sse("[DONE]")
        finally:
            gone.cancel()
            if item is not None and not item.done():
                item.cancel()
            for req in reqs:
                if not req.done.is_set():
                    req.cancel()  # the client went away (or the server is stopping)

    return guard_app(app, access)


# A body over the limit is read on and dropped, up to these bounds, before the 413 goes out: a
# client that is still uploading (most do not read the response until their body is sent) would
# otherwise have the connection reset under it, losing the 413 (the kernel answers unread data on
# a closed socket with RST). Past them the connection is closed unread.
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 5.0


async def _read_body(http: HTTPRequest, limit: int, timeout_s: float) -> bytes:
    """The request body; a 413 once it exceeds `limit` bytes and a 408 where it has not arrived in
    `timeout_s` seconds. Both close the connection. Before a 413 the rest of the body is read and
    dropped (`_drain`) so that the client sees the answer; a client that sent `Expect: 100-continue`
    has sent nothing yet and is answered at once. Raises ClientDisconnect where the client goes
    away meanwhile."""
    declared = http.headers.get("content-length", "")
    # ASCII digits only, and no more than any real body has (int() of thousands of digits raises)
    size = int(declared) if declared.isascii() and declared.isdigit() and len(declared) <= 18 else None
    if size is not None and size > limit:
        if "100-continue" not in http.headers.get("expect", "").lower() and size <= DRAIN_MAX_BYTES:
            await _drain(http)
        raise _body_too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    await _drain(http, already=size)
                    raise _body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise P.ProtocolError(f"the request body did not arrive within {timeout_s:g} s (--read-timeout)",
                              code="read_timeout", status=408, headers={"Connection": "close"}) from None
    return b"".join(chunks)


async def _drain(http: HTTPRequest, already: int = 0) -> None:
    """Reads and drops what is left of the body, up to DRAIN_MAX_BYTES in all and DRAIN_MAX_S."""
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            async for chunk in http.stream():
                already += len(chunk)
                if already > DRAIN_MAX_BYTES:
                    return
    except TimeoutError:
        return


def _body_too_large(limit: int) -> P.ProtocolError:
    return P.ProtocolError(f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
                           code="request_too_large", status=413, headers={"Connection": "close"})


async def _until_disconnect(http: HTTPRequest) -> None:
    """Returns when the client has gone away (the body was read already: nothing else arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _param_of(e: SpecwoodError) -> str | None:
    msg = str(e)
    for p in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "messages", "logit_bias",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if msg.startswith(p):
            return p
    if isinstance(e, ContextLengthError):
        return "max_tokens"
    return "method" if msg.startswith("method") else None


def _code_of(e: SpecwoodError) -> str | None:
    if isinstance(e, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(e, SamplingParamsError):
        return "invalid_value"
    return None


def _version() -> str:
    try:
        from specwood.version import __version__
    except ImportError:  # pragma: no cover
        return "0"
    return __version__


# ---------------------------------------------------------------------------------------------
# running it


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket, so a busy port fails before any model is loaded."""
    if not 0 <= port <= 65535:
        raise SpecwoodError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecwoodError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def make_scheduler(engine: EngineLike, *, max_batch: int = 8, max_queue: int = 64,
                   kv_memory: int | None = None) -> Scheduler:
    """The server's scheduler: `max_batch` cache rows that grow with the longest request up to the
    engine's whole context (plus tree room) within a KV budget of `kv_memory` bytes (None: half
    the memory available now), the rows and the prefix cache together: the prefix cache keeps
    what the rows leave. 0: no reuse across requests (the rows then take the default budget)."""
    if max_batch < 1:
        raise SpecwoodError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 1:
        raise SpecwoodError(f"--max-queue must be >= 1, got {max_queue}")
    if kv_memory is not None and kv_memory < 0:
        raise SpecwoodError(f"--kv-memory must be >= 0 bytes, got {kv_memory}")
    runner = getattr(engine.target, "runner", None) is not None  # llama.cpp holds its own KV
    budget = kv_memory or (None if runner else default_kv_memory(engine.target.device))
    return engine.make_scheduler(max_batch=max_batch, row_len=int(engine.max_context) + TREE_ROOM,
                                 max_queue=max_queue, kv_memory=None if kv_memory == 0 else budget or 0,
                                 kv_budget=budget)


def serve(engine: EngineLike, *, host: str = "127.0.0.1", port: int = 8000, method: str = "auto",
          options: dict[str, Any] | None = None, max_batch: int = 8, max_queue: int = 64,
          sock: socket.socket | None = None, log_level: str = "warning", executor: Any = None,
          background: Any = None, max_body_bytes: int = P.DEFAULT_MAX_BODY_BYTES, access: Access = Access(),
          drain_timeout: float = DEFAULT_DRAIN_S, request_timeout: float | None = None,
          read_timeout: float = DEFAULT_READ_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
          kv_memory: int | None = None, sharing: Sharing = Sharing()) -> None:
    """Serve `engine` until interrupted (SIGINT/SIGTERM). Prints one "listening on" line. On the
    signal it stops accepting requests and drains: running requests get `drain_timeout` seconds
    to finish, then end (streams with an error event and [DONE]); a second signal ends at once.
    executor: a ParallelExecutor to serve on (DuoDecoding, lock-step batches), a PipelineExecutor
    (SpecPipe-DB, requests joining and leaving between pipeline steps), or None for the
    continuous-batching scheduler. background: a child process (group leader) that may only
    run while the server is idle (the plan measured in the background; `pause_while_busy`).
    read_timeout: seconds a request's headers, and then its body, may take to arrive;
    max_connections: open connections served, requests on more get 503 (connections.py);
    kv_memory: bytes of finished requests' K/V kept for reuse (`make_scheduler`; the other
    executors reuse nothing); sharing: who reuses whose work (tenancy.Sharing; without a shared
    cache the server keeps no prefix cache at all)."""
    import uvicorn

    sock = sock or bind_socket(host, port)
    if executor is not None:  # DuoDecoding's worker or SpecPipe's ranks (specwood.engine.executor)
        scheduler = Scheduler(executor, max_batch=max_batch, max_queue=max_queue)
    else:
        scheduler = make_scheduler(engine, max_batch=max_batch, max_queue=max_queue,
                                   kv_memory=kv_memory if sharing.shared_cache else 0)
    warning = budget_warning(kv_memory) if kv_memory else None
    if warning:
        _log(warning)
    scheduler.request_timeout_s = request_timeout
    app = create_app(engine, scheduler, method=method, options=options, max_body_bytes=max_body_bytes,
                     access=access.for_bind(str(sock.getsockname()[0])), read_timeout=read_timeout,
                     sharing=sharing)
    if background is not None:
        pause_while_busy(background, scheduler)
    # uvicorn waits for open responses a little longer than the drain, so streams get their end
    config = uvicorn.Config(app, log_level=log_level, access_log=False,
                            # uvicorn waits float seconds (asyncio.wait_for); its annotation says int
                            timeout_graceful_shutdown=drain_timeout + 10,  # type: ignore[arg-type]
                            lifespan="on", **uvicorn_limits(read_timeout, max_connections))
    server = uvicorn.Server(config)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host

    down: list[str] = []  # why the executor went down for good, if it did

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"specwood: listening on http://{shown}:{bound_port} (model {engine.target_name}, "
                  f"method {app.state.methods.default}, max batch {max_batch})", flush=True)
        # an executor that cannot recover (a dead pipeline rank) ends the server: /health says 503
        # meanwhile, and a supervisor restarts the process on its non-zero exit
        while not task.done():
            failure = scheduler.failure
            if failure and not down:
                down.append(failure)
                server.should_exit = True
            await asyncio.wait([task], timeout=EXECUTOR_POLL_S)
        await task

    if not scheduler.executor.steps_in_caller or threading.current_thread() is not threading.main_thread():
        # the other executors compute in their own processes (and signals reach only the main thread)
        try:
            asyncio.run(run())
        finally:
            scheduler.stop()
            sock.close()
        if down:
            raise SpecwoodError(f"the executor went down ({down[0]}); the server stopped -- start it again")
        return

    # Decode steps run on this (the main) thread, HTTP on a second one: torch's OpenMP team is
    # ~10% slower for a thread that is not the main one (Scheduler.run_here). uvicorn installs no
    # signal handlers off the main thread, so they go to its handle_exit here; its shutdown stops
    # the scheduler (the app's lifespan), which ends run_here.
    def http() -> None:
        try:
            asyncio.run(run())
        finally:
            scheduler.stop()  # also when uvicorn could not start

    http_thread = threading.Thread(target=http, name="specwood-http", daemon=True)
    draining = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        if not draining.is_set():  # the first: drain, then stop the scheduler (failing what is left)
            draining.set()
            timer = threading.Timer(drain_timeout, scheduler.stop, kwargs={"timeout": 0})
            timer.daemon = True
            timer.start()
            _log(f"draining: running requests get {drain_timeout:g} s to finish (a second signal ends at once)")
        server.handle_exit(sig, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        scheduler.run_here(then=http_thread.start)
        http_thread.join(drain_timeout + 30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
