"""The SD-vs-AR decision rule (seed paper 000, Eq. 7-8): pure functions, no model code.

    P_eff(x) = AAT(x) / (T_v(x) + T_d(x)),    P_AR = P(1) = 1 / T_v(1)

Per context bucket: if max_x P_eff(x) < P_AR, decode autoregressively; otherwise verify trees of
x* = argmax_x P_eff(x) tokens (x* - 1 drafted nodes, the shape's `budget`). Also the helpers that
evaluate measured timing rows: interpolation, a monotone fit, the nearest context bucket.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

MAX_X = 1025  # the engine's largest tree (MAX_BUDGET drafted nodes + root)


@dataclass
class Decision:
    method: str  # "ar" or "sd"
    x: int  # verification length to use (1 for AR)
    speedup: float  # max P_eff / P_AR (below 1 when AR wins)
    p_eff: float  # best SD effective performance, tokens/s
    p_ar: float  # 1 / T_v(1), tokens/s
    x_best_sd: int  # argmax of P_eff even when AR wins


def p_eff(x: int, t_v: Callable[[int], float], t_d: Callable[[int], float], aat: Callable[[int], float]) -> float:
    """Eq. 7: effective tokens per second when verifying x tokens per target forward."""
    return float(aat(x)) / (float(t_v(x)) + float(t_d(x)))


def decide(t_v: Callable[[int], float], t_d: Callable[[int], float], aat: Callable[[int], float],
           xs: Sequence[int], margin: float = 0.0, free: int = 0) -> Decision:
    """Eq. 8: SD only if some x >= 2 beats autoregressive decoding (by the fraction `margin`, for
    a model whose errors are known to be that large); then its argmax (the smallest x among equal
    maxima, which costs the least drafting).

    `free`: tokens of the grammar's forced run ahead of the tree's root, verified in the same
    forward and (canonical tokens of the forced text) taken as accepted: every option, the plain
    step included, pays for their rows and gains them, P(x) = (free + AAT(x)) / (T_v(free + x) + T_d(x))."""
    if free:
        t_v_tree, aat_tree = t_v, aat
        t_v = lambda x: float(t_v_tree(x + free))  # noqa: E731
        aat = lambda x: free + float(aat_tree(x))  # noqa: E731
    p_ar = (1.0 + free) / float(t_v(1))
    cands = sorted({int(x) for x in xs if int(x) >= 2})
    if not cands:
        return Decision("ar", 1, 0.0, 0.0, p_ar, 1)
    values = np.array([p_eff(x, t_v, t_d, aat) for x in cands])
    i = int(np.argmax(values))
    best = float(values[i])
    if best < p_ar * (1.0 + margin):
        return Decision("ar", 1, best / p_ar, best, p_ar, cands[i])
    return Decision("sd", cands[i], best / p_ar, best, p_ar, cands[i])


@dataclass
class ParallelProfile:
    """DuoDecoding measured on this machine (the planner's `parallel` stage): the draft worker
    and the target each on their share of the cores, timed while both run.

    An iteration costs max(gamma T_d, T_v,split(x_bar)) + comm: the draft drafts gamma tokens
    while the target verifies x_bar tokens (the pending chain + root; 1 after a miss), the two
    overlapping; comm is the measured rest (pipe messages, tree rebuilds, waiting; negative
    where the sides overlap better than max() assumes)."""

    gamma: float  # mean draft budget per iteration
    t_draft_token_s: float  # one draft token with the worker's threads, the target running
    target_slowdown: float  # T_v with the target's threads, the draft running / T_v with all threads
    verify_tokens: float  # mean x_bar: tokens the target verifies per iteration
    tokens_per_iteration: float  # emitted tokens per iteration
    comm_s: float  # per-iteration time outside the overlapped compute
    tokens_per_s: float  # measured decode throughput (what the model reproduces at its bucket)
    context: int  # the bucket it was measured at
    draft_threads: int = 1

    def iteration_s(self, t_v: Callable[[float], float]) -> float:
        overlapped = max(self.gamma * self.t_draft_token_s, self.target_slowdown * float(t_v(self.verify_tokens)))
        return max(overlapped + self.comm_s, 0.25 * overlapped)

    def p_parallel(self, t_v: Callable[[float], float]) -> float:
        """Tokens/s of parallel SD where the full-thread target costs t_v(x)."""
        return self.tokens_per_iteration / self.iteration_s(t_v)


def batch_share(t_v: Callable[[float], float], t_d: Callable[[float], float],
                batch: int, draft_rows: Callable[[float], float] | None = None, riding: int = 0
                ) -> tuple[Callable[[float], float], Callable[[float], float]]:
    """Per-request costs when `batch` requests share each step, each verifying x tokens: the
    target forward runs B*x tokens, T_v,B(x) = T_v(B x) / B, and the drafts of all requests are
    batched too, so a request's drafting shrinks as the draft's own forward grows with rows:
    T_d,B(x) = T_d(x) D(B) / (B D(1)), D(n) = one draft forward of n rows (`draft_rows`; without
    it the target's growth T_v(B) / (B T_v(1)) stands in, which under-prices a draft whose kernels
    change with rows, e.g. int4 weights up to 3 rows and bf16 above). With these, `decide`
    maximises the batch's throughput; AR's own share is T_v(B) / B. Wide trees stop paying as the
    batch alone fills the hardware (past the roofline's ridge).

    `riding` prompt tokens of newcomers in the same forward (their prefill chunks) make it
    compute-bound: the batch's decode step then costs what a forward of its own would cost with
    one token a request, T_v(B), plus the tree tokens' own compute above that,
    T_v(R + B x) - T_v(R + B) -- far more per token than below the roofline's ridge."""
    if batch <= 1 and not riding:
        return t_v, t_d
    rows = draft_rows or t_v
    growth = float(rows(batch)) / (batch * float(rows(1)))
    shared_d = lambda x: float(t_d(x)) * growth  # noqa: E731
    if not riding:
        return (lambda x: float(t_v(batch * x)) / batch), shared_d
    own, start = float(t_v(batch)), float(t_v(riding + batch))
    return (lambda x: (own + float(t_v(riding + batch * x)) - start) / batch), shared_d


def interpolate(row: dict[int, float], x: float) -> float:
    """Piecewise-linear T(x) through measured points; linear extrapolation past either end."""
    xs = sorted(row)  # a row is a few keys, mostly in order already
    if len(xs) == 1:
        return float(row[xs[0]])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # xs[i - 1] < x <= xs[i] inside the range
    lo, hi = xs[i - 1], xs[i]
    if hi == x:
        return float(row[hi])
    slope = (row[hi] - row[lo]) / (hi - lo)
    return max(0.0, float(row[lo] + slope * (x - lo)))


def monotone(row: dict[int, float]) -> dict[int, float]:
    """The non-decreasing least-squares fit to T(x) (pool adjacent violators): a forward over
    more tokens never takes less time, so a dip is timing noise and must not attract argmax."""
    xs = sorted(row)
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([row[x], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(xs, values))


def nearest_context(contexts: Sequence[int], ctx: float) -> int:
    """The bucket closest to ctx on a log scale (contexts grow geometrically); the smaller of two
    equally close ones."""
    cs, bounds = _log_midpoints(tuple(contexts))
    return cs[bisect.bisect_left(bounds, max(ctx, 1))]


@functools.lru_cache(maxsize=64)
def _log_midpoints(contexts: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The contexts sorted, and between each two the point equally far from both on a log scale."""
    cs = sorted(set(contexts))
    return cs, [math.sqrt(max(a, 1) * max(b, 1)) for a, b in zip(cs, cs[1:])]
