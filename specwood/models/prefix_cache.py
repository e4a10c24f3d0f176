"""Committed K/V that outlives a request: a prefix cache on token ids, bounded by bytes, LRU.

A finished request's committed tokens (never tree slots) are copied out of its cache row into a
compact entry; a new request copies the longest matching prefix back into its own row (from an
entry, or from the committed prefix of a request still running on the same pool) and prefills
only the rest. Copies, not shared slots: a row stays the request's own (the batched step, trees
and `compact` are unchanged), and evicting an entry never touches a request that matched it.
One cache serves several pools (the target's, each draft model's); entries match only on the
pool they came from.
"""
from __future__ import annotations

import itertools
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


@dataclass(eq=False)  # entries are compared by identity (list.remove)
class Entry:
    """One cached prefix: its token ids and their K/V [layers, H_kv, n, D] from one pool."""

    pool: int  # id() of the KVCache it came from
    tokens: np.ndarray
    k: torch.Tensor
    v: torch.Tensor
    used: int  # LRU clock

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


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
        self.entries: list[Entry] = []
        self.nbytes = 0
        self.stats = PrefixStats()
        self._clock = itertools.count()

    # --- finding and restoring ------------------------------------------------------------------

    def restore(self, cache: KVCache, row: int, tokens: Sequence[int], limit: int,
                live: Iterable[tuple[int, Sequence[int]]] = (), name: str = "target") -> int:
        """Copy the K/V of the longest cached prefix of `tokens` (at most `limit` tokens) into
        slots [0, m) of `row` and set the row's length to m; returns m (0: nothing matched).
        `live` offers the committed prefixes of rows in use on `cache` (row, their tokens): a
        prompt shared with a running request is computed once."""
        want = token_array(tokens[:limit])
        best, source = 0, None
        for entry in self.entries:
            if entry.pool == id(cache):
                m = common_prefix(entry.tokens, want)
                if m > best:
                    best, source = m, entry
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
                source.used = next(self._clock)
                cache.put_slots(row, 0, source.k[:, :, :best], source.v[:, :, :best])
            else:
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

    def store(self, cache: KVCache, row: int, tokens: Sequence[int]) -> None:
        """Keep the committed slots [0, n) of `row` (n = the row's length), which hold `tokens[:n]`,
        as an entry; entries it extends are dropped, the least recently used evicted to fit."""
        n = min(cache.lengths[row], len(tokens))
        if n == 0:
            return
        new = token_array(tokens[:n])
        size = n * cache.bytes_per_slot
        if size > self.budget_bytes:
            return
        for entry in [e for e in self.entries if e.pool == id(cache)]:
            shared = common_prefix(entry.tokens, new)
            if shared == len(new):  # already held (as itself or inside a longer entry)
                entry.used = next(self._clock)
                return
            if shared == len(entry.tokens):  # the new one holds it
                self._drop(entry)
        while self.entries and self.nbytes + size > self.budget_bytes:
            self._drop(min(self.entries, key=lambda e: e.used))
            self.stats.evictions += 1
        k, v = cache.slots_of(row, 0, n)
        self.entries.append(Entry(id(cache), new, k.clone(), v.clone(), next(self._clock)))
        self.nbytes += size
        self.stats.stored += 1

    def set_budget(self, budget_bytes: int) -> None:
        """A new bound (the server's KV budget less its rows, which grew or shrank): the least
        recently used entries go until the rest fits."""
        self.budget_bytes = max(0, int(budget_bytes))
        while self.entries and self.nbytes > self.budget_bytes:
            self._drop(min(self.entries, key=lambda e: e.used))
            self.stats.evictions += 1

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries, self.nbytes = [], 0

    @property
    def cached_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)
