"""Prefix reuse on the sequential executor: where a request's rows start (specwood.models.prefix_cache).

At admission a request's target row and its draft model's row start from the longest prefix of
its prompt held by a cached entry or by a running request on the same pool; it prefills only the
rest. While newcomers prefill together, one that shares its next prompt tokens with another
waits a step and copies them (`followers`, `catch_up`): a system prompt common to concurrent
requests, or the prompt of `n` choices, is computed once. At a normal finish the committed
tokens of both rows are kept (`keep`); a cancelled or failed request leaves nothing behind.

Where it applies: the target on our torch runtime, unless the request's draft head reads the
target's features (it must see every prompt token's); a draft model on a shared pool whose rows
hold its K/V of the context tokens alone (`DraftSource.shares_prefixes`: ModelDraftSource).
Other sources (n-gram lookup, llama.cpp drafts, draft heads) prefill as before.

Reuse stays within a request's cache scope (Request.cache_scope: a server's tenant and
`cache_salt`): entries, running rows and newcomers of another scope are never matched, so no
request can learn another scope's prompts from what it finds cached. None: nothing is shared.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specwood.drafting.base import DraftSource
from specwood.engine.request import Request
from specwood.engine.step import wants_features
from specwood.models.cache import KVCache
from specwood.models.prefix_cache import PrefixCache, common_prefix, token_array


def target_reusable(req: Request) -> bool:
    return req.cache_scope is not None and not wants_features(req)


def draft_reusable(req: Request) -> bool:
    src = req.drafter.source
    return req.cache_scope is not None and src is not None and src.shares_prefixes()


def _target_row(req: Request) -> tuple[int, str] | None:
    """The request's target row and cache scope, where the prefix cache applies to it."""
    if req.row is None or req.cache_scope is None or not target_reusable(req):
        return None
    return req.row, req.cache_scope


def _draft_row(req: Request) -> tuple[DraftSource, KVCache, int, str] | None:
    """The request's draft source, its pool and row, and its cache scope, where the prefix cache
    applies to it (a source that shares prefixes is attached to a pool)."""
    src = req.drafter.source
    if req.cache_scope is None or src is None or not src.shares_prefixes():
        return None
    cache, row = src.kv_row()
    return src, cache, row, req.cache_scope


class PrefixReuse:
    """The sequential executor's use of one PrefixCache for its target pool and draft pools."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.running: list[Request] = []  # admitted, not yet released

    # --- the rows running requests hold -------------------------------------------------------

    def _live_target(self, scope: str | None) -> list[tuple[int, Sequence[int]]]:
        return [(r.row, r.context) for r in self.running
                if r.row is not None and r.cache_scope == scope and target_reusable(r)]

    def _live_draft(self, pool: KVCache, scope: str | None) -> list[tuple[int, Sequence[int]]]:
        return [(d[2], r.context) for r in self.running
                if r.cache_scope == scope and (d := _draft_row(r)) is not None and d[1] is pool]

    # --- admission, progress, the end ---------------------------------------------------------

    def admitted(self, req: Request, target: KVCache) -> None:
        """Start `req`'s rows from the longest prefix held (its rows are allocated, the draft's
        attached). The target keeps the prompt's last token to compute: its logits give the
        first token."""
        n = len(req.prompt_ids)
        if (t := _target_row(req)) is not None:
            row, scope = t
            req.prefilled = self.cache.restore(target, row, req.prompt_ids, n - 1, self._live_target(scope),
                                               "target", scope=scope)
            req.cached_tokens = req.prefilled
        if (d := _draft_row(req)) is not None:
            src, pool, row, scope = d
            got = self.cache.restore(pool, row, req.prompt_ids, n, self._live_draft(pool, scope), "draft",
                                     scope=scope)
            if src.pending:  # a deferred draft prefill: what is left waits for its first forward
                src.defer(req.prompt_ids[got:])
            else:
                req.draft_prefilled = got
        self.running.append(req)

    def released(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)

    def keep(self, req: Request, target: KVCache) -> None:
        """A request that finished: its committed tokens (the context before the root) as entries,
        up to its last emitted token: a last step may commit tokens past max_tokens or a stop
        string, which no next turn's prompt holds (entries that end there would never be
        extended by the next turn's, and both would be kept)."""
        tokens = req.context[:len(req.prompt_ids) + len(req.out.token_ids)]
        if (t := _target_row(req)) is not None:
            self.cache.store(target, t[0], tokens, scope=t[1])
        if (d := _draft_row(req)) is not None:
            _, pool, row, scope = d
            self.cache.store(pool, row, tokens, scope=scope)

    # --- newcomers prefilling together ----------------------------------------------------------

    def catch_up(self, newcomers: list[Request], reading: list[Request], target: KVCache) -> None:
        """Carry each newcomer's target row, and the draft row of each request whose draft is
        `reading` its prompt, along the prompt as far as a running row's committed prefix goes
        (copies instead of a prefill). A draft row holds the prompt's first `draft_prefilled`
        tokens (the tokens emitted meanwhile wait as its pending ones, read after the prompt)."""
        for req in newcomers:
            if (t := _target_row(req)) is not None and req.prefilled == target.lengths[t[0]]:
                before = req.prefilled
                req.prefilled = self.cache.extend(target, t[0], req.prompt_ids, len(req.prompt_ids) - 1,
                                                  self._live_target(t[1]))
                req.cached_tokens += req.prefilled - before
        for req in reading:
            d = _draft_row(req)
            if d is not None and req.draft_prefilled == d[0].length:
                _, pool, row, scope = d
                req.draft_prefilled = self.cache.extend(pool, row, req.prompt_ids, len(req.prompt_ids),
                                                        self._live_draft(pool, scope), "draft")

    @staticmethod
    def followers(requests: list[Request], draft: bool) -> set[Request]:
        """Newcomers whose next prompt tokens an earlier newcomer computes this step (at the same
        place, the same tokens): they wait a step and copy them (`catch_up`)."""
        def done(r: Request) -> int:
            return r.draft_prefilled if draft else r.prefilled

        usable = draft_reusable if draft else target_reusable
        leaders: list[tuple[Request, np.ndarray]] = []
        out: set[Request] = set()
        for req in requests:
            if not usable(req):
                continue
            ids = token_array(req.prompt_ids)
            here = done(req)
            if any(lead.cache_scope == req.cache_scope and done(lead) == here
                   and common_prefix(lead_ids, ids) > here + 1 for lead, lead_ids in leaders):
                out.add(req)
            else:
                leaders.append((req, ids))
        return out
