"""One decision for the requests that share a step (issue 58): whether the batch drafts, and with
what tree, from the batch's step cost with and without drafting.

Each request alone weighs its tree against its own plain step. In a shared step that is the wrong
question: the batch's forward grows with every request's tree, and the batch's drafts run as
one draft forward per level, so what one request's tree costs depends on the others'. The
shapes of one prepared `auto` share a `BatchChoice`; the first of them asked before a step
decides for all: over the requests of the step before (those still running) and itself, the
tree x that maximises the batch's expected tokens per second,

    (sum of the drafting requests' AAT(x) + one token per request without a draft)
    / (T_v(rows of the batch at x) + the drafting requests' share of the draft rounds),

against plain decoding's B / T_v(B), by BATCH_MARGIN as before. The costs are the server's
measured ones (OnlineCosts); each request's AAT is its own (its AcceptanceTracker). Where the
batch decodes plainly its `Probes` drafts the best tree now and then, so the batch finds out when
drafting starts to pay. Every later request asked before the same step gets the same answer.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from specwood.planner.decision import Decision, decide
from specwood.planner.online import OnlineCosts
from specwood.planner.probes import Probes
from specwood.planner.store import BATCH_MARGIN


class Member(Protocol):
    """What a BatchChoice asks of a request's policy (PlannedShape)."""

    model: bool

    def request_aat(self, context_len: int) -> Callable[[float], float]: ...


class BatchChoice:
    """The batch's tree size per step (module docstring). `probes`: None, never probe."""

    def __init__(self, probes: Probes | None = None):
        self.probes = probes
        self._asked: dict[Any, int] = {}  # member -> its context, this step
        self._before: dict[Any, int] = {}  # the step before's
        self._key: tuple[int, int] | None = None
        self._x = 1
        self.decision: Decision | None = None  # the last one made, for tests and stats

    def forget(self, member: Any) -> None:
        """A request ended."""
        self._asked.pop(member, None)
        self._before.pop(member, None)

    def x_for(self, member: Member, context_len: int, batch: int, riding: int, costs: OnlineCosts,
              draft_scale: float) -> int:
        """The tree size (1: plain) for `member` in a step of `batch` requests with `riding`
        prefill tokens in its forward."""
        if member in self._asked or self._key != (batch, riding):  # a new step
            self._before, self._asked = self._asked, {}
            self._key = None
        self._asked[member] = context_len
        if self._key is None:
            self._key = (batch, riding)
            self._x = self._decide(member, context_len, batch, riding, costs, draft_scale)
        return self._x if member.model else 1

    def _decide(self, member: Member, context_len: int, batch: int, riding: int, costs: OnlineCosts,
                draft_scale: float) -> int:
        others = [(m, c) for m, c in self._before.items() if m is not member][:max(0, batch - 1)]
        members = [(member, context_len), *others]
        drafting = [(m, c) for m, c in members if m.model]
        if not drafting:
            self.decision = None
            return 1
        n = len(members)
        ctx = sum(c for _, c in members) / n
        curves = [m.request_aat(c) for m, c in drafting]
        share = len(drafting) / n  # of the batch's requests, those with a draft

        def aat(x: float) -> float:
            return (sum(float(curve(x)) for curve in curves) + (n - len(drafting))) / n

        def rows(x: float) -> float:
            return batch * (share * x + (1.0 - share))

        whole = lambda r: costs.t_v(ctx, r, batch)  # noqa: E731
        if riding:
            own, start = whole(batch), whole(riding + batch)
            t_v = lambda x: (own + whole(riding + rows(x)) - start) / batch  # noqa: E731
        else:
            t_v = lambda x: whole(rows(x)) / batch  # noqa: E731
        t_d = lambda x: share * draft_scale * costs.t_d_share(ctx, x, batch)  # noqa: E731
        d = self.decision = decide(t_v, t_d, aat, costs.plan.candidate_xs(int(ctx)), margin=BATCH_MARGIN)
        if self.probes is not None and d.x_best_sd >= 2 and self.probes.step(d.method == "sd"):
            return d.x_best_sd
        return d.x if d.method == "sd" else 1
