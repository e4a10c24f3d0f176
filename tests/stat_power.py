"""Power of the G-tests (docs/testing.md): from a biased run's p-value at n samples, the
noncentrality each sample adds, then the p-value to expect and the smallest bias caught with
99% power (p < P_BIASED) at another sample count.

A G statistic under a fixed alternative is ~ noncentral chi-square(df, lam) with lam = 2 n KL, so
lam grows linearly in n; for a small acceptance bias e the output law moves by O(e), so lam grows
as e^2. The observed G = chi2.isf(p, df) estimates df + lam (one run: a rough estimate, the
margins below are orders of magnitude, not percents).

    python tests/stat_power.py P_OBSERVED N_OBSERVED DF BIAS N_NEW [N_NEW ...]
"""
from __future__ import annotations

import sys

from scipy import optimize, stats

P_BIASED = 1e-6


def per_sample_noncentrality(p: float, n: int, df: int) -> float:
    return max(stats.chi2.isf(p, df) - df, 0.0) / n


def expected_p(lam1: float, n: int, df: int) -> float:
    """The p-value of a run whose G is its mean df + lam (the median run's, roughly)."""
    return float(stats.chi2.sf(df + lam1 * n, df))


def power(lam1: float, n: int, df: int, threshold: float = P_BIASED) -> float:
    return float(stats.ncx2.sf(stats.chi2.isf(threshold, df), df, lam1 * n))


def smallest_bias(lam1: float, n: int, df: int, bias: float, want: float = 0.99) -> float:
    """The acceptance bias caught (p < P_BIASED) with probability `want` at n samples."""
    crit = stats.chi2.isf(P_BIASED, df)
    lam = optimize.brentq(lambda x: stats.ncx2.sf(crit, df, x) - want, 1e-6, 1e7)
    return bias * (lam / (lam1 * n)) ** 0.5


if __name__ == "__main__":
    p, n, df, bias = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    lam1 = per_sample_noncentrality(p, n, df)
    for n_new in [n] + [int(x) for x in sys.argv[5:]]:
        caught = smallest_bias(lam1, n_new, df, bias)
        print(f"n={n_new}: expected p {expected_p(lam1, n_new, df):.2g}, power at +{bias} "
              f"{power(lam1, n_new, df):.6f}, smallest bias caught (99% power) {caught:.4f}")
