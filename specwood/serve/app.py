"""The OpenAI-compatible HTTP server: `create_app(engine, scheduler)` and `serve(...)`.

The app routes each endpoint to `OpenAIServing` (specwood.serve.serving: requests become engine
Requests on one continuous-batching Scheduler), answers every error in OpenAI's shape, and starts
and stops the scheduler with its lifespan; `serve` runs it under uvicorn, decoding on the main
thread, and drains on a signal.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specwood.engine.config import AUTO, SchedulerConfig
from specwood.engine.protocols import EngineLike
from specwood.engine.scheduler import Scheduler
from specwood.errors import SpecwoodError
from specwood.heap import freeze_loaded_objects, keep_freed_memory
from specwood.serve import protocol as P
from specwood.serve.background import pause_while_busy
from specwood.serve.connections import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, uvicorn_limits
from specwood.serve.guard import Access, guard_app
from specwood.serve.protocol import ProtocolError
from specwood.serve.kv_memory import budget_warning
from specwood.serve.serving import OpenAIServing
from specwood.serve.tenancy import Sharing

DEFAULT_MAX_CONTEXT = 4096  # `specwood serve --executor parallel|pipeline` or on llama.cpp without --max-context
EXECUTOR_POLL_S = 0.5  # how often the server looks whether its executor went down
DEFAULT_DRAIN_S = 30.0  # on SIGTERM, how long running requests may take to finish


def _log(msg: str) -> None:
    print(f"specwood serve: {msg}", file=sys.stderr, flush=True)


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
    serving = OpenAIServing(engine, scheduler, method=method, options=options, model_name=model_name,
                            max_body_bytes=max_body_bytes, read_timeout=read_timeout, sharing=sharing)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        sampler = asyncio.create_task(serving.sample_queue_times())
        try:
            yield
        finally:
            sampler.cancel()
            serving.close()
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="specwood", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.scheduler, app.state.serving = engine, scheduler, serving
    app.state.metrics, app.state.methods = serving.metrics, serving.methods

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

    # --- the endpoints: serving's ---------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        return serving.health()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return serving.models()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    @app.post("/v1/chat/completions", openapi_extra=serving.chat_schema)
    async def chat_completions(request: HTTPRequest) -> Response:
        return await serving.generate(request, "chat")

    @app.post("/v1/completions", openapi_extra=serving.completion_schema)
    async def completions(request: HTTPRequest) -> Response:
        return await serving.generate(request, "completion")

    return guard_app(app, access)


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
    # proto named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose
    # socket says IPPROTO_TCP, and accepted ones copy the listener's 0 otherwise. With Nagle on,
    # a response's body waited for the client's delayed ACK of its headers: +40 ms on every
    # JSON answer (a stream's chunks waited while an earlier one was unacknowledged; BENCHMARKS.md §37)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # where accepted sockets inherit it
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecwoodError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def server_config(*, max_batch: int = 8, max_queue: int = 64, kv_memory: int | None = None,
                  shared_cache: bool = True, request_timeout: float | None = None) -> SchedulerConfig:
    """The server's scheduler configuration from its flags, their meaning read here once:
    `max_batch` cache rows that grow with the longest request up to the engine's whole context
    (plus tree room) within `--kv-memory` bytes (None: half the memory available once the models
    are loaded), the rows and the prefix cache together; `--kv-memory 0` keeps that default budget
    and reuses nothing across requests, and so does `--no-shared-cache` (`shared_cache=False`)."""
    return SchedulerConfig(max_batch=max_batch, max_queue=max_queue, request_timeout_s=request_timeout,
                           kv_memory=kv_memory or AUTO, reuse=shared_cache and kv_memory != 0)


def serve(engine: EngineLike, config: SchedulerConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          method: str = "auto", options: dict[str, Any] | None = None, sock: socket.socket | None = None,
          log_level: str = "warning", executor: Any = None, background: Any = None,
          max_body_bytes: int = P.DEFAULT_MAX_BODY_BYTES, access: Access = Access(),
          drain_timeout: float = DEFAULT_DRAIN_S, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, sharing: Sharing = Sharing()) -> None:
    """Serve `engine` until interrupted (SIGINT/SIGTERM). Prints one "listening on" line. On the
    signal it stops accepting requests and drains: running requests get `drain_timeout` seconds
    to finish, then end (streams with an error event and [DONE]); a second signal ends at once.
    config: the scheduler and its KV cache (`server_config`'s by default: batch, queue, request
    timeout, --kv-memory and reuse; the other executors take its batch, queue and timeout and
    reuse nothing). executor: a ParallelExecutor to serve on (DuoDecoding, lock-step batches), a
    PipelineExecutor (SpecPipe-DB, requests joining and leaving between pipeline steps), or None
    for the continuous-batching scheduler. background: a child process (group leader) that may
    only run while the server is idle (the plan measured in the background; `pause_while_busy`).
    read_timeout: seconds a request's headers, and then its body, may take to arrive;
    max_connections: open connections served, requests on more get 503 (connections.py);
    sharing: who reuses whose work (tenancy.Sharing; `config.reuse` says whether the server keeps
    a prefix cache at all)."""
    import uvicorn

    keep_freed_memory()  # a step's large buffers reuse freed heap, not fresh pages (specwood.heap)
    config = config or server_config(shared_cache=sharing.shared_cache)
    sock = sock or bind_socket(host, port)
    if executor is not None:  # DuoDecoding's worker or SpecPipe's ranks (specwood.engine.executor)
        scheduler = Scheduler(executor, config)
    else:
        scheduler = engine.make_scheduler(config)
    warning = budget_warning(config.kv_memory) if isinstance(config.kv_memory, int) else None
    if warning:
        _log(warning)
    app = create_app(engine, scheduler, method=method, options=options, max_body_bytes=max_body_bytes,
                     access=access.for_bind(str(sock.getsockname()[0])), read_timeout=read_timeout,
                     sharing=sharing)
    freeze_loaded_objects()  # the loaded server's objects out of the collector's full passes (specwood.heap)
    if background is not None:
        pause_while_busy(background, scheduler)
    # uvicorn waits for open responses a little longer than the drain, so streams get their end
    http_config = uvicorn.Config(app, log_level=log_level, access_log=False,
                                 # uvicorn waits float seconds (asyncio.wait_for); its annotation says int
                                 timeout_graceful_shutdown=drain_timeout + 10,  # type: ignore[arg-type]
                                 lifespan="on",
                                 **uvicorn_limits(read_timeout, max_connections))
    server = uvicorn.Server(http_config)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host

    down: list[str] = []  # why the executor went down for good, if it did

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"specwood: listening on http://{shown}:{bound_port} (model {engine.target_name}, "
                  f"method {app.state.methods.default}, max batch {config.max_batch})", flush=True)
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
