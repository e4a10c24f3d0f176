"""The two curve fits of the roofline planner (seed paper 000, Eq. 1 and Eq. 3).

* Primary roofline: P(x) = x / T_v(x), the target's throughput of *input* tokens when it verifies
  x tokens in one forward, is modelled as a x + b below the ridge x_R and P_max above it.
* AAT(x) = A + B ln(x - C): average accepted tokens per target forward (bonus token included)
  as a function of the verification length x.

Both fits are plain least squares with numpy only (scipy is a test extra, not a runtime
dependency). The roofline uses *relative* residuals, because P spans two or three orders of
magnitude between x = 1 and x = 128 and the x = 1 point (autoregressive decoding) matters most.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence, overload

import numpy as np


# ---------------------------------------------------------------------------------------------
# primary roofline


@dataclass
class RooflineFit:
    """P(x) = a x + b for x < x_ridge, p_max for x >= x_ridge (tokens/s of input tokens).

    x_ridge = inf means no compute roof was seen in the measured range (memory-bound throughout);
    x_ridge <= min x means compute-bound everywhere (P is flat, Eq. 9's degenerate case).
    """

    a: float
    b: float
    x_ridge: float
    p_max: float
    rel_error: float  # RMS relative residual over the measured points
    max_rel_error: float = 0.0

    @overload
    def __call__(self, x: float) -> float: ...
    @overload
    def __call__(self, x: np.ndarray) -> np.ndarray: ...

    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:
        x_arr = np.asarray(x, dtype=np.float64)
        out = np.where(x_arr < self.x_ridge, self.a * x_arr + self.b, self.p_max)
        return float(out) if np.ndim(out) == 0 else out

    def t_v(self, x: float | np.ndarray) -> float | np.ndarray:
        """Verification time implied by the fit: T_v(x) = x / P(x)."""
        return np.asarray(x, dtype=np.float64) / self(x)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["x_ridge"] = None if math.isinf(self.x_ridge) else self.x_ridge  # JSON has no inf
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RooflineFit":
        d = dict(d)
        d["x_ridge"] = math.inf if d.get("x_ridge") is None else float(d["x_ridge"])
        return cls(**d)


def _weighted_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """a, b minimising sum(((a x + b) / y - 1)^2): least squares on relative residuals."""
    w = 1.0 / y
    design = np.stack([x * w, w], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    return float(a), float(b)


def _weighted_const(y: np.ndarray) -> float:
    """c minimising sum((c / y - 1)^2)."""
    return float(np.sum(1.0 / y) / np.sum(1.0 / y**2))


def fit_roofline(xs: Sequence[float], times: Sequence[float] | None = None,
                 throughputs: Sequence[float] | None = None) -> RooflineFit:
    """Fit Eq. 1 to measured points: give T_v(x) in seconds (`times`) or P(x) (`throughputs`).

    Every split of the sorted points into a linear left part (>= 2 points, or none) and a flat
    right part is tried; the split with the smallest relative SSE wins. The ridge is then placed
    where the line meets P_max when that lies between the two points of the split (the roofline
    is continuous), else at the first flat point.
    """
    x = np.asarray(xs, dtype=np.float64)
    if throughputs is None:
        if times is None:
            raise ValueError("give times or throughputs")
        p = x / np.asarray(times, dtype=np.float64)
    else:
        p = np.asarray(throughputs, dtype=np.float64)
    if x.shape != p.shape or x.size < 2:
        raise ValueError("need at least two (x, value) points of equal count")
    if not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError("throughputs must be positive and finite")
    order = np.argsort(x)
    x, p = x[order], p[order]
    n = x.size
    cands: list[tuple[float, int, int, float, float, float]] = []  # (sse, params, k, a, b, pmax)
    for k in [0] + list(range(2, n + 1)):  # k = number of points on the linear part
        a = b = 0.0
        sse = 0.0
        if k:
            a, b = _weighted_line(x[:k], p[:k])
            sse += float(np.sum(((a * x[:k] + b) / p[:k] - 1.0) ** 2))
        pmax = _weighted_const(p[k:]) if k < n else math.inf
        if k < n:
            sse += float(np.sum((pmax / p[k:] - 1.0) ** 2))
        params = 1 if k == 0 else 2 if k == n else 3
        cands.append((sse, params, k, a, b, pmax))
    # Occam: a one-segment model within 5 % of the best SSE wins over a two-segment one
    # (exact data would otherwise put a "ridge" at the last point of a straight line)
    floor = min(c[0] for c in cands) * 1.05 + 1e-20
    best = min((c for c in cands if c[0] <= floor), key=lambda c: (c[1], c[0]))
    _, _, k, a, b, pmax = best
    if k == 0:  # flat: compute-bound everywhere
        fit = RooflineFit(a=0.0, b=pmax, x_ridge=float(x[0]), p_max=pmax, rel_error=0.0)
    elif k == n:  # no roof in range: memory-bound everywhere
        fit = RooflineFit(a=a, b=b, x_ridge=math.inf, p_max=a * x[-1] + b, rel_error=0.0)
    else:
        ridge = float(x[k])
        if a > 0:
            cross = (pmax - b) / a
            if x[k - 1] <= cross <= x[k]:
                ridge = cross
        fit = RooflineFit(a=a, b=b, x_ridge=ridge, p_max=pmax, rel_error=0.0)
    rel = np.asarray(fit(x)) / p - 1.0
    fit.rel_error = float(np.sqrt(np.mean(rel**2)))
    fit.max_rel_error = float(np.max(np.abs(rel)))
    return fit


# ---------------------------------------------------------------------------------------------
# AAT(x) = A + B ln(x - C)


@dataclass
class AATFit:
    A: float
    B: float
    C: float
    r2: float = 1.0
    n_points: int = 0

    @overload
    def __call__(self, x: float) -> float: ...
    @overload
    def __call__(self, x: np.ndarray) -> np.ndarray: ...

    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:
        """The model, clipped to the physical range 1 <= AAT(x) <= x (Eq. 4: never more tokens
        accepted than verified, and a step always yields at least the bonus/correction token)."""
        x_arr = np.asarray(x, dtype=np.float64)
        raw = self.A + self.B * np.log(np.maximum(x_arr - self.C, 1e-12))
        out = np.clip(raw, 1.0, np.maximum(x_arr, 1.0))
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["r2"] = None if math.isnan(self.r2) else self.r2  # strict JSON has no NaN
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AATFit":
        r2 = d.get("r2")
        return cls(float(d["A"]), float(d["B"]), float(d["C"]), float("nan") if r2 is None else float(r2),
                   int(d.get("n_points", 0)))


# A typical curve for a small same-family draft with a tree shape, used when nothing was
# measured: AAT(2) ~ 1.7, AAT(16) ~ 3.2, AAT(64) ~ 4.2 -- in the range the paper reports for
# LongSpec/EAGLE-3 (Table I's best set of 13 nodes gives ~2.5x on a memory-bound board).
DEFAULT_AAT = AATFit(A=1.2, B=0.72, C=0.0, r2=float("nan"), n_points=0)


def _ab_for(c: float, x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Linear least squares for A, B at a fixed C; returns (A, B, SSE)."""
    z = np.log(x - c)
    design = np.stack([np.ones_like(z), z], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    sse = float(np.sum((a + b * z - y) ** 2))
    return float(a), float(b), sse


def fit_aat(xs: Sequence[float], aats: Sequence[float], c_span: float = 10.0) -> AATFit:
    """Fit AAT(x) = A + B ln(x - C) with C < min(x).

    C enters non-linearly, A and B linearly: for every C on a log-spaced grid of offsets
    d = min(x) - C in [1e-4, c_span * max(x)] we solve A, B by linear least squares, then refine
    the best d by golden-section search on log d. Two points give an exact fit with C pinned at
    min(x) - 1 (the data cannot determine C).
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(aats, dtype=np.float64)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("need at least two (x, AAT) points of equal count")
    if len(np.unique(x)) < 2:
        raise ValueError("need at least two distinct x values")
    x0 = float(x.min())
    if len(np.unique(x)) == 2:
        c = x0 - 1.0
        a, b, sse = _ab_for(c, x, y)
        return AATFit(a, b, c, r2=_r2(y, sse), n_points=int(x.size))

    def sse_at(log_d: float) -> float:
        return _ab_for(x0 - math.exp(log_d), x, y)[2]

    lo, hi = math.log(1e-4), math.log(c_span * max(float(x.max()), 1.0))
    grid = np.linspace(lo, hi, 200)
    errs = np.array([sse_at(g) for g in grid])
    i = int(np.argmin(errs))
    a_, b_ = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    # golden-section refinement inside the bracket around the grid minimum
    phi = (math.sqrt(5) - 1) / 2
    c1, c2 = b_ - phi * (b_ - a_), a_ + phi * (b_ - a_)
    f1, f2 = sse_at(c1), sse_at(c2)
    for _ in range(60):
        if f1 < f2:
            b_, c2, f2 = c2, c1, f1
            c1 = b_ - phi * (b_ - a_)
            f1 = sse_at(c1)
        else:
            a_, c1, f1 = c1, c2, f2
            c2 = a_ + phi * (b_ - a_)
            f2 = sse_at(c2)
    log_d = c1 if f1 < f2 else c2
    if errs[i] < min(f1, f2):
        log_d = float(grid[i])
    c = x0 - math.exp(log_d)
    a, b, sse = _ab_for(c, x, y)
    return AATFit(a, b, c, r2=_r2(y, sse), n_points=int(x.size))


def _r2(y: np.ndarray, sse: float) -> float:
    sst = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - sse / sst if sst > 0 else (1.0 if sse < 1e-12 else 0.0)
