"""PNG plots of a plan (matplotlib, Agg backend): roofline, AAT fit, P_eff per context bucket."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specwood.planner.store import Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_roofline(plan: Plan, path: Path) -> Path:
    """P(x) = x / T_v(x) per context: measured points and the fitted piecewise roofline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ctx, row) in enumerate(sorted(plan.verify_times.items())):
        color = colors[i % len(colors)]
        xs = np.array(sorted(row), dtype=float)
        ax.plot(xs, xs / np.array([row[int(x)] for x in xs]), "o", ms=3, color=color, label=f"ctx {ctx}")
        fit = plan.rooflines.get(ctx)
        if fit is not None:
            grid = np.linspace(xs.min(), xs.max(), 400)
            ridge = "none in range" if not np.isfinite(fit.x_ridge) else f"{fit.x_ridge:.1f}"
            ax.plot(grid, fit(grid), "-", lw=1, color=color,
                    label=f"fit: x_R {ridge}, rel.err {fit.rel_error:.1%}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("verification length x (tokens per target forward)")
    ax.set_ylabel("P(x) = x / T_v(x)  [input tokens/s]")
    ax.set_title(f"primary roofline — {plan.key.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_aat(plan: Plan, path: Path) -> Path:
    """Measured AAT(x) and the fitted A + B ln(x - C)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    hi = max([*plan.aat_points, *(max(r) for r in plan.verify_times.values() if r), 8])
    grid = np.linspace(max(1.0, plan.aat.C + 1e-3), hi, 400)
    curves = [(f"ctx {c}", f, plan.aat_points_by_context.get(c, {})) for c, f in sorted(plan.aat_by_context.items())]
    curves = curves or [("", plan.aat, plan.aat_points)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, fit, pts) in enumerate(curves):
        color = colors[i % len(colors)]
        r2 = "n/a" if not np.isfinite(fit.r2) else f"{fit.r2:.3f}"
        g = grid[grid > fit.C]
        ax.plot(g, fit(g), "-", color=color,
                label=f"{label} fit {fit.A:.2f} + {fit.B:.2f} ln(x - {fit.C:.2f}), R² {r2}".strip())
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], "o", color=color, label=f"{label} measured".strip())
    ax.set_xlabel("verification length x")
    ax.set_ylabel("AAT(x)  [tokens per target forward]")
    ax.set_title(f"AAT — {plan.key.method}, {Path(plan.key.target).name} / {Path(plan.key.draft).name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_peff(plan: Plan, path: Path) -> Path:
    """P_eff(x) per context bucket with P_AR (dashed) and the chosen x marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    choices = {c.context: c for c in plan.choices}
    for i, ctx in enumerate(plan.contexts):
        color = colors[i % len(colors)]
        xs, ps = plan.p_eff_curve(ctx)
        if not xs:
            continue
        ax.plot(xs, ps, "-", color=color, label=f"ctx {ctx}")
        choice = choices.get(ctx)
        if choice is not None:
            ax.axhline(choice.p_ar, ls="--", lw=0.8, color=color)
            xb = choice.x_best_sd
            pb = ps[xs.index(xb)] if xb in xs else choice.p_eff
            marker = "*" if choice.method != "ar" else "x"
            ax.plot([xb], [pb], marker, ms=11, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verification length x")
    ax.set_ylabel("P_eff(x) = AAT / (T_v + T_d)  [tokens/s]")
    ax.set_title("effective performance (dashed: autoregressive; * chosen, x: AR wins)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_plan(plan: Plan, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_roofline(plan, out_dir / "roofline.png"), plot_aat(plan, out_dir / "aat.png"),
            plot_peff(plan, out_dir / "p_eff.png")]


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
