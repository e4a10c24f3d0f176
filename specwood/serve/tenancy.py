"""Who shares cached work on a server: tenants (API keys), `cache_salt`, and reuse turned off.

A request reuses work (a cached prompt prefix's K/V, a running request's prompt, suffix drafts
from earlier answers) only from requests of its own cache scope, and whatever it leaves behind
is found only by them: its scope is its tenant (the API key it authenticated with; one tenant
without keys) and, within the tenant, its `cache_salt`. Anything shared is a side channel (a
cached prompt answers faster and counts as `cached_tokens`), so a scope is the set of requests
allowed to learn each other's prompts and answers. docs/server.md, "Isolation", says what is
still shared and what timing reveals.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Sharing:
    """The server's policy: `shared_cache` False gives every request a scope of its own (no
    reuse across requests at all); `specwood_stats` False leaves the per-request speculation
    statistics out of responses (they show how well earlier answers predicted this one)."""

    shared_cache: bool = True
    specwood_stats: bool = True

    def scope_of(self, tenant: str, cache_salt: str | None) -> str | None:
        """The cache scope of a request of `tenant` ("" without keys) with `cache_salt`: "" for
        the default (no key, no salt), else a digest of both (fixed size, and the salt itself is
        kept nowhere); None where nothing is shared."""
        if not self.shared_cache:
            return None
        if not tenant and cache_salt is None:
            return ""
        # the salt is length-prefixed: no tenant/salt pair can spell another's scope
        salt = "" if cache_salt is None else f"{len(cache_salt)}:{cache_salt}"
        return hashlib.sha256(f"{tenant}\x1f{salt}".encode()).hexdigest()[:32]
