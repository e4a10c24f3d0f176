"""The pipeline executor (SpecPipe, seed paper 002): the target split into stages, one
torch.distributed rank per stage, fed ONE speculative tree level per pipeline step.

Rank 0 is the first stage and also owns the requests and the token source (the draft model runs
in-process on rank 0 in this version); the last rank holds the final norm and head and verifies.
A pipeline step (paper, Algorithm 1):

1. the level entering stage 1 is broadcast from rank 0 (ids, parents, tokens);
2. node-wise computation: every stage runs the level it holds through its layers with the tree
   mask, writing KV at positions prefix + depth; rank 0 then drafts over the new level;
3. the last stage, holding the verified root, verifies ONE token: greedy = target argmax, sampling
   = the existing lossless verifier on the root's children (drafted top-k: the "selected" rule);
4. pruning propagation: the verdict is broadcast and every rank prunes its mirror of the tree,
   its KV cache (keeping the verified token's KV) and its in-flight hidden states to the verified
   node's subtree;
5. inter-node transmission: survivors move one stage on (isend/recv); the next level is chosen
   from the surviving bottom nodes (fixed width w of top-k children, `engine/specpipe/draft.py`).
A miss (the token is not a candidate) empties the pipeline and the verified token refills it from
stage 1: a stall of m - 1 steps. The prompt enters as verified chunks, so prefill is pipelined too.

SpecPipe-DB (dynamic batching): several requests are in flight at once, each a `Lane` with its own
KV row on every stage (`KVPool`), tree mirror, token source and verdicts. A step packs every lane's
level on a stage into ONE padded forward (`run_levels`; the draft's new levels likewise), the last
stage verifies one token per lane, every lane is pruned on its own, and all survivors travel in one
transfer. Requests join (up to `max_lanes`) and leave between steps (`submit`, `step`), so another
request's levels fill the bubbles a miss leaves.
Mode "pp" is plain pipeline parallelism on the same ranks: no draft, one token per full pass.
Mode "specinfer" is PP + SpecInfer-style speculation on the same ranks: rank 0 drafts a whole static
tree (any tree shape of `drafting/shapes.py`, SpecInfer's <1,1,3,1,1,1,1,1> by default) from the
verified token, the tree takes one full pass (m steps), the last stage verifies it with the shared
verifiers (greedy, or lossless sampling with the draft's distributions shipped along), and every
stage keeps the KV of the accepted path; then the next tree enters from the target's next token.

Launch: `torchrun --nproc-per-node M -m specwood.engine.specpipe.torchrun PROMPT --target ... --draft ...`
(--nnodes/--node-rank/--master-addr as usual), or `PipelineExecutor` (specpipe/launch.py), which
spawns the M ranks itself on 127.0.0.1 (`specwood generate --executor pipeline --stages M`).
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from collections import deque
from typing import Any, Callable

import torch

from specwood.engine.specpipe.draft import FixedWidthSource, draft_levels
from specwood.drafting.model_source import ModelDraftSource
from specwood.drafting.shapes import make_shape, prune
from specwood.engine.output import GenerationResult, OutputStream
from specwood.engine.specpipe.comm import CMD_EXIT, CMD_NOOP, CMD_STEP, Comm, Monitor, die, init_group, is_comm_error
from specwood.engine.specpipe.jobs import DEFAULT_TREE, DRAFTED_MODES, MODES, Job, check_pipeline_args
from specwood.engine.specpipe.lanes import Lane
from specwood.engine.specpipe.state import (EMPTY, HIT, MISS, NONE, TREE, KVPool, Level, LevelVerdict, StageKV,
                                            TreeMirror, run_levels)
from specwood.errors import SpecwoodError
from specwood.models.transformer import Transformer
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict, tree_uniforms, verify, verify_trees

KEEPALIVE_S = 5.0  # an idle rank 0 broadcasts a no-op this often (no collective waits for ever)


# ---------------------------------------------------------------------------------------------
# one rank


class PipelineRank:
    """One stage's rank: its layers' KV rows (one per request in flight, `KVPool`), the lanes;
    on rank 0 also the draft, tokenizer, the queue of requests and the step loop's driver.

    SpecPipe-DB: every request in flight is a `Lane`; one pipeline step packs every lane's level
    of each stage into ONE padded forward per stage (and every new level into one draft forward on
    rank 0), verifies one token per lane, prunes per lane, and ships every lane's survivors in one
    transfer. Requests join (up to `max_lanes`) and leave between steps."""

    def __init__(self, comm: Any, stage: Transformer, *, draft: Transformer | None = None,
                 tokenizer: Any = None, eos_ids: set[int] | None = None,
                 on_step: Callable[["PipelineRank", int], None] | None = None, max_lanes: int = 8):
        self.comm, self.rank, self.world = comm, comm.rank, comm.world
        self.last = self.world - 1
        self.stage = stage
        self.pool = KVPool(stage)
        self.draft_model = draft
        self.draft_pool = KVPool(draft) if draft is not None else None
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids or ())
        self.on_step = on_step  # tests: inspect every rank's state after each step
        self.max_lanes = max_lanes
        self.lanes: dict[int, Lane] = {}  # in flight, in table order
        self.waiting: deque[tuple[Lane, list[str] | None, Callable[[str], None] | None]] = deque()
        self.step_no = 0
        self._ids = itertools.count()

    # --- rank 0: requests in, results out ---

    def submit(self, job: Job, stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
               on_done: Callable[[GenerationResult], None] | None = None, lane_id: int | None = None) -> int:
        """Queue a request; it joins the pipeline at a step with a free lane. Returns its lane id."""
        if job.mode not in MODES:
            raise SpecwoodError(f"unknown pipeline mode '{job.mode}' (use {' or '.join(MODES)})")
        if job.mode in DRAFTED_MODES and self.draft_model is None:
            raise SpecwoodError(f"mode '{job.mode}' needs a draft model on rank 0 (or use mode 'pp')")
        check_pipeline_args(self.world, job.width, job.topk)
        lane_id = next(self._ids) if lane_id is None else lane_id
        if lane_id in self.lanes or any(w[0].id == lane_id for w in self.waiting):
            raise RuntimeError(f"lane {lane_id} submitted twice")
        lane = Lane(lane_id, job, self.world)
        lane.on_done = on_done
        self.waiting.append((lane, stop, on_text))
        return lane_id

    def cancel(self, lane_id: int) -> None:
        """Drop a request: queued, it ends now; in flight, it leaves at the next step."""
        for item in list(self.waiting):
            if item[0].id == lane_id:
                self.waiting.remove(item)
                lane = item[0]
                lane.stream = OutputStream(self.tokenizer, len(lane.job.prompt), lane.job.max_tokens, self.eos_ids)
                lane.stream.finish_reason = "cancelled"
                if lane.on_done is not None:
                    lane.on_done(self._finish(lane))
                return
        if lane_id in self.lanes:
            self.lanes[lane_id].cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.lanes or self.waiting)

    def generate_many(self, jobs: list[tuple[Job, list[str] | None]],
                      on_text: Callable[[str], None] | None = None) -> list[GenerationResult]:
        """Rank 0: run several requests at once (up to `max_lanes` in flight) until all are done."""
        results: dict[int, GenerationResult] = {}
        for i, (job, stop) in enumerate(jobs):
            self.submit(job, stop, on_text if len(jobs) == 1 else None, functools.partial(results.__setitem__, i))
        while len(results) < len(jobs):
            self.step()
        return [results[i] for i in range(len(jobs))]

    def generate(self, job: Job, stop: list[str] | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Rank 0: run one request on every rank."""
        return self.generate_many([(job, stop)], on_text)[0]

    def serve(self, conn: Any) -> None:
        """Rank 0 under the launcher: requests arrive on `conn` at any time and join between
        steps; text, results and per-request errors go back on it, tagged with the request's id."""
        while True:
            try:
                if not self.busy and not conn.poll(KEEPALIVE_S):
                    self.comm.header([CMD_NOOP, 0, 0, 0, 0])
                    continue
                msgs = []
                while conn.poll(0):
                    msgs.append(conn.recv())
            except (EOFError, OSError):
                msgs = [("close",)]  # the launcher is gone
            for msg in msgs:
                if msg[0] == "close":
                    self.comm.header([CMD_EXIT, 0, 0, 0, 0])
                    return
                if msg[0] == "cancel":
                    self.cancel(msg[1])
                    continue
                _, rid, job, stop = msg
                try:
                    self.submit(job, stop, functools.partial(_relay, conn, "text", rid),
                                functools.partial(_relay, conn, "result", rid), lane_id=rid)
                except SpecwoodError as e:
                    conn.send(("error", rid, str(e)))
            if self.busy:
                self.step()

    def step(self) -> None:
        """Rank 0: one pipeline step for everything in flight (admitting queued requests first)."""
        t = time.perf_counter()
        joins, rows, nodes = self._plan()
        hdr = [CMD_STEP, self.step_no, len(joins), len(rows), len(nodes[0])]
        plan_s = time.perf_counter() - t
        for lane in self.lanes.values():
            lane.stats.draft_s += plan_s  # choosing levels: the token source's work
        t0 = time.perf_counter()
        self._step(self.comm.header(hdr), t0, joins, rows, nodes)

    def _plan(self) -> tuple[list[tuple[int, Job]], list[list[int]], list[list[int]]]:
        """Rank 0: admit queued requests, then each lane's level entering stage 1 (none for a lane
        that leaves). Returns the joins, the lane table and the nodes entering."""
        joins = []
        while self.waiting and len(self.lanes) < self.max_lanes:
            lane, stop, on_text = self.waiting.popleft()
            job = lane.job
            self._join(lane)
            lane.stream = OutputStream(self.tokenizer, len(job.prompt), job.max_tokens, self.eos_ids, stop, on_text)
            joins.append((lane.id, job))
        rows: list[list[int]] = []
        nodes: list[list[int]] = [[], [], []]
        for lane in self.lanes.values():
            if lane.cancelled and lane.result is None:
                lane.stream.finish_reason = "cancelled"
                lane.result = self._finish(lane)
        trees = self._draft_trees([lane for lane in self.lanes.values() if lane.result is None and self._refills(lane)])
        for lane in self.lanes.values():
            level = self._entering(lane, trees.get(lane.id)) if lane.result is None else None
            kind = 2 if level is not None and level.tree else int(level is not None and level.verified)
            rows.append([lane.id, int(lane.result is not None), kind, level.position if level else 0,
                         len(level) if level else 0])
            if level is not None:
                for col, values in enumerate((level.ids, level.parents, level.tokens)):
                    nodes[col].extend(values)
        return joins, rows, nodes

    @staticmethod
    def _refills(lane: Lane) -> bool:
        """Whether the lane's next level starts from its verified token (its prompt is in, and the
        pipeline holds nothing of it: a miss, an empty verdict or a verified whole tree)."""
        return not lane.chunks and lane.mirror.root is None and lane.v.kind in (MISS, EMPTY, TREE)

    def _entering(self, lane: Lane, tree: TokenTree | None = None) -> Level | None:
        """Rank 0: the lane's next level: a prompt chunk, a refill from the verified token (a
        whole tree, specinfer: `tree`, drafted by `_draft_trees`), or the next fixed-width level
        from the draft."""
        level = None
        if lane.chunks:
            chunk = lane.chunks.pop(0)
            level = Level(list(range(lane.next_id, lane.next_id + len(chunk))), [-1] * len(chunk), chunk, lane.pos,
                          True)
            lane.pos += len(chunk)
        elif self._refills(lane):  # refill from the verified token
            if lane.trees is not None:  # specinfer: a whole tree rooted at it
                if tree is None:
                    raise RuntimeError(f"request {lane.id} refills with a tree but none was drafted")
                level, lane.tree = self._tree_level(lane, tree)
            else:
                level = Level([lane.next_id], [-1], [lane.v.token], lane.v.position, True)
        elif lane.draft is not None:
            level = lane.draft.next_level(lane.mirror, lane.next_id)
            if level is not None and level.position > lane.limit:
                level = None
        if level is None and all(h is None for h in lane.held):
            raise RuntimeError(f"the pipeline ran dry before request {lane.id} finished")
        lane.next_id += len(level) if level is not None else 0
        return level

    def _finish(self, lane: Lane) -> GenerationResult:
        """Rank 0: the request's result (its per-stage stats are added when it leaves)."""
        job, c = lane.job, lane.counts
        extra = {"executor": "pipeline", "stages": self.world, "pipeline_steps": lane.stats.steps,
                 "hits": c.hits, "misses": c.misses, "empty_verdicts": c.empty, "stall_steps": c.stall_steps}
        if job.mode == "specpipe":
            extra.update(width=job.width, topk=job.topk, hit_rate=round(c.hits / max(1, c.hits + c.misses), 4),
                         mean_level_nodes=round(sum(c.level_nodes) / max(1, len(c.level_nodes)), 2))
        elif job.mode == "specinfer":
            extra.update(tree=dict(job.tree or DEFAULT_TREE), trees=c.trees, accepted=c.accepted,
                         mean_accepted_tokens=round((c.accepted + c.trees) / max(1, c.trees), 3))
        return lane.stream.finish(job.mode, extra)

    def _drafting(self) -> tuple[Transformer, KVPool]:
        """Rank 0's draft model and its pool (a drafted mode: `submit` checked there is one)."""
        if self.draft_model is None or self.draft_pool is None:
            raise SpecwoodError("this mode needs a draft model on rank 0 (or use mode 'pp')")
        return self.draft_model, self.draft_pool

    # --- every rank ---

    def follow(self) -> None:
        """Ranks > 0: obey rank 0 until it says exit."""
        while True:
            t0 = time.perf_counter()
            hdr = self.comm.header()
            if hdr[0] == CMD_EXIT:
                return
            if hdr[0] == CMD_STEP:
                self._step(hdr, t0)
            elif hdr[0] != CMD_NOOP:
                raise RuntimeError(f"protocol: command {hdr[0]} from rank 0")

    def _join(self, lane: Lane) -> None:
        """A request enters: its cache rows, and on rank 0 its token source, on the last rank its sampler."""
        job, r = lane.job, self.rank
        lane.kv = self.pool.acquire(job.cache_len(self.world))
        if r == 0 and job.mode == "specpipe":
            draft, draft_pool = self._drafting()
            lane.draft = FixedWidthSource(draft, job.width, job.topk, 0,
                                          kv=draft_pool.acquire(job.cache_len(self.world)),
                                          emit_limit=job.params.emit_limit)
        if r == 0 and job.mode == "specinfer":
            lane.trees = self._tree_drafter(job)
        if r == self.last and not job.params.greedy:
            lane.gen = job.params.generator(self.stage.device)
        self.lanes[lane.id] = lane

    def _leave(self, leaving: list[Lane]) -> None:
        """Requests leave (every rank): their per-stage stats to rank 0, their cache rows freed."""
        per_rank = self.comm.gather({lane.id: lane.stats.as_dict() for lane in leaving})
        for lane in leaving:
            self.pool.release(lane.kv)
            if lane.draft is not None:
                self._drafting()[1].release(lane.draft.kv)
            if lane.trees is not None:
                lane.trees[0].close()  # its row of the draft's pool
            del self.lanes[lane.id]
            result = lane.result
            if per_rank is not None and result is not None:  # rank 0: every leaving lane has its result
                result.stats["per_stage"] = [stats[lane.id] for stats in per_rank]
                if lane.on_done is not None:
                    lane.on_done(result)

    def _step(self, hdr: list[int], t0: float, joins: list[tuple[int, Job]] | None = None,
              rows: list[list[int]] | None = None, nodes: list[list[int]] | None = None) -> None:
        """One pipeline step on this rank (paper, Algorithm 1, for every lane at once); rank 0
        passes what it planned, the others receive it."""
        r, last, comm = self.rank, self.last, self.comm
        _, step, n_joins, n_rows, n_nodes = hdr
        if step != self.step_no:
            raise RuntimeError(f"protocol: step {step} from rank 0, this rank is at step {self.step_no}")
        if n_joins:
            joined = comm.obj(joins)
            if r != 0:
                for lane_id, job in joined:
                    self._join(Lane(lane_id, job, self.world))
        table = comm.longs(rows, n_rows, 5) if n_rows else []
        ids, parents, tokens = comm.longs(nodes, 3, n_nodes) if n_nodes else ([], [], [])
        if [row[0] for row in table] != list(self.lanes):
            raise RuntimeError(f"protocol: lane table {[row[0] for row in table]} at step {step}, this rank has "
                               f"{list(self.lanes)}")
        leaving = [self.lanes[row[0]] for row in table if row[1]]
        if leaving:
            self._leave(leaving)
        active, entered, off = [], {}, 0
        for lane_id, _, kind, position, n in (row for row in table if not row[1]):
            lane = self.lanes[lane_id]
            active.append(lane)
            level = None
            if n:
                level = Level(ids[off:off + n], parents[off:off + n], tokens[off:off + n], position, kind == 1,
                              tree=kind == 2)
                off += n
                lane.mirror.add(level)
                entered[lane_id] = level
            lane.held[0] = level
        sampled_trees = [lane for lane in active if lane.id in entered and entered[lane.id].tree
                         and not lane.job.params.greedy]
        if sampled_trees:  # the draft distributions the verifier needs for sampled children (last stage)
            metas = comm.obj({lane.id: (t.child_rule, t.without_replacement, t.child_dists)
                              for lane in sampled_trees if (t := lane.tree) is not None} if r == 0 else None)
            for lane in sampled_trees:
                lane.tree_meta = metas[lane.id]
        t1 = time.perf_counter()

        # node-wise computation: every lane's level on this stage in one forward
        runs: list[tuple[StageKV, Level, torch.Tensor, TreeMirror, str]] = []
        outs: dict[int, torch.Tensor] = {}
        for lane in active:
            mine = lane.held[r]
            if mine is not None:
                x = torch.tensor(mine.tokens) if r == 0 else lane.inbox
                if x is None:
                    raise RuntimeError(f"protocol: rank {r} holds a level of request {lane.id} but no hidden states")
                mode = ("all" if mine.tree else "last") if r == last else "none"
                runs.append((lane.kv, mine, x, lane.mirror, mode))
        for (kv, _, _, _, _), out in zip(runs, run_levels(runs)):
            outs[kv.row] = out
        t2 = time.perf_counter()
        drafting = [(lane.draft, entered[lane.id], lane.mirror) for lane in active
                    if lane.draft is not None and lane.id in entered]
        if drafting:
            draft_levels(drafting)
            for lane in active:
                if lane.draft is not None and lane.id in entered and not entered[lane.id].verified:
                    lane.counts.level_nodes.append(len(entered[lane.id]))
        t3 = time.perf_counter()

        # verification of one token per lane (last stage), broadcast to all
        mine_v = None
        if r == last:
            mine_v = [[step, v.kind, v.token, v.node, v.position] for v in self._verify_lanes(active, outs)]
        verdicts = comm.longs(mine_v, len(active), 5, root=last) if active else []
        t4 = time.perf_counter()

        # pruning propagation, per lane
        send_keys, send_x, expect_keys, expect_n = [], [], [], []
        for lane, (got_step, *v) in zip(active, verdicts):
            if got_step != step:
                raise RuntimeError(f"protocol: verdict of step {got_step} from rank {last} during step {step}")
            lane.v = v = LevelVerdict(*v)
            mirror = lane.mirror
            path = mirror.path(v.node) if v.kind == TREE else None  # the accepted path, root first
            lane.emitted = [mirror.token[x] for x in path[1:]] + [v.token] if path is not None else [v.token]
            mirror.apply(v)
            if lane.held[last] is not None:
                mirror.consumed(lane.held[last].ids)
            if path is not None:
                lane.kv.commit_path(path)
                if lane.trees is not None and lane.tree is not None:
                    lane.trees[0].commit(lane.tree, [x - path[0] for x in path[1:]], v.token)
            else:
                lane.kv.prune(v, mirror)
            if lane.draft is not None:
                lane.draft.prune(v, mirror)
            alive = mirror.alive()
            nxt: list[Level | None] = [None]
            for h in lane.held[:-1]:
                h = h.keep(alive) if h is not None else None
                nxt.append(h if h is not None and len(h) else None)
            mine, passing = lane.held[r], nxt[r + 1] if r < last else None
            if mine is not None and passing is not None:  # (what passes on is part of what this rank held)
                index = {x: i for i, x in enumerate(mine.ids)}
                send_keys += [lane_key(lane.id, x) for x in passing.ids]
                send_x.append(outs[lane.kv.row][[index[x] for x in passing.ids]])
            if r > 0:
                got = nxt[r].ids if nxt[r] is not None else []
                expect_keys += [lane_key(lane.id, x) for x in got]
                expect_n.append(len(got))
            lane.held = nxt
        t5 = time.perf_counter()

        # inter-node transmission: every lane's survivors in one message
        inbox = comm.transfer(step, send_keys, torch.cat(send_x) if send_x else None, expect_keys)
        if r > 0:
            parts = inbox.split(expect_n) if inbox is not None else [None] * len(active)
            for lane, n, x in zip(active, expect_n, parts):
                lane.inbox = x.to(self.stage.device) if n else None
        t6 = time.perf_counter()

        for lane in active:
            s = lane.stats
            s.steps += 1
            s.sync_s += (t1 - t0) + (t4 - t3)
            s.compute_s += t2 - t1
            s.draft_s += t3 - t2
            s.prune_s += t5 - t4
            s.transfer_s += t6 - t5
            if lane.kv.row in outs:
                s.busy_steps += 1
                s.nodes += len(outs[lane.kv.row])
            if lane.job.trace:
                s.trace.append([t0, t1, t2, t3, t4, t5, t6])
            if r == 0:
                self._emit(lane)
        self.step_no += 1
        if self.on_step is not None:
            self.on_step(self, step)

    def _emit(self, lane: Lane) -> None:
        """Rank 0: the lane's verified token(s) of this step into its stream."""
        v, c, stream = lane.v, lane.counts, lane.stream
        if lane.result is not None:
            return
        if v.kind == TREE:
            stream.push_step(lane.emitted)
            c.trees += 1
            c.accepted += len(lane.emitted) - 1
        elif v.kind != NONE:
            stream.push_step([v.token])
            c.hits += v.kind == HIT
            c.misses += v.kind == MISS
            c.empty += v.kind == EMPTY
        elif stream.t_first is not None:
            c.stall_steps += 1
        if stream.finished:
            lane.result = self._finish(lane)

    # --- PP + SpecInfer: whole trees ---

    def _tree_drafter(self, job: Job) -> list[Any]:
        """Rank 0, specinfer: [draft source (a row of the draft's pool, prompt not yet in), shape,
        generator, started]."""
        opts = dict(job.tree or DEFAULT_TREE)
        shape = make_shape(opts.pop("name", "static"), **opts)
        draft, pool = self._drafting()
        gen = None
        if not job.params.greedy:  # not the verifier's stream: the same seed would correlate them
            gen = torch.Generator(device=draft.device)
            if job.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed((job.params.seed * 1000003 + 12345) % (1 << 62))
        pool.make_room(job.cache_len(self.world))
        source = ModelDraftSource(draft, extra_slots=job.tree_nodes + 2, pool=pool.cache)
        source.attach(len(job.prompt), job.max_tokens)
        return [source, shape, gen, False]

    def _draft_trees(self, lanes: list[Lane]) -> dict[int, TokenTree]:
        """Rank 0, specinfer: the trees of the specinfer lanes of `lanes` (those refilling from
        their verified token), drafted together (one draft forward per round for all of them,
        `draft_together`); the prompts of those drafting their first tree go into the draft
        first, in one forward per chunk."""
        from specwood.drafting.together import draft_together
        from specwood.models.prefill import PREFILL_CHUNK, prefill_rows

        drafters = [(lane, trees) for lane in lanes if (trees := lane.trees) is not None]
        if not drafters:
            return {}
        draft, pool = self._drafting()
        new = [(lane, trees) for lane, trees in drafters if not trees[3]]
        for start in range(0, max((len(lane.job.prompt) for lane, _ in new), default=0), PREFILL_CHUNK):
            prefill_rows(draft, pool.cache, [(trees[0].row, lane.job.prompt, start,
                                              min(start + PREFILL_CHUNK, len(lane.job.prompt)))
                                             for lane, trees in new if len(lane.job.prompt) > start])
        for _, trees in new:
            trees[3] = True
        drafts = {}
        for lane, (src, shape, gen, _) in drafters:
            drafts[lane.id] = (shape.draft(lane.job.prompt + lane.stream.token_ids[:-1], lane.v.token, lane.job.params,
                                           gen), src)

        def root_alone(lane_id: int) -> TokenTree:  # no room left to draft
            return TokenTree.with_root(self.lanes[lane_id].v.token,
                                       "selected" if self.lanes[lane_id].job.params.greedy else "sampled")

        return draft_together(drafts, root_alone)[0]

    def _tree_level(self, lane: Lane, tree: TokenTree) -> tuple[Level, TokenTree]:
        """Rank 0, specinfer: the lane's tree rooted at the verified token, as one level."""
        v = lane.v
        room = lane.limit - v.position  # deeper nodes would only feed tokens past max_tokens
        if tree.max_depth > room:
            tree = prune(tree, {i for i in range(1, len(tree)) if tree.depths[i] <= room})
        first_id = lane.next_id
        ids = list(range(first_id, first_id + len(tree)))
        parents = [-1] + [first_id + p for p in tree.parents[1:]]
        return Level(ids, parents, list(tree.tokens), v.position, False, tree=True), tree

    def _verify_lanes(self, active: list[Lane], outs: dict[int, torch.Tensor]) -> list[LevelVerdict]:
        """Each lane's verdict at the last stage: a whole tree, or the token after the root (a HIT
        when it is one of the root's drafted children), or NONE. Through the shared verifier: the
        sampled lanes in one `verify_trees` call, each on draws from its own generator."""
        verdicts = [LevelVerdict(NONE)] * len(active)
        asked: list[tuple[int, TokenTree, torch.Tensor, bool]] = []  # (index, tree, logits, whole tree)
        for i, lane in enumerate(active):
            mine = lane.held[self.last]
            if mine is not None and mine.tree:
                asked.append((i, self._level_tree(lane, mine), outs[lane.kv.row], True))
            elif mine is not None and mine.ids[-1] == lane.mirror.root:
                tree = self._root_tree(lane)
                # every row is the root's: only the first decision is used (a deeper one is never
                # reached in a one-level tree; an accepted child just re-reads the root's row)
                asked.append((i, tree, outs[lane.kv.row][-1].reshape(1, -1).expand(len(tree), -1), False))
        results: dict[int, Verdict] = {}
        sampled = [a for a in asked if not active[a[0]].job.params.greedy]
        for i, tree, logits, _ in asked:
            if active[i].job.params.greedy:
                results[i] = verify(tree, logits, active[i].job.params, active[i].gen)
        if sampled:
            got = verify_trees([t for _, t, _, _ in sampled], [lg for _, _, lg, _ in sampled],
                               [active[i].job.params for i, _, _, _ in sampled],
                               [tree_uniforms(t, active[i].gen, lg.device) for i, t, lg, _ in sampled])
            results.update((i, v) for (i, _, _, _), v in zip(sampled, got))
        for i, _, _, whole in asked:
            lane, verdict = active[i], results[i]
            verdicts[i] = (self._tree_verdict(lane.held[self.last], verdict) if whole
                           else self._root_verdict(lane, verdict))
        return verdicts

    @staticmethod
    def _level_tree(lane: Lane, level: Level) -> TokenTree:
        """A whole tree held at the last stage (logits [n, V], row i after node i) as a TokenTree."""
        params = lane.job.params
        index = {x: i for i, x in enumerate(level.ids)}
        rule, wor, dists = ("selected", True, {}) if params.greedy else lane.tree_meta
        return TokenTree(list(level.tokens), [index.get(p, -1) for p in level.parents], level.depths(),
                         [1.0] * len(level), dict(dists), rule, wor)

    @staticmethod
    def _tree_verdict(level: Level, verdict: Verdict) -> LevelVerdict:
        node = level.ids[verdict.accepted[-1]] if verdict.accepted else level.ids[0]
        return LevelVerdict(TREE, int(verdict.next_token), node, level.position + len(verdict.accepted) + 1)

    @staticmethod
    def _root_tree(lane: Lane) -> TokenTree:
        """The root and its drafted children as a one-level tree: they were chosen deterministically
        by the draft, so the "selected" rule keeps sampling lossless."""
        m = lane.mirror
        root = m.root
        if root is None:
            raise RuntimeError(f"protocol: request {lane.id} verified without a root")
        tree = TokenTree.with_root(m.token[root], "selected")
        for k in m.children(root):
            tree.add_node(0, m.token[k])
        return tree

    @staticmethod
    def _root_verdict(lane: Lane, verdict: Verdict) -> LevelVerdict:
        m = lane.mirror
        root = m.root
        if root is None:
            raise RuntimeError(f"protocol: request {lane.id} verified without a root")
        kids = m.children(root)
        position = m.position[root] + 1
        if verdict.accepted:
            node = kids[verdict.accepted[0] - 1]
            return LevelVerdict(HIT, m.token[node], node, position)
        return LevelVerdict(MISS if kids else EMPTY, int(verdict.next_token), -1, position)


def _relay(conn: Any, kind: str, rid: int, payload: Any) -> None:
    """Rank 0 to the launcher: a request's text or result."""
    conn.send((kind, rid, payload))


def lane_key(lane_id: int, node: int) -> int:
    """One int naming a request's node (what the transfer's checksum covers)."""
    return (lane_id << 32) | node


# ---------------------------------------------------------------------------------------------
# a rank's process (spawned by the launcher, or started by torchrun)


def pick_backend(device: torch.device, world: int) -> tuple[str, torch.device]:
    """(process-group backend, where communicated tensors live): NCCL on CUDA when every rank has
    a GPU of its own (NCCL refuses two ranks on one GPU); otherwise gloo, over host memory."""
    if device.type == "cuda" and torch.cuda.device_count() >= world:
        return "nccl", device
    return "gloo", torch.device("cpu")


def run_rank(rank: int, world: int, build: Callable[[int, range], dict[str, Any]], layers: list[range],
             store: Any, conn: Any = None, collective_timeout_s: float = 600.0,
             fingerprint: str = "") -> GenerationResult | None:
    """Build this rank's parts (`build(rank, layers[rank])` -> dict: stage; on rank 0 also draft,
    tokenizer, eos_ids, and `job` = (Job, stop) without a launcher), join the group, check that
    every rank agrees, then serve requests from `conn` (launcher) or run the job once (torchrun).
    Failures end the process with one line (exit 2 for bad input, 1 otherwise)."""
    monitor = None
    try:
        parts = build(rank, layers[rank])
        stage = parts["stage"]
        dev = stage.device
        backend, comm_dev = pick_backend(dev, world)
        store = init_group(rank, world, backend, store, collective_timeout_s)
        monitor = Monitor(store, rank, world)
        monitor.start()
        comm = Comm(rank, world, comm_dev, stage.config.dim, stage.dtype)
        seen = comm.gather((fingerprint, stage.config.name, stage.config.n_layers, list(stage.layer_range)))
        bad = comm.obj(_disagreement(seen, layers) if seen is not None else None)  # rank 0 gathered
        if bad:
            if rank == 0:
                print(f"specwood: error: {bad}", file=sys.stderr, flush=True)
            monitor.close()
            os._exit(2)
        node = PipelineRank(comm, stage, draft=parts.get("draft"), tokenizer=parts.get("tokenizer"),
                            eos_ids=parts.get("eos_ids"), max_lanes=parts.get("max_lanes", 8))
        result = None
        with torch.inference_mode():
            if rank == 0 and conn is not None:
                conn.send(("ready", {"pid": os.getpid(), "layers": [list(r) for r in layers]}))
                node.serve(conn)
            elif rank == 0:
                job, stop = parts["job"]
                result = node.generate(job, stop, on_text=parts.get("on_text"))
                comm.header([CMD_EXIT, 0, 0, 0, 0])
            else:
                node.follow()
        monitor.close()
        return result
    except SpecwoodError as e:
        if monitor is not None:
            monitor.post_failure(str(e))
        die(f"pipeline rank {rank}: {e}", 2)
    except Exception as e:  # noqa: BLE001
        if monitor is not None and is_comm_error(e):
            die(f"pipeline rank {rank}: {monitor.wait_for_culprit()}")
        line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if monitor is not None:
            monitor.post_failure(line)
        die(f"pipeline rank {rank}: {line}")
    return None


def _disagreement(seen: list[Any], layers: list[range]) -> str | None:
    """Ranks launched with different models or stage plans: what differs, else None."""
    first = seen[0]
    for r, s in enumerate(seen):
        if s[0] != first[0] or s[1] != first[1] or s[2] != first[2]:
            return (f"pipeline ranks disagree on the target: rank 0 has {first[1]} ({first[2]} layers), rank {r} has "
                    f"{s[1]} ({s[2]} layers); launch every rank with the same model")
        if s[3] != list(layers[r]):
            return f"pipeline rank {r} holds layers {s[3]}, expected {list(layers[r])}"
    return None
