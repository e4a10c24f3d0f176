"""The one registry of decoding methods: name -> needs a draft model?, the options it takes
(validated), and how to build each request's drafter (draft source + tree shape).

The engine, the CLI, the bench harness and the server all go through `prepare_method`; the
planner registers `auto` and `prior` itself (specwood.planner.auto), so the engine never imports
the planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from specwood.drafting.shapes import needs_model
from specwood.engine.executor import EXECUTORS
from specwood.engine.protocols import EngineLike
from specwood.engine.request import Drafter
from specwood.errors import SpecwoodError

# sources(model) -> a draft source for one request on that model (the scheduler's pooled rows)
SourceFactory = Callable[[Any], Any]


class DrafterFactory(Protocol):
    """new_drafter(sources, prompt_len, max_tokens, load, scope) -> Drafter, once per request; load: the
    requests that will share its decode steps (itself included, `admission_load`); scope: the
    request's cache scope (Request.cache_scope): state shared across requests (the suffix cache's
    answers) is read and written only within it, None: shared with no other request."""

    def __call__(self, sources: SourceFactory, prompt_len: int, max_tokens: int, load: int = 1,
                 scope: str | None = "", /) -> Drafter: ...


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    needs_draft: bool  # needs the engine's draft model
    options: tuple[str, ...]  # option names it takes
    # prepare(engine, options) -> DrafterFactory; validates option values, builds shared parts once
    prepare: Callable[[EngineLike, dict[str, Any]], DrafterFactory]
    wants_draft: bool | None = None  # load a draft model for it when one is configured (default: needs_draft)
    # choose_executor(engine, options, prompt_len) -> "sequential" | "parallel", when the method
    # picks its executor itself (auto follows the plan); None: sequential unless asked otherwise
    choose_executor: Callable[[EngineLike, dict[str, Any], int], str] | None = None
    # the executors it runs on (specwood.engine.executors) and the backends its target may use
    executors: tuple[str, ...] = ("sequential",)
    backends: tuple[str, ...] = ("torch", "llama.cpp")

    @property
    def loads_draft(self) -> bool:
        return self.needs_draft if self.wants_draft is None else self.wants_draft


_REGISTRY: dict[str, Method] = {}


class MethodTable(Protocol):
    """A server's table of the methods its requests may name, and what each runs with: on an
    engine, prepared drafter factories (specwood.serve.app's `_Methods`); on the pipeline
    executor, its modes and trees (specwood.serve.pipeline_methods.PipelineMethods)."""

    default: str  # what a request that names no method runs
    names: list[str]  # what a request may name

    def cached(self, name: str | None) -> tuple[str, Any] | None:
        """(the method's canonical name, what it runs with) where ready now (None: `prepare` it
        first, off the event loop); `name` None: the default. A bad name raises ProtocolError."""

    def prepare(self, name: str) -> tuple[str, Any]:
        """Blocking: make `name` ready (once) and return what `cached` would."""


def register(method: Method) -> Method:
    _REGISTRY[method.name] = method
    return method


def method_names(executor: str | None = "sequential") -> list[str]:
    """The methods that run on `executor` (None: every method)."""
    return [name for name, m in _REGISTRY.items() if executor is None or executor in m.executors]


# what a sequential method's name means on another executor: DuoDecoding is the parallel
# executor's drafting, SpecPipe and plain PP the pipeline's
EXECUTOR_ALIASES: dict[str, dict[str, str]] = {"parallel": {"ar": "duo", "auto": "duo"},
                                               "pipeline": {"auto": "specpipe", "ar": "pp"}}


def method_on(executor: str, name: str | None) -> str:
    """The method `name` runs as on `executor` (an alias resolved; None: the executor's default),
    or one line saying where it runs instead."""
    key = EXECUTOR_ALIASES.get(executor, {}).get(str(name or "auto").strip().lower(), name or "auto")
    method = get_method(key)
    if executor not in method.executors:
        here = method_names(executor)
        runs = f"method{'s' if len(here) > 1 else ''} {', '.join(repr(m) for m in here)}"
        raise SpecwoodError(f"executor '{executor}' runs {runs}, not '{method.name}' (which runs on "
                            f"{' and '.join(method.executors)}); drop --method or use another --executor")
    return method.name


def check_backend(name: str, backend: str) -> None:
    """Refuse a method whose draft reads what the `backend` target does not expose."""
    method = get_method(name)
    if backend not in method.backends:
        raise SpecwoodError(f"method '{method.name}' needs a {' or '.join(method.backends)} target, not {backend} "
                            f"(use --backend {method.backends[0]})")


def get_method(name: str) -> Method:
    key = str(name).strip().lower().replace("_", "-")
    if key not in _REGISTRY:
        raise SpecwoodError(f"unknown method '{name}' (choose from {', '.join(_REGISTRY)})")
    return _REGISTRY[key]


def split_backend(method: str) -> tuple[str, str | None]:
    """'dyspec@llama.cpp' -> ('dyspec', 'llama.cpp'): a method and the backend its models run on
    (the bench's way to put rows of both backends in one run); None: the engine's own backends."""
    from specwood.engine.backends import BACKENDS

    name, sep, backend = str(method).rpartition("@")
    if sep and backend.strip().lower() in BACKENDS:
        return name.strip(), backend.strip().lower()
    return str(method).strip(), None


def split_executor(method: str) -> tuple[str, str | None]:
    """'duo@parallel' -> ('duo', 'parallel'): a method and the executor it runs on (the bench's
    way to put both executors in one run); a bare name gets None: the method decides. A backend
    suffix (split_backend) is dropped."""
    name, _, suffix = split_backend(method)[0].partition("@")
    executor = suffix.strip().lower() or None
    if executor is not None and executor not in EXECUTORS:
        raise SpecwoodError(f"unknown executor '{executor}' in '{method}' (use NAME@parallel, NAME@pipeline or "
                            "NAME@sequential; NAME@llama.cpp or NAME@torch picks the backend)")
    return name.strip(), executor


def options_for(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The subset of shared options (e.g. the bench's pass-through ones) that `name` takes (all
    of them for a name outside the registry: whoever runs it says what is wrong)."""
    if name not in _REGISTRY:
        return dict(options)
    taken = _REGISTRY[name].options
    return {k: v for k, v in options.items() if k in taken}


def prepare_method(engine: EngineLike, name: str, options: dict[str, Any] | None = None) -> DrafterFactory:
    """Check a method's options and draft needs once; the factory of its per-request drafters."""
    method = get_method(name)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        takes = f"it takes {', '.join(method.options)}" if method.options else "it takes none"
        raise SpecwoodError(f"method '{method.name}' does not use option(s) {', '.join(unknown)} ({takes})")
    check_backend(method.name, getattr(engine, "backend", "torch"))
    if method.needs_draft and engine.draft_model is None:
        raise SpecwoodError(f"method '{method.name}' needs a draft model; "
                            "pass --draft NAME|PATH (draft=... in the API)")
    return method.prepare(engine, options)


# ---------------------------------------------------------------------------------------------
# built-in methods: plain decoding, every tree shape over the draft model, early-exit


def _prepare_ar(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
    return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter()


def _shape_method(name: str, needs_draft: bool, options: tuple[str, ...]) -> Method:
    def prepare(engine: EngineLike, opts: dict[str, Any]) -> DrafterFactory:
        from specwood.drafting.shapes import make_shape

        shape = make_shape(name, **opts)
        if not needs_draft:
            return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(None, shape)
        return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(sources(engine.draft_model), shape)

    # the pipeline runs PP + SpecInfer: a tree drafted by its draft model
    executors = ("sequential", "pipeline") if needs_draft else ("sequential",)
    return Method(name, SHAPE_SUMMARIES[name], needs_draft, options, prepare, executors=executors)


SHAPE_SUMMARIES = {
    "chain": "a chain of draft-model tokens",
    "static": "a fixed branching list per depth (SpecInfer)",
    "sequoia": "the Sequoia dynamic-program tree",
    "eagle": "EAGLE-2: expand the top-k frontier, rerank by cumulative probability",
    "dyspec": "DySpec greedy heap expansion under a node budget",
    "dyspec-threshold": "DySpec layer-wise expansion above a threshold",
    "pld": "prompt lookup: a chain copied from the context (no model)",
}
SHAPE_OPTIONS: dict[str, tuple[str, ...]] = {
    "chain": ("budget", "depth"),
    "static": ("budget", "depth", "branching"),
    "sequoia": ("budget", "depth", "acceptance"),
    "eagle": ("budget", "depth", "topk"),
    "dyspec": ("budget", "depth"),
    "dyspec-threshold": ("budget", "depth", "threshold"),
    "pld": ("budget", "depth"),
}


def _shape_option(method: str, options: dict[str, Any], default: str) -> Any:
    """The tree shape a method with a `shape` option drafts with, built from the options left."""
    from specwood.drafting.shapes import canonical_shape, make_shape

    shape_name = canonical_shape(options.pop("shape", default))  # "Chain" takes chain's options
    allowed = SHAPE_OPTIONS.get(shape_name, ())
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise SpecwoodError(f"{method} with shape '{shape_name}' does not use option(s) {', '.join(extra)}")
    return make_shape(shape_name, **options)


EARLY_EXIT_DEPTH = 2


def _prepare_early_exit(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
    from specwood.drafting.model_source import early_exit_model

    options = dict(options)
    layer = options.pop("exit_layer", None) or max(1, engine.target_config.n_layers // 4)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise SpecwoodError(f"exit_layer must be an integer, got {layer!r}")
    from specwood.drafting.shapes import canonical_shape

    if canonical_shape(options.get("shape", "chain")) == "chain" and options.get("budget") is None \
            and options.get("depth") is None:
        # an untrained exit accepts almost nothing (AAT ~1.0): each drafted token is a wasted quarter
        # forward, so the default chain is 2 tokens (on the fp32 1.5B target 0.54x `ar`, at 5 0.35x)
        options["depth"] = EARLY_EXIT_DEPTH
    shape = _shape_option("early-exit", options, "chain")
    model = early_exit_model(engine.target, layer)
    return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(sources(model), shape)


def _prepare_head(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
    head = getattr(engine, "draft_head", None)
    if head is None:
        raise SpecwoodError("method 'head' needs a draft head; pass --head PATH (head=... in the API), e.g. one "
                            "made by `specwood train-drafter`")
    shape = _shape_option("head", dict(options), "eagle")
    # the head reads the prompt from the target's prefill features, in its first draft forward
    return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(sources(head), shape,
                                                                               defer_draft_prefill=True)


register(Method("ar", "plain autoregressive decoding (the baseline)", False, (), _prepare_ar))
for _name, _opts in SHAPE_OPTIONS.items():
    register(_shape_method(_name, needs_model(_name), _opts))
register(Method("early-exit", "experimental: the target's first layers + its head draft a chain (no trained exit "
                "adapter: AAT ~1.0, slower than ar)", False,
                ("exit_layer", "shape", "budget", "depth", "topk", "threshold", "branching", "acceptance"),
                _prepare_early_exit, backends=("torch",)))


register(Method("head", "a feature-level draft head (EAGLE) drafts the tree from the target's own features "
                "(--head PATH; shape=eagle by default)", False,
                ("shape", "budget", "depth", "topk", "threshold", "branching", "acceptance"), _prepare_head,
                backends=("torch",)))


def _prepare_suffix(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
    from specwood.drafting.suffix_source import SuffixOptions, SuffixShape, SuffixSource, suffix_cache_for

    cache = suffix_cache_for(engine, options.get("suffix_cache_tokens"))
    opts = SuffixOptions(**{k: v for k, v in options.items() if k in ("budget", "depth")})
    eos = frozenset(getattr(engine, "eos_token_ids", ()) or ())

    def new_drafter(sources: SourceFactory, prompt_len: int, max_tokens: int, load: int = 1,
                    scope: str | None = "") -> Drafter:
        # scope None: a request that shares nothing with others drafts from its own text only
        source = SuffixSource(cache if scope is not None else None, prompt_len, max_tokens, eos_ids=eos,
                              scope=scope or "")
        shape = SuffixShape(source, opts)
        return Drafter(None, shape, extra_stats=shape.source.stats)

    return new_drafter


# SuffixDecoding: a tree from suffix matches over the request and every earlier answer (no model);
# covers pld (a chain copied from the context), which stays for comparison
register(Method("suffix", "a tree from suffix matches over the request and the server's earlier answers (no model)",
                False, ("budget", "depth", "suffix_cache_tokens"), _prepare_suffix))


def _prepare_duo(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
    from specwood.drafting.multi_sequence import make_multi_sequence

    shape = make_multi_sequence(**options)
    return lambda sources, prompt_len, max_tokens, load=1, scope="": Drafter(sources(engine.draft_model), shape)


# DuoDecoding's drafting policy; in-process (draft then verify) here, draft and target at the same
# time with executor="parallel" (specwood.engine.parallel, `--executor parallel`)
register(Method("duo", "DuoDecoding dynamic multi-sequence drafting (parallel with --executor parallel)", True,
                ("budget", "depth", "max_sequences"), _prepare_duo, executors=("sequential", "parallel")))


def _pipeline_only(name: str) -> Callable[[Any, dict[str, Any]], DrafterFactory]:
    def prepare(engine: EngineLike, options: dict[str, Any]) -> DrafterFactory:
        raise SpecwoodError(f"method '{name}' runs on the pipeline executor: --executor pipeline "
                            "(executor='pipeline' in the API)")
    return prepare


# SpecPipe's modes (specwood.engine.specpipe.launch): the target's layers over rank processes
for _name, _summary, _draft in (("specpipe", "SpecPipe: the pipeline fed one tree level per step", True),
                                ("pp", "plain pipeline parallelism (no speculation)", False),
                                ("specinfer", "PP + SpecInfer: a whole static tree per pipeline pass", True)):
    register(Method(_name, _summary, _draft, (), _pipeline_only(_name), executors=("pipeline",), backends=("torch",)))
