"""SpecPipe's per-rank state, with no communication in it: the tree levels in flight, the mirror of
the speculative tree every rank keeps, and one stage's KV cache with its pruning.

Every rank applies the same events in the same order (a level entering stage 1, a verdict from
the last stage), so every rank's `TreeMirror` and view of what each stage holds stay identical
without shipping the tree around: only a new level's (ids, parents, tokens) are broadcast, the
"snapshot of M" of the paper. `StageKV` is used by the target's stages and by the draft alike.

Cache layout of a stage: one KVCache row per request in flight (`KVPool`, SpecPipe-DB packs the
rows of several requests into one forward with `run_levels`); in a row, slots [0, committed) hold
verified tokens, slot == position; then the speculative nodes this stage has computed, densely, in the order `spec`.
Pruning to the verified node's subtree keeps the verified node's KV (moved to slot `committed`)
and its descendants', and drops the rest (SpecPipe Fig. 8: row ∨ col of the verified node).

PP + SpecInfer (mode "specinfer") sends a whole tree instead: a `Level` with `tree` set holds the
verified root and its drafted nodes (positions by depth); every stage computes it with the tree
mask, the last stage verifies all of it at once (verdict TREE: the deepest accepted node and the
target's next token), and every stage keeps the KV of the accepted path (`StageKV.commit_path`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specwood.models.batch import RowInput, forward_rows
from specwood.models.cache import KVCache
from specwood.models.transformer import Transformer

# verdict kinds (the last stage's answer each step)
NONE, HIT, MISS, EMPTY = 0, 1, 2, 3  # nothing verified / a candidate / not a candidate / no candidates
TREE = 4  # a whole tree verified (PP + SpecInfer): node = deepest accepted node (the root if none)


@dataclass
class Level:
    """Nodes that enter stage 1 together: one speculative tree level (all at `position`), or a
    chain of verified tokens at positions position, position+1, … (a prompt chunk, a refill root)."""

    ids: list[int]
    parents: list[int]  # parent node id; -1 inside a verified chain
    tokens: list[int]
    position: int
    verified: bool
    tree: bool = False  # a whole tree: ids[0] is its verified root (parent -1) at `position`, BFS order

    def __len__(self) -> int:
        return len(self.ids)

    def depths(self) -> list[int]:
        """Depth below the root of each node of a tree level (parents precede children)."""
        depth: dict[int, int] = {}
        for x, p in zip(self.ids, self.parents):
            depth[x] = depth[p] + 1 if p in depth else 0
        return [depth[x] for x in self.ids]

    def positions(self) -> list[int]:
        n = len(self.ids)
        if self.tree:
            return [self.position + d for d in self.depths()]
        return [self.position + i for i in range(n)] if self.verified else [self.position] * n

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool of a tree level: M[i, j] iff node j is node i or one of its ancestors."""
        index = {x: i for i, x in enumerate(self.ids)}
        m = torch.zeros(len(self.ids), len(self.ids), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p in index:
                m[i] = m[index[p]]
            m[i, i] = True
        return m

    def keep(self, alive: set[int]) -> "Level":
        """The nodes still alive after pruning (a verified chain, or a whole tree, always survives)."""
        if self.verified or self.tree:
            return self
        idx = [i for i, x in enumerate(self.ids) if x in alive]
        return Level([self.ids[i] for i in idx], [self.parents[i] for i in idx], [self.tokens[i] for i in idx],
                     self.position, False)


@dataclass
class LevelVerdict:
    """The last rank's verdict on a lane's newest level (or whole tree), which every rank applies:
    `kind` (NONE, HIT, MISS, EMPTY, TREE), the token it settles and where. A pipeline message,
    not a tree's outcome: that is specwood.verify.Verdict, from which a TREE verdict is made."""

    kind: int
    token: int = -1
    node: int = -1  # the verified node's id on a HIT
    position: int = -1  # the verified token's position


@dataclass
class TreeMirror:
    """The live speculative tree: the latest verified token (`root`) and its drafted descendants."""

    parent: dict[int, int] = field(default_factory=dict)
    position: dict[int, int] = field(default_factory=dict)
    token: dict[int, int] = field(default_factory=dict)
    root: int | None = None  # None after a miss, until the refill root enters
    verified: set[int] = field(default_factory=set)  # verified nodes some stage has still to compute

    def add(self, level: Level) -> None:
        for i, (x, p, t, pos) in enumerate(zip(level.ids, level.parents, level.tokens, level.positions())):
            if x in self.position:
                raise RuntimeError(f"protocol: node {x} entered twice")
            if not level.verified and p not in self.position and not (level.tree and i == 0):
                raise RuntimeError(f"protocol: node {x} has unknown parent {p}")
            self.parent[x], self.position[x], self.token[x] = p, pos, t
        if level.verified:
            self.verified.update(level.ids)
            self.root = level.ids[-1]
        elif level.tree:
            self.verified.add(level.ids[0])
            self.root = level.ids[0]

    def children(self, node: int) -> list[int]:
        return [x for x, p in self.parent.items() if p == node]  # dicts keep insertion (= trial) order

    def alive(self) -> set[int]:
        return set(self.position)

    def bottom(self) -> list[int]:
        """The deepest live nodes (the frontier the next level grows from)."""
        if self.root is None:
            return []
        depth = max(self.position.values())
        return [x for x, q in self.position.items() if q == depth]

    def ancestors(self, node: int) -> list[int]:
        """`node`'s unverified ancestors (not the node itself)."""
        out = []
        p = self.parent[node]
        while p in self.position and p not in self.verified:
            out.append(p)
            p = self.parent[p]
        return out

    def path(self, node: int) -> list[int]:
        """`node` and its ancestors in the mirror, root first."""
        out = [node]
        while self.parent[out[-1]] in self.position:
            out.append(self.parent[out[-1]])
        return out[::-1]

    def apply(self, v: LevelVerdict) -> None:
        """To-subtree pruning: keep the verified node and its descendants (every rank does this).
        A TREE verdict settles the one tree in flight: nothing speculative is left."""
        if v.kind == NONE:
            return
        if v.kind == TREE:
            for d in (self.parent, self.position, self.token):
                d.clear()
            self.verified.clear()
            self.root = None
            return
        keep: set[int] = set()
        if v.kind == HIT:
            keep = {v.node}
            for x in sorted(self.position, key=self.position.__getitem__):  # parents before children
                if self.parent[x] in keep:
                    keep.add(x)
            self.verified.add(v.node)
            self.root = v.node
        else:
            self.root = None
        keep |= self.verified  # verified tokens still in flight (none can be, on a miss)
        for d in (self.parent, self.position, self.token):
            for x in [x for x in d if x not in keep]:
                del d[x]

    def consumed(self, ids: list[int]) -> None:
        """The last stage has computed these verified nodes: no rank needs them any more."""
        for x in ids:
            if x != self.root:
                self.verified.discard(x)
                for d in (self.parent, self.position, self.token):
                    d.pop(x, None)


class KVPool:
    """One model's (or stage's) KV cache shared by the requests in flight, a row each; it grows
    (in place) when a request needs more rows or a longer row than it has."""

    def __init__(self, model: Transformer, max_len: int = 64, rows: int = 1):
        self.model = model
        self.cache: KVCache = model.new_cache(max_len, rows)

    def make_room(self, max_len: int) -> None:
        """A free row, and rows of at least `max_len` slots."""
        if not self.cache.free_rows or self.cache.max_len < max_len:
            self.cache.grow(max_len, self.cache.rows + (0 if self.cache.free_rows else 1))

    def acquire(self, max_len: int) -> "StageKV":
        self.make_room(max_len)
        return StageKV(self.model, self.cache, self.cache.allocate())

    def release(self, kv: "StageKV") -> None:
        self.cache.release(kv.row)


class StageKV:
    """One request's row of a model's (or stage's) KV cache under SpecPipe: a committed prefix
    and the speculative nodes computed so far; `run` computes a level (`run_levels`: several
    requests' levels in one forward), `prune` follows a verdict."""

    def __init__(self, model: Transformer, cache: KVCache, row: int = 0):
        self.model, self.cache, self.row = model, cache, row
        self.committed = 0
        self.spec: list[int] = []  # node ids at slots committed, committed+1, …

    @classmethod
    def alone(cls, model: Transformer, max_len: int) -> "StageKV":
        """A private one-row cache (a request run on its own)."""
        return cls(model, model.new_cache(max_len, 1))

    def reset(self, max_len: int) -> None:
        if self.cache.max_len < max_len:
            self.cache.grow(max_len, self.cache.rows)
        self.cache.lengths[self.row] = 0
        self.committed, self.spec = 0, []

    def run(self, level: Level, x: torch.Tensor, mirror: TreeMirror, logits: str = "none") -> torch.Tensor:
        """Compute `level` (token ids [n] on a first stage, else hidden states [n, dim]) over the
        cached prefix and the nodes' ancestors. Returns hidden states [n, dim], or logits for the
        last node ("last", [1, V]) or every node ("all", [n, V]) on a last stage."""
        return run_levels([(self, level, x, mirror, logits)])[0]

    def plan(self, level: Level, x: torch.Tensor, mirror: TreeMirror, logits: str) -> tuple[RowInput, bool]:
        """This row's part of a batched forward over `level`, and whether it is a verified chain."""
        n = len(level)
        # a verified chain, or a node verified while in flight (what the last stage computes)
        chain = not level.tree and (level.verified or (n == 1 and level.ids[0] in mirror.verified))
        if level.tree:
            if self.spec:
                raise RuntimeError("protocol: a tree reached a stage that still holds speculative nodes")
            if level.position != self.committed:
                raise RuntimeError(f"protocol: a tree rooted at position {level.position}, stage has {self.committed}")
            start = self.committed
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool), level.ancestor_mask()], dim=1)
        elif chain:
            if self.spec:
                raise RuntimeError("protocol: a verified chain reached a stage that holds speculative nodes")
            if level.position != self.committed:
                raise RuntimeError(f"protocol: verified tokens at position {level.position}, "
                                   f"stage has {self.committed}")
            start = self.committed
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        else:
            start = self.committed + len(self.spec)
            mask = torch.zeros(n, start + n, dtype=torch.bool)
            mask[:, :self.committed] = True
            col = {x: self.committed + j for j, x in enumerate(self.spec)}
            for i, node in enumerate(level.ids):
                for a in mirror.ancestors(node):
                    mask[i, col[a]] = True  # KeyError here = an ancestor this stage never computed
                mask[i, start + i] = True
        self.cache.check_room(start + n)
        outputs = torch.tensor([n - 1]) if logits == "last" else torch.arange(n)  # "none": ignored
        return RowInput(self.row, x, torch.tensor(level.positions()), torch.arange(start, start + n), mask,
                        outputs), chain

    def advance(self, level: Level, chain: bool) -> None:
        """After the forward: the level's nodes are in the cache."""
        if chain:
            self.committed += len(level)
        else:
            self.spec.extend(level.ids)
        self.cache.lengths[self.row] = self.committed + len(self.spec)

    def prune(self, v: LevelVerdict, mirror: TreeMirror) -> None:
        """Keep the verified node (its KV becomes committed) and its subtree; drop the rest.
        `mirror` has already applied `v`, so the live nodes are exactly that subtree."""
        if v.kind == NONE:
            return
        slot = {x: self.committed + j for j, x in enumerate(self.spec)}
        head = [v.node] if v.kind == HIT and v.node in slot else []
        kept = [x for x in self.spec if x in mirror.position and x not in head]
        # compaction moves the verified node to slot `committed`, its subtree right after it
        self.cache.compact([slot[x] for x in head + kept], self.committed, self.row)
        self.committed += len(head)
        self.spec = kept

    def commit_path(self, path: list[int]) -> None:
        """After a TREE verdict: the accepted path's KV (root first) becomes committed, the rest goes."""
        slot = {x: self.committed + j for j, x in enumerate(self.spec)}
        missing = [x for x in path if x not in slot]
        if missing:
            raise RuntimeError(f"protocol: accepted nodes {missing} were never computed on this stage")
        self.cache.compact([slot[x] for x in path], self.committed, self.row)
        self.committed += len(path)
        self.spec = []


# one row of `run_levels`: (the row's StageKV, the level, its input [n] ids or [n, dim] hidden states,
# the request's mirror, which logits: "none" / "last" / "all")
LevelRun = tuple[StageKV, Level, torch.Tensor, TreeMirror, str]


def run_levels(runs: list[LevelRun]) -> list[torch.Tensor]:
    """Several requests' levels through one model in ONE padded forward (SpecPipe-DB: every
    request in flight on a stage computes together), each on its own cache row."""
    if not runs:
        return []
    planned = [kv.plan(level, x, mirror, logits) for kv, level, x, mirror, logits in runs]
    kv0 = runs[0][0]
    out = forward_rows(kv0.model, kv0.cache, [p for p, _ in planned])
    for (kv, level, _, _, _), (_, chain) in zip(runs, planned):
        kv.advance(level, chain)
    return out
