"""A request: everything one generation needs, owned in one object (nothing lives in loop locals).

The scheduler moves a request through WAITING -> PREFILL -> DECODE -> FINISHED; every decode step
advances it by one target forward shared with the other running requests.
"""
from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from specwood.errors import SpecwoodError

from specwood.constrain.processors import Processors
from specwood.drafting.base import DraftSource, ShapePolicy, TreeShape
from specwood.engine.output import GenerationResult, OutputStream
from specwood.sampling import SamplingParams
from specwood.tree.token_tree import TokenTree
from specwood.verify import Verdict

if TYPE_CHECKING:  # step.py imports this module
    from specwood.engine.step import StepRecord

StepHook = Callable[[TokenTree, Verdict], None]
_ids = itertools.count()


@dataclass
class Drafter:
    """One request's drafting: its draft source (state: cache row, pending tokens) and its tree
    shape policy (specwood.drafting.base). `shape` None decodes plainly. The policy chooses the
    shape per step, knowing how many requests share the step and how many prefill tokens ride in
    its forward (`for_batch`), and observes each verdict and what the step cost the batch
    (`on_step`), as `auto` does; a TreeShape is its own policy."""

    source: DraftSource | None = None
    shape: ShapePolicy | None = None
    hooks: list[StepHook] = field(default_factory=list)
    extra_stats: Callable[[], dict[str, Any]] | None = None  # what the method adds to the stats
    # the draft model reads the prompt in its first forward instead of a prefill before the first
    # token (a source with `defer`): auto's late draft, which may never draft at all
    defer_draft_prefill: bool = False

    def shape_for_step(self, batch_size: int, context_len: int, riding: int = 0, free: int = 0) -> TreeShape | None:
        """The shape for this step; `free`: tokens of the grammar's forced run the tree grows after
        (context_len counts them)."""
        return self.shape.for_batch(batch_size, context_len, riding, free) if self.shape is not None else None

    def on_step(self, tree: TokenTree, verdict: Verdict, cost: StepRecord | None = None) -> None:
        if self.shape is not None:
            self.shape.on_step(tree, verdict, cost)
        for hook in self.hooks:
            hook(tree, verdict)

    def close(self) -> None:
        """The request ended: the source gives its rows back, a shape with state (a suffix
        source's answer for the global cache) closes too."""
        for part in (self.source, self.shape):
            if part is not None:
                part.close()

    def model_source(self) -> DraftSource:
        """Its source, where the caller knows it has one (`uses_draft_model`, `wants_target_features`)."""
        if self.source is None:
            raise RuntimeError("this request drafts without a draft source")
        return self.source

    @property
    def uses_draft_model(self) -> bool:
        """Its source is a draft model with KV state that the executor attaches and prefills."""
        return self.source is not None and self.source.uses_draft_model

    @property
    def wants_target_features(self) -> bool:
        """Its source reads the target's features (a feature-level draft head)."""
        return self.source is not None and self.source.wants_target_features


@dataclass
class SpecStats:
    """Per-request speculative statistics."""

    steps: int = 0
    accepted: int = 0  # drafted tokens accepted (the bonus/correction token not counted)
    drafted_depth: int = 0  # sum of tree depths: what a perfect draft would have had accepted
    tree_nodes: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    by_depth_reached: list[int] = field(default_factory=list)  # steps whose path reached depth d+1
    by_depth_offered: list[int] = field(default_factory=list)  # steps whose tree had depth >= d+1

    def record(self, tree: TokenTree, n_accepted: int, draft_s: float, verify_s: float) -> None:
        self.steps += 1
        self.accepted += n_accepted
        depth = tree.max_depth
        self.drafted_depth += depth
        self.tree_nodes += tree.size
        self.draft_s += draft_s
        self.verify_s += verify_s
        while len(self.by_depth_offered) < depth:
            self.by_depth_offered.append(0)
            self.by_depth_reached.append(0)
        for d in range(depth):
            self.by_depth_offered[d] += 1
            self.by_depth_reached[d] += d < n_accepted

    def as_dict(self) -> dict[str, Any]:
        s = max(self.steps, 1)
        return {
            "spec_steps": self.steps,
            # AAT: tokens emitted per target forward, the bonus/correction token included
            "mean_accepted_tokens": round((self.accepted + self.steps) / s, 4),
            "acceptance_rate": round(self.accepted / self.drafted_depth, 4) if self.drafted_depth else 0.0,
            "acceptance_by_depth": [round(r / o, 4) for r, o in zip(self.by_depth_reached, self.by_depth_offered)],
            "mean_tree_nodes": round(self.tree_nodes / s, 2),
            "mean_tree_depth": round(self.drafted_depth / s, 3),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
        }


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


def draft_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator:
    """The draft's own random stream: seeded from the request's seed but distinct from the
    target's, so drafting never shifts the target sampler's draws."""
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed((params.seed * 0x9E3779B97F4A7C15 + 0x5851F42D) % (1 << 63))
    return g


class Request:
    """One generation: prompt, sampling params and random streams, output stream, stats, drafter."""

    timeout_s: float | None = None  # the deadline the scheduler gave it at submit, in seconds from then
    deadline: float | None = None  # time.monotonic() by which it must end
    expired = False  # ran past its deadline: ended through the cancellation path, then failed
    # the target's logits after the prompt's last token: set by the executor's prefill, read for
    # the first token, then deleted
    prefill_logits: torch.Tensor

    def __init__(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, drafter: Drafter,
                 out: OutputStream, *, method: str, device: torch.device | str = "cpu",
                 extra_stats: Callable[[], dict[str, Any]] | None = None,
                 on_finish: Callable[["Request"], None] | None = None, request_id: str | None = None,
                 processors: Processors | None = None, cache_scope: str | None = ""):
        self.id = request_id or f"req-{next(_ids)}"
        # who may reuse this request's work and whose it may reuse (prefix cache, running rows,
        # the suffix cache): requests of the same scope only; None: no other request
        self.cache_scope = cache_scope
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        self.processors = processors  # per-path logits processors (grammar, bias, penalties), None: none
        self.drafter = drafter
        self.out = out
        self.method = method
        self.target_generator = None if params.greedy else params.generator(device)
        self.draft_generator = None if params.greedy else draft_generator(params, device)
        self.stats = SpecStats()
        self.extra_stats = extra_stats
        self.on_finish = on_finish
        self.state = State.WAITING
        self.t_submitted = time.perf_counter()
        self.t_admitted: float | None = None  # when it left the queue
        self.row: int | None = None  # target cache row
        self.prefilled = 0  # prompt tokens in the target cache
        self.cached_tokens = 0  # of those, how many came from the prefix cache (not computed for it)
        self.draft_prefilled = 0
        self.root: int | None = None  # newest token: emitted, not yet in the target cache
        self.context: list[int] = list(prompt_ids)  # every token before the root
        self.result: GenerationResult | None = None
        self.error: str | None = None
        self.exception: BaseException | None = None
        self._cancel = threading.Event()
        self.done = threading.Event()

    def cache_row(self) -> int:
        """Its target cache row (admitted: the executor allocated it)."""
        if self.row is None:
            raise RuntimeError(f"request {self.id} has no cache row (not admitted)")
        return self.row

    def root_token(self) -> int:
        """Its newest token, emitted and not yet in the cache (prefilled: it has a first token)."""
        if self.root is None:
            raise RuntimeError(f"request {self.id} has no token yet (not prefilled)")
        return self.root

    @property
    def uses_draft_model(self) -> bool:
        return self.drafter.uses_draft_model

    @property
    def draft_behind(self) -> bool:
        """Its draft model has not read the whole prompt yet: it decodes plainly meanwhile (the
        draft reads the prompt after the first token, which never waits for it)."""
        return self.uses_draft_model and self.draft_prefilled < len(self.prompt_ids)

    @property
    def draft_first(self) -> bool:
        """Its draft reads the prompt before the first token: a seeded sampled request, whose
        draws follow its trees, so its trees must not depend on how fast its draft catches up
        among other requests (the same seed gives the same answer alone and in a batch)."""
        return not self.params.greedy and self.params.seed is not None

    def attach_draft(self) -> None:
        """Give the draft source its cache row at admission; a deferred one takes the prompt as
        tokens still to read, so the draft's prefill is done (Drafter.defer_draft_prefill)."""
        source = self.drafter.model_source()
        source.attach(len(self.prompt_ids), self.max_tokens)
        if self.drafter.defer_draft_prefill:
            source.defer(self.prompt_ids)
            self.draft_prefilled = len(self.prompt_ids)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step (thread-safe)."""
        self._cancel.set()

    def check_deadline(self) -> bool:
        """Past its deadline: cancelled and marked, so that the scheduler fails it with
        DeadlineExceeded (an executor that runs many steps inside one scheduler step asks too)."""
        if self.deadline is not None and not self.expired and time.monotonic() > self.deadline:
            self.expired = True
            self.cancel()
        return self.expired

    def stats_dict(self) -> dict[str, Any]:
        extra = self.stats.as_dict() if self.stats.steps else {}
        if self.processors is not None and self.processors.matcher is not None:
            extra.update(grammar_forced_tokens=self.processors.forced, grammar_pruned_nodes=self.processors.pruned,
                         grammar_mask_s=round(self.processors.mask_s, 4))
        if self.extra_stats is not None:
            extra.update(self.extra_stats())
        return extra

    # --- the end (the executor has released the request's cache rows) ---

    def complete(self, result: GenerationResult | None = None, notify: bool = True) -> None:
        """Finished: build the result (or take the executor's) and, unless the caller will later
        (`notify`), tell whoever waits."""
        self.state = State.FINISHED
        self.result = result if result is not None else self.out.finish(self.method, self.stats_dict())
        if notify:
            self.notify()

    def fail(self, error: BaseException) -> None:
        """Failed with `error`: a SpecwoodError's text is the user's message, anything else an
        internal error."""
        self.state = State.FINISHED
        self.error = (str(error) if isinstance(error, SpecwoodError)
                      else f"internal error: {type(error).__name__}: {error}")
        self.exception = error
        self.notify()

    def outcome(self) -> GenerationResult:
        """The finished request's result; its exception raised if it failed."""
        if self.exception is not None:
            raise self.exception
        if self.result is None:
            raise RuntimeError(f"request {self.id} has not finished")
        return self.result

    def notify(self) -> None:
        self.done.set()
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:  # noqa: BLE001 - a consumer's callback must not stop the executor
                pass
