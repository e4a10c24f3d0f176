"""What SpecPipe's ranks run, decided before any process starts: the modes, the checks of
--stages/--width/--topk, the stages' layer ranges (`stage_ranges`: the largest stage's weight
bytes minimised) and a `Job` (one request as every rank sees it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specwood.drafting.shapes import make_shape
from specwood.errors import SpecwoodError
from specwood.models.config import ModelConfig
from specwood.sampling import SamplingParams

PROMPT_CHUNK = 256  # prompt tokens per level: prefill is pipelined chunk by chunk
MODES = ("specpipe", "pp", "specinfer")
DRAFTED_MODES = ("specpipe", "specinfer")  # the modes that need a draft model on rank 0
DEFAULT_TREE: dict[str, Any] = {"name": "static"}  # specinfer: SpecInfer's branching <1,1,3,1,1,1,1,1>


# ---------------------------------------------------------------------------------------------
# checks and stage boundaries (cheap: run before any process starts)


def tree_nodes(tree: dict[str, Any] | None) -> int:
    """The most nodes (root excluded) a specinfer tree of these `make_shape` options can have;
    bad options raise SpecwoodError (checked before any process starts)."""
    opts = dict(tree or DEFAULT_TREE)
    return make_shape(opts.pop("name", "static"), **opts).max_nodes


def check_pipeline_args(stages: Any, width: Any, topk: Any, n_layers: int | None = None) -> None:
    """Bad --stages / --width / --topk as one clear SpecwoodError (width "auto": the planner picks it)."""
    for name, value in (("--stages", stages), ("--width", width), ("--topk", topk)):
        if name == "--width" and value == "auto":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecwoodError(f"{name} must be a positive integer, got {value!r}")
    if stages < 2:
        raise SpecwoodError(f"a pipeline needs at least 2 stages, got --stages {stages}")
    if n_layers is not None and stages > n_layers:
        raise SpecwoodError(f"--stages {stages} is more than the target's {n_layers} layers (use 2..{n_layers})")


def weight_elements(config: ModelConfig) -> tuple[int, int]:
    """(one layer's matmul weights, the head's), in elements: what a decode step reads."""
    c = config
    layer = (c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim
             + 3 * c.dim * c.intermediate_size)
    return layer, c.vocab_size * c.dim


def stage_ranges(config: ModelConfig, stages: int, first_stage_extra: float = 0.0) -> list[range]:
    """Contiguous layer ranges minimising the largest stage's weight bytes (a CPU decode step reads
    every weight once), the head counted on the last stage; every stage gets a layer or more.
    first_stage_extra: more work on rank 0 in the same unit (target weight elements), e.g. the
    draft model it runs beside its layers."""
    layer, head = weight_elements(config)
    n = config.n_layers
    check_pipeline_args(stages, 1, 1, n)
    def cost(a: int, b: int) -> float:
        return (b - a) * layer + (head if b == n else 0) + (first_stage_extra if a == 0 else 0)

    # best[s][b]: the smallest max-stage cost of layers [0, b) in s stages, and the last cut
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, stages + 1):
        for b in range(s, n + 1):
            best[s][b] = min((max(best[s - 1][a][0], cost(a, b)), a) for a in range(s - 1, b))
    cuts, b = [], n
    for s in range(stages, 0, -1):
        a = best[s][b][1]
        cuts.append(range(a, b))
        b = a
    return cuts[::-1]


@dataclass
class Job:
    """One request as every rank sees it (rank 0 broadcasts it when the request joins)."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    mode: str = "specpipe"
    width: int = 8
    topk: int = 4
    tree: dict[str, Any] | None = None  # specinfer: make_shape options ({"name": ..., "budget": ...})
    tree_nodes: int = 0  # specinfer: the most drafted nodes a tree can have (`tree_nodes(tree)`)
    trace: bool = False  # every rank records per-step timestamps (stats per_stage[r]["trace"])

    def cache_len(self, stages: int) -> int:
        # committed tokens, plus at most `stages` levels of `width` speculative nodes in flight
        # (or one whole tree)
        spec = max((self.width + 1) * (stages + 1), self.tree_nodes + 1)
        return len(self.prompt) + self.max_tokens + spec + PROMPT_CHUNK
