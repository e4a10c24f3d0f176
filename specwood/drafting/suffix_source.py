"""Model-free drafting from suffix matches (SuffixDecoding): over the request's own prompt and
output, and over every answer the server gave before (one global index per model and server).

Only committed tokens enter either index: a request's own stream is the context plus its root
(all verified), and its answer goes into the global index when it ends -- what the request
committed, never a grammar's forced run that the target cut short (see `SuffixSource.close`).
The global index starts empty, fills from answers given, and holds at most `cache_tokens` tokens
(oldest overwritten). Answers carry a scope (a tenant): a request drafts only from its own
scope's answers.
Each step both are asked; the proposal with the larger expected accepted length drafts. The tree
is deterministic, so it is verified with the "selected" rule, lossless under sampling.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container, Sequence

import torch

from specwood.drafting.base import Drafting, TreeShape
from specwood.drafting.suffix_index import SuffixIndex
from specwood.drafting.suffix_tree import SuffixDraft, continuation_tree
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams

if TYPE_CHECKING:  # the engine is a layer above: its protocol is only named in annotations
    from specwood.engine.protocols import EngineLike

DEFAULT_CACHE_TOKENS = 1 << 19  # the global index's bound: 14 MiB (28 bytes a token; measured with tracemalloc)
DEFAULT_WINDOW = 1 << 16  # a request's own index: its newest tokens, so a huge context costs no more
ANSWER_LEAD = 4  # prompt tokens kept before an answer in the global index (the chat template's end)


class SuffixCache:
    """The answers one model gave on this server, in one bounded index (thread-safe: requests
    end on the scheduler's thread while others draft)."""

    def __init__(self, cache_tokens: int = DEFAULT_CACHE_TOKENS):
        self.index = SuffixIndex(cache_tokens)
        self.lock = threading.Lock()
        self.queries = 0
        self.hits = 0
        self.answers = 0

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @property
    def size(self) -> int:
        return self.index.size

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (fixed by its capacity)."""
        return self.index.nbytes

    def add_answer(self, prompt_tail: Sequence[int], output: Sequence[int], scope: str = "") -> None:
        """Keep an answer (after the last prompt tokens) as one document of `scope`."""
        if not output:
            return
        with self.lock:
            self.index.end_document()
            self.index.extend([*prompt_tail[-ANSWER_LEAD:], *output], scope)
            self.index.end_document()
            self.answers += 1

    def find(self, tail: Sequence[int], max_depth: int, scope: str = "") -> tuple[int, list[list[int]]]:
        """What followed `tail`'s end in `scope`'s answers (SuffixIndex.find)."""
        with self.lock:
            match, conts = self.index.find(tail, max_depth, scope)
            self.queries += 1
            self.hits += bool(conts)
        return match, conts

    def clear(self) -> None:
        with self.lock:
            self.index.clear()
            self.queries = self.hits = self.answers = 0

    def stats(self) -> dict[str, Any]:
        return {"tokens": self.size, "capacity": self.capacity, "bytes": self.nbytes, "answers": self.answers,
                "queries": self.queries, "hits": self.hits,
                "hit_rate": round(self.hits / self.queries, 4) if self.queries else 0.0}


_caches: "weakref.WeakKeyDictionary[Any, SuffixCache]" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def suffix_cache_for(engine: EngineLike, cache_tokens: int | None = None) -> SuffixCache:
    """The global suffix cache of `engine`'s target model (one per model per process); a new
    explicit bound starts it afresh at that size."""
    if cache_tokens is not None and (not isinstance(cache_tokens, int) or isinstance(cache_tokens, bool)
                                     or cache_tokens < 1):
        raise SpecwoodError(f"suffix_cache_tokens must be a positive integer, got {cache_tokens!r}")
    key = engine.target
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None or (cache_tokens is not None and cache.capacity != cache_tokens):
            cache = _caches[key] = SuffixCache(cache_tokens or DEFAULT_CACHE_TOKENS)
        return cache


def suffix_caches() -> list[SuffixCache]:
    """Every live global suffix cache (for /metrics)."""
    with _caches_lock:
        return list(_caches.values())


@dataclass
class SuffixOptions:
    budget: int = 16  # most tree nodes
    depth: int = 16  # deepest node
    min_prob: float = 0.1  # a node's path probability must reach this

    def __post_init__(self) -> None:
        for what, v in (("budget", self.budget), ("depth", self.depth)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecwoodError(f"suffix {what} must be a positive integer, got {v!r}")
        if not isinstance(self.min_prob, (int, float)) or not 0.0 <= self.min_prob <= 1.0:
            raise SpecwoodError(f"suffix min_prob must be in [0, 1], got {self.min_prob!r}")


class SuffixSource:
    """One request's suffix drafting: its own index over prompt + output, and the global cache
    (the answers of `scope` only, and its answer kept under `scope`)."""

    def __init__(self, cache: SuffixCache | None, prompt_len: int, max_tokens: int = 0, window: int = DEFAULT_WINDOW,
                 eos_ids: Container[int] = (), scope: str = ""):
        self.cache = cache
        self.scope = scope
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids
        self.window = window
        self.room = max(64, min(window, prompt_len + max_tokens + 2)) if max_tokens else window
        self.local: SuffixIndex | None = None  # built at the first proposal (sized to the request)
        self.seen = 0  # tokens of context + root already in `local`
        self._indexed_before_root = -1  # the context token the last sync indexed just before its root
        self._indexed_root = -1  # the root the last sync indexed (observe() moves `_root` on)
        self._root = -1  # the last step's next token (observe)
        # what the request committed, for close(): see _committed
        self._synced: tuple[list[int], int, int] | None = None  # the last step's (context list, its length, root)
        self._observed = False  # the last synced step's verdict came back (observe)
        self._accepted: list[int] | None = None  # its accepted path after the root, where told
        self._live: list[int] | None = None  # the request's own context list: the one that grows after a step
        self._sure = prompt_len  # leading tokens of every later context known committed
        self._closed = False
        self.steps = self.local_wins = self.global_wins = 0
        self.builds = 0  # local indexes built: one a request, unless a forced run was cut short

    def sync(self, context: list[int], root: int) -> SuffixIndex:
        """Bring the local index up to context + [root]. Normally an extension of what it saw;
        where it is not (a step drafted after a grammar's forced run that was then cut short),
        the index is built afresh so that it holds only what the request committed."""
        self._note_step(context, root)
        if self.local is not None and not self._extends(context, root):
            self.local, self.seen = None, 0
        if self.local is not None and len(context) + 1 == self.seen:  # this step's, already held
            return self.local
        if self.local is None:
            self.local = SuffixIndex(self.room)
            self.builds += 1
        # tokens that the ring would overwrite before this step ends are never written
        self.local.extend(context[max(self.seen, len(context) + 1 - self.local.capacity):])
        self.local.extend([root])
        self.seen = len(context) + 1
        self._root, self._indexed_root = root, root
        # a value, not the list: the engine extends the context in place, so the list's last token moves
        self._indexed_before_root = context[-1] if context else -1
        return self.local

    def _extends(self, context: list[int], root: int) -> bool:
        """Whether context + [root] carries on from what the index holds (the two tokens indexed
        last are where they were: a cut-short run differs right after the committed part)."""
        n, last, before = self.seen, self._indexed_root, self._indexed_before_root
        if len(context) + 1 == n:  # the same step asked again
            return root == last and (n < 2 or context[-1] == before)
        return len(context) >= n and context[n - 1] == last and (n < 2 or context[n - 2] == before)

    def proposals(self, context: list[int], root: int, budget: int, depth: int, min_prob: float,
                  use_global: bool = True) -> list[SuffixDraft]:
        """The local proposal, and the global one where earlier answers match."""
        local = self.sync(context, root)
        m = local.max_match
        tail = [*context[-(m - 1):], root] if m > 1 else [root]
        self.steps += 1
        match, conts = local.find(tail, depth)
        found = [continuation_tree(root, conts, budget, min_prob, match)]
        if self.cache is not None and use_global:
            g_match, g_conts = self.cache.find(tail, depth, self.scope)
            if g_conts:
                found.append(continuation_tree(root, g_conts, budget, min_prob, g_match))
                found[-1].source = "global"
        return found

    def count(self, chosen: SuffixDraft) -> None:
        """Stats: which source's proposal the step took."""
        if chosen.source == "global":
            self.global_wins += 1
        else:
            self.local_wins += chosen.expected > 0

    def propose(self, context: list[int], root: int, budget: int, depth: int, min_prob: float,
                use_global: bool = True) -> SuffixDraft:
        """The better of the local and the global proposal (larger expected accepted length)."""
        found = self.proposals(context, root, budget, depth, min_prob, use_global)
        best = max(found, key=lambda d: d.expected)  # the local one on a tie
        self.count(best)
        return best

    def observe(self, next_token: int, accepted: Sequence[int] | None = None) -> None:
        """The step's verdict: its next token, and (where the caller has the tree) the tokens of
        the accepted path after the root. It comes only when the tree's drafted part was tested:
        after a grammar's forced run, only when the target took the whole run."""
        self._root = next_token
        self._observed = True
        self._accepted = list(accepted) if accepted is not None else None

    def _note_step(self, context: list[int], root: int) -> None:
        """A step starts: what the previous one tells about the committed tokens. The engine
        passes the request's own context list, which it extends in place after the step; a step
        after a grammar's forced run gets a copy extended by the run, which the target may cut."""
        if self._synced is not None:
            before, n, _ = self._synced
            if len(before) > n:  # grew after its step: the request's own list
                self._live = before
            if self._observed:  # that step's context and root (and its path, where told) were kept
                path = len(self._accepted) + 1 if self._accepted is not None else 0
                self._sure = max(self._sure, n + 1 + path)
            if before is context and len(context) == n:  # the same step asked again
                return
        self._synced, self._observed, self._accepted = (context, len(context), root), False, None

    def _committed(self, synced: tuple[list[int], int, int]) -> list[int]:
        """The request's committed tokens (prompt first), at its end: its own context list and the
        last next token where known; after a forced run whose verdict never came (the target cut
        it short, or nothing was drafted after it) only what earlier steps confirmed, never the
        run's refused tokens."""
        context, n, root = synced
        live = context if len(context) > n else self._live
        if live is not None:  # every token in it was accepted (the engine appends accepted paths only)
            return [*live, self._root] if self._observed else list(live)
        if self._observed:  # a forced run taken whole, on a copy that never grows
            return [*context[:n], root, *([*self._accepted, self._root] if self._accepted is not None else [])]
        return list(context[:self._sure])

    def close(self) -> None:
        """The request ended: its answer (committed tokens only) goes into the global cache."""
        if self._closed:
            return
        self._closed = True
        if self.cache is not None and self._synced is not None:
            committed = self._committed(self._synced)
            answer = committed[self.prompt_len:]
            # a step's accepted path may run past the end: the answer is what the request emitted
            answer = answer[:self.max_tokens] if self.max_tokens else answer
            end = next((i for i, t in enumerate(answer) if t in self.eos_ids), None)
            answer = answer if end is None else answer[:end + 1]
            self.cache.add_answer(committed[max(0, self.prompt_len - ANSWER_LEAD):self.prompt_len], answer,
                                  self.scope)

    def stats(self) -> dict[str, Any]:
        return {"suffix_steps": self.steps, "suffix_local_wins": self.local_wins,
                "suffix_global_wins": self.global_wins, "suffix_index_builds": self.builds}


def global_allowed(params: SamplingParams) -> bool:
    """Whether a request may draft from the global cache: a seeded sampled request drafts from
    its own text only, so the same seed gives the same answer whatever the server answered before
    (its drafts change which random draws verification uses, never the law of the output)."""
    return params.greedy or params.seed is None


class SuffixShape(TreeShape):
    """`--method suffix`: each step's tree is the suffix source's proposal (no draft forward)."""

    name = "suffix"
    needs_model = False  # a suffix-tree proposal: no draft calls

    def __init__(self, source: SuffixSource, options: SuffixOptions):
        self.source = source
        self.options = options
        self.last: SuffixDraft | None = None

    @property
    def max_nodes(self) -> int:
        return self.options.budget

    def draft(self, context: list[int], root: int, params: SamplingParams,
              generator: torch.Generator | None) -> Drafting:
        yield from ()  # no draft calls
        o = self.options
        self.last = self.source.propose(context, root, o.budget, o.depth, o.min_prob, global_allowed(params))
        return self.last.tree

    def on_step(self, tree: Any, verdict: Any, cost: Any = None) -> None:
        self.source.observe(verdict.next_token, [tree.tokens[i] for i in verdict.accepted])

    def close(self) -> None:
        self.source.close()
