"""A bounded index of token streams for model-free drafting (SuffixDecoding's suffix tree, our way).

Tokens live in a ring of `capacity` slots (absolute positions grow for ever; position p sits in
slot p % capacity and is live while p >= total - capacity), so memory is fixed and eviction is
first in, first out and free: a write overwrites the oldest token. Every live position e whose
last `anchor` tokens (tokens[e - anchor + 1 .. e]) hold no separator is linked to the previous
position whose anchor hashes to the same bucket (a hash chain, as LZ77 compressors keep one), and
`head` maps a bucket to its newest position. A bucket may hold other anchors (and other scopes'):
a query skips positions whose anchor tokens or scope are not its own, so what it finds is exactly
what a chain per anchor would give.

A query with the context's tail walks the anchor's chain over its `max_occurrences` newest live
occurrences, extends each match backwards (up to `max_match` tokens) and keeps those with the
longest match that are followed by at least one token; what followed each of them (up to
`max_depth` tokens, cut at a document's end) is its continuation. Those continuations are the
suffix-tree node of the longest matched suffix, with its counts: the number of continuations
that start with a path is that path's count (specwood.drafting.suffix_tree builds the tree).

Scopes (tenants): each document is written under one scope (a write under another scope starts a
new document), and a query sees only its own scope's occurrences; another scope's writes change
what it finds only by pushing old tokens out of the shared ring.

Memory: four flat arrays, 4 + 8 + 8 bytes a slot (token, scope id, chain link) and 8 bytes a
bucket (one bucket a slot, rounded up to a power of two): 28-36 bytes a token, whatever was
written (`nbytes`). Cost per step: O(new tokens) to append, O(max_occurrences * max_match +
continuations) to query (plus the rare other anchors sharing the bucket), whatever the context
length (an array read costs a little more than a list's: a query at the default sizes takes some
16 us here against 11 us with lists, for a sixth of the memory); a context longer than the ring
drafts from its newest `capacity` tokens. Documents (finished answers) are separated by
SEPARATOR, so no match or continuation crosses from one into the next.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from typing import Sequence

SEPARATOR = -1
_NONE = -(1 << 62)  # no position: below every ring's base, so a chain walk stops on it
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing's odd multiplier (2^64 / golden ratio)
_MASK64 = (1 << 64) - 1
_SCOPE_KEY = os.urandom(16)  # scope ids are keyed hashes: nobody outside can aim at another scope's id


def scope_id(scope: str) -> int:
    """A scope's 64-bit id (0 for ""): a hash, not a table, so scopes cost nothing to remember
    (a client may send a new `cache_salt` each request); two scopes share one with odds 2^-64."""
    if not scope:
        return 0
    digest = hashlib.blake2b(scope.encode(), digest_size=8, key=_SCOPE_KEY).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class SuffixIndex:
    def __init__(self, capacity: int, anchor: int = 2, max_match: int = 24, max_occurrences: int = 64):
        if capacity < 1 or anchor < 1 or max_match < anchor or max_occurrences < 1:
            raise ValueError(f"bad suffix index sizes: capacity {capacity}, anchor {anchor}, max_match "
                             f"{max_match}, max_occurrences {max_occurrences}")
        self.capacity = capacity
        self.anchor = anchor
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.tokens = array("i", [SEPARATOR]) * capacity
        self.scopes = array("q", [0]) * capacity  # slot -> the id of the scope its document was written under
        self.prev = array("q", [_NONE]) * capacity  # slot -> previous absolute position in its bucket
        self.bits = max(4, (capacity - 1).bit_length())
        self.head = array("q", [_NONE]) * (1 << self.bits)  # bucket -> its newest position
        self.scope = 0  # the id of the scope of the document being written
        self.total = 0  # positions ever written

    # --- writing -----------------------------------------------------------------------------------

    @property
    def base(self) -> int:
        """The oldest live position."""
        return max(0, self.total - self.capacity)

    @property
    def size(self) -> int:
        """Live positions (tokens and separators)."""
        return self.total - self.base

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's arrays (all of its memory but a few objects)."""
        return sum(a.itemsize * len(a) for a in (self.tokens, self.scopes, self.prev, self.head))

    def _bucket(self, key: int) -> int:
        """The bucket of an anchor folded into one int (with its scope)."""
        return ((key * _MIX) & _MASK64) >> (64 - self.bits)

    def _key(self, anchor: Sequence[int], sid: int) -> int:
        key = sid & 0xFFFFFFFF  # the bucket needs only some of the scope's bits: the chain checks all
        for t in anchor:
            key = key * 0x100000001B3 + t + 1  # an FNV-like fold; any fold works, the chain checks tokens
        return key

    def extend(self, tokens: Sequence[int], scope: str = "") -> None:
        """Append tokens to the current document (under `scope`: a document has one; tokens of
        another scope close it first)."""
        sid = scope_id(scope)
        seed = (sid & 0xFFFFFFFF) * 0x100000001B3 + 1  # _key's fold, its first step done
        if sid != self.scope:
            self.end_document()
            self.scope = sid
        cap, a, toks, scopes, prev, head = self.capacity, self.anchor, self.tokens, self.scopes, self.prev, self.head
        shift = 64 - self.bits
        e = self.total
        before = toks[(e - 1) % cap] if e else SEPARATOR  # the token written last
        for t in tokens:
            slot = e % cap
            toks[slot] = t
            scopes[slot] = sid
            if t != SEPARATOR and e + 1 >= a and a <= cap:
                if a == 2:  # the default, spelled out: this loop is the per-prompt cost
                    if before != SEPARATOR:
                        b = ((((seed + before) * 0x100000001B3 + t + 1) * _MIX) & _MASK64) >> shift
                        prev[slot] = head[b]  # a link to an overwritten position ends the chain (below base)
                        head[b] = e
                else:
                    anchor = [toks[(e - i) % cap] for i in range(a - 1, -1, -1)]
                    if SEPARATOR not in anchor:
                        b = self._bucket(self._key(anchor, sid))
                        prev[slot] = head[b]
                        head[b] = e
            before = t
            e += 1
        self.total = e

    def end_document(self) -> None:
        """Close the current document: nothing matches or continues across the boundary."""
        e = self.total
        if e and self.tokens[(e - 1) % self.capacity] != SEPARATOR:
            self.tokens[e % self.capacity] = SEPARATOR  # a separator has no anchor: nothing to link
            self.scopes[e % self.capacity] = self.scope
            self.total = e + 1

    def clear(self) -> None:
        SuffixIndex.__init__(self, self.capacity, self.anchor, self.max_match, self.max_occurrences)

    # --- reading -----------------------------------------------------------------------------------

    def token_at(self, position: int) -> int:
        return self.tokens[position % self.capacity]

    def find(self, tail: Sequence[int], max_depth: int, scope: str = "") -> tuple[int, list[list[int]]]:
        """The longest match length of `tail`'s end (0: none) and the continuations, newest
        occurrence first, of the occurrences (in `scope`'s documents) that match that long."""
        a = self.anchor
        sid = scope_id(scope)
        if len(tail) < a or max_depth < 1:
            return 0, []
        key = [*tail[-a:]]
        if SEPARATOR in key:
            return 0, []
        pos = self.head[self._bucket(self._key(key, sid))]
        base, total, cap, toks, scopes, prev = self.base, self.total, self.capacity, self.tokens, self.scopes, self.prev
        limit = min(self.max_match, len(tail))
        last, before = key[-1], key[-2] if a >= 2 else SEPARATOR
        best, ends = 0, []
        seen = 0
        while seen < self.max_occurrences:
            if pos - a + 1 < base:  # the anchor's first token was overwritten (or no more positions)
                break
            e = pos
            slot = e % cap
            pos = prev[slot]
            if (toks[slot] != last or scopes[slot] != sid or (a >= 2 and toks[(e - 1) % cap] != before)
                    or (a > 2 and any(toks[(e - a + 1 + i) % cap] != key[i] for i in range(a - 2)))):
                continue  # another anchor (or scope) in the same bucket
            seen += 1
            if e + 1 >= total or toks[(e + 1) % cap] == SEPARATOR:
                continue  # nothing followed this occurrence (yet)
            m = a
            while m < limit and e - m >= base and toks[(e - m) % cap] == tail[-1 - m]:
                m += 1
            if m > best:
                best, ends = m, [e]
            elif m == best:
                ends.append(e)
        conts = []
        for e in ends:
            cont = []
            for p in range(e + 1, min(e + 1 + max_depth, total)):
                t = toks[p % cap]
                if t == SEPARATOR:
                    break
                cont.append(t)
            conts.append(cont)
        return best, conts
