"""One request in flight on a SpecPipe rank (`Lane`): its cache row, its mirror of the speculative
tree, the level each stage holds; on rank 0 its output stream, token source and counts; and the
per-rank step statistics (`RankStats`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specwood.engine.output import GenerationResult, OutputStream
from specwood.engine.specpipe.draft import FixedWidthSource
from specwood.engine.specpipe.jobs import PROMPT_CHUNK, Job
from specwood.engine.specpipe.state import NONE, Level, LevelVerdict, StageKV, TreeMirror
from specwood.tree.token_tree import TokenTree


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


class Lane:
    """One request in flight, as one rank sees it: its row of the stage's KV cache, its mirror
    of the speculative tree, the level each stage holds; on rank 0 also its output stream, its
    token source and its counts; on the last rank its sampler."""

    def __init__(self, lane_id: int, job: Job, world: int):
        self.id, self.job = lane_id, job
        self.kv: StageKV  # its cache row, taken when it joins (PipelineRank._join)
        self.mirror = TreeMirror()
        self.held: list[Level | None] = [None] * world
        self.inbox: torch.Tensor | None = None  # hidden states of held[rank], from the previous stage
        self.stats = RankStats()
        self.gen: torch.Generator | None = None  # last rank, sampling
        self.tree_meta: Any = None  # last rank, specinfer sampling: the drafted tree's child distributions
        # rank 0
        self.stream: OutputStream  # set when it joins (PipelineRank._plan) or is cancelled while queued
        self.counts = Counts()
        self.draft: FixedWidthSource | None = None
        self.trees: list[Any] | None = None  # specinfer: [draft source, shape, generator, started]
        self.tree: TokenTree | None = None  # specinfer: the drafted tree in flight
        self.chunks = [job.prompt[i:i + PROMPT_CHUNK] for i in range(0, len(job.prompt), PROMPT_CHUNK)]
        self.next_id = self.pos = 0
        self.v = LevelVerdict(NONE)  # the latest verdict
        self.emitted: list[int] = []  # the tokens the latest verdict settled
        self.limit = len(job.prompt) + job.max_tokens - 2  # the last input position any token needs
        self.result: GenerationResult | None = None  # finished: it leaves at the next step
        self.cancelled = False
        self.on_done: Callable[[GenerationResult], None] | None = None
