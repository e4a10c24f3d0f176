"""The sequential executor: continuous batching in this process; every step advances all running
requests with one target forward.

The step itself (`SequentialStep`: prefill, first token, draft, one target forward, verify, commit)
runs over a small interface to where the target's K/V rows live (`TargetRows`): the
`SequentialExecutor`'s KV cache pools here, or a one-sequence runner (the llama.cpp backend:
specwood.engine.runner.RunnerExecutor), each composing the same step.

`SequentialExecutor` owns the KV cache pools (one for the target, one per draft model) of
`max_batch` rows, configured once (specwood.engine.config.SchedulerConfig). A request joins at the
next step: its prompt is prefilled in chunks, interleaved with the running requests' decode steps,
so a long newcomer stalls them for one chunk at a time, not for its whole prompt
(`prefill_share`); the chunks ride in the decode step's target forward (one pass over the weights
for both). The request's lifecycle (queue, admission, cancellation, its end) is the Scheduler's
(specwood.engine.scheduler).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from specwood.drafting.base import DraftSource
from specwood.drafting.model_source import ModelDraftSource
from specwood.engine.config import BASE_ROW_LEN, STATIC_ROW_LEN, TREE_ROOM, SchedulerConfig, default_kv_memory
from specwood.engine.executor import Executor
from specwood.engine.output import GenerationResult
from specwood.engine.prefix_reuse import PrefixReuse
from specwood.engine.request import Request, State
from specwood.engine.step import (StepRecord, commit, draft_trees, first_tokens, hand_prompt_features,
                                  hand_tree_features, plain_tree, target_forward, tree_rows, verify_requests,
                                  wants_features)
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.models.batch import RowInput, forward_rows_features
from specwood.models.cache import KVCache
from specwood.models.cuda_graphs import GraphedForward, cuda_graphs_wanted
from specwood.models.prefill import prefill_input, prefill_outputs, prefill_rows_features
from specwood.models.prefix_cache import PrefixCache
from specwood.models.transformer import Transformer
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict

__all__ = ["BASE_ROW_LEN", "TREE_ROOM", "SequentialExecutor", "SequentialStep", "TargetRows", "budget_row_cap"]

GROW_AHEAD = 512  # a row grown for a newcomer also holds this many of its new tokens


Chunk = tuple[Request, int, int]  # a prompt's tokens [start, end) of one request


class TargetRows(ABC):
    """What `SequentialStep` needs from where the target's K/V rows live: the prompt chunks of a
    step, the target's forwards over them and over each request's tree, and the commit of what was
    accepted. A request that fails in one of them fails alone (its executor's `fail`)."""

    @abstractmethod
    def prefill_chunks(self, newcomers: list[Request], decoding: list[Request]) -> list[Chunk]:
        """Split this step's prefill into chunks: the newcomers' prompts on the target (the
        `decoding` requests share the step), and the draft models' prompts of requests whose
        draft is still behind (read after the first token, or before it for `draft_first`).
        Run the draft side and return the target's chunks."""

    @abstractmethod
    def prefill(self, chunks: list[Chunk]) -> None:
        """The target's forward over prompt chunks alone (nobody decodes); a prompt's last chunk
        leaves its last token's logits in `req.prefill_logits`."""

    @abstractmethod
    def fits(self, req: Request, tree: TokenTree) -> bool:
        """Whether `tree` fits beside the request's context (else the step decodes it plainly)."""

    @abstractmethod
    def forward(self, live: list[Request], trees: dict[Request, TokenTree], failed: dict[Request, BaseException],
                chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """The target's logits after every node of each live request's tree (None for one that
        failed, noted in `failed`), with the newcomers' prompt `chunks` riding in the same forward."""

    @abstractmethod
    def commit(self, req: Request, tree: TokenTree, verdict: Verdict, cost: StepRecord, forced: int = 0) -> list[int]:
        """Keep the accepted path's K/V as committed context; the tokens the step emits."""


def read_own_draft(executor: Executor, req: Request, start: int, end: int) -> None:
    """A draft source that runs its own model (llama.cpp, or a runner's one-row torch draft)
    takes its prompt chunk [start, end) itself; a failure fails the request alone."""
    try:
        req.drafter.model_source().prefill_part(req.prompt_ids, start, end)
        req.draft_prefilled = end
    except Exception as e:  # noqa: BLE001
        executor.fail(req, e)


class SequentialStep:
    """One step of the sequential executor over `rows`: the newcomers' prompt chunks, the first
    token of each prompt done, one decode step (draft, one target forward, verify, commit) for
    the others. Each request that ends goes through `executor.finish` / `executor.fail`."""

    def __init__(self, rows: TargetRows, executor: Executor):
        self.rows = rows
        self.executor = executor

    def step(self, running: list[Request]) -> StepRecord | None:
        """Prefill a chunk of the newcomers' prompts and decode one step of the others (the
        chunks ride in its target forward); a prefill-only step when nobody decodes."""
        decoding = [r for r in running if r.state is State.DECODE]
        prefilling = [r for r in running if r.state is State.PREFILL]
        if prefilling and not decoding:
            self._prefill(prefilling)
            return None
        return self._decode(decoding, prefilling) if decoding else None

    def _prefill(self, requests: list[Request]) -> None:
        """Advance the newcomers' prompts by their share in a step with nobody decoding: one
        forward per model for all the chunks."""
        with torch.inference_mode():
            self.rows.prefill(self.rows.prefill_chunks(requests, []))
            self._first_tokens(requests)

    def _first_tokens(self, requests: list[Request]) -> None:
        """The first token of each prompt done: it never waits for the draft (which reads the
        prompt after it), but for a `draft_first` request's."""
        ready = [req for req in requests if req.state is State.PREFILL and req.prefilled >= len(req.prompt_ids)
                 and not (req.draft_first and req.draft_behind)]
        for req, token in zip(ready, first_tokens(ready, [req.prefill_logits for req in ready])):
            try:
                if isinstance(token, Exception):
                    raise token
                req.root = token
                del req.prefill_logits
                req.state = State.DECODE
                if req.out.push_step([req.root]):
                    self.executor.finish(req)
            except Exception as e:  # noqa: BLE001
                self.executor.fail(req, e)

    def _decode(self, batch: list[Request], newcomers: Sequence[Request] = ()) -> StepRecord:
        """One decode step of `batch`; the newcomers' prefill chunks ride in its target forward."""
        rows = self.rows
        failed: dict[Request, BaseException] = {}
        with torch.inference_mode():
            chunks = rows.prefill_chunks(list(newcomers), batch)
            batch = [r for r in batch if r.state is State.DECODE]  # not failed in its draft's chunk
            riding = sum(b - a for _, a, b in chunks)
            t0 = time.perf_counter()
            trees, forced = draft_trees(batch, len(batch), failed, riding)
            for req, tree in trees.items():  # no room to speculate: a plain step
                if not rows.fits(req, tree):
                    trees[req] = plain_tree(req)
                    forced.pop(req, None)
            live = [r for r in batch if r in trees]
            t1 = time.perf_counter()
            outs = rows.forward(live, trees, failed, chunks)
            t2 = time.perf_counter()
            self._first_tokens(list(newcomers))
            record = StepRecord(len(batch), sum(len(t) for t in trees.values()), t1 - t0, t2 - t1,
                                drafting=sum(len(trees[r]) > 1 for r in live),
                                prefill_tokens=riding)
            done = [(req, logits) for req, logits in zip(live, outs) if logits is not None]
            verdicts = verify_requests([r for r, _ in done], [trees[r] for r, _ in done], [lg for _, lg in done])
            for (req, _), verdict in zip(done, verdicts):
                tree = trees[req]
                try:
                    if isinstance(verdict, Exception):
                        raise verdict
                    tokens = rows.commit(req, tree, verdict, record, forced.get(req, 0))
                    record.drafts.append((tree.size, len(verdict.accepted), tree.max_depth))
                    if req.out.push_step(tokens):
                        self.executor.finish(req)
                except Exception as e:  # noqa: BLE001
                    failed[req] = e
        for req, err in failed.items():
            self.executor.fail(req, err)
        return record


class SequentialExecutor(Executor, TargetRows):
    """Batched steps in this process: `config.max_batch` cache rows per pool, continuous batching
    (see the module); its pools are the rows of its `SequentialStep`."""

    name = "sequential"
    records_steps = True
    reuse: PrefixReuse | None = None  # prefix reuse across requests (specwood.engine.prefix_reuse)

    def __init__(self, target: Transformer, config: SchedulerConfig = SchedulerConfig(),
                 drafts: tuple[Any, ...] = ()):
        """`drafts`: the draft models whose pools are made now (others get theirs on first use).
        Under `config.kv_memory` ("auto": DEFAULT_SHARE of the memory available now) rows start
        short and grow up to what the budget holds."""
        max_batch, tree_room, row_len = config.max_batch, config.tree_room, config.row_len
        memory = config.kv_memory  # bytes, "auto" or None (SchedulerConfig checked which)
        kv_budget = default_kv_memory(target.device) if isinstance(memory, str) else memory
        row_cap = None
        if kv_budget is not None:  # rows start short and grow on demand up to what the budget holds
            row_cap = budget_row_cap(target, drafts, max_batch, kv_budget, tree_room, row_len)
            row_len = min(row_cap, config.base_row_len)
        self.config = config
        self.max_batch = max_batch
        self.target = target
        self.cuda_graphs = cuda_graphs_wanted() if config.cuda_graphs is None else config.cuda_graphs
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.prefill_step_tokens = config.prefill_step_tokens
        self.growable = config.growable  # a private scheduler may re-allocate its pools while idle
        self.tree_room = tree_room  # slots a row keeps beyond prompt + new tokens for a tree
        self.row_len = row_len or min(target.max_positions + tree_room, STATIC_ROW_LEN)
        self.cache = self._pool(target)
        # The draft models' pools are allocated here, on the thread that builds the scheduler (the
        # one that steps it, in a server), not on first use by a request: a large torch op on any
        # other thread (the HTTP one) gives the process a second OpenMP team, and from then on
        # every decode step is ~30% slower on 2 cores (BENCHMARKS.md §9d).
        self._draft_pools: dict[int, tuple[Transformer, KVCache]] = {
            id(m): (m, self._pool(m)) for m in drafts if isinstance(m, Transformer)}
        # finished requests' committed K/V, and running ones' prefixes, for newcomers to start from
        if config.reuse:
            bound = kv_budget if kv_budget is not None else config.prefix_bytes
            if bound is None:  # (SchedulerConfig refuses this)
                raise SpecwoodError("reuse on static rows needs prefix_bytes (the prefix cache's bound), or give "
                                    "kv_memory")
            self.reuse = PrefixReuse(PrefixCache(bound))
        # under a KV budget: rows start short and grow (all together: one tensor) to the longest
        # request running, up to `_row_cap`; the prefix cache holds what the rows leave
        self.kv_budget = kv_budget
        self._row_cap = row_cap or self.row_len
        self._base_row_len = min(self._row_cap, config.base_row_len)
        if kv_budget is not None and self.reuse is not None:
            self.reuse.cache.set_budget(kv_budget - self.rows_bytes())
        self.steps = SequentialStep(self, self)

    @property
    def free_rows(self) -> int:
        return self.cache.free_rows

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.reuse.cache if self.reuse is not None else None

    # --- rows under a KV budget -----------------------------------------------------------------

    @property
    def max_row_len(self) -> int:
        return self._row_cap if self.kv_budget is not None else self.row_len

    def _pools(self) -> list[tuple[Any, KVCache]]:
        return [(self.target, self.cache), *self._draft_pools.values()]

    def rows_bytes(self) -> int:
        """Bytes the K/V rows of every pool take now."""
        return sum(pool.nbytes for _, pool in self._pools())

    def _resize_rows(self, row_len: int) -> None:
        """Every pool's rows to `row_len` slots in place (grow: entries kept; shrink: idle pools
        only); the prefix cache gets the budget the rows leave."""
        for _, pool in self._pools():
            pool.resize(row_len)
            if pool.graphs is not None:  # captured on the old tensors
                pool.graphs = GraphedForward(pool.graphs.model, pool)
        self.row_len = row_len
        if self.reuse is not None and self.kv_budget is not None:
            self.reuse.cache.set_budget(self.kv_budget - self.rows_bytes())

    def _fit_rows(self, needed: int, idle: bool) -> None:
        """Rows long enough for `needed` slots (scheduler thread only: torch ops on another thread
        would start a second OpenMP team): doubled up to the cap, so a long request grows them a
        few times, not every step; back to the base length when the pool is idle."""
        if self.kv_budget is None:
            return
        base = self._base_row_len
        if idle and self.row_len > base and needed <= base:
            self._resize_rows(base)
        elif needed > self.row_len:
            self._resize_rows(min(self._row_cap, max(-(-needed // 64) * 64, 2 * self.row_len)))

    # --- pools --------------------------------------------------------------------------------

    def _pool(self, model: Transformer) -> KVCache:
        """A KV pool of max_batch rows for `model`; on CUDA its decode-sized forwards replay CUDA
        graphs (one launch per step instead of hundreds)."""
        cache = model.new_cache(self.row_len, self.max_batch)
        if self.cuda_graphs and cache.device.type == "cuda":
            cache.graphs = GraphedForward(model, cache)
        return cache

    def draft_source(self, model: Transformer) -> DraftSource:
        """A draft source for one request, on a row of this scheduler's pool for `model` (a draft on
        another backend brings its own: llama.cpp contexts; a draft head reads pairs of tokens and
        target features: its `source_class`)."""
        if not isinstance(model, Transformer):
            return model.new_source()
        if self.lacks_draft_pool(model):  # a caller that builds requests outside a scheduler: its own thread steps
            self.add_draft_pool(model)
        source_class = getattr(model, "source_class", ModelDraftSource)
        return source_class(model, extra_slots=self.tree_room, pool=self._draft_pools[id(model)][1])

    def lacks_draft_pool(self, model: Any) -> bool:
        return isinstance(model, Transformer) and id(model) not in self._draft_pools

    def add_draft_pool(self, model: Transformer) -> None:
        """A pool for a draft model first met after start (early-exit's first layers): under a KV
        budget the rows' cap is recounted with it and the prefix cache keeps what is left."""
        if not self.lacks_draft_pool(model):
            return
        self._draft_pools[id(model)] = (model, self._pool(model))
        if self.kv_budget is not None:
            drafts = tuple(m for m, _ in self._draft_pools.values())
            try:
                cap = budget_row_cap(self.target, drafts, self.max_batch, self.kv_budget, self.tree_room, self._row_cap)
            except SpecwoodError:  # the budget holds too little with it: the rows keep what they have
                cap = self.row_len
            self._row_cap = max(self.row_len, cap)
            if self.reuse is not None:
                self.reuse.cache.set_budget(self.kv_budget - self.rows_bytes())

    def ensure_room(self, needed: int, idle: bool = True) -> None:
        """Grow the pools of an idle private scheduler; a clear error otherwise. Under a KV
        budget, only checks: rows grow at admission and as requests go on (`_fit_rows`)."""
        if self.kv_budget is not None:
            if needed > self._row_cap:
                raise ContextLengthError(
                    f"the request needs {needed - self.tree_room} context tokens but the KV budget of "
                    f"{self.kv_budget} bytes (--kv-memory) holds {self._row_cap - self.tree_room} for each of "
                    f"{self.max_batch} rows; shorten the prompt or lower max_tokens (or raise --kv-memory, "
                    "or lower --max-batch)")
            return
        if needed <= self.row_len:
            return
        if not self.growable or not idle:
            raise ContextLengthError(
                f"the request needs {needed - self.tree_room} context tokens but this server's cache rows hold "
                f"{self.row_len - self.tree_room}; shorten the prompt or lower max_tokens (or raise --max-context)")
        self.row_len = -(-needed // 256) * 256
        self.cache = self._pool(self.target)
        self._draft_pools = {k: (m, self._pool(m)) for k, (m, _) in self._draft_pools.items()}
        if self.reuse is not None:  # entries name the pools they came from
            self.reuse.cache.clear()

    # --- admission and release ----------------------------------------------------------------

    def free_slots(self, running: int) -> int:
        return self.cache.free_rows

    def admit(self, req: Request) -> None:
        if self.kv_budget is not None:  # room for the prompt, a tree and some new tokens
            self._fit_rows(self.room_for(len(req.prompt_ids), min(req.max_tokens, GROW_AHEAD)),
                           idle=self.cache.free_rows == self.cache.rows)
        req.row = self.cache.allocate()
        if req.uses_draft_model:
            req.attach_draft()
        if self.reuse is not None:
            self.reuse.admitted(req, self.cache)

    def finish(self, req: Request, result: GenerationResult | None = None) -> None:
        if self.reuse is not None:  # before the scheduler releases its rows
            self.reuse.keep(req, self.cache)
        super().finish(req, result)

    def release(self, req: Request) -> None:
        if self.reuse is not None:
            self.reuse.released(req)
        if req.row is not None:
            self.cache.release(req.row)
            req.row = None
        req.drafter.close()

    # --- the step -----------------------------------------------------------------------------

    def step(self, running: list[Request]) -> StepRecord | None:
        if self.kv_budget is not None:  # every row holds its context and a whole tree
            self._fit_rows(max(len(r.context) + 1 + self.tree_room for r in running), idle=False)
        return self.steps.step(running)

    def prefill_share(self, newcomers: int, decoding: bool) -> tuple[int, int]:
        """(tokens each newcomer's prompt advances this step, tokens in all), per model.

        While others decode, every newcomer advances `prefill_chunk_tokens`: the running
        requests' step waits on these chunks, and a long prompt gets in at the same pace whoever
        else arrives (at most `prefill_step_tokens` in all; the rest wait their turn). With nobody
        decoding, `prefill_step_tokens` is shared out equally, never less than `prefill_chunk_tokens`
        each: short prompts get their first token after a step or two instead of waiting for
        one forward over every long prompt that arrived with them."""
        each = self.prefill_chunk_tokens
        if not decoding:
            each = max(each, self.prefill_step_tokens // max(1, newcomers))
        return each, max(self.prefill_step_tokens, each)

    # --- the rows of its step (TargetRows) --------------------------------------------------------

    def prefill(self, chunks: list[Chunk]) -> None:
        self._prefill_forward(self.target, self.cache, chunks, draft=False)

    def prefill_chunks(self, newcomers: list[Request], decoding: list[Request]) -> list[Chunk]:
        """Split the step's prefill into chunks (request, start, end) per model: the newcomers'
        prompts on the target; on the draft models the prompts of requests past their first
        token (the first token never waits for the draft: it reads the prompt after, while its
        request decodes plainly), and of `draft_first` newcomers beside their target's. Run the
        draft models' chunks (one forward per draft pool) and return the target's."""
        reading = [r for r in newcomers if r.draft_first and r.draft_behind] + [r for r in decoding if r.draft_behind]
        if not newcomers and not reading:
            return []
        waiting: dict[bool, set[Request]] = {False: set(), True: set()}
        if self.reuse is not None:  # shared prompt tokens: computed by one request, copied by the others
            self.reuse.catch_up(newcomers, reading, self.cache)
            waiting = {False: self.reuse.followers(newcomers, False), True: self.reuse.followers(reading, True)}
        # a draft's chunks hold up the requests that decode with no prompt of their own left to read
        others = {False: bool(decoding), True: any(not r.draft_behind for r in decoding)}
        chunks: dict[bool, list[Chunk]] = {}
        for draft, requests in ((False, newcomers), (True, reading)):
            each, left = self.prefill_share(max(1, len(requests) - len(waiting[draft])), others[draft])
            chunks[draft] = []
            for req in requests:
                done = req.draft_prefilled if draft else req.prefilled
                take = min(len(req.prompt_ids) - done, each, left)
                if take > 0 and req not in waiting[draft]:
                    chunks[draft].append((req, done, done + take))
                    left -= take
        pools: dict[int, list[Chunk]] = {}
        for chunk in chunks[True]:
            source = chunk[0].drafter.model_source()
            if source.batched:  # one prefill forward per draft pool
                pools.setdefault(id(source.cache), []).append(chunk)
            else:
                read_own_draft(self, *chunk)
        for group in pools.values():
            src = group[0][0].drafter.model_source()
            self._prefill_forward(src.model, src.kv_row()[0], group, draft=True)
        return [c for c in chunks[False] if c[0].state is State.PREFILL]  # not failed in its draft chunk

    def _prefill_forward(self, model: Transformer, cache: KVCache, chunks: list[tuple[Request, int, int]],
                         draft: bool) -> None:
        if not chunks:
            return
        try:
            logits, features = prefill_rows_features(model, cache, self._row_chunks(chunks, draft),
                                                     [not draft and wants_features(r) for r, _, _ in chunks])
            hand_prompt_features(chunks, features)
        except Exception as e:  # noqa: BLE001 - one at a time, to fail only the request at fault
            if len(chunks) == 1:
                self.fail(chunks[0][0], e)
                return
            for chunk in chunks:
                self._prefill_forward(model, cache, [chunk], draft)
            return
        self._prefilled(chunks, logits, draft)

    @staticmethod
    def _target_prefill_inputs(chunks: list[tuple[Request, int, int]]) -> list[RowInput]:
        """The chunks as rows of a target forward; features too for a request whose draft head reads them."""
        return [prefill_input(r.cache_row(), r.prompt_ids, a, b, wants_features(r)) for r, a, b in chunks]

    @staticmethod
    def _row_chunks(chunks: list[tuple[Request, int, int]], draft: bool) -> list[tuple[int, list[int], int, int]]:
        """(cache row, prompt, start, end) of each chunk, on the target's rows or the draft's."""
        return [(r.drafter.model_source().kv_row()[1] if draft else r.cache_row(), r.prompt_ids, a, b)
                for r, a, b in chunks]

    @staticmethod
    def _prefilled(chunks: list[tuple[Request, int, int]], logits: list[torch.Tensor], draft: bool) -> None:
        """Note the chunks' progress; a prompt's last chunk keeps its last token's logits."""
        for (req, _, end), row_logits in zip(chunks, logits):
            if draft:
                req.draft_prefilled = end
            else:
                req.prefilled = end
                if end == len(req.prompt_ids):
                    req.prefill_logits = row_logits

    def fits(self, req: Request, tree: TokenTree) -> bool:
        L = self.cache.lengths[req.cache_row()]
        return L + tree.max_depth < self.target.max_positions and L + len(tree) <= self.cache.max_len

    def commit(self, req: Request, tree: TokenTree, verdict: Verdict, cost: StepRecord, forced: int = 0) -> list[int]:
        return commit(self.cache, req, tree, verdict, cost, forced)

    def _forward(self, live: list[Request], trees: dict[Request, TokenTree],
                 failed: dict[Request, BaseException]) -> list[torch.Tensor | None]:
        if not live:
            return []
        try:
            return list(target_forward(self.target, self.cache, live, trees))
        except Exception as e:  # noqa: BLE001 - find the request at fault; the others go on
            if len(live) == 1:
                failed[live[0]] = e
                return [None]
        outs: list[torch.Tensor | None] = []
        for req in live:
            try:
                outs.append(target_forward(self.target, self.cache, [req], trees)[0])
            except Exception as err:  # noqa: BLE001
                failed[req] = err
                outs.append(None)
        return outs

    def forward(self, live: list[Request], trees: dict[Request, TokenTree], failed: dict[Request, BaseException],
                chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """The step's target forward with the newcomers' prefill chunks packed in: the weights
        are read once for both. If it raises, each part runs again on its own to find the
        request at fault (whatever it wrote to the cache is rewritten)."""
        if not chunks:
            return self._forward(live, trees, failed)
        prompt_chunks = self._row_chunks(chunks, draft=False)
        inputs = tree_rows(self.cache, live, trees) + self._target_prefill_inputs(chunks)
        try:
            outs, features = forward_rows_features(self.target, self.cache, inputs)
        except Exception:  # noqa: BLE001
            self._prefill_forward(self.target, self.cache, chunks, draft=False)
            return self._forward(live, trees, failed)
        hand_tree_features(live, features[:len(live)])
        hand_prompt_features(chunks, features[len(live):])
        self._prefilled(chunks, prefill_outputs(self.cache, prompt_chunks, outs[len(live):]), draft=False)
        return list(outs[:len(live)])


def budget_row_cap(target: Transformer, drafts: tuple[Any, ...], rows: int, kv_budget: int, tree_room: int,
                   row_len: int | None = None) -> int:
    """The longest row (slots) `rows` rows of every pool (the target's and each torch draft's)
    may reach within `kv_budget` bytes, at most the model's context plus tree room (or
    `row_len`). A budget that cannot hold a tree and a few tokens per row is a clear error."""
    per_slot = sum(m.kv_bytes_per_slot for m in (target, *drafts) if isinstance(m, Transformer))
    cap = min(row_len or target.max_positions + tree_room, target.max_positions + tree_room)
    fits = kv_budget // (rows * per_slot) - 1  # each row keeps a scratch slot
    if fits < tree_room + 64:
        raise SpecwoodError(
            f"a KV budget of {kv_budget} bytes (--kv-memory) holds {max(fits, 0)} slots for each of {rows} rows "
            f"({per_slot} bytes a slot), less than one tree ({tree_room} slots) and 64 tokens; give at least "
            f"{rows * per_slot * (tree_room + 65)} bytes or lower --max-batch")
    return min(cap, fits)
