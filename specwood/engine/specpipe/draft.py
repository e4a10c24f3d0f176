"""SpecPipe's token source: a draft model that grows a fixed-width (w, k) tree one level per step.

Each step the draft runs over the level that just entered the pipeline (its KV kept in a
`StageKV`, pruned with the same verdicts as the target's stages) and keeps every node's top-k
next tokens. The next level is chosen *after* the step's verdict, from the surviving bottom
nodes only: of their k candidates each, the w with the highest cumulative probability (beam-like),
so a level never holds more than w nodes and pruning never wastes a slot of the next level.
"""
from __future__ import annotations

import torch

from specwood.engine.specpipe.state import Level, LevelVerdict, StageKV, TreeMirror, run_levels
from specwood.models.transformer import Transformer


class FixedWidthSource:
    """One request's token source. `kv`: its row of the draft's cache (`KVPool.acquire`), or a
    private cache of `max_len` slots."""

    def __init__(self, model: Transformer, width: int, topk: int, max_len: int, kv: StageKV | None = None,
                 emit_limit: int | None = None):
        if width < 1 or topk < 1:
            raise ValueError(f"tree width and top-k must be >= 1, got w={width}, k={topk}")
        self.kv = kv if kv is not None else StageKV.alone(model, max_len)
        self.width, self.topk = width, topk
        self.emit_limit = emit_limit  # ids at or past it (padding past the tokenizer's) are never drafted
        self.cands: dict[int, tuple[list[int], list[float]]] = {}  # node -> its top-k (tokens, log-probs)
        self.cum: dict[int, float] = {}  # node -> log-prob of its path below the verified root

    def reset(self, max_len: int, width: int | None = None, topk: int | None = None) -> None:
        self.kv.reset(max_len)
        self.width, self.topk = width or self.width, topk or self.topk
        self.cands, self.cum = {}, {}

    def run(self, level: Level, mirror: TreeMirror) -> None:
        """Draft over the level that entered stage 1 this step (before the verdict arrives)."""
        draft_levels([(self, level, mirror)])

    def absorb(self, level: Level, logits: torch.Tensor) -> None:
        """Keep the top-k of the draft's logits over `level` (last node of a verified chain, else every node)."""
        logits = logits.float()
        if self.emit_limit is not None and self.emit_limit < logits.shape[-1]:
            logits = logits.clone()
            logits[..., self.emit_limit:] = float("-inf")
        top = logits.log_softmax(-1).topk(min(self.topk, logits.shape[-1]), dim=-1)
        nodes = level.ids[-1:] if level.verified else level.ids
        for x, toks, lps in zip(nodes, top.indices.tolist(), top.values.tolist()):
            self.cands[x] = (toks, lps)
        if level.verified:
            self.cum[level.ids[-1]] = 0.0

    def prune(self, v: LevelVerdict, mirror: TreeMirror) -> None:
        self.kv.prune(v, mirror)
        for d in (self.cands, self.cum):
            for x in [x for x in d if x not in mirror.position]:
                del d[x]

    def next_level(self, mirror: TreeMirror, first_id: int) -> Level | None:
        """The w best children of the bottom nodes by cumulative probability, in BFS order."""
        frontier = [x for x in mirror.bottom() if x in self.cands]
        if not frontier:
            return None
        scored = [(self.cum[x] + lp, i, x, t) for i, x in enumerate(frontier) for t, lp in zip(*self.cands[x])]
        best = sorted(scored, key=lambda s: -s[0])[:self.width]
        best.sort(key=lambda s: (s[1], -s[0]))  # grouped by parent, parents in level order
        ids = list(range(first_id, first_id + len(best)))
        for x, (c, _, _, _) in zip(ids, best):
            self.cum[x] = c
        return Level(ids, [s[2] for s in best], [s[3] for s in best], mirror.position[frontier[0]] + 1, False)


def draft_levels(runs: list[tuple[FixedWidthSource, Level, TreeMirror]]) -> None:
    """Several requests' new levels through the draft in one batched forward (their rows of one cache)."""
    outs = run_levels([(src.kv, level, torch.tensor(level.tokens), mirror, "last" if level.verified else "all")
                       for src, level, mirror in runs])
    for (src, level, _), logits in zip(runs, outs):
        src.absorb(level, logits)
