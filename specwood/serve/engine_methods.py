"""The server's method table on the engine's own executors (sequential, parallel): a request's
"method" names a method of the registry (specwood.methods); the pipeline's is
serve.pipeline_methods.PipelineMethods."""
from __future__ import annotations

import sys
import threading
from typing import Any

from specwood.errors import SpecwoodError
from specwood.methods import MethodTable
from specwood.serve.protocol import ProtocolError


def _log(msg: str) -> None:
    print(f"specwood serve: {msg}", file=sys.stderr, flush=True)


class EngineMethods(MethodTable):
    """Prepared method factories, one per method name: the server's default prepared at start-up,
    the others on first use (off the event loop) and cached."""

    def __init__(self, engine: Any, default: str, options: dict[str, Any] | None):
        from specwood.methods import get_method, method_names

        self.engine = engine
        self.options = {k: v for k, v in (options or {}).items() if v is not None}
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}
        name = get_method(default).name
        try:
            factory = engine.prepare(name, self.options)
        except SpecwoodError as e:
            if name != "auto":
                raise
            # auto is "the planner's choice of AR or speculation": without a usable plan, AR
            _log(f"warning: method auto is unavailable ({e}); requests without a method decode with ar")
            name, factory = "ar", engine.prepare("ar", {})
        self.default = name
        self._cache[name] = factory
        self.names = method_names()  # what a request may name

    def cached(self, name: str | None) -> tuple[str, Any] | None:
        if name is None:
            return self.default, self._cache[self.default]
        key = self._key(name)
        return (key, self._cache[key]) if key in self._cache else None

    def _key(self, name: str) -> str:
        from specwood.methods import get_method

        try:
            return get_method(name).name
        except SpecwoodError as e:
            raise ProtocolError(str(e), param="method", code="unknown_method") from None

    def prepare(self, name: str) -> tuple[str, Any]:
        """Blocking: prepare `name` once (options of the server that it takes) and cache it."""
        from specwood.methods import options_for

        key = self._key(name)
        with self._lock:
            if key not in self._cache:
                try:
                    self._cache[key] = self.engine.prepare(key, options_for(key, self.options))
                except SpecwoodError as e:
                    raise ProtocolError(str(e), param="method", code="unsupported_method") from None
            return key, self._cache[key]
