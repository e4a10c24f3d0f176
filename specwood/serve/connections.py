"""Bounds on the server's HTTP connections, so idle or slow clients cannot hold it: a deadline for
a request's headers, an idle keep-alive timeout and a cap on open connections (uvicorn's
settings, `uvicorn_limits`). The body's deadline is the app's (`_read_body` in app.py): uvicorn
reads bodies only as the app asks for them.

uvicorn (0.54) times out only idle keep-alive connections: a connection that never completes its
request headers is held forever. `header_deadline_protocol` closes one whose headers have not
arrived `read_timeout_s` after it opened (or after the first byte of a keep-alive connection's
next request).
"""
from __future__ import annotations

import asyncio
from typing import Any

DEFAULT_READ_TIMEOUT_S = 30.0  # headers, and the body, must arrive within this
DEFAULT_MAX_CONNECTIONS = 256  # open connections served; requests on more get 503
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this


def header_deadline_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (h11 or httptools, as uvicorn picks) with a deadline on
    each request's headers."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:
                self._disarm()  # a request's headers arrived: its body runs on the app's deadline
            elif cycle is None or cycle.response_complete:
                self._arm()  # the start of a keep-alive connection's next request (or leftovers)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_limits(read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS) -> dict[str, Any]:
    """uvicorn.Config keywords bounding connections: the header deadline, the keep-alive timeout
    and the cap (uvicorn answers 503 once its open connections reach `limit_concurrency`, counting
    the one asking: so the cap plus one)."""
    return {"http": header_deadline_protocol(read_timeout_s), "timeout_keep_alive": KEEP_ALIVE_S,
            "limit_concurrency": max_connections + 1}
