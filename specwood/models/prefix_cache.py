"""Committed K/V that outlives a request: a prefix cache on token ids, bounded by bytes, LRU.

A finished request's committed tokens (never tree slots) are copied out of its cache row into a
compact entry; a new request copies the longest matching prefix back into its own row (from an
entry, or from the committed prefix of a request still running on the same pool) and prefills
only the rest. Copies, not shared slots: a row stays the request's own (the batched step, trees
and `compact` are unchanged), and evicting an entry never touches a request that matched it.
One cache serves several pools (the target's, each draft model's); entries match only on the
pool they came from, and only within their scope (a tenant: another scope's entries are never
matched, touched or dropped by a request, only evicted by the shared byte budget).

The entries of one (pool, scope) sit in a radix tree (a compressed trie on token ids). No entry
is a prefix of another (a new entry drops one it extends; one already held is not stored), so
every entry ends at a leaf, and every node names an entry below it: the longest cached prefix of
a prompt is found by walking the prompt once, O(prompt length) whatever the number of entries.
Eviction takes the least recently used entry off an ordered dict in O(1) (and its leaf off the
tree in O(its length)).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from specwood.models.cache import KVCache


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def token_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


@dataclass(eq=False)  # entries are compared (and hashed) by identity
class Entry:
    """One cached prefix: its token ids and their K/V [layers, H_kv, n, D] from one pool."""

    pool: int  # id() of the KVCache it came from
    tokens: np.ndarray
    k: torch.Tensor
    v: torch.Tensor
    scope: str = ""
    leaf: "_Node | None" = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class _Node:
    """A radix tree node: the tokens on the edge from its parent, its children by their edge's
    first token, and an entry whose tokens run through it (a leaf's own entry)."""

    __slots__ = ("edge", "parent", "children", "entry")

    def __init__(self, edge: np.ndarray, parent: "_Node | None", entry: "Entry | None"):
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry = entry


def _walk(root: _Node, want: np.ndarray, ids: list[int]) -> tuple[int, _Node | None]:
    """How many leading tokens of `want` the tree holds, and the deepest node they reach (the
    node whose edge the match ends on or inside; None: nothing matched)."""
    node, depth, last = root, 0, None
    while depth < len(ids):
        child = node.children.get(ids[depth])
        if child is None:
            break
        m = common_prefix(child.edge, want[depth:depth + len(child.edge)])
        depth += m
        last = child
        if m < len(child.edge):
            break
        node = child
    return depth, last


@dataclass
class PrefixStats:
    """Counts since start, per pool name ("target", "draft"): tokens looked up and found."""

    query_tokens: dict[str, int] = field(default_factory=dict)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    stored: int = 0


class PrefixCache:
    """Entries of committed K/V for one or more KV pools, at most `budget_bytes` in all."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.nbytes = 0
        self.cached_tokens = 0
        self.stats = PrefixStats()
        self._lru: OrderedDict[Entry, None] = OrderedDict()  # least recently used first
        self._roots: dict[tuple[int, str], _Node] = {}  # (id(pool), scope) -> its radix tree

    @property
    def entries(self) -> list[Entry]:
        """Every entry, least recently used first."""
        return list(self._lru)

    # --- finding and restoring ------------------------------------------------------------------

    def restore(self, cache: KVCache, row: int, tokens: Sequence[int], limit: int,
                live: Iterable[tuple[int, Sequence[int]]] = (), name: str = "target", scope: str = "") -> int:
        """Copy the K/V of the longest cached prefix of `tokens` (at most `limit` tokens) into
        slots [0, m) of `row` and set the row's length to m; returns m (0: nothing matched).
        `live` offers the committed prefixes of rows in use on `cache` (row, their tokens): a
        prompt shared with a running request is computed once. Only entries stored under
        `scope` match (the caller offers only its scope's live rows)."""
        want = token_array(tokens[:limit])
        best = 0
        source: Entry | int | None = None  # an entry, or a running row
        root = self._roots.get((id(cache), scope))
        if root is not None:
            best, node = _walk(root, want, want.tolist())
            source = node.entry if node is not None else None
        for other, held in live:
            if other != row:
                m = common_prefix(token_array(held[:min(len(held), cache.lengths[other])]), want)
                if m > best:
                    best, source = m, other
        s = self.stats
        s.query_tokens[name] = s.query_tokens.get(name, 0) + len(tokens)
        s.hit_tokens[name] = s.hit_tokens.get(name, 0) + best
        if best:
            if isinstance(source, Entry):
                self._lru.move_to_end(source)
                cache.put_slots(row, 0, source.k[:, :, :best], source.v[:, :, :best])
            elif source is not None:
                cache.copy_slots(row, source, 0, best)
        cache.lengths[row] = best
        return best

    def extend(self, cache: KVCache, row: int, tokens: Sequence[int], limit: int,
               live: Iterable[tuple[int, Sequence[int]]], name: str = "target") -> int:
        """Carry a row that holds `tokens[:cache.lengths[row]]` further along `tokens` (at most to
        `limit`) from a running row's committed prefix: copies slots [length, m) only. Returns the
        row's new length."""
        start = cache.lengths[row]
        want = token_array(tokens[:limit])
        best, source = start, None
        for other, held in live:
            if other != row and cache.lengths[other] > best and start < len(want) and held[start] == want[start]:
                m = common_prefix(token_array(held[:cache.lengths[other]]), want)
                if m > best:
                    best, source = m, other
        if source is not None:
            cache.copy_slots(row, source, start, best)
            cache.lengths[row] = best
            self.stats.hit_tokens[name] = self.stats.hit_tokens.get(name, 0) + best - start
        return best

    # --- keeping ----------------------------------------------------------------------------------

    def store(self, cache: KVCache, row: int, tokens: Sequence[int], scope: str = "") -> None:
        """Keep the committed slots [0, n) of `row` (n = the row's length), which hold `tokens[:n]`,
        as an entry of `scope`; an entry of that scope it extends is dropped, the least recently
        used entries (of any scope) evicted to fit."""
        n = min(cache.lengths[row], len(tokens))
        if n == 0:
            return
        new = token_array(tokens[:n])
        size = n * cache.bytes_per_slot
        if size > self.budget_bytes:
            return
        ids = new.tolist()
        key = (id(cache), scope)
        root = self._roots.get(key)
        if root is not None:
            depth, node = _walk(root, new, ids)
            held = node.entry if node is not None else None
            if depth == n and held is not None:  # already held (as itself or inside a longer entry)
                self._lru.move_to_end(held)
                return
            if node is not None and held is not None and depth == len(held.tokens) and not node.children:
                self._drop(held)  # the new one holds it
        while self._lru and self.nbytes + size > self.budget_bytes:
            self._drop(next(iter(self._lru)))
            self.stats.evictions += 1
        k, v = cache.slots_of(row, 0, n)
        entry = Entry(id(cache), new, k.clone(), v.clone(), scope)
        self._insert(self._roots.setdefault(key, _Node(new[:0], None, None)), entry, ids)
        self._lru[entry] = None
        self.nbytes += size
        self.cached_tokens += n
        self.stats.stored += 1

    def set_budget(self, budget_bytes: int) -> None:
        """A new bound (the server's KV budget less its rows, which grew or shrank): the least
        recently used entries go until the rest fits."""
        self.budget_bytes = max(0, int(budget_bytes))
        while self._lru and self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._lru)))
            self.stats.evictions += 1

    def clear(self) -> None:
        self._lru.clear()
        self._roots.clear()
        self.nbytes = self.cached_tokens = 0

    # --- the radix trees --------------------------------------------------------------------------

    @staticmethod
    def _insert(root: _Node, entry: Entry, ids: list[int]) -> None:
        """Hang `entry` off the tree as a new leaf (no entry holds it, and it holds none)."""
        new, node, depth = entry.tokens, root, 0
        while True:
            child = node.children.get(ids[depth])
            if child is None:
                leaf = _Node(new[depth:], node, entry)
                node.children[ids[depth]] = leaf
                break
            m = common_prefix(child.edge, new[depth:depth + len(child.edge)])
            if m == len(child.edge):  # an inner node (a leaf here would be an entry the new one holds)
                node, depth = child, depth + m
                continue
            middle = _Node(child.edge[:m], node, child.entry)  # split the edge where they part
            node.children[ids[depth]] = middle
            child.edge, child.parent = child.edge[m:], middle
            middle.children[int(child.edge[0])] = child
            leaf = _Node(new[depth + m:], middle, entry)
            middle.children[ids[depth + m]] = leaf
            break
        entry.leaf = leaf

    def _drop(self, entry: Entry) -> None:
        del self._lru[entry]
        self.nbytes -= entry.nbytes
        self.cached_tokens -= len(entry.tokens)
        leaf, entry.leaf = entry.leaf, None
        if leaf is None or leaf.parent is None:
            raise RuntimeError("prefix cache: an entry without its leaf in the tree")
        parent = leaf.parent
        del parent.children[int(leaf.edge[0])]
        grand = parent.parent
        if grand is not None and len(parent.children) == 1:  # an inner node with one child: merge
            (only,) = parent.children.values()
            only.edge = np.concatenate([parent.edge, only.edge])
            only.parent = grand
            grand.children[int(only.edge[0])] = only
            parent = grand
        while parent.parent is not None:  # nodes that named the dropped entry name another below them
            if parent.entry is entry:
                parent.entry = next(iter(parent.children.values())).entry
            parent = parent.parent
        if not parent.children:
            del self._roots[(entry.pool, entry.scope)]
