"""Launching the pipeline executor on one machine: `PipelineExecutor` spawns one process per stage
(torch.multiprocessing, spawn) joined over gloo (NCCL for CUDA stages) on the loopback interface
only, with the rendezvous store a file in a private directory (mode 0700): nothing of a
single-machine pipeline listens beyond 127.0.0.1, and no other user can write the store. The
weights are shipped once through shared memory (each rank gets its layers; rank 0 also the draft,
the tokenizer and the EOS ids), so ranks start in seconds and never re-read model files.

The launcher watches its children: a rank that dies fails the running request with one line
naming it; the other ranks notice on their own (failed collectives, heartbeats) and exit, and any
that have not after GRACE_S are killed, so nothing is left behind. Ranks also die with the launcher.
"""
from __future__ import annotations

import functools
import itertools
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, NoReturn

import torch

from specwood.engine.executor import Executor
from specwood.engine.output import GenerationResult
from specwood.engine.protocols import EngineLike, Prompt
from specwood.engine.specpipe.ranks import run_rank
from specwood.engine.specpipe.jobs import (DRAFTED_MODES, MODES, Job, check_pipeline_args, stage_ranges, tree_nodes,
                                           weight_elements)
from specwood.engine.parallel_worker import build_draft, draft_spec, time_forward
from specwood.engine.processes import ChildLost, NoAnswer, describe_exit, receive
from specwood.engine.request import Drafter, Request, State
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.methods import EXECUTOR_ALIASES
from specwood.sampling import SamplingParams, split_sampling

# `--width auto`: the planner (a higher layer) registers its search for w here when it is imported,
# as it registers its methods in specwood.methods.
WidthPlanner = Callable[..., dict[str, Any]]
_width_planner: WidthPlanner | None = None


def register_width_planner(planner: WidthPlanner) -> None:
    global _width_planner
    _width_planner = planner


END_POLL_S = 0.05  # a scheduler's step waits this long for a lane to end (then looks for cancellations)
SERVE_TREE_ROOM = 64  # a server's margin between a row and the context; the ranks size their rows themselves
LOOPBACK = "lo"  # Linux's loopback interface: where single-machine ranks talk
GRACE_S = 25.0  # how long the other ranks get to exit by themselves after one died


class PipelineFailure(SpecwoodError):
    """A rank died or failed; the executor is unusable afterwards (start a new one)."""


def _available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _stage_weights(model: Any, layers: range) -> dict[str, torch.Tensor]:
    """The canonical tensors a stage over `layers` needs (views: the pipe moves them to shared memory)."""
    n = model.config.n_layers
    sd = model.canonical_state_dict()
    keep = {}
    for name, t in sd.items():
        if name.startswith("layers."):
            if int(name.split(".")[1]) in layers:
                keep[name] = t
        elif name == "tok_embeddings.weight":
            if layers.start == 0 or (layers.stop == n and "output.weight" not in sd):
                keep[name] = t  # tied head: the last stage reads the embedding matrix too
        elif layers.stop == n:
            keep[name] = t
    return keep


def _rank_entry(conn: Any) -> None:
    """A spawned rank: receive its spec, build its parts, run (pipeline.run_rank)."""
    import torch.distributed as dist

    from specwood.engine.specpipe.comm import die
    from specwood.engine.processes import exit_with_parent

    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    try:
        spec = conn.recv()
    except (EOFError, OSError):
        return
    rank, world = spec["rank"], spec["world"]
    torch.set_num_threads(spec["threads"])
    if spec["cores"]:
        try:
            os.sched_setaffinity(0, spec["cores"])
        except (AttributeError, OSError):
            pass
    # gloo and NCCL would otherwise pick the interface the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK)
    try:
        store = dist.FileStore(spec["store"], -1)
    except Exception as e:  # noqa: BLE001
        die(f"pipeline rank {rank}: cannot open the launcher's store: {e}")

    def build(r: int, layers: range) -> dict[str, Any]:
        from specwood.models.transformer import build_model

        parts = {"stage": build_model(spec["config"], spec["weights"], spec["dtype"], spec["device"], layers=layers,
                                      max_positions=spec["max_positions"])}
        spec["weights"] = None
        if r == 0:
            parts.update(tokenizer=spec["tokenizer"], eos_ids=spec["eos_ids"], max_lanes=spec["max_lanes"])
            if spec["draft"] is not None:
                parts["draft"] = build_draft(spec["draft"])
        return parts

    run_rank(rank, world, build, spec["layers"], store, conn if rank == 0 else None, spec["collective_timeout_s"],
             fingerprint=spec["fingerprint"])
    os._exit(0)  # gloo's threads must not keep a finished rank alive


class PipelineRequest:
    """A request submitted to a `PipelineExecutor`: `wait()` for its result; its text streams to
    `on_text` (from the executor's reader thread) as rank 0 verifies tokens."""

    def __init__(self, rid: int, on_text: Callable[[str], None] | None,
                 on_finish: Callable[["PipelineRequest"], None] | None):
        self.id, self.on_text, self.on_finish = rid, on_text, on_finish
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.ended_here = False  # ended by this process (its consumer raised) while rank 0 still runs it
        self.done = threading.Event()

    def _end(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:  # noqa: BLE001 - a consumer's callback must not stop the reader
                pass

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError(f"pipeline request {self.id} gave no result within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise PipelineFailure(f"pipeline request {self.id} ended without a result")
        return self.result


class PipelineExecutor(Executor):
    """The target's layers split over `stages` local processes. Requests run in mode "specpipe"
    (fixed-width (width, topk) trees, one level per step), "pp" (plain pipeline parallelism, one
    token per full pass) or "specinfer" (PP + SpecInfer: a whole static tree per full pass, `tree`
    = make_shape options) on the same ranks. `generate` runs one request; `submit` /
    `generate_many` put several in flight at once (SpecPipe-DB: up to `max_lanes` share every
    pipeline step; more wait in rank 0's queue and join as others leave). `width` None or "auto":
    the planner's choice by E(T) from a quick measurement (or the stored one), `width_choice`.
    As an executor (specwood.engine.executor) a Scheduler's requests take the lanes: each joins
    at the pipeline's next step and leaves when it is done (continuous batching)."""

    name = "pipeline"
    steps_in_caller = False  # the ranks compute; the scheduler's step waits for their results
    tree_room = SERVE_TREE_ROOM

    def __init__(self, engine: EngineLike, stages: int = 2, *, width: int | str | None = 8, topk: int = 4,
                 threads: int | None = None, max_lanes: int = 8, start_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0):
        import torch.distributed as dist
        import torch.multiprocessing as tmp  # registers the shared-memory tensor reducers

        target = engine.target
        if not isinstance(max_lanes, int) or isinstance(max_lanes, bool) or max_lanes < 1:
            raise SpecwoodError(f"max_lanes (--max-batch) must be a positive integer, got {max_lanes!r}")
        check_pipeline_args(stages, 1 if width in (None, "auto") else width, topk, target.config.n_layers)
        cores = _available_cores()
        self.threads = threads or max(1, len(cores) // stages)
        self.width_choice: dict[str, Any] | None = None
        if width in (None, "auto") and engine.draft_model is None:
            width = 8  # plain PP only: no tree to size
        elif width in (None, "auto"):
            if _width_planner is None:
                raise SpecwoodError("--width auto needs specwood's planner (import specwood.planner); "
                                    "or pass --width N")
            self.width_choice = _width_planner(engine, stages, topk, threads=self.threads)
            width = self.width_choice["width"]
        self.engine, self.stages, self.width, self.topk, self.max_lanes = engine, stages, int(width), topk, max_lanes
        self.row_len = int(engine.max_context) + self.tree_room
        # a Scheduler's requests: their mode and lane, and the lanes' ends as the reader sees them
        # (weak: a request made but never admitted, e.g. refused by a full queue, leaves no entry)
        self._modes: weakref.WeakKeyDictionary[Request, tuple[str, dict[str, Any] | None]] = weakref.WeakKeyDictionary()
        self._lanes: dict[Request, PipelineRequest] = {}
        self._cancel_sent: set[Request] = set()
        self._ended: queue.SimpleQueue[tuple[Request, PipelineRequest]] = queue.SimpleQueue()
        self.layers = stage_ranges(target.config, stages, draft_load(engine))
        pin = stages * self.threads <= len(cores)  # one core set per rank when they fit
        self._store_dir = tempfile.mkdtemp(prefix="specwood-pipeline-")  # 0700: this user's alone
        self._store = dist.FileStore(os.path.join(self._store_dir, "store"), -1)
        on_cuda = target.device.type == "cuda"
        ctx = tmp.get_context("spawn")
        self.procs: list[Any] = []  # the ranks' processes (spawn context's Process)
        self.conn: Connection | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self._store_dir)
        self.failed: str | None = None
        self._pending: dict[int, PipelineRequest] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the pending table
        self._send_lock = threading.Lock()  # the pipe's send side (never held with _lock: rank 0 may be
        # blocked sending to the reader while we send to it)
        self._fail_lock = threading.Lock()
        self._closing = False
        self._reader: threading.Thread | None = None
        try:
            for r in range(stages):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_entry, args=(child,), daemon=True, name=f"specpipe-rank{r}")
                proc.start()
                child.close()
                self.procs.append(proc)
                draft = None
                if r == 0 and engine.draft_model is not None:
                    draft = draft_spec(engine.draft_model, str(target.device), self.threads)
                device = f"cuda:{r % torch.cuda.device_count()}" if on_cuda else "cpu"
                parent.send({
                    "rank": r, "world": stages, "store": os.path.join(self._store_dir, "store"), "layers": self.layers,
                    "config": target.config, "weights": _stage_weights(target, self.layers[r]), "dtype": target.dtype,
                    "device": device, "max_positions": target.max_positions, "threads": self.threads,
                    "cores": cores[r * self.threads:(r + 1) * self.threads] if pin else None,
                    "collective_timeout_s": collective_timeout_s, "fingerprint": engine.target_name or "target",
                    "draft": draft, "tokenizer": engine.tokenizer if r == 0 else None,
                    "eos_ids": set(engine.eos_token_ids) if r == 0 else None, "max_lanes": max_lanes,
                })
                if r == 0:
                    self.conn = parent
                else:
                    parent.close()
            kind, self.info = self._recv(start_timeout_s, "starting")
            if kind != "ready":
                raise PipelineFailure(f"pipeline rank 0 answered {kind!r} while starting")
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name="specpipe-reader", daemon=True)
        self._reader.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # --- the executor interface (specwood.engine.executor) ---------------------------------------

    @property
    def failure(self) -> str | None:
        return self.failed

    def free_slots(self, running: int) -> int:
        return self.max_lanes - running

    def ensure_room(self, needed: int, idle: bool = True) -> None:
        if needed - self.tree_room > self.engine.max_context:
            raise ContextLengthError(f"the request needs {needed - self.tree_room} context tokens but the model holds "
                                     f"{self.engine.max_context}; shorten the prompt or lower max_tokens")

    def make_request(self, engine: EngineLike, prompt: Prompt, params: SamplingParams | None = None, *,
                     scheduler: Any, method: str | None = None, prepared: Any = None, **kwargs: Any) -> Request:
        """A request in `method`'s pipeline mode; `prepared`: the server's (mode, specinfer tree)
        for it (serve.pipeline_methods), else the mode `pipeline_mode` gives the name."""
        mode, tree = prepared if prepared is not None else pipeline_mode(method or "specpipe")
        req = engine.new_request(prompt, params, method=mode, scheduler=scheduler,
                                 prepared=lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(), **kwargs)
        self._modes[req] = (mode, tree)
        return req

    def admit(self, req: Request) -> None:
        if req not in self._modes:
            raise SpecwoodError("requests for the pipeline executor come from its make_request")
        mode, tree = self._modes[req]
        req.state = State.DECODE  # rank 0 prefills and decodes
        self._lanes[req] = self.submit(  # the ranks sample without the sequential executor's processors
            req.prompt_ids, req.params.unshaped(), max_tokens=req.max_tokens, stop=req.out.stop or None,
            on_text=req.out.on_text, mode=mode, tree=tree,
            on_finish=functools.partial(self._lane_ended, req))

    def _lane_ended(self, req: Request, lane: PipelineRequest) -> None:
        self._ended.put((req, lane))

    def step(self, running: list[Request]) -> None:
        """The lanes that ended since the last step (waits up to END_POLL_S for the first)."""
        try:
            ended = [self._ended.get(timeout=END_POLL_S)]
        except queue.Empty:
            return None
        while True:
            try:
                ended.append(self._ended.get_nowait())
            except queue.Empty:
                break
        for req, lane in ended:
            if self._lanes.get(req) is not lane:
                continue  # ended already (failed, cancelled, shut down)
            if lane.error is not None:
                if lane.ended_here:
                    try:
                        self._send(("cancel", lane.id))
                    except PipelineFailure:
                        pass
                self.fail(req, lane.error)
            else:
                self.finish(req, result=lane.result)
        return None

    def cancel_running(self, req: Request) -> bool:
        lane = self._lanes.get(req)
        if lane is not None and req not in self._cancel_sent:
            self._cancel_sent.add(req)
            try:
                self.cancel(lane)
            except SpecwoodError:
                pass
        return lane is not None  # the lane ends it ("cancelled") at the pipeline's next step

    def release(self, req: Request) -> None:
        self._modes.pop(req, None)
        self._lanes.pop(req, None)
        self._cancel_sent.discard(req)

    # --- requests ---

    def submit(self, prompt: Any, params: SamplingParams | None = None, *, max_tokens: int = 128,
               stop: list[str] | str | None = None, raw: bool = False,
               on_text: Callable[[str], None] | None = None, mode: str = "specpipe", width: int | None = None,
               topk: int | None = None, tree: dict[str, Any] | None = None, trace: bool = False,
               on_finish: Callable[[PipelineRequest], None] | None = None, **sampling: Any) -> PipelineRequest:
        """Put one request in flight (it joins the pipeline at its next step, or when a lane frees
        up); bad input raises here. `params` (or its fields as keyword arguments): temperature,
        top-k/p and seed. Greedy output is token-identical to `ar`."""
        if self.failed:
            with self._fail_lock:  # the ranks are down once the failure's handling ends
                raise PipelineFailure(f"the pipeline is down ({self.failed}); start a new PipelineExecutor")
        if mode not in MODES:
            raise SpecwoodError(f"unknown pipeline mode '{mode}' (use {' or '.join(MODES)})")
        width, topk = width or self.width, topk or self.topk
        check_pipeline_args(self.stages, width, topk)
        if mode in DRAFTED_MODES and self.engine.draft_model is None:
            raise SpecwoodError(f"mode '{mode}' needs a draft model; load one (--draft NAME|PATH) or use mode 'pp'")
        n_tree = tree_nodes(tree) if mode == "specinfer" else 0
        params, unknown = split_sampling(params, sampling)
        if unknown:
            raise TypeError(f"submit() got unexpected keyword arguments {', '.join(sorted(unknown))}")
        if params.shaping():
            raise SpecwoodError(f"{', '.join(params.shaping())} run on the sequential executor, not 'pipeline'")
        params = replace(params, emit_limit=getattr(self.engine, "emit_limit", None))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise SpecwoodError(f"max_tokens must be a positive integer, got {max_tokens}")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = list(prompt)
        else:
            ids = self.engine.encode(prompt, raw)
        if not ids:
            raise SpecwoodError("the prompt is empty")
        limit = self.engine.max_context
        if len(ids) >= limit:
            raise ContextLengthError(f"prompt has {len(ids)} tokens but the context holds {limit}; shorten the prompt")
        stop = [stop] if isinstance(stop, str) else stop
        job = Job(ids, min(max_tokens, limit - len(ids)), params, mode, width, topk, tree, n_tree, trace)
        req = PipelineRequest(next(self._ids), on_text, on_finish)
        with self._lock:
            self._pending[req.id] = req
        self._send(("submit", req.id, job, stop))
        return req

    def generate(self, prompt: Any, params: SamplingParams | None = None, *, timeout_s: float = 3600.0,
                 **kwargs: Any) -> GenerationResult:
        """One request on the pipeline (the arguments of `submit`)."""
        return self._wait(self.submit(prompt, params, **kwargs), timeout_s)

    def generate_many(self, prompts: list[Any], *, timeout_s: float = 3600.0, **kwargs: Any) -> list[GenerationResult]:
        """Several requests in flight at once (SpecPipe-DB); each prompt may be a dict of its own
        `submit` arguments (with "prompt"), the keyword arguments are shared. Results in order."""
        reqs = []
        for p in prompts:
            own = dict(p) if isinstance(p, dict) else {"prompt": p}
            reqs.append(self.submit(own.pop("prompt"), **{**kwargs, **own}))
        deadline = time.monotonic() + timeout_s
        return [self._wait(r, max(1.0, deadline - time.monotonic())) for r in reqs]

    def cancel(self, req: PipelineRequest) -> None:
        """Drop a request (it ends with finish_reason "cancelled")."""
        if not req.done.is_set() and not self.failed:
            self._send(("cancel", req.id))

    def _wait(self, req: PipelineRequest, timeout: float) -> GenerationResult:
        try:
            result = req.wait(timeout)
        except TimeoutError:
            self.failed = f"no answer within {timeout:.0f}s"
            _kill_all(self.procs)
            raise PipelineFailure(f"the pipeline gave {self.failed} and was stopped") from None
        if self.width_choice is not None and result.stats.get("method") == "specpipe":
            result.stats["width_choice"] = self.width_choice
        return result

    # --- the children ---

    def _read(self) -> None:
        """The reader thread: rank 0's messages to their requests; a dead rank fails them all."""
        while not self._closing:
            try:
                msg = self._pipe().recv() if self._pipe().poll(0.05) else None
            except (EOFError, OSError):
                msg = None
                if not self._closing:
                    self._fail_all()
                    return
            if msg is None:
                if not self._closing and any(not p.is_alive() for p in self.procs):
                    self._fail_all()
                    return
                continue
            kind, rid, payload = msg
            with self._lock:
                req = self._pending.get(rid) if kind == "text" else self._pending.pop(rid, None)
            if req is None:
                continue
            if kind == "text":
                if req.on_text is not None:
                    try:
                        req.on_text(payload)
                    except Exception as e:  # noqa: BLE001 - a consumer's callback failed: its request ends
                        with self._lock:
                            self._pending.pop(rid, None)
                        req.ended_here = True  # a scheduler's step cancels it on rank 0
                        req._end(None, e)
            elif kind == "result":
                req._end(payload)
            else:  # "error": this request's bad input, caught on rank 0
                req._end(None, SpecwoodError(payload))

    def _fail_all(self) -> None:
        try:
            self._fail()
        except PipelineFailure as e:
            with self._lock:
                pending, self._pending = list(self._pending.values()), {}
            for req in pending:
                req._end(None, e)

    def _pipe(self) -> Connection:
        """The pipe to rank 0 (set while starting)."""
        if self.conn is None:
            raise PipelineFailure("the pipeline has no connection to rank 0")
        return self.conn

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._pipe().send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self._fail()

    def _recv(self, timeout: float, what: str) -> tuple[Any, ...]:
        """Before the reader thread runs (starting): rank 0's next message (a message from a rank
        that has exited still counts; a dead rank is named by `_fail`)."""
        try:
            msg: tuple[Any, ...] = receive(self._pipe(), timeout, lambda: all(p.is_alive() for p in self.procs))
            return msg
        except ChildLost:
            self._fail()
        except NoAnswer:
            self.failed = f"no answer within {timeout:.0f}s while {what}"
            _kill_all(self.procs)
            raise PipelineFailure(f"the pipeline gave {self.failed} and was stopped") from None

    def _fail(self) -> NoReturn:
        """A rank is gone: name it at once (`failure`: a server's /health answers 503 from then
        on), let the others exit by themselves (kill them after GRACE_S, or when closed), raise."""
        with self._fail_lock:  # the reader and a sender may both notice: one waits, both raise
            if self.failed:
                raise PipelineFailure(self.failed)
            first = None
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and not self._closing:
                dead = [(r, p) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if first is None and dead:
                    # the first casualty: one killed by a signal, else the first that exited
                    r, p = first = next(((r, p) for r, p in dead if p.exitcode < 0), dead[0])
                    self.failed = f"pipeline rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}"
                if len(dead) == len(self.procs):
                    break
                time.sleep(0.05)
            _kill_all(self.procs)
            if first is None:
                self.failed = "lost the connection to pipeline rank 0"
            raise PipelineFailure(self.failed)

    def close(self) -> None:
        self._closing = True
        if self._reader is not None:
            self._reader.join(5)
        if self.conn is not None and not self.failed:
            try:
                self.conn.send(("close",))
            except (BrokenPipeError, EOFError, OSError):
                pass
            for p in self.procs:
                p.join(10)
        self._finalizer()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            req._end(None, PipelineFailure("the pipeline was closed"))

    def __enter__(self) -> "PipelineExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _kill_all(procs: list[Any], store_dir: str | None = None) -> None:
    """Kill the ranks still alive; with `store_dir` (the executor's end), remove the store too."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)


def generate_pipeline(engine: EngineLike, prompt: Any, params: SamplingParams | None = None, *, stages: int = 2,
                      width: int | str | None = 8, topk: int = 4, threads: int | None = None,
                      **kwargs: Any) -> GenerationResult:
    """One request on a pipeline started for it (and stopped after): `specwood generate --executor pipeline`."""
    with PipelineExecutor(engine, stages, width=width, topk=topk, threads=threads) as ex:
        return ex.generate(prompt, params, **kwargs)


def draft_load(engine: EngineLike) -> float:
    """The draft model rank 0 runs beside its layers, in stage_ranges' unit (target weight
    elements): the target's total times a draft forward's time over a target forward's, both
    timed here (one token at a short context; the ratio is what matters)."""
    draft, target = engine.draft_model, engine.target
    if draft is None:
        return 0.0
    layer, head = weight_elements(target.config)
    total = target.config.n_layers * layer + head
    for model in (draft, target):  # warm-up: a freshly loaded model's first forwards page its weights in
        time_forward(model, 64, 1)
    return total * time_forward(draft, 64, 3) / time_forward(target, 64, 3)


# the method names the pipeline executor runs: Engine.generate(method=..., executor="pipeline") and the
# bench's NAME@pipeline; a tree shape name runs PP + SpecInfer with that shape
# each mode by its own name, and the sequential names that mean one here (the registry's aliases)
PIPELINE_METHODS = {**{mode: mode for mode in MODES}, **EXECUTOR_ALIASES["pipeline"]}


def pipeline_mode(method: str, budget: int | None = None, depth: int | None = None,
                  threshold: float | None = None) -> tuple[str, dict[str, Any] | None]:
    """A method name on the pipeline executor -> (mode, specinfer tree options)."""
    from specwood.drafting.shapes import MODEL_SHAPES

    if method in PIPELINE_METHODS:
        mode = PIPELINE_METHODS[method]
        name = "static"
    elif method in MODEL_SHAPES:
        mode, name = "specinfer", method
    else:
        raise SpecwoodError(f"the pipeline executor runs {', '.join(PIPELINE_METHODS)} or a tree shape for "
                            f"PP + SpecInfer ({', '.join(MODEL_SHAPES)}), not method '{method}'")
    if mode != "specinfer":
        return mode, None
    tree = {"name": name, **{k: v for k, v in (("budget", budget), ("depth", depth), ("threshold", threshold))
                             if v is not None}}
    tree_nodes(tree)
    return mode, tree


def generate_on_pipeline(engine: EngineLike, executor: Any, prompt: Any, params: SamplingParams | None = None, *,
                         method: str = "specpipe", stages: int = 2,
                         width: int | None = None, topk: int | None = None, threads: int | None = None,
                         budget: int | None = None, depth: int | None = None, threshold: float | None = None,
                         **kwargs: Any) -> GenerationResult:
    """`Engine.generate(..., executor="pipeline" | a PipelineExecutor)`: one request on the pipeline
    (a string starts one for the call with `stages`, `width`, `topk`, `threads`, and stops it after)."""
    mode, tree = pipeline_mode(method, budget, depth, threshold)
    if isinstance(executor, PipelineExecutor):
        return executor.generate(prompt, params, mode=mode, width=width, topk=topk, tree=tree, **kwargs)
    return generate_pipeline(engine, prompt, params, stages=stages, width=width or 8, topk=topk or 4, threads=threads,
                             mode=mode, tree=tree, **kwargs)
