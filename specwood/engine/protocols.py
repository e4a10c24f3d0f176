"""The engine as the code around it sees it: the planner, the methods' factories, the executors,
the server and the benchmarks take an `EngineLike`, not `specwood.engine.api.Engine`, so that they
name what they use without importing the loader (and its import cycle through `specwood.methods`).
`Engine` is the one implementation; mypy checks that it satisfies this (tests/test_lint.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

    from specwood.constrain.processors import Processors
    from specwood.engine.config import SchedulerConfig
    from specwood.engine.output import GenerationResult
    from specwood.engine.request import Request
    from specwood.engine.scheduler import Scheduler
    from specwood.methods import DrafterFactory
    from specwood.models.config import ModelConfig
    from specwood.models.transformer import Transformer
    from specwood.sampling import SamplingParams

# a prompt as `generate` and `new_request` take it: text, chat messages or token ids
Prompt = str | list[dict[str, Any]] | list[int]


def is_token_ids(prompt: Any) -> TypeIs[list[int]]:
    """A prompt given as token ids (a list of ints; an empty list counts, and is refused later)."""
    return isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))


class EngineLike(Protocol):
    """A loaded target (and optional draft model or draft head) with its tokenizer.

    `target` and `draft_model` are torch `Transformer`s, or on the llama.cpp backend objects that
    carry the same `config`, `device`, `dtype` and `max_positions` (specwood.engine.backends)."""

    @property
    def target(self) -> Transformer: ...
    @property
    def draft_model(self) -> Transformer | None: ...
    @property
    def draft_head(self) -> Transformer | None: ...
    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer (untyped)
    @property
    def target_name(self) -> str: ...
    @property
    def draft_name(self) -> str | None: ...
    @property
    def max_context(self) -> int: ...
    @property
    def eos_token_ids(self) -> set[int]: ...
    @property
    def emit_limit(self) -> int: ...
    @property
    def target_config(self) -> ModelConfig: ...
    @property
    def draft_config(self) -> ModelConfig | None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def backend(self) -> str: ...
    @property
    def draft_backend(self) -> str | None: ...
    @property
    def scheduler(self) -> Scheduler: ...

    def encode(self, prompt: str | list[dict[str, Any]], raw: bool = False,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]: ...

    def make_scheduler(self, config: SchedulerConfig = ..., drafts: tuple[Any, ...] | None = None) -> Scheduler: ...

    def prepare(self, method: str, options: dict[str, Any] | None = None) -> DrafterFactory: ...

    # the sampling parameters and method options as keywords (Engine.new_request and .generate
    # say which): spelled once there, not copied here
    def new_request(self, prompt: Prompt, *args: Any, **kwargs: Any) -> Request: ...
    def generate(self, prompt: Prompt, *args: Any, **kwargs: Any) -> GenerationResult: ...
    def run(self, request: Request) -> GenerationResult: ...

    def prepare_grammars(self) -> None: ...
    def processors_for(self, params: SamplingParams, prompt_ids: list[int],
                       cache_scope: str | None = "") -> Processors | None: ...
