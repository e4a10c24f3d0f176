"""The parallel executor (DuoDecoding): the draft model in a worker process on its own device and
cores, the target in this process, both working at the same time.

Each iteration both sides start from the same committed prefix. The target verifies the drafts of
the previous iteration (the *pending* chain: root + tokens drafted earlier) and so produces the
next token; meanwhile the draft, assuming the pending chain is accepted, drafts the next tree from
its end: a multi-sequence tree (specwood.drafting.multi_sequence) whose first-level tokens are
guesses of the target's bonus token. After both finish:

* pending chain fully accepted and the bonus token y equals a first-level guess s: the chain under
  s becomes the next pending chain (its tokens were drawn from q conditioned on s, and s == y is
  now the true prefix, so it is verified normally next iteration: lossless);
* otherwise y is the next root with nothing pending, and the draft rolls back to the accepted
  prefix (its KV cache row is truncated or compacted; no re-prefill).

The guesses are never verified against p: y is drawn from p exactly as plain decoding would (or
is the argmax under greedy decoding); a guess only decides which pre-drafted chain is kept.

Message protocol (one multiprocessing Pipe, spawn context; main -> worker, one reply each):

    ("load", spec)                          -> ("ready", info)        spec: config, weights (shared
                                                                      memory), dtype, device, threads
    ("calibrate", ctx, reps)                -> ("calibrated", s)      s per one-token draft forward
    ("prefill", drops, rows, row_len, [(rid, prompt, params, seed, gamma, depth, max_seqs)])
    ("go", drops, [(rid, ctx_len, root, hit, gamma, depth, catchup)])
                                            -> ("drafts", {rid: (tokens, parents, probs,
                                                            dist_nodes, dists)}, timing)
    ("stop",)                               (no reply)
    any failure                             -> ("error", text)

`hit` is the index (in the tree the worker sent last) of the first-level node that matched the
target's token, or -1: then the worker truncates its row to `ctx_len` tokens (the target's
committed context) and drafts from `root`. `catchup` lists committed tokens the worker has not
seen: those the target decoded plainly while the worker was still prefilling. Only token ids, parent indices
and the draft probabilities of drafted tokens cross; full vocabulary rows (`dists`, float32) only under sampling
and only for drafted positions that have a drafted child (what the verifier needs).

Scope: the executor advances a *set* of requests in lock step (one batched target forward and one
batched draft forward per round for all of them). Driven by the one Scheduler
(specwood.engine.scheduler) like every executor: a batch is admitted while none runs and runs to
its end in one scheduler step (no continuous admission on this executor yet); a request that
raises fails alone. `Engine.generate(..., executor="parallel")` runs one request at a time.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from weakref import WeakKeyDictionary

import torch

from specwood.drafting.multi_sequence import MultiSequenceShape, make_multi_sequence
from specwood.engine.config import SchedulerConfig
from specwood.engine.executor import Executor
from specwood.engine.parallel_args import available_cores, check_draft_device, check_draft_threads, parallel_method
from specwood.engine.parallel_process import WorkerFailure, _Inline, _Remote
from specwood.engine.parallel_worker import draft_spec, time_forward, tree_from_payload
from specwood.engine.protocols import EngineLike, Prompt
from specwood.engine.request import Drafter, Request, State
from specwood.engine.scheduler import Scheduler
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.models.cache import KVCache
from specwood.sampling import SamplingParams, split_sampling
from specwood.tree.token_tree import TokenTree


GAMMA_MAX = 32  # the largest draft budget the hardware-aware rule may pick
CALIBRATION_CONTEXT = 128  # context length of the start-up timing
CALIBRATION_REPS = 5
REMEASURE_TOKENS = 64  # re-derive gamma from the measured step times every this many context tokens
EMA = 0.3
RECOVERY_BACKOFF_S = 5.0  # between tries to restart a dead worker while idle
EXECUTOR_OPTIONS = ("draft_device", "draft_threads")


@dataclass
class _Duo:
    """One request's executor state and stats (main side)."""

    shape: MultiSequenceShape
    fixed_gamma: int | None
    pending: TokenTree | None = None  # the tree the target verifies next: root + pending chain
    all_accepted: bool = True  # the last verification accepted the whole pending chain
    hit: int = -1
    hit_rank: int = -1  # which guess (0 = the draft's top token) the last hit was
    gamma: int = 0
    iterations: int = 0
    guesses: int = 0  # iterations whose bonus token could have been guessed
    hits: int = 0
    gammas: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    draft_idle_s: float = 0.0
    target_idle_s: float = 0.0
    draft_prefill_s: float = 0.0
    target_prefill_s: float = 0.0
    worker_len: int | None = None  # the prompt the worker prefilled (until the first go: catch-up from here)
    catchup_steps: int = 0  # plain steps while the worker prefilled (CPU target)
    catchup_s: float = 0.0


class ParallelExecutor(Executor):
    """DuoDecoding: the draft model in a worker process (`draft_device`, `draft_threads` cores),
    the target here (`target_threads`; default: the cores the draft leaves, all of them for a
    CPU target's prefill). As an executor (specwood.engine.executor) it runs the scheduler's
    requests in lock-step batches: a batch is admitted while none runs and runs to completion.
    `generate` runs one request; `run(requests)` a set made by `new_request`. The worker starts
    on first use and is restarted after a failure; `close()` stops it."""

    name = "parallel"
    steps_in_caller = False  # a batch runs to its end in one step: the server's loop gets its own thread

    def __init__(self, engine: EngineLike, *, draft: Any = None, draft_device: str = "cpu",
                 draft_threads: int | None = None, target_threads: int | None = None,
                 gamma_max: int = GAMMA_MAX, remeasure_tokens: int = REMEASURE_TOKENS,
                 start_timeout: float = 180.0, reply_timeout: float = 600.0, verbose: bool = True,
                 inline: bool = False, draft_dtype: str | None = None, catch_up: bool = True):
        model = draft if draft is not None else engine.draft_model
        if model is None:
            raise SpecwoodError("executor 'parallel' needs a draft model; pass --draft NAME|PATH "
                                "(draft=... in the API)")
        tv, dv = engine.target.config.vocab_size, model.config.vocab_size
        if dv != tv:
            raise SpecwoodError(f"draft vocabulary ({dv} tokens) differs from the target's ({tv} tokens); the parallel "
                                "executor needs a draft from the target's model family")
        self.engine = engine
        self.target = engine.target
        self.draft = model
        self.draft_device = check_draft_device(draft_device)
        self.draft_threads = check_draft_threads(draft_threads, self.target.device)
        # a CPU target gets the cores the draft leaves (while a run lasts; other work keeps all), and
        # all of them for its prefill (the draft waits for it) -- unless told its threads: beside
        # other busy processes (a test worker) every op run on more threads than it has cores
        # waits milliseconds for a core
        if target_threads is not None and (not isinstance(target_threads, int) or isinstance(target_threads, bool)
                                           or target_threads < 1):
            raise SpecwoodError(f"target threads must be a positive integer, got {target_threads!r}")
        self.target_threads = target_threads or (max(1, available_cores() - self.draft_threads)
                                                 if self.target.device.type == "cpu" else torch.get_num_threads())
        self.prefill_threads = target_threads or available_cores()
        self.gamma_max = gamma_max
        self.remeasure_tokens = remeasure_tokens
        self.start_timeout = start_timeout
        self.reply_timeout = reply_timeout
        self.verbose = verbose
        self.inline = inline  # the worker's logic in this process, one message at a time (tests)
        # plain target steps while the worker prefills (False: the target waits for the first
        # trees; tests use it to make every step speculative whatever the timing)
        self.catch_up = catch_up
        self.draft_dtype = draft_dtype
        if draft_dtype not in (None, "auto", "int4", "bf16", "fp32"):
            raise SpecwoodError(f"unknown draft dtype '{draft_dtype}' (use auto, int4, bf16 or fp32)")
        self.limit_positions = min(self.target.max_positions, model.max_positions)
        self.tree_room = 2 * gamma_max + 4
        self.row_len = self.limit_positions + self.tree_room
        self._duo: WeakKeyDictionary[Request, _Duo] = WeakKeyDictionary()  # each request's DuoDecoding state
        self.cache: KVCache | None = None
        self._remote: _Remote | _Inline | None = None
        # replies the worker still owes for messages whose answer is no longer wanted (a run ended
        # before its last drafts came): discarded before the next wanted reply, so the next request
        # never waits for them up front
        self._stale = 0
        self._to_drop: list[str] = []
        self._lock = threading.RLock()
        self.restarts = 0
        self._failed = False  # the last run lost its worker: the next start is a restart
        self._restarting = False
        self._next_recovery = 0.0
        self.c_startup: float | None = None
        self.c: float | None = None
        self._t_target: float | None = None
        self._t_draft: float | None = None
        self._gamma = 1
        self._ctx_at_update = 0
        self.on_worker_started: Callable[[int], None] | None = None

    # --- the worker ---------------------------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        return self._remote.pid if self._remote is not None else None

    @property
    def worker_info(self) -> dict[str, Any] | None:
        """What the worker reported at start: pid, device, threads, pinned cores, dtype, int4."""
        return self._remote.info if self._remote is not None else None

    def start(self) -> None:
        """Start the worker (and measure the cost coefficient) unless it is running."""
        with self._lock:
            if self._remote is not None and self._remote.proc.is_alive():
                return
            if self._remote is not None:
                self._discard()
            spec = draft_spec(self.draft, self.draft_device, self.draft_threads, self.draft_dtype)
            self._remote = _Inline(spec) if self.inline else _Remote(spec, self.start_timeout)
            del spec
            self._stale, self._to_drop = 0, []
            try:
                self._calibrate()
            except BaseException:
                self._discard()
                raise

    def _ensure_worker(self) -> None:
        """Start the worker, counting a restart where the last one died or failed."""
        restart = self._failed or (self._remote is not None and not self._remote.proc.is_alive())
        self._restarting = restart
        try:
            self.start()
        finally:
            self._restarting = False
        if restart:
            self.restarts += 1
        self._failed = False

    @property
    def recovering(self) -> str | None:
        remote = self._remote
        if self._restarting:
            return "the draft worker is restarting"
        if self._failed:
            return "the draft worker failed; it restarts while no request runs"
        if remote is not None and not remote.proc.is_alive():
            return f"the draft worker (pid {remote.pid}) {remote.death()}; it restarts while no request runs"
        return None

    def recover(self) -> None:
        """Restart a dead worker while idle, so that the next request does not wait for it."""
        if self.recovering is None or time.monotonic() < self._next_recovery:
            return
        self._next_recovery = time.monotonic() + RECOVERY_BACKOFF_S  # a worker that cannot start: no spin
        with self._lock:
            if self.recovering is not None:
                if self.verbose:
                    print(f"specwood: {self.recovering}; restarting it", file=sys.stderr)
                try:
                    self._ensure_worker()
                except BaseException:
                    self._discard()
                    self._failed = True
                    raise

    def _worker(self) -> _Remote | _Inline:
        """The running worker (`start` made it)."""
        if self._remote is None:
            raise WorkerFailure("the draft worker is not running")
        return self._remote

    def _kv(self) -> KVCache:
        """The target's cache rows of the running batch (`_ensure_cache` made them)."""
        if self.cache is None:
            raise RuntimeError("the parallel executor has no cache rows (no batch admitted)")
        return self.cache

    def _pending(self, r: Request) -> TokenTree:
        """The tree the target verifies next for `r` (set once it has a first token)."""
        tree = self._duo[r].pending
        if tree is None:
            raise RuntimeError(f"request {r.id} has no pending tree")
        return tree

    def _calibrate(self) -> None:
        """c = T_target_step / T_draft_token at start-up, both timed at the same time (as they run)."""
        ctx = max(1, min(CALIBRATION_CONTEXT, self.limit_positions - 2))
        self._worker().send(("calibrate", ctx, CALIBRATION_REPS))
        threads = torch.get_num_threads()
        torch.set_num_threads(self.target_threads)
        try:
            t_target = time_forward(self.target, ctx, CALIBRATION_REPS)
        finally:
            torch.set_num_threads(threads)
        t_draft = self._worker().expect("calibrated", self.reply_timeout, "timing the draft")
        self.c_startup = self.c = t_target / max(t_draft, 1e-9)
        self._t_target, self._t_draft = t_target, t_draft
        self._gamma = self._gamma_from(self.c)

    def _gamma_from(self, c: float) -> int:
        return max(1, min(self.gamma_max, int(round(c))))

    def _discard(self) -> None:
        if self._remote is not None:
            self._remote.close()
        self._remote = None
        self._stale, self._to_drop = 0, []

    def close(self) -> None:
        with self._lock:
            self._discard()

    def __enter__(self) -> "ParallelExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- requests -----------------------------------------------------------------------------

    def ensure_room(self, needed: int, idle: bool = True) -> None:
        if needed - self.tree_room > self.limit_positions:
            raise ContextLengthError(f"the request needs {needed - self.tree_room} context tokens but the models hold "
                                     f"{self.limit_positions}; shorten the prompt or lower max_tokens")

    def make_request(self, engine: EngineLike, prompt: Prompt, params: SamplingParams | None = None, *,
                     scheduler: Any = None, method: str | None = "duo", prepared: Any = None,
                     **kwargs: Any) -> Request:
        """A request for this executor (Engine.new_request's arguments; method options: budget =
        a fixed gamma instead of the hardware-aware one, depth, max_sequences). A server's
        prepared drafter is not used: the worker drafts. Sampling: temperature, top-k/p and seed
        (the worker drafts without the sequential executor's processors)."""
        method = parallel_method(method)
        params, kwargs = split_sampling(params, kwargs)
        options = {k: kwargs.pop(k) for k in ("budget", "depth", "max_sequences") if k in kwargs}
        options = {k: v for k, v in options.items() if v is not None}
        unknown = sorted([*params.shaping(), *(set(kwargs) - {"max_tokens", "stop", "raw", "on_text", "on_finish",
                                                              "request_id", "cache_scope"})])
        if unknown:
            raise SpecwoodError(f"method 'duo' does not use option(s) {', '.join(unknown)} "
                                "(it takes budget, depth, max_sequences)")
        shape = make_multi_sequence(**options)
        state = _Duo(shape, options.get("budget"))

        def factory(sources: Any, prompt_len: int, max_tokens: int, load: int = 1, scope: str | None = "") -> Drafter:
            return Drafter(None, shape)

        req = self.engine.new_request(prompt, params, method=method, scheduler=scheduler or self, prepared=factory,
                                      **kwargs)
        self._duo[req] = state
        req.extra_stats = lambda: self._stats(state)
        return req

    def new_request(self, prompt: Any, params: SamplingParams | None = None, *, method: str = "duo",
                    **kwargs: Any) -> Request:
        """A request for `run` (same arguments as Engine.new_request)."""
        return self.make_request(self.engine, prompt, params, method=method, **kwargs)

    def state_of(self, req: Request) -> _Duo:
        """A request's DuoDecoding state (its pending chain, guesses and hits, gammas)."""
        return self._duo[req]

    def generate(self, prompt: Any, params: SamplingParams | None = None, *, method: str = "duo",
                 **kwargs: Any) -> Any:
        request = self.new_request(prompt, params, method=method, **kwargs)
        self.run([request])
        return request.outcome()

    def _stats(self, st: _Duo) -> dict[str, Any]:
        hist: dict[int, int] = {}
        for s in st.sequences:
            hist[s] = hist.get(s, 0) + 1
        return {
            "executor": "parallel",
            "draft_device": self.draft_device,
            "draft_threads": self.draft_threads,
            "iterations": st.iterations,
            "draft_idle_s": round(st.draft_idle_s, 5),
            "target_idle_s": round(st.target_idle_s, 5),
            "gamma_mode": "fixed" if st.fixed_gamma else "hardware-aware",
            "gamma_mean": round(sum(st.gammas) / len(st.gammas), 3) if st.gammas else 0.0,
            "gamma_last": st.gammas[-1] if st.gammas else 0,
            "cost_coefficient": round(self.c, 4) if self.c is not None else None,
            "cost_coefficient_startup": round(self.c_startup, 4) if self.c_startup is not None else None,
            "sequences_mean": round(sum(st.sequences) / len(st.sequences), 3) if st.sequences else 0.0,
            "sequences_hist": dict(sorted(hist.items())),
            "bonus_guess_hit_rate": round(st.hits / st.guesses, 4) if st.guesses else 0.0,
            "draft_prefill_s": round(st.draft_prefill_s, 5),
            "catchup_steps": st.catchup_steps,
            "target_prefill_s": round(st.target_prefill_s, 5),
            "target_step_s": round(self._t_target, 6) if self._t_target is not None else None,  # EMA
            "draft_token_s": round(self._t_draft, 6) if self._t_draft is not None else None,  # EMA
            "worker_restarts": self.restarts,
        }

    # --- running -----------------------------------------------------------------------------

    def run(self, requests: list[Request]) -> None:
        """Run `requests` (made by `new_request`) to completion, in one lock-step batch."""
        for r in requests:
            if r not in self._duo:
                raise SpecwoodError("requests for the parallel executor come from ParallelExecutor.new_request")
        n = max(1, len(requests))
        scheduler = Scheduler(self, SchedulerConfig(max_batch=n, max_queue=n))
        for r in requests:
            scheduler.submit(r)
        scheduler.run_until_done(requests)

    # --- the executor interface (specwood.engine.executor) ---------------------------------------

    def free_slots(self, running: int) -> int:
        # lock step: a batch runs to its end within one step, so whatever one admission round takes
        # (up to the scheduler's max_batch) is the next batch
        return 1 << 30

    def admit(self, req: Request) -> None:
        if req not in self._duo:
            raise SpecwoodError("requests for the parallel executor come from its make_request (new_request)")

    def release(self, r: Request) -> None:
        if r.row is not None and self.cache is not None:
            self.cache.release(r.row)
        r.row = None
        self._to_drop.append(r.id)  # the worker forgets it with the next message

    def step(self, running: list[Request]) -> None:
        """Run the admitted batch to completion. A worker failure fails its requests with one
        clear error; the next batch restarts the worker."""
        requests = running
        with self._lock:
            threads = torch.get_num_threads()
            try:
                self._ensure_worker()
                torch.set_num_threads(self.target_threads)
                self._run(requests)
            except WorkerFailure as e:
                self._discard()
                self._failed = True
                msg = f"{e}; the request failed and the next request restarts the worker"
                for r in requests:
                    if r.state is not State.FINISHED:
                        self.fail(r, WorkerFailure(msg))
                if self.verbose:
                    print(f"specwood: {msg}", file=sys.stderr)
            except BaseException as e:
                self._discard()  # the worker's state is unknown now
                self._failed = True
                for r in requests:
                    if r.state is not State.FINISHED:
                        self.fail(r, e)
                if not isinstance(e, Exception):
                    raise
            finally:
                torch.set_num_threads(threads)

    def _send(self, msg: tuple[Any, ...]) -> None:
        self._worker().send(msg)

    def _recv_drafts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        while self._stale:
            self._worker().expect("drafts", self.reply_timeout, "drafting")
            self._stale -= 1
        payloads, timing = self._worker().expect("drafts", self.reply_timeout, "drafting")
        return payloads, timing

    @property
    def free_rows(self) -> int | None:
        return self.cache.free_rows if self.cache is not None else None

    def _ensure_cache(self, rows: int, row_len: int) -> KVCache:
        c = self.cache
        if c is None or c.rows < rows or c.max_len < row_len:
            self.cache = None
            self.cache = c = self.target.new_cache(-(-row_len // 256) * 256, rows)
        c.reset()  # every row free (a run returns its rows; this is a safety net)
        c._free = list(range(c.rows - 1, -1, -1))
        return c

    def _run(self, requests: list[Request]) -> None:
        if not requests:
            return
        row_len = max(len(r.prompt_ids) + r.max_tokens + self.tree_room for r in requests)
        cache = self._ensure_cache(len(requests), row_len)
        entries = []
        for r in requests:
            r.row = cache.allocate()
            r.state = State.PREFILL
            r.t_admitted = time.perf_counter()
            st: _Duo = self._duo[r]
            st.gamma = self._gamma_for(r, len(r.prompt_ids) - 1)
            st.gammas.append(st.gamma)
            seed = None if r.draft_generator is None else r.draft_generator.initial_seed()  # (None: greedy)
            entries.append((r.id, r.prompt_ids, r.params, seed, st.gamma, self._depth_for(r),
                            st.shape.max_sequences))
        drops, self._to_drop = self._to_drop, []
        prefill_msg = ("prefill", drops, len(requests), row_len, entries)
        # A target on its own device prefills while the worker prefills the prompt and drafts
        # guesses of the first token. A CPU target shares the cores with the worker, so it
        # prefills alone on all of them first (the first token comes as soon as with plain
        # decoding); the worker prefills after it while the target decodes plainly (catch-up).
        shared = self.target.device.type == "cpu"
        if not shared:
            self._send(prefill_msg)
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        if shared:
            torch.set_num_threads(self.prefill_threads)
        try:
            self._prefill(requests)
        finally:
            torch.set_num_threads(threads)
        t_prefill = time.perf_counter() - t0
        for r in requests:
            self._duo[r].target_prefill_s = t_prefill
        live = [r for r in requests if r.state is State.DECODE]
        if shared and live:
            self._send(prefill_msg)
        elif not shared and not live:
            self._stale += 1
        if not live:
            return
        t1 = time.perf_counter()
        # plain steps until the first trees arrive -- unless a request samples with a seed: how
        # many steps that is depends on timing, and it would change which random draws it makes
        catch_up = self.catch_up and all(r.params.greedy or r.params.seed is None for r in live)
        while catch_up and live and not self._drafts_ready():
            for r in live:
                self._duo[r].pending = TokenTree.with_root(r.root_token(), "selected" if r.params.greedy else "sampled")
                self._duo[r].catchup_steps += 1
            dt = self._target_step(live)
            for r in live:
                self._duo[r].catchup_s += dt
            live = [r for r in live if r.state is State.DECODE]
        if not live:
            self._stale += 1
            return
        payloads, timing = self._recv_drafts()
        for r in live:
            st = self._duo[r]
            st.draft_prefill_s = timing["busy_s"]
            st.target_idle_s += time.perf_counter() - t1 - st.catchup_s
            if st.catchup_steps:  # the trees guess a token the target has passed: a miss
                st.all_accepted = False
            self._take_tree(r, payloads[r.id])
        while live:
            for r in [r for r in live if r.check_deadline() or r.cancelled]:
                r.out.finish_reason = "cancelled"
                self.finish(r)
            live = [r for r in live if r.state is State.DECODE]
            if not live:
                return
            go = []
            for r in live:
                if r.max_tokens - len(r.out.token_ids) <= 1:
                    continue  # this step ends it (a step emits a token at least): no tree to draft for it
                st = self._duo[r]
                st.gamma = self._gamma_for(r, len(r.context) + len(self._pending(r)) - 1)
                # the first go after catch-up steps hands the worker the tokens it missed
                catchup = r.context[st.worker_len:] if st.catchup_steps and st.worker_len is not None else []
                st.worker_len = None
                st.gammas.append(st.gamma)
                go.append((r.id, len(r.context), r.root, st.hit, st.gamma, self._depth_for(r), catchup))
            if go:
                drops, self._to_drop = self._to_drop, []
                self._send(("go", drops, go))
            t_target = self._target_step(live)
            still = [r for r in live if r.state is State.DECODE]
            if not still:
                self._stale += bool(go)  # not waited for: the next run discards it
                return
            drafted = {e[0] for e in go}
            if any(r.id not in drafted for r in still):
                raise RuntimeError("a request outlived the step that had to end it (max_tokens)")
            t1 = time.perf_counter()
            payloads, timing = self._recv_drafts()
            waited = time.perf_counter() - t1
            for r in live:
                self._duo[r].target_idle_s += waited
                self._duo[r].draft_idle_s += timing["idle_s"]
            self._measure(t_target, timing, len(live), max(len(r.context) for r in live))
            for r in still:
                self._take_tree(r, payloads[r.id])
            live = still

    def _prefill(self, requests: list[Request]) -> None:
        """The target's prompt prefill for every request; each one's first token (TTFT)."""
        from specwood.engine.step import first_tokens
        from specwood.models.prefill import PREFILL_CHUNK, prefill_rows

        start = 0
        with torch.inference_mode():
            while True:
                chunk = [r for r in requests if len(r.prompt_ids) > start]
                if not chunk:
                    break
                outs = prefill_rows(self.target, self._kv(),
                                    [(r.cache_row(), r.prompt_ids, start, min(start + PREFILL_CHUNK, len(r.prompt_ids)))
                                     for r in chunk])
                done = [(r, logits) for r, logits in zip(chunk, outs)
                        if start + PREFILL_CHUNK >= len(r.prompt_ids) and r.state is State.PREFILL]
                tokens = first_tokens([r for r, _ in done], [logits for _, logits in done])
                for (r, _), token in zip(done, tokens):
                    try:
                        if isinstance(token, Exception):
                            raise token
                        r.root = token
                        r.state = State.DECODE
                        self._duo[r].worker_len = len(r.prompt_ids)  # what the prefill message gives the worker
                        if r.out.push_step([r.root]):
                            self.finish(r)
                    except Exception as e:  # noqa: BLE001 - this request fails alone
                        self.fail(r, e)
                start += PREFILL_CHUNK

    def _target_step(self, live: list[Request]) -> float:
        """One batched target forward verifying every request's pending tree; commit and emit.
        Returns its seconds."""
        from specwood.engine.step import StepRecord, commit, target_forward, verify_requests

        t0 = time.perf_counter()
        trees = {r: self._pending(r) for r in live}
        rows = sum(len(t) for t in trees.values())
        cache = self._kv()
        with torch.inference_mode():
            outs = target_forward(self.target, cache, live, trees)
            verdicts = verify_requests(live, [trees[r] for r in live], outs)
            for r, verdict in zip(live, verdicts):
                st, tree = self._duo[r], trees[r]
                try:
                    if isinstance(verdict, Exception):
                        raise verdict
                    st.all_accepted = len(verdict.accepted) == tree.max_depth
                    st.iterations += 1
                    tokens = commit(cache, r, tree, verdict,
                                    StepRecord(len(live), rows, 0.0, time.perf_counter() - t0))
                    if r.out.push_step(tokens):
                        self.finish(r)
                except Exception as e:  # noqa: BLE001 - this request fails alone; the batch goes on
                    self.fail(r, e)
        return time.perf_counter() - t0

    def _drafts_ready(self) -> bool:
        """Whether the worker's answer to the last message is here (stale answers dropped)."""
        worker = self._worker()
        while self._stale and worker.ready():
            worker.expect("drafts", self.reply_timeout, "drafting")
            self._stale -= 1
        return not self._stale and worker.ready()

    def _take_tree(self, r: Request, payload: tuple[Any, ...]) -> None:
        """The worker's tree for this request: keep the sequence that starts with the token the
        target just produced (if the pending chain was accepted whole), else nothing pends."""
        st: _Duo = self._duo[r]
        tree = tree_from_payload(payload, r.params.greedy, self.target.device)
        firsts = tree.children(0)
        st.sequences.append(len(firsts))
        st.hit = st.hit_rank = -1
        if st.all_accepted and firsts:
            st.guesses += 1
            st.hit_rank = next((k for k, c in enumerate(firsts) if tree.tokens[c] == r.root), -1)
            st.hit = firsts[st.hit_rank] if st.hit_rank >= 0 else -1
            st.hits += st.hit >= 0
        st.pending = tree.reroot(st.hit) if st.hit >= 0 else TokenTree.with_root(r.root_token(), tree.child_rule)

    def _gamma_for(self, r: Request, root_pos: int) -> int:
        """This iteration's budget for a tree rooted at position `root_pos`: the fixed or the
        hardware-aware gamma, within the context and the tokens the request may still emit."""
        st: _Duo = self._duo[r]
        gamma = st.fixed_gamma or self._gamma
        room = min(self.limit_positions, self._kv().max_len) - 1 - root_pos
        return max(0, min(gamma, room))

    def _depth_for(self, r: Request) -> int:
        """No sequence longer than the tokens the request may still emit (a sequence starts with
        the token after the pending chain) or the method's depth option."""
        st: _Duo = self._duo[r]
        pend = st.pending.size if st.pending is not None else 0  # chain tokens, the root is emitted
        left = max(1, r.max_tokens - len(r.out.token_ids) - pend)
        return min(left, st.shape.max_depth) if st.shape.max_depth else left

    def _measure(self, t_target: float, timing: dict[str, Any], n_live: int, ctx: int) -> None:
        """Re-measure c from the running iterations (EMA of the target's busy time per step and
        the draft's busy time per drafted token); gamma follows it as the context grows."""
        tokens = timing["tokens"] / max(n_live, 1)
        if tokens <= 0:
            return
        t_draft = timing["busy_s"] / tokens
        self._t_target = t_target if self._t_target is None else (1 - EMA) * self._t_target + EMA * t_target
        self._t_draft = t_draft if self._t_draft is None else (1 - EMA) * self._t_draft + EMA * t_draft
        self.c = self._t_target / max(self._t_draft, 1e-9)
        if abs(ctx - self._ctx_at_update) >= self.remeasure_tokens:
            self._ctx_at_update = ctx
            self._gamma = self._gamma_from(self.c)
