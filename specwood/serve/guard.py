"""Who may talk to the server: an API key, browser origins, Host names and JSON bodies, checked
before a request reaches the app (an ASGI middleware: streams pass through untouched).

- `api_keys`: requests to /v1/* (every path with scope "all", /health and /metrics included) need
  `Authorization: Bearer KEY` (what OpenAI clients send) or `x-api-key: KEY` with one of the keys;
  else 401. Each key is a tenant: the request's ASGI scope carries the tenant's id (TENANT_KEY),
  and the server's caches reuse work only among requests of one tenant (docs/server.md).
- `allowed_origins`: a request carrying an `Origin` header (a browser's cross-site request) is
  refused with 403 unless its origin is listed ("*" allows any); listed origins get CORS headers
  and preflights. None by default, so a web page cannot make a local server work for it.
- `allowed_hosts`: where given, the Host header's name must be one of them (403 otherwise): a
  server on the loopback interface answers only to loopback names, which stops DNS rebinding.
- A POST whose Content-Type is not JSON gets 415 (a browser form or text/plain body, the kinds a
  page may send without a preflight).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, TypeVar

from specwood.serve.protocol import error_body

if TYPE_CHECKING:
    from starlette.applications import Starlette

    AppT = TypeVar("AppT", bound=Starlette)

Message = dict[str, Any]  # an ASGI scope or message
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
TENANT_KEY = "specwood.tenant"  # the ASGI scope entry naming the request's tenant ("" without keys)


def tenant_id(key: str) -> str:
    """A tenant's id: a digest of its key, so the key itself never sits in caches or logs."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class RequestGuard:
    def __init__(self, app: ASGIApp, *, api_keys: Iterable[str] = (), key_scope: str = "v1",
                 allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] | None = None):
        if key_scope not in ("v1", "all"):
            raise ValueError(f"key_scope must be 'v1' or 'all', got {key_scope!r}")
        self.app = app
        # every key is compared (no early exit), so the time of a refusal says nothing of which key was close
        self.keys = [(k.encode(), tenant_id(k)) for k in api_keys if k]
        self.key_scope = key_scope
        self.allowed_origins = {o.rstrip("/") for o in allowed_origins}
        self.allowed_hosts = None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is not None:
            status, message, code, extra = refusal
            return await _respond(send, status, error_body(message, status, None, code), extra)
        scope[TENANT_KEY] = self.tenant(scope)
        await self.app(scope, receive, send)

    def tenant(self, scope: Message) -> str:
        """The id of the tenant whose key the request carries ("" without keys, or without one)."""
        if not self.keys:
            return ""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
        return self._match(given) or ""

    def _match(self, given: str | None) -> str | None:
        """The tenant id of the key `given`, or None."""
        if given is None:
            return None
        found = None
        data = given.encode()
        for key, tenant in self.keys:
            if hmac.compare_digest(data, key):
                found = tenant
        return found

    def check(self, scope: Message) -> tuple[int, str, str, dict[str, str]] | None:
        """(status, message, code, extra headers) of a refusal, or None to let the request in."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.allowed_hosts is not None:
            host = host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return 403, f"the Host '{host}' is not served here (a server on loopback answers loopback names)", \
                    "host_not_allowed", {}
        origin = headers.get("origin")
        if origin is not None and "*" not in self.allowed_origins and origin.rstrip("/") not in self.allowed_origins:
            return 403, f"requests from the origin {origin} are not allowed (start the server with " \
                        "--allowed-origins to let a web page use it)", "origin_not_allowed", {}
        method, path = scope.get("method", "GET"), scope.get("path", "/")
        if method == "OPTIONS" and origin is not None:
            return None  # a preflight of an allowed origin: answered by the CORS layer
        if self.keys and (self.key_scope == "all" or path.startswith("/v1/")):
            given = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
            if self._match(given) is None:
                what = "is missing" if given is None else "is wrong"
                return 401, f"the API key {what}: send 'Authorization: Bearer KEY' (a key given to --api-key, " \
                            "--api-keys-file or SPECWOOD_API_KEY)", "invalid_api_key", {"www-authenticate": "Bearer"}
        if method == "POST":
            ctype = headers.get("content-type")
            if ctype is not None and not _is_json(ctype):
                return 415, f"request bodies must be JSON (Content-Type: application/json), got '{ctype}'", \
                    "unsupported_media_type", {}
        return None


def host_name(host: str) -> str:
    """The name part of a Host header ('[::1]:8000' -> '::1', 'Example.com:80' -> 'example.com')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _bearer(value: str) -> str | None:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _respond(send: Callable[[Message], Awaitable[None]], status: int, body: dict[str, Any],
                   extra: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


@dataclass(frozen=True)
class Access:
    """The server's access rules (see the module's docstring); the default lets every local
    client in and every browser origin out."""

    api_key: str | None = None  # one key (SPECWOOD_API_KEY, or the first --api-key)
    key_scope: str = "v1"  # "v1": the key guards /v1/*; "all": /health and /metrics too
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host
    more_keys: tuple[str, ...] = ()  # further keys: one tenant each (--api-key again, --api-keys-file)

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for k in (self.api_key, *self.more_keys) if k))

    def for_bind(self, host: str) -> "Access":
        """The rules for a server bound to `host`: on loopback, only loopback Host names (and
        those listed) unless a list was given."""
        if self.allowed_hosts is None and host.strip("[]").lower() in LOOPBACK_HOSTS:
            return replace(self, allowed_hosts=LOOPBACK_HOSTS)
        return self


def guard_app(app: AppT, access: Access) -> AppT:
    """`app` behind the guard, with CORS headers and preflights for the allowed origins."""
    origins = list(access.allowed_origins)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type", "x-api-key"])
    app.add_middleware(RequestGuard, api_keys=access.api_keys, key_scope=access.key_scope, allowed_origins=origins,
                       allowed_hosts=access.allowed_hosts)
    return app
