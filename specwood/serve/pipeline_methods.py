"""`specwood serve --executor pipeline`: the server's method table on a `PipelineExecutor`
(SpecPipe-DB; its requests' lifecycle is the one Scheduler's, specwood.engine.scheduler).

A request's "method" picks the pipeline mode: specpipe (or auto), pp (or ar), specinfer, or a tree
shape for PP + SpecInfer (`pipeline_mode`); the server's default is the one it started with.
"""
from __future__ import annotations

from typing import Any

from specwood.drafting.shapes import MODEL_SHAPES
from specwood.engine.specpipe.launch import PIPELINE_METHODS, pipeline_mode
from specwood.errors import SpecwoodError
from specwood.methods import MethodTable
from specwood.serve.protocol import ProtocolError


class PipelineMethods(MethodTable):
    """The server's method table on the pipeline."""

    def __init__(self, default: str, options: dict[str, Any] | None = None):
        self.options = {k: v for k, v in (options or {}).items() if v is not None}
        name, (mode, _) = self._check(default)
        self.default = mode if name == "auto" else name  # auto on the pipeline is SpecPipe
        self.names = [*PIPELINE_METHODS, *MODEL_SHAPES]  # what a request may name: the shapes drafted by a model

    def _check(self, name: str) -> tuple[str, tuple[str, dict[str, Any] | None]]:
        o = self.options
        try:
            mode, tree = pipeline_mode(name, o.get("budget"), o.get("depth"), o.get("threshold"))
        except SpecwoodError as e:
            raise ProtocolError(str(e), param="method", code="unsupported_method") from None
        return name, (mode, tree)

    def cached(self, name: str | None) -> tuple[str, Any]:
        return self._check(self.default if name is None else name)

    def prepare(self, name: str) -> tuple[str, Any]:
        return self._check(name)
