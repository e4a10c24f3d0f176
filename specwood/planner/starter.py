"""Plans made without `specwood plan`'s full measurement: the starter plan `auto` follows until a
measured one is stored (T_v and T_d timed at start, on our runtime or a llama.cpp target) and the timed plan
(T_v and T_d timed here, a stored or default AAT curve) that specwood.planner.configs also uses.
"""
from __future__ import annotations

import datetime
from typing import Sequence

from specwood.engine.backends import LlamaCppTarget
from specwood.engine.protocols import EngineLike
from specwood.errors import SpecwoodError
from specwood.models.llamacpp import LlamaCppModel
from specwood.planner.analytic import stored_aat
from specwood.planner.fits import DEFAULT_AAT
from specwood.planner.profiler import measure_draft_times, median_time, random_tree
from specwood.planner.store import Plan, PlanKey, plan_key_for


def starter_plan(engine: EngineLike, method: str) -> Plan:
    """A plan that needs no calibration, for a device without a measured one: T_v(x) and T_d(x)
    timed here at start (seconds; `torch_starter_plan`, `runner_starter_plan` on llama.cpp) with
    the stored or default AAT curve, once per process and models. Each request still adapts AAT
    to what it sees. The analytic model of the hardware (planner/analytic.py) is not used for
    this: on the 2-core CPU it put T_v(48) at 1.03 T_v(1) where the q4 kernels measured 8.8
    (BENCHMARKS.md §18b), so `auto` verified trees that cost more than they gave."""
    key = plan_key_for(engine, method)
    if key not in _STARTER_PLANS:
        runner = getattr(engine.target, "runner", None) is not None
        _STARTER_PLANS[key] = runner_starter_plan(engine, method) if runner else torch_starter_plan(engine, method)
    return _STARTER_PLANS[key]


def starter_plan_ready(engine: EngineLike, method: str) -> bool:
    """Whether this process has timed the starter plan for these models already."""
    return plan_key_for(engine, method) in _STARTER_PLANS


TORCH_XS = (1, 2, 4, 8, 16, 32, 48)  # 48: the largest suffix proposal auto weighs, plus the root
TORCH_CONTEXTS = (128, 1024)
TORCH_X_CAP = 16  # the model's trees; the suffix source may add more nodes where T_v(x) says they pay
# On AMX tiles T_v(x) is nearly flat to 32-64 rows (issue 39's measurements of bf16 on AMX), so the
# grid reaches further and the model's trees may be wider; the timing still decides what pays.
AMX_XS = TORCH_XS + (64,)
AMX_X_CAP = 32


def starter_grid() -> tuple[tuple[int, ...], int]:
    """The x values the starter plan times and the model tree's node cap, for this process's linears."""
    from specwood.models.amx import decided_tile_path

    return (AMX_XS, AMX_X_CAP) if decided_tile_path() is not None else (TORCH_XS, TORCH_X_CAP)


def torch_starter_plan(engine: EngineLike, method: str, repeats: int = 3) -> Plan:
    """A starter plan for a target on our torch runtime: T_v(x, ctx) timed on the target at two
    contexts, T_d(x) with the method's real drafting, the draft's prefill per token, AAT(x) from a
    stored plan of the pair or the default curve (`timed_plan`). About 15 s for the default pair
    on a 2-core CPU."""
    from specwood.models.amx import decided_tile_path
    from specwood.models.transformer import Transformer
    from specwood.planner.build import measure_draft_prefill_lengths
    from specwood.planner.profiler import measure_verify_times

    tiles = decided_tile_path()
    grid, x_cap = starter_grid()
    positions = min(int(engine.target.max_positions), int(engine.max_context))
    xs = [x for x in grid if x < positions // 2] or [1, 2]
    contexts = [c for c in TORCH_CONTEXTS if c + max(xs) < positions] or [max(1, positions - max(xs) - 1)]
    tv = measure_verify_times(engine.target, xs, contexts, repeats, refine=False, progress=False)
    draft_xs = [x for x in xs if x <= x_cap]
    td = ({c: {x: 0.0 for x in draft_xs} for c in tv} if engine.draft_model is None else
          measure_draft_times(engine, [method], xs=draft_xs, contexts=(min(tv),), repeats=repeats,
                              progress=False)[method])
    prefill = measure_draft_prefill_lengths(engine) if isinstance(engine.draft_model, Transformer) else {}
    plan = timed_plan(engine, method, tv, td, draft_prefill_s=prefill[min(prefill)] if prefill else 0.0,
                      note="starter plan: T_v and T_d timed at start"
                      + (f" with {tiles.name} from {tiles.min_rows} rows" if tiles is not None else ""))
    plan.draft_prefill_by_length = prefill
    plan.x_cap = x_cap
    plan.source = "starter"
    return plan.refresh()


def describe_starter_plan(plan: Plan) -> str:
    """One line: what the starter plan timed and what it chose at each context, so a user (and a
    benchmark's log) sees why `auto` drafts or decodes plainly on this machine."""
    ctx = min(plan.contexts)
    times = ", ".join(f"T_v({x}) {plan.t_v(ctx, x) * 1e3:.1f}" for x in (1, 2, 4, 8) if x in plan.verify_times[ctx])
    draft = ", ".join(f"T_d({x}) {plan.t_d(ctx, x) * 1e3:.1f}" for x in (2, 4) if plan.draft_times)
    choices = "; ".join(f"at {c.context}: " + ("plain" if c.method == "ar" else f"{c.method} x = {c.x}")
                        + f" ({max(c.p_eff, c.p_ar):.1f} tok/s, plain {c.p_ar:.1f})" for c in plan.choices)
    return f"starter plan, ms at context {ctx}: {times}" + (f", {draft}" if draft else "") + f" -- {choices}"


RUNNER_XS = (1, 2, 4, 8, 16)
_STARTER_PLANS: dict[PlanKey, Plan] = {}


def runner_starter_plan(engine: EngineLike, method: str, ctx: int = 128, repeats: int = 3) -> Plan:
    """A starter plan for a target on llama.cpp, where no analytic model of our
    own runtime applies: T_v(x) timed on the target's runner (one tree forward of x tokens after
    `ctx` tokens), T_d(x) timed with the method's real drafting, AAT(x) from a stored plan of the
    pair or the default curve. A few seconds at start; if even this says speculation cannot pay
    (llama.cpp's batch evaluation on a CPU can cost nearly one step per token), auto decodes
    plainly and says so."""
    tv = runner_verify_times(engine, RUNNER_XS, (ctx,), repeats)
    td = ({ctx: {x: 0.0 for x in RUNNER_XS}} if engine.draft_model is None else
          measure_draft_times(engine, [method], xs=RUNNER_XS, contexts=(ctx,), repeats=repeats, progress=False)[method])
    plan = timed_plan(engine, method, tv, td, draft_prefill_s=0.0,
                      note="starter plan for a runner-backed target: T_v and T_d timed at start")
    plan.x_cap = max(RUNNER_XS)
    plan.source = "starter"
    return plan.refresh()


def timed_plan(engine: EngineLike, method: str, verify_times: dict[int, dict[int, float]],
               draft_times: dict[int, dict[int, float]], *, draft_prefill_s: float | None,
               draft_row_times: dict[int, float] | None = None, note: str) -> Plan:
    """A plan from T_v and T_d timed here, with the AAT(x) of the pair's measured plan (any
    device, any weight mode) or the default curve: what a short timing can say without the
    minutes of calibration decoding `specwood plan` spends on AAT. `note` says who timed it."""
    found = stored_aat(str(engine.target_name), str(engine.draft_name or "none"), method)
    plan = Plan(key=plan_key_for(engine, method), contexts=sorted(verify_times), verify_times=verify_times,
                draft_times=draft_times, aat=found[0] if found else DEFAULT_AAT, draft_prefill_s=draft_prefill_s,
                draft_row_times=dict(draft_row_times or {}), mode="timed",
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                notes=[f"{note}; " + (found[1] if found else "default AAT curve")])
    return plan.refresh()


def runner_verify_times(engine: EngineLike, xs: Sequence[int], contexts: Sequence[int],
                        repeats: int = 3) -> dict[int, dict[int, float]]:
    """T_v(x, ctx) of a llama.cpp target: one tree forward of x tokens after ctx random tokens, on
    a context of its own over the loaded weights (a request may be decoding on the serving one)."""
    import torch

    target = engine.target
    if not isinstance(target, LlamaCppTarget):
        raise SpecwoodError("runner_verify_times measures a llama.cpp target (--backend llama.cpp)")
    serving = target.runner
    vocab = engine.target_config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[int, dict[int, float]] = {}
    for ctx in contexts:
        runner = LlamaCppModel(serving.loaded.path, n_ctx=ctx + max(xs) + 8, n_seq_max=max(xs),
                               vocab_size=vocab, weights=serving.loaded)
        runner.prefill(torch.randint(0, vocab, (ctx,), generator=g).tolist())
        out[ctx] = {}
        for x in xs:
            tree = random_tree(x, g, vocab)

            def forward() -> None:
                runner.forward_tree(tree)
                runner.rollback(ctx)

            out[ctx][x] = median_time(forward, repeats, warmup=1)
        runner.close()
    return out
