"""The pipeline executor (SpecPipe, seed paper 002): the target split into stages, one
torch.distributed rank per stage, fed ONE speculative tree level per pipeline step.

Rank 0 is the first stage and also owns the request and the token source (the draft model runs
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
   from the surviving bottom nodes (fixed width w of top-k children, `drafting/fixed_width.py`).
A miss (the token is not a candidate) empties the pipeline and the verified token refills it from
stage 1: a stall of m - 1 steps. The prompt enters as verified chunks, so prefill is pipelined too.
Mode "pp" is plain pipeline parallelism on the same ranks: no draft, one token per full pass.
Mode "specinfer" is PP + SpecInfer-style speculation on the same ranks: rank 0 drafts a whole static
tree (any tree shape of `drafting/shapes.py`, SpecInfer's <1,1,3,1,1,1,1,1> by default) from the
verified token, the tree takes one full pass (m steps), the last stage verifies it with the shared
verifiers (greedy, or lossless sampling with the draft's distributions shipped along), and every
stage keeps the KV of the accepted path; then the next tree enters from the target's next token.

Launch: `torchrun --nproc-per-node M -m specwood.engine.pipeline PROMPT --target ... --draft ...`
(--nnodes/--node-rank/--master-addr as usual), or `PipelineExecutor` (pipeline_launch.py), which
spawns the M ranks itself on 127.0.0.1 (`specwood generate --executor pipeline --stages M`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specwood.drafting.fixed_width import FixedWidthSource
from specwood.drafting.model_source import ModelDraftSource
from specwood.drafting.shapes import make_shape, prune
from specwood.engine.output import GenerationResult, OutputStream
from specwood.engine.pipeline_comm import (CMD_EXIT, CMD_LEVEL, CMD_NOOP, CMD_REQUEST, CMD_STOP, Comm, Monitor,
                                           die, init_group, is_comm_error)
from specwood.engine.pipeline_state import EMPTY, HIT, MISS, NONE, TREE, Level, StageKV, TreeMirror, Verdict
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree
from specwood.verify import verify

PROMPT_CHUNK = 256  # prompt tokens per level: prefill is pipelined chunk by chunk
KEEPALIVE_S = 5.0  # an idle rank 0 broadcasts a no-op this often (no collective waits for ever)
MODES = ("specpipe", "pp", "specinfer")
DRAFTED_MODES = ("specpipe", "specinfer")  # the modes that need a draft model on rank 0
DEFAULT_TREE: dict[str, Any] = {"name": "static"}  # specinfer: SpecInfer's branching <1,1,3,1,1,1,1,1>


# ---------------------------------------------------------------------------------------------
# checks and stage boundaries (cheap: run before any process starts)


def tree_nodes(tree: dict[str, Any] | None) -> int:
    """The most nodes (root excluded) a specinfer tree of these `make_shape` options can have;
    bad options raise SpecwoodError (checked before any process starts)."""
    opts = dict(tree or DEFAULT_TREE)
    shape = make_shape(opts.pop("name", "static"), **opts)
    layout = getattr(shape, "layout", None)
    if layout is not None:
        return len(layout)
    return int(getattr(shape, "budget", None) or getattr(shape, "k", None) or 1024)


def check_pipeline_args(stages: Any, width: Any, topk: Any, n_layers: int | None = None) -> None:
    for name, value in (("--stages", stages), ("--width", width), ("--topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecwoodError(f"{name} must be a positive integer, got {value!r}")
    if stages < 2:
        raise SpecwoodError(f"a pipeline needs at least 2 stages, got --stages {stages}")
    if n_layers is not None and stages > n_layers:
        raise SpecwoodError(f"--stages {stages} is more than the target's {n_layers} layers (use 2..{n_layers})")


def weight_elements(config: Any) -> tuple[int, int]:
    """(one layer's matmul weights, the head's), in elements: what a decode step reads."""
    c = config
    layer = (c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim
             + 3 * c.dim * c.intermediate_size)
    return layer, c.vocab_size * c.dim


def stage_ranges(config: Any, stages: int, first_stage_extra: float = 0.0) -> list[range]:
    """Contiguous layer ranges minimising the largest stage's weight bytes (a CPU decode step reads
    every weight once), the head counted on the last stage; every stage gets a layer or more.
    first_stage_extra: more work on rank 0 in the same unit (target weight elements), e.g. the
    draft model it runs beside its layers."""
    layer, head = weight_elements(config)
    n = config.n_layers
    check_pipeline_args(stages, 1, 1, n)
    cost = lambda a, b: (b - a) * layer + (head if b == n else 0) + (first_stage_extra if a == 0 else 0)  # noqa: E731
    # best[s][b]: the smallest max-stage cost of layers [0, b) in s stages, and the last cut
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, stages + 1):
        for b in range(s, n + 1):
            best[s][b] = min((max(best[s - 1][a][0], cost(a, b)), a) for a in range(s - 1, b))
    cuts, b = [], n
    for s in range(stages, 0, -1):
        a = best[s][b][1]
        cuts.append(range(a, b))
        b = a
    return cuts[::-1]


# ---------------------------------------------------------------------------------------------
# one rank


@dataclass
class Job:
    """One request as every rank sees it (rank 0 broadcasts it at the start)."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    mode: str = "specpipe"
    width: int = 8
    topk: int = 4
    tree: dict[str, Any] | None = None  # specinfer: make_shape options ({"name": ..., "budget": ...})
    tree_nodes: int = 0  # specinfer: the most drafted nodes a tree can have (`tree_nodes(tree)`)
    trace: bool = False  # every rank records per-step timestamps (stats per_stage[r]["trace"])

    def cache_len(self, stages: int) -> int:
        # committed tokens, plus at most `stages` levels of `width` speculative nodes in flight
        # (or one whole tree)
        spec = max((self.width + 1) * (stages + 1), self.tree_nodes + 1)
        return len(self.prompt) + self.max_tokens + spec + PROMPT_CHUNK


@dataclass
class RankStats:
    steps: int = 0
    busy_steps: int = 0
    compute_s: float = 0.0
    draft_s: float = 0.0
    prune_s: float = 0.0
    transfer_s: float = 0.0
    sync_s: float = 0.0  # waiting in the level / verdict broadcasts (idle time, mostly)
    nodes: int = 0
    # Job.trace: per step [start, level in, computed, drafted, verdict in, pruned, transferred]
    # (time.perf_counter: CLOCK_MONOTONIC on Linux, one clock for every process of a machine)
    trace: list[list[float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class Counts:
    hits: int = 0
    misses: int = 0
    empty: int = 0  # verdicts on a root without candidates (the first token, plain PP, partial refills)
    stall_steps: int = 0  # steps after the first token in which nothing was verified
    level_nodes: list[int] = field(default_factory=list)
    trees: int = 0  # specinfer: trees verified
    accepted: int = 0  # specinfer: drafted tokens accepted


class PipelineRank:
    """One stage's rank: its layers' KV (`StageKV`), and on rank 0 the draft, tokenizer and requests."""

    def __init__(self, comm: Any, stage: torch.nn.Module, *, draft: torch.nn.Module | None = None,
                 tokenizer: Any = None, eos_ids: set[int] | None = None,
                 on_step: Callable[["PipelineRank", int], None] | None = None):
        self.comm, self.rank, self.world = comm, comm.rank, comm.world
        self.last = self.world - 1
        self.stage = stage
        self.kv = StageKV(stage, 64)
        self.draft = FixedWidthSource(draft, 1, 1, 64) if draft is not None else None
        self.draft_model = draft
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids or ())
        self.on_step = on_step  # tests: inspect every rank's state after each step
        self.mirror = TreeMirror()
        self.held: list[Level | None] = []

    # --- the request loop ---

    def serve(self, conn: Any) -> None:
        """Rank 0 under the launcher: requests arrive on `conn`; replies go back on it."""
        while True:
            try:
                if not conn.poll(KEEPALIVE_S):
                    self.comm.header([CMD_NOOP, 0, 0, 0, 0])
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("close",)  # the launcher is gone
            if msg[0] == "close":
                self.comm.header([CMD_EXIT, 0, 0, 0, 0])
                return
            _, job, stop = msg
            result = self.generate(job, stop, on_text=lambda s: conn.send(("text", s)))
            conn.send(("result", result))

    def generate(self, job: Job, stop: list[str] | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Rank 0: run one request on every rank."""
        if job.mode in DRAFTED_MODES and self.draft is None:
            raise SpecwoodError(f"mode '{job.mode}' needs a draft model on rank 0 (or use mode 'pp')")
        self.comm.header([CMD_REQUEST, 0, 0, 0, 0])
        self.comm.obj(job)
        stream = OutputStream(self.tokenizer, len(job.prompt), job.max_tokens, self.eos_ids, stop, on_text)
        counts, stats = self.decode(job, stream)
        per_rank = self.comm.gather(stats.as_dict())
        extra = {"executor": "pipeline", "stages": self.world, "pipeline_steps": stats.steps,
                 "hits": counts.hits, "misses": counts.misses, "empty_verdicts": counts.empty,
                 "stall_steps": counts.stall_steps, "per_stage": per_rank}
        if job.mode == "specpipe":
            extra.update(width=job.width, topk=job.topk,
                         hit_rate=round(counts.hits / max(1, counts.hits + counts.misses), 4),
                         mean_level_nodes=round(sum(counts.level_nodes) / max(1, len(counts.level_nodes)), 2))
        elif job.mode == "specinfer":
            extra.update(tree=dict(job.tree or DEFAULT_TREE), trees=counts.trees, accepted=counts.accepted,
                         mean_accepted_tokens=round((counts.accepted + counts.trees) / max(1, counts.trees), 3))
        return stream.finish(job.mode, extra)

    def follow(self) -> None:
        """Ranks > 0: obey rank 0 until it says exit."""
        while True:
            cmd = self.comm.header()[0]
            if cmd == CMD_EXIT:
                return
            if cmd == CMD_REQUEST:
                self.decode(self.comm.obj(), None)
                self.comm.gather(self._stats.as_dict())
            elif cmd != CMD_NOOP:
                raise RuntimeError(f"protocol: command {cmd} from rank 0 between requests")

    def decode(self, job: Job, stream: OutputStream | None) -> tuple[Counts, RankStats]:
        """The pipeline steps of one request (every rank runs this loop in lock step)."""
        r, last, comm = self.rank, self.last, self.comm
        self.kv.reset(job.cache_len(self.world))
        draft = self.draft if (r == 0 and job.mode == "specpipe") else None
        if draft is not None:
            draft.reset(job.cache_len(self.world), job.width, job.topk)
        self._trees = self._tree_drafter(job) if (r == 0 and job.mode == "specinfer") else None
        tree: TokenTree | None = None  # rank 0, specinfer: the drafted tree in flight
        gen = job.params.generator(self.stage.device) if r == last and not job.params.greedy else None
        self.mirror, self.held = TreeMirror(), [None] * self.world
        mirror = self.mirror
        stats, counts = RankStats(), Counts()
        self._stats = stats
        chunks = [job.prompt[i:i + PROMPT_CHUNK] for i in range(0, len(job.prompt), PROMPT_CHUNK)]
        limit = len(job.prompt) + job.max_tokens - 2  # the last input position any token needs
        next_id, pos, v, inbox, step = 0, 0, Verdict(NONE), None, 0
        while True:
            t0 = time.perf_counter()
            level, hdr, t_tree = None, None, 0.0
            if r == 0:
                if stream.finished:
                    hdr = [CMD_STOP, step, 0, 0, 0]
                else:
                    if chunks:
                        chunk = chunks.pop(0)
                        level = Level(list(range(next_id, next_id + len(chunk))), [-1] * len(chunk), chunk, pos, True)
                        pos += len(chunk)
                    elif mirror.root is None and v.kind in (MISS, EMPTY, TREE):  # refill from the verified token
                        if self._trees is not None:  # specinfer: a whole tree rooted at it
                            level, tree = self._draft_tree(job, v, next_id, limit, stream)
                            t_tree = time.perf_counter() - t0
                        else:
                            level = Level([next_id], [-1], [v.token], v.position, True)
                    elif draft is not None:
                        level = draft.next_level(mirror, next_id)
                        if level is not None and level.position > limit:
                            level = None
                    if level is None and all(h is None for h in self.held):
                        raise RuntimeError("the pipeline ran dry before the request finished")
                    next_id += len(level) if level is not None else 0
                    kind = 2 if level is not None and level.tree else int(level is not None and level.verified)
                    hdr = [CMD_LEVEL, step, kind, level.position, len(level)] if level else \
                        [CMD_LEVEL, step, 0, 0, 0]
            hdr = comm.header(hdr)
            if hdr[0] == CMD_STOP:
                break
            if hdr[0] != CMD_LEVEL or hdr[1] != step:
                raise RuntimeError(f"protocol: header {hdr} during step {step}")
            level = comm.level(level, hdr) if hdr[4] else None
            if level is not None and level.tree and not job.params.greedy:
                # the draft distributions the verifier needs for sampled children (last stage)
                meta = (tree.child_rule, tree.without_replacement, tree.child_dists) if r == 0 else None
                self._tree_meta = comm.obj(meta)
            if level is not None:
                mirror.add(level)
            self.held[0] = level
            t1 = time.perf_counter()
            stats.sync_s += t1 - t0 - t_tree
            stats.draft_s += t_tree

            # node-wise computation
            mine, out = self.held[r], None
            if mine is not None:
                x = torch.tensor(mine.tokens) if r == 0 else inbox
                out = self.kv.run(mine, x, mirror, ("all" if mine.tree else "last") if r == last else "none")
                stats.busy_steps += 1
                stats.nodes += len(mine)
            t2 = time.perf_counter()
            stats.compute_s += t2 - t1
            if draft is not None and level is not None:
                with torch.inference_mode():
                    draft.run(level, mirror)
                if not level.verified:
                    counts.level_nodes.append(len(level))
            t3 = time.perf_counter()
            stats.draft_s += t3 - t2

            # verification of one token (last stage), broadcast to all
            mine_v = None
            if r == last:
                mine_v = Verdict(NONE)
                if mine is not None and mine.tree:
                    mine_v = self._verify_tree(mine, out, job.params, gen)
                elif mine is not None and mine.ids[-1] == mirror.root:
                    mine_v = self._verify(out[-1], job.params, gen)
            v = comm.verdict(mine_v, step)
            t4 = time.perf_counter()
            stats.sync_s += t4 - t3

            # pruning propagation
            path = mirror.path(v.node) if v.kind == TREE else None  # the accepted path, root first
            emitted = [mirror.token[x] for x in path[1:]] + [v.token] if path is not None else [v.token]
            mirror.apply(v)
            if self.held[last] is not None:
                mirror.consumed(self.held[last].ids)
            if path is not None:
                self.kv.commit_path(path)
                if self._trees is not None:
                    self._trees[0].commit(tree, [x - path[0] for x in path[1:]], v.token)
            else:
                self.kv.prune(v, mirror)
            if draft is not None:
                draft.prune(v, mirror)
            alive = mirror.alive()
            nxt: list[Level | None] = [None]
            for h in self.held[:-1]:
                h = h.keep(alive) if h is not None else None
                nxt.append(h if h is not None and len(h) else None)
            t5 = time.perf_counter()
            stats.prune_s += t5 - t4

            # inter-node transmission
            send_ids, send_x = [], None
            if r < last and nxt[r + 1] is not None:
                index = {x: i for i, x in enumerate(mine.ids)}
                send_ids = nxt[r + 1].ids
                send_x = out[[index[x] for x in send_ids]]
            inbox = comm.transfer(step, send_ids, send_x, nxt[r].ids if r > 0 and nxt[r] is not None else [])
            self.held = nxt
            t6 = time.perf_counter()
            stats.transfer_s += t6 - t5
            stats.steps += 1
            if job.trace:
                stats.trace.append([t0, t1, t2, t3, t4, t5, t6])

            if r == 0:
                if v.kind == TREE:
                    stream.push_step(emitted)
                    counts.trees += 1
                    counts.accepted += len(emitted) - 1
                elif v.kind != NONE:
                    stream.push_step([v.token])
                    counts.hits += v.kind == HIT
                    counts.misses += v.kind == MISS
                    counts.empty += v.kind == EMPTY
                elif stream.t_first is not None:
                    counts.stall_steps += 1
            if self.on_step is not None:
                self.on_step(self, step)
            step += 1
        return counts, stats

    def _tree_drafter(self, job: Job) -> list[Any]:
        """Rank 0, specinfer: [draft source (prompt not yet in), shape, generator, started]."""
        opts = dict(job.tree or DEFAULT_TREE)
        shape = make_shape(opts.pop("name", "static"), **opts)
        gen = None
        if not job.params.greedy:  # not the verifier's stream: the same seed would correlate them
            gen = torch.Generator(device=self.draft_model.device)
            if job.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed((job.params.seed * 1000003 + 12345) % (1 << 62))
        return [ModelDraftSource(self.draft_model, extra_slots=job.tree_nodes + 2), shape, gen, False]

    def _draft_tree(self, job: Job, v: Verdict, first_id: int, limit: int,
                    stream: OutputStream) -> tuple[Level, TokenTree]:
        """Rank 0, specinfer: a whole tree rooted at the verified token, as one level."""
        src, shape, gen, started = self._trees
        if not started:
            src.start(job.prompt, job.max_tokens)
            self._trees[3] = True
        tree = shape.build(job.prompt + stream.token_ids[:-1], v.token, src, job.params, gen)
        room = limit - v.position  # deeper nodes would only feed tokens past max_tokens
        if tree.max_depth > room:
            tree = prune(tree, {i for i in range(1, len(tree)) if tree.depths[i] <= room})
        ids = list(range(first_id, first_id + len(tree)))
        parents = [-1] + [first_id + p for p in tree.parents[1:]]
        return Level(ids, parents, list(tree.tokens), v.position, False, tree=True), tree

    def _verify_tree(self, level: Level, logits: torch.Tensor, params: SamplingParams,
                     gen: torch.Generator | None) -> Verdict:
        """A whole tree (logits [n, V], row i after node i) through the shared verifier."""
        index = {x: i for i, x in enumerate(level.ids)}
        rule, wor, dists = ("selected", True, {}) if params.greedy else self._tree_meta
        tree = TokenTree(list(level.tokens), [index.get(p, -1) for p in level.parents], level.depths(),
                         [1.0] * len(level), dict(dists), rule, wor)
        verdict = verify(tree, logits, params, gen)
        node = level.ids[verdict.accepted[-1]] if verdict.accepted else level.ids[0]
        return Verdict(TREE, int(verdict.next_token), node, level.position + len(verdict.accepted) + 1)

    def _verify(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> Verdict:
        """The token after the root, from the root's logits [V]; a HIT if it is one of the root's
        drafted children. A one-level tree through the shared verifier (its children were chosen
        deterministically by the draft: the "selected" rule keeps sampling lossless)."""
        m = self.mirror
        root, kids = m.root, m.children(m.root)
        tree = TokenTree.with_root(m.token[root], "selected")
        for k in kids:
            tree.add_node(0, m.token[k])
        # every row is the root's: only the first decision is used (a deeper one is never reached
        # in a one-level tree; an accepted child just re-reads the root's row)
        verdict = verify(tree, logits.reshape(1, -1).expand(len(tree), -1), params, gen)
        position = m.position[root] + 1
        if verdict.accepted:
            node = kids[verdict.accepted[0] - 1]
            return Verdict(HIT, m.token[node], node, position)
        return Verdict(MISS if kids else EMPTY, int(verdict.next_token), -1, position)


# ---------------------------------------------------------------------------------------------
# a rank's process (spawned by the launcher, or started by torchrun)


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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
        store = init_group(rank, world, pick_backend(dev), store, collective_timeout_s)
        monitor = Monitor(store, rank, world)
        monitor.start()
        comm = Comm(rank, world, dev, stage.config.dim, stage.dtype)
        seen = comm.gather((fingerprint, stage.config.name, stage.config.n_layers, list(stage.layer_range)))
        bad = comm.obj(_disagreement(seen, layers) if rank == 0 else None)
        if bad:
            if rank == 0:
                print(f"specwood: error: {bad}", file=sys.stderr, flush=True)
            monitor.close()
            os._exit(2)
        node = PipelineRank(comm, stage, draft=parts.get("draft"), tokenizer=parts.get("tokenizer"),
                            eos_ids=parts.get("eos_ids"))
        result = None
        with torch.inference_mode():
            if rank == 0 and conn is not None:
                conn.send(("ready", {"pid": os.getpid(), "layers": [list(r) for r in layers]}))
                node.serve(conn)
            elif rank == 0:
                result = node.generate(*parts["job"], on_text=parts.get("on_text"))
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


# ---------------------------------------------------------------------------------------------
# torchrun entry point


def _parser() -> argparse.ArgumentParser:
    from specwood.cli import add_model_args, add_sampling_args

    p = argparse.ArgumentParser(prog="python -m specwood.engine.pipeline",
                                description="SpecPipe over torch.distributed; run under torchrun --nproc-per-node M")
    p.add_argument("prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--mode", choices=MODES, default="specpipe")
    p.add_argument("--stages", type=int, default=None, help="must equal the world size (default: it)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--shape", default="static", help="--mode specinfer: the tree shape (static = SpecInfer's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--raw", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: every rank loads its own layers; rank 0 also the draft and tokenizer."""
    args = _parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        stages = args.stages if args.stages is not None else world
        if stages != world:
            raise SpecwoodError(f"--stages {stages} does not match the {world} launched ranks "
                                f"(torchrun --nproc-per-node {stages}, or drop --stages)")
        check_pipeline_args(stages, args.width, args.topk)
        if args.threads:
            torch.set_num_threads(args.threads)
        from specwood.engine.api import check_device, resolve_dtype
        from specwood.models.loader import load_checkpoint

        device = args.device if not args.device.startswith("cuda") else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        device = check_device(device)
        dtype = resolve_dtype(args.dtype, device)
        cfg = load_checkpoint(args.target or _default_target(), dtype=dtype, layers=range(0, 1))[0]
        check_pipeline_args(stages, args.width, args.topk, cfg.n_layers)
        layers = stage_ranges(cfg, stages)
    except SpecwoodError as e:
        if rank == 0:
            print(f"specwood: error: {e}", file=sys.stderr, flush=True)
        return 2
    target = args.target or _default_target()

    def build(r: int, rng: range) -> dict[str, Any]:
        from specwood.models.transformer import build_model

        c, sd, path = load_checkpoint(target, dtype=dtype, layers=rng)
        positions = min(args.max_context or c.max_position_embeddings, c.max_position_embeddings)
        parts: dict[str, Any] = {"stage": build_model(c, sd, dtype, device, layers=rng, max_positions=positions)}
        if r == 0:
            parts.update(_rank0_parts(args, target, c, path, device, dtype, positions))
        return parts

    result = run_rank(rank, world, build, layers, None, None, args.timeout, fingerprint=str(target))
    if rank == 0 and result is not None:
        import json

        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats}))
        else:
            s = result.stats
            print(f"\n[{s['method']} x{world} stages] {s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, "
                  f"TBT p50 {s['tbt_ms_p50']} ms, hits {s['hits']}, misses {s['misses']}, "
                  f"stall steps {s['stall_steps']}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _default_target() -> str:
    from specwood.models.registry import DEFAULT_TARGET

    return DEFAULT_TARGET


def _rank0_parts(args: Any, target: str, cfg: Any, path: Any, device: str, dtype: torch.dtype,
                 positions: int) -> dict[str, Any]:
    from types import SimpleNamespace

    from specwood.engine.api import Engine
    from specwood.models.loader import load_checkpoint, load_tokenizer
    from specwood.models.registry import default_draft_for
    from specwood.models.transformer import build_model, int4_available

    tokenizer = load_tokenizer(path)
    parts: dict[str, Any] = {"tokenizer": tokenizer, "on_text": None if args.json else
                             (lambda s: (sys.stdout.write(s), sys.stdout.flush()))}
    if args.mode in DRAFTED_MODES:
        draft = default_draft_for(target) if args.draft == "auto" else args.draft
        if draft in (None, "none"):
            raise SpecwoodError(f"mode '{args.mode}' needs a draft model: pass --draft NAME|PATH (or --mode pp)")
        int4 = args.draft_dtype == "int4" or (args.draft_dtype == "auto" and device == "cpu" and int4_available())
        ddtype = torch.bfloat16 if int4 else dtype
        dcfg, dsd, _ = load_checkpoint(str(draft), dtype=ddtype)
        parts["draft"] = build_model(dcfg, dsd, ddtype, device, max_positions=positions, int4=int4)
    shim = SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(config=cfg))  # Engine's helpers, no Engine
    parts["eos_ids"] = Engine._eos_ids(shim)
    prompt = Engine.encode(shim, args.prompt, args.raw)
    max_tokens = min(args.max_tokens, positions - len(prompt))
    if max_tokens < 1:
        raise SpecwoodError(f"prompt has {len(prompt)} tokens but the context holds {positions}; shorten the prompt")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    tree = {"name": args.shape}
    parts["job"] = (Job(prompt, max_tokens, params, args.mode, args.width, args.topk, tree, tree_nodes(tree)), None)
    return parts


if __name__ == "__main__":
    sys.exit(main())
