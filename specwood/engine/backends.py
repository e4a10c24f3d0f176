"""Which runtime runs each model: `torch` (specwood's own runtime, every feature) or `llama.cpp`
(llama-cpp-python on the GGUF file as it is; CPU; one request at a time for a target).
SPECWOOD_LLAMACPP_EXACT=1 runs a llama.cpp target in exact mode (specwood.models.llamacpp).

The target and the draft choose independently (`backend`, `draft_backend`). A target backend of
`auto` loads the configuration `specwood plan --choose-config` measured fastest on this machine
for the model pair (both backends and weight modes; see `resolve_runtime`); without one, `auto`
picks llama.cpp when llama-cpp-python is importable and the model is a GGUF file, else torch. On
llama.cpp a target is a `LlamaCppTarget` (driven through the ModelRunner seam by a
RunnerExecutor) and a draft a `LlamaCppDraft` (a pool of llama.cpp contexts that hands each
request a LlamaCppDraftSource), so tree shapes, draft sources, verifiers and the method registry
are the same on both backends.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from specwood.errors import SpecwoodError
from specwood.models.config import ModelConfig

BACKENDS = ("torch", "llama.cpp")
BACKEND_CHOICES = ("torch", "llama.cpp", "auto")
# weight modes of a torch target and of a torch draft (the command lines' --dtype / --draft-dtype)
DTYPE_CHOICES = ("auto", "bf16", "fp32", "int8", "q4", "q4-lite")
DRAFT_DTYPE_CHOICES = ("auto", "int4", "int8", "q4", "q4-lite", "bf16", "fp32")
DEFAULT_LLAMACPP_CTX = 8192  # KV cells per llama.cpp context unless --max-context says otherwise
# llama.cpp sequences per context. llama.cpp reserves a logits row per sequence at start (151,936
# floats = 0.58 MB each for Qwen2.5), so 256 cost 0.15 GB per context; 64 cover the trees the
# planner uses (x <= 32) and cost a quarter (BENCHMARKS.md §7g)
TARGET_SEQUENCES = 64  # tree leaves per step
DRAFT_SEQUENCES = 64  # ... of a draft context: branches of a drafted tree


def _is_gguf(model: str | os.PathLike[str] | None) -> bool:
    from specwood.models.registry import DEFAULT_TARGET, REGISTRY

    name = str(model or DEFAULT_TARGET).strip()
    return name.lower() in REGISTRY or (name.lower().endswith(".gguf") and Path(name).is_file())


def llama_cpp_available() -> bool:
    from specwood.models.llamacpp import import_llama_cpp

    try:
        import_llama_cpp()
    except SpecwoodError:
        return False
    return True


def resolve_backend(backend: str | None, model: str | os.PathLike[str] | None) -> str:
    """'torch', 'llama.cpp' or 'auto' (llama.cpp for a GGUF model when llama-cpp-python is importable)
    -> the backend to use; the missing extra is a one-line error (with the pip command)."""
    b = str(backend or "torch").strip().lower()
    if b not in BACKEND_CHOICES:
        raise SpecwoodError(f"unknown backend '{backend}' (use {', '.join(BACKEND_CHOICES)})")
    if b == "auto":
        return "llama.cpp" if _is_gguf(model) and llama_cpp_available() else "torch"
    if b == "llama.cpp":
        from specwood.models.llamacpp import import_llama_cpp

        import_llama_cpp()
    return b


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and in which weight mode the target and the draft run (the arguments of `load`)."""

    backend: str = "torch"
    dtype: str = "auto"
    draft_backend: str = "torch"
    draft_dtype: str = "auto"

    def label(self) -> str:
        def one(backend: str, dtype: str, default: str) -> str:
            return "llama.cpp" if backend == "llama.cpp" else f"torch {default if dtype == 'auto' else dtype}"
        return (f"target {one(self.backend, self.dtype, 'bf16')}, "
                f"draft {one(self.draft_backend, self.draft_dtype, 'int4')}")


# (target, draft, device) -> the measured fastest RuntimeConfig and a line saying where it comes
# from, or None. The planner registers it (the engine does not import the planner).
MeasuredConfigLookup = Callable[[str, "str | None", str], "tuple[RuntimeConfig, str] | None"]
_measured_config_lookups: list[MeasuredConfigLookup] = []


def register_measured_config(lookup: MeasuredConfigLookup) -> None:
    if lookup not in _measured_config_lookups:
        _measured_config_lookups.append(lookup)


def resolve_runtime(asked: RuntimeConfig, target: str | os.PathLike[str] | None, draft: str | os.PathLike[str] | None,
                    device: str = "cpu") -> tuple[RuntimeConfig, str | None]:
    """The backends to load: a target backend of 'auto' takes the stored measured choice for this
    machine and pair (its draft backend and both weight modes too, where the dtypes asked for are
    'auto' or agree with it); otherwise each 'auto' backend resolves alone (resolve_backend).
    Returns the config and, when a measured choice was applied, a line saying so."""
    from specwood.models.registry import DEFAULT_TARGET

    if str(asked.backend).strip().lower() == "auto":
        for lookup in _measured_config_lookups:
            found = lookup(str(target or DEFAULT_TARGET), None if draft is None else str(draft), str(device))
            if found is None:
                continue
            chosen, note = found
            agrees = all(str(mine) in ("auto", theirs) for mine, theirs in
                         ((asked.dtype, chosen.dtype), (asked.draft_dtype, chosen.draft_dtype)))
            if agrees:
                if "llama.cpp" in (chosen.backend, chosen.draft_backend) and not llama_cpp_available():
                    continue  # the extra went away since the choice was measured
                return chosen, f"--backend auto: {chosen.label()} ({note})"
    backend = resolve_backend(asked.backend, target)
    draft_backend = resolve_backend(asked.draft_backend, draft) if draft is not None else "torch"
    return replace(asked, backend=backend, draft_backend=draft_backend), None


def check_backends(backend: str, draft_backend: str, *, dtype: Any = "auto", draft_dtype: Any = "auto",
                   device: str = "cpu", executor: str | None = None) -> None:
    """Refuse the combinations the llama.cpp backend does not support, in one line each."""
    for flag, b, dt, which in (("--dtype", backend, dtype, "target"),
                               ("--draft-dtype", draft_backend, draft_dtype, "draft")):
        if b != "llama.cpp":
            continue
        if str(dt) != "auto":
            raise SpecwoodError(f"{flag} {dt} applies to the torch backend; llama.cpp runs the GGUF's own weight "
                                f"types (drop {flag}, or use --{'draft-' if which == 'draft' else ''}backend torch)")
        if not str(device).startswith("cpu"):
            raise SpecwoodError(f"the llama.cpp backend runs on the CPU; --device {device} needs --backend torch "
                                "--draft-backend torch")
    if executor not in (None, "sequential") and "llama.cpp" in (backend, draft_backend):
        raise SpecwoodError(f"the {executor} executor runs torch models; with --executor {executor} use --backend "
                            "torch --draft-backend torch (llama.cpp runs the sequential executor)")


def gguf_config(name_or_path: str | os.PathLike[str]) -> tuple[ModelConfig, Path]:
    """The model config from a GGUF file's header (no tensor is read), named as load_checkpoint names it."""
    from specwood.models.gguf_file import config_from_gguf, read_gguf_header
    from specwood.models.llamacpp import gguf_path
    from specwood.models.registry import REGISTRY

    path = gguf_path(name_or_path)
    config = config_from_gguf(read_gguf_header(path))
    if str(name_or_path).strip().lower() in REGISTRY:
        config.name = str(name_or_path).strip().lower()
    return config, path


def _context_size(config: ModelConfig, max_context: int | None) -> int:
    return min(max_context or DEFAULT_LLAMACPP_CTX, config.max_position_embeddings)


class LlamaCppTarget:
    """The target on llama.cpp: one context (so a batch of one) and what the engine reads of a model."""

    backend = weight_mode = "llama.cpp"

    def __init__(self, name_or_path: str | os.PathLike[str], max_context: int | None = None,
                 exact: bool | None = None) -> None:
        from specwood.models.llamacpp import LlamaCppModel

        if exact is None:  # a diagnostic switch: slower, but tree and one-token logits round alike
            exact = os.environ.get("SPECWOOD_LLAMACPP_EXACT", "") == "1"
        self.config, path = gguf_config(name_or_path)
        self.runner = LlamaCppModel(path, n_ctx=_context_size(self.config, max_context), n_seq_max=TARGET_SEQUENCES,
                                    vocab_size=self.config.vocab_size, exact=exact)
        self.max_positions = self.runner.n_ctx
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of the logits; the weights keep the GGUF's types

    def close(self) -> None:
        self.runner.close()


class LlamaCppDraft:
    """The draft on llama.cpp: one load of the GGUF file, a context per running request (borrowed
    by its LlamaCppDraftSource, given back when the request ends)."""

    backend = weight_mode = "llama.cpp"

    def __init__(self, name_or_path: str | os.PathLike[str], max_context: int | None = None) -> None:
        from specwood.models.llamacpp import LlamaCppModel

        self.config, path = gguf_config(name_or_path)
        self.n_ctx = _context_size(self.config, max_context)
        first = LlamaCppModel(path, n_ctx=self.n_ctx, n_seq_max=DRAFT_SEQUENCES, vocab_size=self.config.vocab_size)
        self.weights = first.loaded
        self.max_positions = first.n_ctx
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._free = [first]

    def borrow(self) -> Any:
        from specwood.models.llamacpp import LlamaCppModel

        if self._free:
            return self._free.pop()
        return LlamaCppModel(self.weights.path, n_ctx=self.n_ctx, n_seq_max=DRAFT_SEQUENCES,
                             vocab_size=self.config.vocab_size, weights=self.weights)

    def give_back(self, ctx: Any) -> None:
        self._free.append(ctx)

    def new_source(self) -> Any:
        from specwood.drafting.llamacpp_source import LlamaCppDraftSource

        return LlamaCppDraftSource(self)
