"""The OpenAI endpoints' handlers: `OpenAIServing` turns HTTP requests into engine Requests on one
Scheduler and their results into OpenAI responses, without the web framework's app (serve.app
routes to it), so it can be driven by a test with a starlette Request alone.

A request's body is parsed once (serve.protocol: its SamplingParams built there), its `n` choices
become engine Requests (choice i seeded seed + i), each submitted to the scheduler; the scheduler
thread's callbacks (text deltas, the end of a request) are bridged into the event loop with
`loop.call_soon_threadsafe`. A client that goes away cancels its requests, which frees their cache
rows at the scheduler's next step.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from specwood.constrain import grammars
from specwood.engine.protocols import EngineLike, is_token_ids
from specwood.engine.request import Request
from specwood.engine.scheduler import QueueFullError, Scheduler
from specwood.errors import DeadlineExceeded, GrammarError, SpecwoodError
from specwood.methods import MethodTable
from specwood.serve import protocol as P
from specwood.serve.connections import DEFAULT_READ_TIMEOUT_S
from specwood.serve.engine_methods import EngineMethods
from specwood.serve.guard import TENANT_KEY
from specwood.serve.metrics import ServerMetrics
from specwood.serve.openapi import chat_body, completion_body, generation_operation
from specwood.serve.pipeline_methods import PipelineMethods
from specwood.serve.prompt_limits import PromptLimit
from specwood.serve.protocol import GenerationRequest, ProtocolError
from specwood.serve.structured import TokenBytes, ToolCallText, chat_logprobs, completion_logprobs
from specwood.serve.tenancy import Sharing

RETRY_AFTER_S = 1
QUEUE_SAMPLE_S = 0.005  # period of the queue-time sampler while requests wait for admission
logger = logging.getLogger("specwood.serve")


class OpenAIServing:
    """The server's endpoints over `engine` and `scheduler`: `health()`, `models()` and
    `generate(http, kind)` for /v1/chat/completions ("chat") and /v1/completions ("completion").
    `method` (with `options`) is the default method, prepared now; a request may name another with
    the non-standard body field "method"; a body over `max_body_bytes` gets a 413, one that has not
    arrived `read_timeout` seconds after its headers a 408; `sharing` says who reuses whose cached
    work (specwood.serve.tenancy). Raises SpecwoodError for a bad default method or rows too short."""

    def __init__(self, engine: EngineLike, scheduler: Scheduler, *, method: str = "auto",
                 options: dict[str, Any] | None = None, model_name: str | None = None,
                 max_body_bytes: int = P.DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
                 sharing: Sharing = Sharing()):
        self.engine, self.scheduler, self.sharing = engine, scheduler, sharing
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
        # the context a request may use: the engine's, or less where the scheduler's rows are shorter
        executor = scheduler.executor
        tree_room = executor.tree_room
        self.max_context = min(int(engine.max_context), int(executor.max_row_len) - tree_room)
        budget = executor.kv_budget
        self.why = (f" (the KV budget of {budget} bytes, --kv-memory, holds {self.max_context} in each of "
                    f"{scheduler.max_batch} cache rows; the model's own context is {int(engine.max_context)})"
                    if budget is not None and self.max_context < int(engine.max_context) else "")
        if self.max_context < 2:
            raise SpecwoodError(f"the scheduler's cache rows ({executor.row_len} slots, {tree_room} kept for trees) "
                                "leave no room for a request; build it with row_len = max_context + TREE_ROOM")
        # the pipeline runs its own modes; every other executor the method registry's methods
        self.methods: MethodTable = (PipelineMethods(method, options) if executor.name == "pipeline"
                                     else EngineMethods(engine, method, options))
        self.name = model_name or str(engine.target_name or "specwood")
        self.metrics = ServerMetrics(scheduler, self.name)
        scheduler.observers.append(self.metrics.observe_step)
        self.vocab = int(engine.target_config.vocab_size)
        self.prompt_limit = PromptLimit(engine.tokenizer, self.max_context, self.why)
        self.created = P.now()
        self.tool_format = grammars.ToolFormat.of(engine.tokenizer)  # the tool-call tags, as the vocabulary has them
        # not inside the first grammar request, where its GIL stalls every other
        engine.prepare_grammars()
        self.token_bytes = TokenBytes(engine.tokenizer)
        self.submitted = asyncio.Event()  # wakes the queue-time sampler (set on the event loop)
        self.chat_schema = generation_operation(chat_body(self.name, self.methods.names, self.max_context))
        self.completion_schema = generation_operation(completion_body(self.name, self.methods.names, self.vocab,
                                                                      self.max_context))

    def close(self) -> None:
        self.prompt_limit.close()

    async def sample_queue_times(self) -> None:
        """Samples the queue's waiting times while requests wait (the metrics' admission times); runs
        until cancelled."""
        while True:
            if not self.metrics.has_pending:
                self.submitted.clear()
                await self.submitted.wait()
            await asyncio.sleep(QUEUE_SAMPLE_S)
            self.metrics.sample_admissions()

    # --- plain endpoints ----------------------------------------------------------------------

    def health(self) -> JSONResponse:
        scheduler = self.scheduler
        if scheduler.loop_died:
            return JSONResponse(P.error_body("the scheduler thread has stopped", 503), status_code=503)
        failure = scheduler.failure  # an executor down for good (a dead pipeline rank)
        if failure:
            return JSONResponse(P.error_body(f"the executor is down: {failure}", 503), status_code=503)
        recovering = scheduler.executor.recovering  # a dead draft worker, restarting
        if recovering:
            return JSONResponse(P.error_body(f"the executor is recovering: {recovering}", 503), status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "model": self.name, "running": scheduler.num_running,
                             "waiting": scheduler.num_waiting,
                             "free_rows": scheduler.executor.free_rows})  # None: the pipeline's ranks hold theirs

    def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.created, "owned_by": "specwood", "root": self.name,
             "max_model_len": self.max_context, "draft": self.engine.draft_name,
             "default_method": self.methods.default}]})

    # --- generation ---------------------------------------------------------------------------

    async def generate(self, http: HTTPRequest, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            raw = await _read_body(http, self.max_body_bytes, self.read_timeout)
        except ClientDisconnect:  # the client went away mid-upload: a cancelled request, not an error
            self.metrics.upload_dropped()
            logger.debug("a client disconnected before its request body arrived")
            return Response(status_code=499)
        # parsing, the chat template and tokenisation take a while for a large body: off the event
        # loop, so /health and every stream go on meanwhile
        body, g = await asyncio.to_thread(self.parse, raw, kind)
        if g.model is not None and g.model != self.name:
            raise ProtocolError(f"the model '{g.model}' does not exist; this server serves '{self.name}'",
                                param="model", code="model_not_found")
        found = self.methods.cached(g.method)
        if found is None:  # (a named method: None gets the default, always ready)
            found = await asyncio.to_thread(self.methods.prepare, g.method or self.methods.default)
        method_name, prepared = found
        # a prompt too long to fit is refused before it is tokenized; large ones on their own thread
        prompt_ids = await self.prompt_limit.run(g, self._encode)
        max_tokens = g.max_tokens
        room = self.max_context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room if kind == "chat" else min(P.COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            field = "max_completion_tokens" if "max_completion_tokens" in body and body["max_completion_tokens"] \
                is not None else "max_tokens"
            raise ProtocolError(f"this model's maximum context length is {self.max_context} tokens{self.why}; you "
                                f"requested {len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, "
                                f"{max_tokens} to generate): lower {field} or shorten the prompt", param=field,
                                code="context_length_exceeded")
        loop, rid = asyncio.get_running_loop(), P.new_id(kind)
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        scope = self.sharing.scope_of(http.scope.get(TENANT_KEY, ""), g.cache_salt)
        # the n choices: requests of their own, sharing the prompt's prefill. Built off the event
        # loop (a grammar compiles, a draft pool may be allocated), queued on it.
        jobs = [_Job(loop, queue, i) for i in range(g.n)]
        await asyncio.to_thread(self._make_requests, g, prompt_ids, max_tokens, method_name, prepared, jobs, arrival,
                                rid, scope)
        for i, job in enumerate(jobs):
            try:
                self._submit(job, arrival)
            except BaseException:
                for queued in jobs[:i]:  # the choices already queued end with the one refused
                    queued.request.cancel()
                for unqueued in jobs[i + 1:]:
                    unqueued.request.drafter.close()
                raise
        if g.stream:
            return StreamingResponse(self._stream(http, g, kind, rid, jobs, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(http, g, kind, rid, [job.request for job in jobs], queue)

    def _make_requests(self, g: GenerationRequest, prompt_ids: list[int], max_tokens: int, method_name: str,
                       prepared: Any, jobs: list[_Job], arrival: float, rid: str, scope: str | None) -> None:
        """Each choice's request (choice i seeded seed + i), not yet queued (a worker thread)."""
        made: list[Request] = []
        try:
            for job in jobs:
                job.req = self._make_request(g, prompt_ids, max_tokens, method_name, prepared, job, arrival,
                                             rid if g.n == 1 else f"{rid}-{job.index}", scope)
                made.append(job.req)
        except BaseException:
            for req in made:  # nothing queued yet: give back what the drafters hold
                req.drafter.close()
            raise

    def _make_request(self, g: GenerationRequest, prompt_ids: list[int], max_tokens: int, method_name: str,
                      prepared: Any, job: _Job, arrival: float, request_id: str, scope: str | None) -> Request:
        def on_finish(req: Request) -> None:  # scheduler thread
            self.metrics.request_finished(req, arrival)
            job.on_finish(req)

        try:
            return self.scheduler.make_request(self.engine, prompt_ids, g.choice_params(job.index),
                                               max_tokens=max_tokens, stop=g.stop or None, method=method_name,
                                               raw=g.raw, on_text=job.on_text if g.stream else None,
                                               prepared=prepared, on_finish=on_finish, request_id=request_id,
                                               cache_scope=scope)
        except SpecwoodError as e:
            raise ProtocolError(str(e), param=P.param_of(e), code=P.code_of(e)) from None

    def _submit(self, job: _Job, arrival: float) -> Request:
        """One choice's request into the scheduler's queue (on the event loop)."""
        req = job.req
        assert req is not None
        self.metrics.request_submitted(req, arrival)
        self.submitted.set()
        try:
            self.scheduler.submit(req)
        except QueueFullError as e:
            self.metrics.request_rejected(req)
            req.drafter.close()
            raise ProtocolError(str(e), code="queue_full", status=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return req

    def parse(self, raw: bytes, kind: str) -> tuple[dict[str, Any], GenerationRequest]:
        """A body of the endpoint `kind` ("chat" or "completion") as a validated request, its
        sampling parameters built once; a ProtocolError (a 4xx) for a bad one."""
        body = P.parse_json(raw)
        g = P.parse_chat_request(body, self.vocab) if kind == "chat" else P.parse_completion_request(body, self.vocab)
        if g.calls_tools:  # the tools' grammar needs the tokenizer's tags: built here, not in protocol
            try:
                grammar = grammars.tools_grammar(g.tools or [], g.tool_choice, self.tool_format,
                                                 g.parallel_tool_calls, content=g.json_schema)
            except GrammarError as e:
                raise ProtocolError(f"tools: {e}", param="tools", code="invalid_tools") from None
            g.params = replace(g.params, grammar=grammar)
        return body, g

    def _encode(self, g: GenerationRequest) -> list[int]:
        if is_token_ids(g.prompt):
            ids = list(g.prompt)  # token ids
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ProtocolError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})",
                                    param="prompt")
        else:
            try:
                ids = self.engine.encode(g.prompt, raw=g.raw, tools=g.tool_specs or None,
                                         template_kwargs=g.template_kwargs or None)
            except SpecwoodError as e:
                raise ProtocolError(str(e), param="messages" if g.kind == "chat" else "prompt") from None
            except Exception as e:  # noqa: BLE001 - e.g. a chat template that rejects the conversation
                raise ProtocolError(f"could not encode the prompt: {type(e).__name__}: {e}",
                                    param="messages" if g.kind == "chat" else "prompt") from None
        param = "messages" if g.kind == "chat" else "prompt"
        if not ids:
            raise ProtocolError("the prompt is empty", param=param)
        if len(ids) >= self.max_context:
            raise ProtocolError(f"the prompt has {len(ids)} tokens but this model's maximum context length is "
                                f"{self.max_context} tokens{self.why} (the prompt and at least one new token); shorten "
                                "the prompt", param=param, code="context_length_exceeded")
        return ids

    def shown_stats(self, res: Any) -> dict[str, Any] | None:
        """The specwood_stats a response carries: None (left out) under --no-specwood-stats."""
        return res.stats if self.sharing.specwood_stats else None

    def _logprobs(self, kind: str, entries: list[Any] | None, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        if kind == "chat":
            return chat_logprobs(entries, self.token_bytes)
        return completion_logprobs(entries, self.token_bytes, offset)

    def _tool_calls_reader(self, g: GenerationRequest) -> ToolCallText:
        """The reader of a choice's tool calls (with a response_format, the answer is JSON or calls)."""
        return ToolCallText(self.tool_format, self.engine.tokenizer, calls_first=g.json_schema is not None)

    def _answer(self, g: GenerationRequest, res: Any) -> tuple[str, str, list[Any] | None]:
        """A finished choice's text, finish reason and parsed tool calls (finish_reason "tool_calls",
        unless the answer ran out of tokens after them)."""
        text, finish, calls = res.text, res.finish_reason, None
        if g.calls_tools:
            text, parsed = self._tool_calls_reader(g).finish(res.text, res.token_ids)
            if parsed:
                calls, finish = P.tool_call_objects(parsed), "tool_calls" if finish == "stop" else finish
        return text, finish, calls

    async def _complete(self, http: HTTPRequest, g: GenerationRequest, kind: str, rid: str, reqs: list[Request],
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
            _stop_waiting(gone, item, reqs)
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
            text, finish, calls = self._answer(g, res)
            one = P.completion_response(kind, rid, P.now(), self.name, text, finish, usage,
                                        self.shown_stats(res) if i == 0 else None,
                                        tool_calls=calls, logprobs=self._logprobs(kind, res.logprobs))
            if i == 0:
                body = one
            else:
                body["choices"].append({**one["choices"][0], "index": i})
        return JSONResponse(body)

    async def _stream(self, http: HTTPRequest, g: GenerationRequest, kind: str, rid: str, jobs: list[_Job],
                      queue: asyncio.Queue[tuple[Any, ...]]) -> AsyncIterator[str]:
        t = P.now()
        reqs = [job.request for job in jobs]
        with_usage = g.include_usage or g.continuous_usage

        def chunk(index: int, **kw: Any) -> str:
            n = kw.pop("tokens", None)
            u = _usage([reqs[index]], n) if g.continuous_usage and n is not None else None
            body = P.stream_chunk(kind, rid, t, self.name, usage_=u, with_usage=with_usage, **kw)
            body["choices"][0]["index"] = index
            return P.sse(body)

        # starlette also cancels this generator when the client goes (ASGI < 2.4 servers such as
        # uvicorn); watching here too covers a request still queued on any server
        gone = asyncio.ensure_future(_until_disconnect(http))
        item: asyncio.Future[tuple[Any, ...]] | None = None
        calls_texts = [self._tool_calls_reader(g) if g.calls_tools else None for _ in jobs]
        offsets = [0] * len(jobs)  # per choice: characters of its text covered by the logprobs sent (completions)

        def logprobs(i: int, entries: list[Any] | None) -> dict[str, Any] | None:
            out = self._logprobs(kind, entries, offsets[i])
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
                yield P.sse(P.usage_chunk(kind, rid, t, self.name, _usage(reqs, total),
                                          self.shown_stats(reqs[0].outcome())))
            yield P.sse("[DONE]")
        finally:
            _stop_waiting(gone, item, reqs)


def _stop_waiting(gone: asyncio.Future[None], item: asyncio.Future[tuple[Any, ...]] | None,
                  reqs: list[Request]) -> None:
    """A handler's end: stop watching the client and the queue, and cancel the requests still
    running (the client went away, or the server is stopping)."""
    gone.cancel()
    if item is not None and not item.done():
        item.cancel()
    for req in reqs:
        if not req.done.is_set():
            req.cancel()


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
