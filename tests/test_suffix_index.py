"""The suffix index and its draft tree against brute-force references on random token streams
(small alphabets, so matches and ties are frequent; small rings, so eviction is exercised)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specwood.drafting.suffix_index import SEPARATOR, SuffixIndex
from specwood.drafting.suffix_tree import continuation_tree


def reference_find(stream: list[int], capacity: int, anchor: int, max_match: int, max_occurrences: int,
                   tail: list[int], max_depth: int) -> tuple[int, list[list[int]]]:
    """What `SuffixIndex.find` promises, by scanning the live window backwards."""
    total = len(stream)
    base = max(0, total - capacity)
    if len(tail) < anchor or max_depth < 1:
        return 0, []
    key = tail[-anchor:]
    occurrences = [e for e in range(total - 1, base - 1, -1)
                   if e - anchor + 1 >= base and stream[e - anchor + 1:e + 1] == key][:max_occurrences]
    best, ends = 0, []
    for e in occurrences:
        if e + 1 >= total or stream[e + 1] == SEPARATOR:
            continue
        m = anchor
        while m < min(max_match, len(tail)) and e - m >= base and stream[e - m] == tail[-1 - m]:
            m += 1
        if m > best:
            best, ends = m, [e]
        elif m == best:
            ends.append(e)
    conts = []
    for e in ends:
        cont = []
        for t in stream[e + 1:e + 1 + max_depth]:
            if t == SEPARATOR:
                break
            cont.append(t)
        conts.append(cont)
    return best, conts


def reference_tree(continuations: list[list[int]], budget: int, min_prob: float):
    """The kept nodes as (path, count) in the order the tree should add them: an explicit trie
    of every prefix, then repeatedly the best node whose parent is kept, by (count desc, depth,
    parent's rank, newest first among siblings)."""
    n = len(continuations)
    counts: dict[tuple[int, ...], int] = {}
    first_seen: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(continuations):
        for d in range(1, len(c) + 1):
            path = tuple(c[:d])
            counts[path] = counts.get(path, 0) + 1
            first_seen.setdefault(path, i)
    rank = {(): -1}
    kept: list[tuple[tuple[int, ...], int]] = []
    while len(kept) < budget:
        ready = [p for p in counts if p not in rank and p[:-1] in rank and counts[p] >= min_prob * n]
        if not ready:
            break
        best = min(ready, key=lambda p: (-counts[p], len(p), rank[p[:-1]], first_seen[p]))
        rank[best] = len(kept)
        kept.append((best, counts[best]))
    return kept


ops = st.lists(st.one_of(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.just("end")),
               min_size=1, max_size=25)


@settings(max_examples=600, deadline=None)
@given(ops=ops, capacity=st.integers(3, 40), anchor=st.integers(1, 3), max_match=st.integers(3, 8),
       max_occurrences=st.integers(1, 12), tail=st.lists(st.integers(0, 3), min_size=0, max_size=10),
       max_depth=st.integers(0, 6), from_stream=st.booleans())
def test_find_matches_the_reference(ops, capacity, anchor, max_match, max_occurrences, tail, max_depth, from_stream):
    index = SuffixIndex(capacity, anchor, max(max_match, anchor), max_occurrences)
    stream: list[int] = []
    for op in ops:
        if op == "end":
            index.end_document()
            if stream and stream[-1] != SEPARATOR:
                stream.append(SEPARATOR)
        else:
            index.extend(op)
            stream.extend(op)
        assert index.total == len(stream) and index.size == min(len(stream), capacity)
    if from_stream:  # the request's own case: the tail is the stream's end
        tail = [t for t in stream[-10:] if t != SEPARATOR]
    got = index.find(tail, max_depth)
    want = reference_find(stream, capacity, anchor, max(max_match, anchor), max_occurrences, tail, max_depth)
    assert got == want


@settings(max_examples=300, deadline=None)
@given(conts=st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=6), min_size=0, max_size=10),
       budget=st.integers(1, 12), min_prob=st.sampled_from([0.0, 0.1, 0.3, 0.5]))
def test_continuation_tree_matches_the_reference(conts, budget, min_prob):
    draft = continuation_tree(7, conts, budget, min_prob)
    tree = draft.tree
    want = reference_tree(conts, budget, min_prob)
    assert tree.tokens[0] == 7 and tree.child_rule == "selected"
    paths = [()]
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i  # parents before children
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    assert paths[1:] == [p for p, _ in want]
    n = len(conts)
    count = dict(want)
    for i in range(1, len(tree)):
        parent_count = count.get(paths[tree.parents[i]], n)
        assert abs(tree.probs[i] - count[paths[i]] / parent_count) < 1e-12  # the frequency ratio
        assert abs(draft.path_probs[i] - count[paths[i]] / n) < 1e-12
    assert abs(draft.expected - sum(c / n for _, c in want)) < 1e-9
    for i in range(len(tree)):  # siblings carry distinct tokens
        kids = [tree.tokens[c] for c in tree.children(i)]
        assert len(kids) == len(set(kids))


def test_a_context_longer_than_the_ring_drafts_from_its_window():
    index = SuffixIndex(capacity=100, anchor=2)
    pattern = [5, 6, 7, 8, 9]
    index.extend(pattern + [1] * 200)  # the pattern is overwritten
    assert index.find([5, 6], 4) == (0, [])
    index.extend(pattern + [2, 3])
    match, conts = index.find([1, 5, 6], 4)
    assert match == 3 and conts == [[7, 8, 9, 2]]
    assert len(index.tokens) == 100  # memory stays at the bound


def test_documents_never_continue_across_a_separator():
    index = SuffixIndex(capacity=64, anchor=1)
    index.extend([1, 2, 3])
    index.end_document()
    index.extend([3, 4])
    index.end_document()
    assert index.find([3], 3) == (1, [[4]])  # the 3 ending the first answer has no continuation
    assert index.find([2], 3) == (1, [[3]])


def test_a_request_index_holds_only_committed_tokens_after_a_cut_short_run():
    """A step may draft after a grammar's forced run as if the run were context; when the run is
    then cut short, the next step's context does not extend what was indexed, and the request's
    index is rebuilt from the committed tokens (it would otherwise propose the refused run)."""
    from specwood.drafting.suffix_source import SuffixSource

    committed = [1, 2, 3, 4, 1, 2]
    run = [3, 9, 9, 9]  # drafted over as context, then refused after its first token
    source = SuffixSource(None, prompt_len=3)
    source.propose(committed + run[:-1], run[-1], budget=8, depth=4, min_prob=0.0)
    source.propose(committed + run[:-1], run[-1], budget=8, depth=4, min_prob=0.0)  # the same step again
    assert source.local.size == len(committed) + len(run)
    now = committed + [3]
    draft = source.propose(now, 5, budget=8, depth=4, min_prob=0.0)
    fresh = SuffixSource(None, prompt_len=3)
    assert draft == fresh.propose(now, 5, budget=8, depth=4, min_prob=0.0)
    assert source.local.size == fresh.local.size == len(now) + 1
    later = now + [5, 1]  # an ordinary step after it extends the index again
    source.propose(later, 2, budget=8, depth=4, min_prob=0.0)
    assert source.local.size == len(later) + 1
