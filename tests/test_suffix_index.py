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


# --- scopes, memory, and what a request's close keeps ----------------------------------------------

def test_a_scope_finds_only_its_own_answers_and_others_change_nothing_but_eviction():
    """Two tenants write the same openings with different continuations: each finds only its own;
    B's writes leave A's results as they were (until the shared ring overwrites A's tokens)."""
    from specwood.drafting.suffix_source import SuffixCache

    cache = SuffixCache(200)
    cache.add_answer([1, 2], [5, 6, 7, 8], scope="a")
    before = cache.find([5, 6], 4, scope="a")
    assert before == (2, [[7, 8]])
    assert cache.find([5, 6], 4, scope="b") == (0, [])  # nothing of A's
    assert cache.find([5, 6], 4) == (0, [])  # nor for the default scope
    cache.add_answer([1, 2], [5, 6, 9, 9], scope="b")
    cache.add_answer([1, 2], [5, 6, 7, 3], scope="b")
    assert cache.find([5, 6], 4, scope="a") == before
    assert cache.find([5, 6], 4, scope="b") == (2, [[7, 3], [9, 9]])
    for _ in range(40):  # B fills the ring: A's answer is overwritten, first in first out
        cache.add_answer([1, 2], [5, 6, 9, 9], scope="b")
    assert cache.find([5, 6], 4, scope="a") == (0, [])


def test_scopes_against_the_reference_per_scope_stream():
    """Random documents under three scopes into one ring: each scope's query equals the
    reference over the ring with the other scopes' tokens turned into separators."""
    import random

    rnd = random.Random(2)
    for trial in range(200):
        capacity = rnd.randrange(8, 60)
        index = SuffixIndex(capacity, anchor=rnd.choice([1, 2, 3]), max_match=6, max_occurrences=rnd.randrange(1, 8))
        stream: list[tuple[int, str]] = []
        for _ in range(rnd.randrange(1, 12)):
            scope = rnd.choice(["", "a", "b"])
            doc = [rnd.randrange(3) for _ in range(rnd.randrange(1, 10))]
            index.extend(doc, scope)
            for t in doc:
                if stream and stream[-1][0] != SEPARATOR and stream[-1][1] != scope:
                    stream.append((SEPARATOR, ""))  # another scope's write starts a new document
                stream.append((t, scope))
            if rnd.random() < 0.5:
                index.end_document()
                if stream[-1][0] != SEPARATOR:
                    stream.append((SEPARATOR, ""))
        assert index.total == len(stream)
        tail = [rnd.randrange(3) for _ in range(rnd.randrange(0, 8))]
        for scope in ("", "a", "b", "c"):
            mine = [t if s == scope else SEPARATOR for t, s in stream]
            want = reference_find(mine, capacity, index.anchor, index.max_match, index.max_occurrences, tail, 4)
            assert index.find(tail, 4, scope) == want, (trial, scope)


def test_the_global_index_memory_is_fixed_by_its_capacity():
    """Filled past its capacity twice with 150k-vocabulary documents (nearly every anchor new),
    the index holds what `nbytes` says (tracemalloc), at most 32 bytes a token."""
    import random
    import tracemalloc

    from specwood.drafting.suffix_source import SuffixCache

    rnd = random.Random(1)
    capacity = 1 << 14
    docs = [[rnd.randrange(150_000) for _ in range(rnd.randrange(100, 400))] for _ in range(2 * capacity // 250)]
    tracemalloc.start()
    try:
        cache = SuffixCache(capacity)
        for d in docs:
            cache.add_answer(d[:4], d, scope=str(len(d) % 3))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.index.total > 2 * capacity
    assert cache.nbytes <= 32 * capacity
    assert held < cache.nbytes + 64 * 1024  # the arrays and a few small objects, nothing that grows
    assert cache.stats()["bytes"] == cache.nbytes


def _index_documents(cache) -> list[list[int]]:
    index = cache.index
    live = [index.token_at(p) for p in range(index.base, index.total)]
    docs, cur = [], []
    for t in live:
        if t == SEPARATOR:
            if cur:
                docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs + ([cur] if cur else [])


def _step(source, context: list[int], root: int, draft_context: list[int] | None = None,
          draft_root: int | None = None) -> None:
    """A step as the engine runs it: the source drafts from the request's own context list, or
    after a grammar's forced run from a copy extended by the run (draft_context, draft_root)."""
    ctx = context if draft_context is None else draft_context
    source.propose(ctx, root if draft_root is None else draft_root, budget=4, depth=4, min_prob=0.0)


def test_a_forced_run_the_target_cut_short_never_enters_the_global_cache():
    """A step drafted after a forced run [30, 31, 32] (the context a copy extended by it); the
    target keeps 30 and corrects to 40, so no verdict reaches the source; the request then ends.
    The answer kept is what the request committed (the last token, never told, left out), never
    the refused 31, 32."""
    from specwood.drafting.suffix_source import SuffixCache, SuffixSource

    prompt = [10, 11, 12, 13]
    cache = SuffixCache(1000)
    source = SuffixSource(cache, prompt_len=len(prompt))
    context = list(prompt)
    _step(source, context, 20)
    source.observe(21, [])  # a plain step: 20 kept, 21 next
    context.extend([20])
    _step(source, context, 21, draft_context=[*context, 21, 30, 31], draft_root=32)
    context.extend([21, 30])  # the engine keeps the root and the accepted part of the run; 40 is the new root
    source.close()
    (doc,) = _index_documents(cache)
    assert doc == [*prompt, 20, 21, 30]  # was [*prompt, 20, 21, 30, 31, 32]: refused tokens as an answer


def test_a_forced_run_taken_whole_keeps_the_run_and_the_path_after_it():
    """The target takes the whole forced run and one drafted token after it: the verdict (on the
    subtree after the run) reaches the source through SuffixShape.on_step; the answer kept is
    the run, that token and the next one, in order (it used to skip the run's last token and
    the path)."""
    from specwood.drafting.suffix_source import SuffixCache, SuffixOptions, SuffixShape, SuffixSource
    from specwood.tree.token_tree import TokenTree
    from specwood.verify import Verdict

    prompt = [10, 11, 12, 13]
    cache = SuffixCache(1000)
    shape = SuffixShape(SuffixSource(cache, prompt_len=len(prompt)), SuffixOptions())
    context = list(prompt)
    _step(shape.source, context, 20)
    shape.on_step(TokenTree.with_root(20), Verdict([], 21))
    context.extend([20])
    _step(shape.source, context, 21, draft_context=[*context, 21, 30, 31], draft_root=32)
    sub = TokenTree.with_root(32)
    sub.add_node(0, 33)
    shape.on_step(sub, Verdict([1], 34))
    context.extend([21, 30, 31, 32, 33])
    shape.close()
    assert _index_documents(cache) == [[*prompt, 20, 21, 30, 31, 32, 33, 34]]


def test_a_request_forced_from_its_first_step_keeps_only_what_was_confirmed():
    """With no step of its own context list seen, a forced run whose verdict never came keeps
    nothing past what earlier verdicts confirmed; one taken whole keeps the run."""
    from specwood.drafting.suffix_source import SuffixCache, SuffixSource

    prompt = [10, 11, 12, 13]
    cache = SuffixCache(1000)
    source = SuffixSource(cache, prompt_len=len(prompt))
    _step(source, list(prompt), 0, draft_context=[*prompt, 20, 30], draft_root=31)  # cut short: no verdict
    source.close()
    assert cache.answers == 0 and _index_documents(cache) == []
    source = SuffixSource(cache, prompt_len=len(prompt))
    _step(source, list(prompt), 0, draft_context=[*prompt, 20, 30], draft_root=31)
    source.observe(35)  # taken whole (auto's observe: no path given)
    _step(source, list(prompt), 0, draft_context=[*prompt, 20, 30, 31, 35, 50], draft_root=51)  # cut short
    source.close()
    assert _index_documents(cache) == [[*prompt, 20, 30, 31]]


def test_a_source_drafts_and_keeps_its_answer_in_its_scope():
    from specwood.drafting.suffix_source import SuffixCache, SuffixSource

    cache = SuffixCache(1000)
    cache.add_answer([1], [5, 6, 7, 8, 9], scope="b")
    prompt = [1, 5, 6]
    probe_a = SuffixSource(cache, prompt_len=len(prompt), scope="a")
    assert all(d.source != "global" for d in probe_a.proposals(prompt[:-1], 6, 4, 4, 0.0))  # B's answer is not A's
    probe_b = SuffixSource(cache, prompt_len=len(prompt), scope="b")
    assert probe_b.proposals(prompt[:-1], 6, 4, 4, 0.0)[-1].source == "global"
    a = SuffixSource(cache, prompt_len=len(prompt), scope="a")
    context = list(prompt)
    a.propose(context, 7, 4, 4, 0.0)
    a.observe(3, [])
    context.append(7)
    a.close()
    assert cache.find([6, 7], 1, scope="a") == (2, [[3]])
    assert cache.find([6, 7], 1, scope="b") == (2, [[8]])


def test_a_new_scope_each_answer_costs_no_memory():
    """Clients choose scopes (a `cache_salt` each request): 20,000 of them leave nothing behind
    but the ring, and each still finds its own answer only."""
    import tracemalloc

    from specwood.drafting.suffix_source import SuffixCache

    cache = SuffixCache(1024)
    cache.add_answer([1], [5, 6, 7], scope="warm-up")
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(20_000):
            cache.add_answer([1], [5, 6, i % 50], scope=f"salt-{i}")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - before < 16 * 1024
    assert cache.find([5, 6], 1, scope="salt-19999") == (2, [[19999 % 50]])
    assert cache.find([5, 6], 1, scope="salt-0") == (0, [])  # overwritten long ago
