"""A bounded index of token streams for model-free drafting (SuffixDecoding's suffix tree, our way).

Tokens live in a ring of `capacity` slots (absolute positions grow for ever; position p sits in
slot p % capacity and is live while p >= total - capacity), so memory is fixed and eviction is
first in, first out and free: a write overwrites the oldest token. Every live position e whose
last `anchor` tokens (tokens[e - anchor + 1 .. e]) hold no separator is linked to the previous
position with the same anchor (a hash chain, as LZ77 compressors keep one), and `head` maps an
anchor to its newest position.

A query with the context's tail walks the anchor's chain over its `max_occurrences` newest live
occurrences, extends each match backwards (up to `max_match` tokens) and keeps those with the
longest match that are followed by at least one token; what followed each of them (up to
`max_depth` tokens, cut at a document's end) is its continuation. Those continuations are the
suffix-tree node of the longest matched suffix, with its counts: the number of continuations
that start with a path is that path's count (specwood.drafting.suffix_tree builds the tree).

Cost per step: O(new tokens) to append, O(max_occurrences * max_match + continuations) to query,
whatever the context length; a context longer than the ring drafts from its newest `capacity`
tokens. Documents (finished answers) are separated by SEPARATOR, so no match or continuation
crosses from one into the next.
"""
from __future__ import annotations

from typing import Sequence

SEPARATOR = -1


class SuffixIndex:
    def __init__(self, capacity: int, anchor: int = 2, max_match: int = 24, max_occurrences: int = 64):
        if capacity < 1 or anchor < 1 or max_match < anchor or max_occurrences < 1:
            raise ValueError(f"bad suffix index sizes: capacity {capacity}, anchor {anchor}, max_match "
                             f"{max_match}, max_occurrences {max_occurrences}")
        self.capacity = capacity
        self.anchor = anchor
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = [SEPARATOR] * capacity
        self.prev: list[int] = [-1] * capacity  # slot -> previous absolute position with the same anchor
        self.head: dict[tuple[int, ...], int] = {}
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

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current document."""
        cap, a, toks, prev, head = self.capacity, self.anchor, self.tokens, self.prev, self.head
        e = self.total
        for t in tokens:
            slot = e % cap
            toks[slot] = t
            prev[slot] = -1
            base = e + 1 - cap  # the oldest live position once e is written (may be < 0)
            if t != SEPARATOR and e + 1 >= a and a <= cap:
                if a == 2:  # the default, spelled out: this loop is the per-prompt cost
                    key = (toks[(e - 1) % cap], t)
                else:
                    key = tuple(toks[(e - i) % cap] for i in range(a - 1, -1, -1))
                if SEPARATOR not in key:
                    last = head.get(key)
                    if last is not None and last >= base:
                        prev[slot] = last
                    head[key] = e
            e += 1
        self.total = e
        if len(head) > 4 * cap + 1024:  # anchors whose every occurrence was overwritten
            self._forget_stale()

    def end_document(self) -> None:
        """Close the current document: nothing matches or continues across the boundary."""
        if self.total and self.tokens[(self.total - 1) % self.capacity] != SEPARATOR:
            self.extend([SEPARATOR])

    def clear(self) -> None:
        self.__init__(self.capacity, self.anchor, self.max_match, self.max_occurrences)

    def _forget_stale(self) -> None:
        base = self.base
        self.head = {k: e for k, e in self.head.items() if e >= base}

    # --- reading -----------------------------------------------------------------------------------

    def token_at(self, position: int) -> int:
        return self.tokens[position % self.capacity]

    def find(self, tail: Sequence[int], max_depth: int) -> tuple[int, list[list[int]]]:
        """The longest match length of `tail`'s end (0: none) and the continuations, newest
        occurrence first, of the occurrences that match that long."""
        a = self.anchor
        if len(tail) < a or max_depth < 1:
            return 0, []
        key = tuple(tail[-a:])
        pos = self.head.get(key)
        base, total, cap, toks, prev = self.base, self.total, self.capacity, self.tokens, self.prev
        limit = min(self.max_match, len(tail))
        best, ends = 0, []
        for _ in range(self.max_occurrences):
            if pos is None or pos - a + 1 < base:  # the anchor's first token was overwritten
                break
            e = pos
            pos = prev[e % cap]
            if pos == -1:
                pos = None
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
