"""Building a plan on the engine's own device: measure T_v, T_d and AAT(x), fit, decide per
context bucket (build_plan), and the stored-or-built plan for an engine (get_plan).
"""
from __future__ import annotations

import datetime as _dt
import math
import sys
import time
from typing import Any, Callable, Sequence

import torch

from specwood.engine.protocols import EngineLike
from specwood.errors import SpecwoodError
from specwood.planner.calibration import CALIBRATION_PROMPTS, calibration_set, encode_prompts
from specwood.planner.decision import MAX_X, ParallelProfile
from specwood.planner.fits import DEFAULT_AAT, AATFit, fit_aat
from specwood.planner.pauses import undisturbed
from specwood.planner.prior_tree import PriorScores
from specwood.planner.store import DEFAULT_METHOD, Plan, load_plan, plan_key_for, save_if_quiet


def method_factory(engine: EngineLike, method: str,
                   prior: PriorScores | None = None) -> Callable[[int], tuple[Any, Any]]:
    """budget -> (source, shape) for a method name, or for "prior" from the prior scores. The
    source is created once and shared (its cache is reused across builds)."""
    from specwood.planner.profiler import method_components
    from specwood.planner.prior_tree import prior_shape

    state: dict[str, Any] = {}

    def make(budget: int) -> tuple[Any, Any]:
        if method == "prior":
            if prior is None:
                raise SpecwoodError("method 'prior' needs prior scores (run `specwood plan --method prior`)")
            src, shape = method_components(engine, lambda b: prior_shape(prior.best_layout(b)), budget)
        else:
            src, shape = method_components(engine, method, budget)
        state.setdefault("source", src)
        return state["source"], shape

    return make


def measure_aat(engine: EngineLike, make: Callable[[int], tuple[Any, Any]], xs: Sequence[int],
                prompts_ids: Sequence[Sequence[int]], max_tokens: int,
                progress: bool = True, label: str = "") -> dict[int, dict[str, float]]:
    """AAT(x) on the calibration prompts for each verification length x (budget x - 1), plus the
    per-step draft and verify seconds seen while decoding."""
    from specwood.planner.profiler import _progress, run_speculative

    out: dict[int, dict[str, float]] = {}
    with _progress(len(xs), f"calibrating AAT(x) {label}".strip(), progress) as bar:
        for x in xs:
            source, shape = make(int(x) - 1)
            # greedy, so a run taken again after a pause accepts the same; only its times change
            stats = undisturbed(lambda: run_speculative(engine, source, shape, prompts_ids, max_tokens))
            s = stats.as_dict()
            steps = max(stats.steps, 1)
            out[int(x)] = {"aat": float(s["mean_accepted_tokens"]), "steps": float(stats.steps),
                           "draft_s": stats.draft_s / steps, "verify_s": stats.verify_s / steps,
                           "mean_tree_nodes": float(s["mean_tree_nodes"])}
            bar.set_postfix(x=x, aat=f"{out[int(x)]['aat']:.2f}")
            bar.update(1)
    return out


def measure_draft_prefill(engine: EngineLike, n_tokens: int = 512, repeats: int = 2) -> float | None:
    """Seconds per prompt token of the draft model's prefill (None without a draft model)."""
    timed = _draft_prefill_at(engine, n_tokens, repeats)
    return None if timed is None else timed[1]


PREFILL_LENGTHS = (512, 2048)  # where the draft's prefill is timed: its growth with the prompt's length


def measure_draft_prefill_lengths(engine: EngineLike, lengths: Sequence[int] = PREFILL_LENGTHS,
                                  repeats: int = 2) -> dict[int, float]:
    """Seconds per prompt token of the draft's prefill at each length the context allows: a
    token's attention reads every earlier one, so per token a 4k-token prompt costs ~1.4x a
    512-token one on the default draft (BENCHMARKS §35). Empty without a draft model."""
    out: dict[int, float] = {}
    for n in lengths:
        timed = _draft_prefill_at(engine, n, repeats if n == lengths[0] else 1)
        if timed is not None and timed[0] not in out:
            out[timed[0]] = timed[1]
    return out


def _draft_prefill_at(engine: EngineLike, n_tokens: int, repeats: int) -> tuple[int, float] | None:
    """(prompt tokens timed, seconds per token) of the draft's prefill of about n_tokens tokens."""
    from specwood.drafting.model_source import ModelDraftSource

    if engine.draft_model is None:
        return None
    n = max(8, min(n_tokens, engine.max_context // 2))
    ids = calibration_set(engine, n, 1) or encode_prompts(engine, CALIBRATION_PROMPTS[:1])
    source = ModelDraftSource(engine.draft_model)
    with torch.inference_mode():
        source.start(ids[0][:16])  # allocate the cache, warm the kernels
        best = math.inf
        for _ in range(repeats):
            best = min(best, undisturbed(lambda: _seconds(lambda: source.start(ids[0]))))
    return len(ids[0]), best / len(ids[0])


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


DRAFT_ROWS = (1, 2, 3, 4, 8, 16)


def measure_draft_rows(engine: EngineLike, ctx: int = 128, repeats: int = 5) -> dict[int, float]:
    """Seconds of one draft-model forward of n rows after ctx cached tokens, for n in DRAFT_ROWS:
    how a batch's draft round grows with the requests in it (batch_share). Empty for a draft
    that is not a torch model (llama.cpp drafts run a context per request, unbatched)."""
    from specwood.models.transformer import Transformer
    from specwood.planner.profiler import measure_verify_times

    draft = engine.draft_model
    if not isinstance(draft, Transformer):
        return {}
    ctx = min(ctx, max(1, draft.max_positions - max(DRAFT_ROWS) - 1))
    times = measure_verify_times(draft, DRAFT_ROWS, (ctx,), repeats, refine=False, progress=False)
    return dict(next(iter(times.values()), {}))


def measure_parallel(engine: EngineLike, plan: Plan, prompts_ids: Sequence[Sequence[int]], max_tokens: int,
                     progress: bool = True) -> ParallelProfile | None:
    """DuoDecoding (specwood.engine.parallel) decoding the calibration prompts greedily, with its
    own hardware-aware budget: the per-iteration yield and the split-core step times the plan's
    executor choice rests on (None without a draft model)."""
    from specwood.engine.parallel import CALIBRATION_CONTEXT, CALIBRATION_REPS, ParallelExecutor
    from specwood.engine.parallel_worker import time_forward

    if engine.draft_model is None or not prompts_ids:
        return None
    if progress:
        print("[plan] parallel executor (DuoDecoding): starting the draft worker and decoding the calibration "
              "prompts", file=sys.stderr)
    ctx = max(1, min(CALIBRATION_CONTEXT, engine.max_context - 2))
    # all threads, nothing beside it
    t_full = undisturbed(lambda: time_forward(engine.target, ctx, CALIBRATION_REPS))
    with ParallelExecutor(engine, verbose=False) as ex:
        ex.start()
        slowdown = (ex._t_target or t_full) / t_full
        iterations = emitted = steps = verified = 0
        decode_s = gamma = t_draft = 0.0
        for ids in prompts_ids:
            res = undisturbed(lambda: ex.generate(list(ids), max_tokens=max_tokens))
            st = res.stats
            n = len(res.token_ids) - 1
            if n < 1 or not st.get("iterations"):
                continue
            iterations += st["iterations"]
            emitted += n
            decode_s += n / st["tokens_per_s"]
            steps += st["spec_steps"]
            verified += st["spec_steps"] * (st["mean_tree_nodes"] + 1)
            gamma += st["gamma_mean"] * st["iterations"]
            t_draft += (st["draft_token_s"] or ex._t_draft or 0.0) * st["iterations"]
    if not iterations:
        return None
    prompt_ctx = int(sum(len(i) for i in prompts_ids) / len(prompts_ids))
    profile = ParallelProfile(gamma=gamma / iterations, t_draft_token_s=t_draft / iterations, target_slowdown=slowdown,
                              verify_tokens=verified / max(steps, 1), tokens_per_iteration=emitted / iterations,
                              comm_s=0.0, tokens_per_s=emitted / decode_s, context=prompt_ctx,
                              draft_threads=ex.draft_threads)
    # what the overlapped compute does not explain (messages, tree rebuilds, waiting on each
    # other; negative where the two sides overlap better than the max() assumes), so the model
    # reproduces the measured rate at the bucket it was measured at
    t_v = lambda v: plan.t_v(prompt_ctx, v)  # noqa: E731
    profile.comm_s = decode_s / iterations - profile.iteration_s(t_v)
    if progress:
        print(f"[plan] parallel: {profile.tokens_per_s:.1f} tok/s, gamma {profile.gamma:.1f}, "
              f"{profile.tokens_per_iteration:.2f} tokens/iteration, target {slowdown:.2f}x slower beside the "
              f"draft, comm {profile.comm_s * 1e3:.1f} ms/iteration", file=sys.stderr)
    return profile


def build_plan(
    engine: EngineLike,
    method: str = DEFAULT_METHOD,
    quick: bool = True,
    calibration_prompts: Sequence[str] | None = None,
    *,
    contexts: Sequence[int] | None = None,
    xs: Sequence[int] | None = None,
    aat_xs: Sequence[int] | None = None,
    max_tokens: int | None = None,
    repeats: int | None = None,
    device_id: str | None = None,
    prior_nodes: int | None = None,
    prior_levels: int | None = None,
    raw_prompts: bool = False,
    progress: bool = True,
    parallel: bool = True,
) -> Plan:
    """Profile T_v and T_d, calibrate AAT(x), fit, and decide per context bucket.

    x is the verification length everywhere (tree tokens including the root); AAT(x) is measured
    by decoding with budget = x - 1 drafted nodes. With method "prior" the prior-score search
    runs first (maximal tree of `prior_nodes` over `prior_levels` levels) and AAT(x) is measured
    with its top-(x - 1) trees. quick: fewer x points, contexts, prompts and tokens.
    raw_prompts: feed the calibration prompts as plain text instead of through the chat template.
    parallel: also measure the DuoDecoding parallel executor (with a draft model), so each bucket
    says which executor is fastest.
    """
    from specwood.planner import profiler as prof
    from specwood.planner.machine import LoadWatch
    from specwood.planner.prior_tree import collect_prior_scores

    if method in ("ar", "auto"):
        raise SpecwoodError(f"cannot plan method '{method}': give the speculative method to tune (e.g. dyspec)")
    load = LoadWatch()  # others' CPU use now and at the end: a plan measured beside them is not stored
    xs = sorted(set(xs or (prof.QUICK_XS if quick else prof.DEFAULT_XS)) | {1})
    wanted = list(contexts or (prof.QUICK_CONTEXTS if quick else prof.DEFAULT_CONTEXTS))
    fit_ctx = [c for c in wanted if c + max(xs) + 1 < engine.max_context]
    if not fit_ctx:  # a small model: one bucket that fits
        fit_ctx = [max(1, engine.max_context - max(xs) - 2)]
    max_tokens = max_tokens or (32 if quick else 64)
    repeats = repeats or (5 if quick else 7)
    if calibration_prompts is not None:  # explicit prompts: one set for every bucket
        given = encode_prompts(engine, calibration_prompts, raw_prompts)
        sets = {c: given for c in fit_ctx}
        what = f"{len(given)} given prompts"
    else:  # the first bucket also gets short chat prompts: what most requests look like
        n = 2 if quick else 4
        sets = {c: calibration_set(engine, c, n, n if i == 0 else 0) for i, c in enumerate(fit_ctx)}
        sets = {c: ids for c, ids in sets.items() if ids} or {fit_ctx[0]: encode_prompts(engine, CALIBRATION_PROMPTS)}
        what = (f"{n} chat prompts + {n} raw code/prose windows of the bucket's length (first bucket), "
                f"{n} windows (others)")
    prompts_ids = sets[min(sets)]
    notes = ["x = verification length (tree tokens incl. root); budget = x - 1 drafted nodes",
             f"AAT(x) measured per context bucket on {what}, {max_tokens} tokens each (greedy)"]

    prior = None
    x_cap = MAX_X
    if method == "prior":
        n_nodes = prior_nodes or (32 if quick else 64)
        levels = prior_levels or (6 if quick else 8)
        if progress:
            print(f"[plan] prior-score search: maximal tree of {n_nodes} nodes over {levels} levels", file=sys.stderr)
        prior = collect_prior_scores(engine, prompts_ids, max_tokens, n_nodes, levels)
        x_cap = n_nodes + 1
    make = method_factory(engine, method, prior)
    xs = [x for x in xs if x <= x_cap] or [1, 2]

    t_v = prof.measure_verify_times(engine.target, xs, fit_ctx, repeats, quick, progress=progress)
    t_v = {c: r for c, r in t_v.items() if r} or t_v
    default_aat = (2, 4, 8, 16, 32) if quick else (2, 3, 4, 6, 8, 12, 16, 24, 32)
    aat_xs = sorted({int(x) for x in (aat_xs or default_aat) if 2 <= int(x) <= min(max(xs), x_cap)})
    by_ctx: dict[int, AATFit] = {}
    t_d: dict[int, dict[int, float]] = {}
    points_by_ctx: dict[int, dict[int, float]] = {}
    observed: dict[int, dict[str, float]] = {}  # pooled over buckets, weighted by steps
    for c, ids in sorted(sets.items()):
        seen = measure_aat(engine, make, aat_xs, ids, max_tokens, progress, label=f"ctx {c}") if aat_xs else {}
        points_by_ctx[c] = {x: o["aat"] for x, o in seen.items()}
        few = [x for x, o in seen.items() if o["steps"] < 8]
        if few:
            notes.append(f"ctx {c}: AAT at x = {few} rests on fewer than 8 decoding steps (the model stopped early)")
        if len(points_by_ctx[c]) >= 2:
            by_ctx[c] = fit_aat(list(points_by_ctx[c]), list(points_by_ctx[c].values()))
        for x, o in seen.items():
            acc = observed.setdefault(x, {k: 0.0 for k in o})
            for k, v in o.items():
                acc[k] += v * o["steps"] if k != "steps" else v
        if len(seen) >= 2:  # T_d(x) as drafted while decoding real text (see below)
            t_d[c] = {1: 0.0, **{x: o["draft_s"] for x, o in seen.items()}}
    for o in observed.values():
        for k in o:
            if k != "steps":
                o[k] /= max(o["steps"], 1.0)
    # T_d(x) comes from the calibration runs: how many draft forwards a heap or threshold shape
    # spends depends on how sure the draft is, i.e. on the text, so a synthetic context misleads.
    # Buckets without calibration fall back to profiling the shape on the calibration tokens.
    if t_d:
        notes.append("T_d(x) = mean drafting seconds per step while calibrating AAT(x) (per bucket)")
    else:
        shape_spec = {method: (lambda b: make(b)[1])} if method == "prior" else [method]
        t_d = prof.measure_draft_times(engine, shape_spec, xs, fit_ctx[:1], max(2, repeats // 2),
                                       seed_ids=[t for ids in prompts_ids for t in ids], progress=progress)[method]
        notes.append(f"T_d(x) profiled at context {fit_ctx[0]} on the calibration tokens and reused for every bucket")
    points = {x: o["aat"] for x, o in observed.items()}
    if len(points) >= 2:
        aat = fit_aat(list(points), list(points.values()))
    else:
        aat = DEFAULT_AAT
        notes.append("too few AAT points: using the default AAT curve")

    draft_prefill = measure_draft_prefill_lengths(engine, sorted({*PREFILL_LENGTHS, max(fit_ctx)}))
    draft_rows = measure_draft_rows(engine)
    plan = Plan(key=plan_key_for(engine, method, device_id),
                contexts=sorted(t_v), verify_times=t_v, draft_times=t_d, aat=aat, aat_points=points,
                aat_by_context=by_ctx, aat_points_by_context=points_by_ctx, x_cap=x_cap,
                draft_prefill_s=draft_prefill[min(draft_prefill)] if draft_prefill else None,
                draft_prefill_by_length=draft_prefill, draft_row_times=draft_rows, source="measured",
                mode="quick" if quick else "full", prior=prior, observed=observed, notes=notes,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    if parallel and engine.draft_model is not None:
        plan.refresh()  # the T_v rows the parallel model reads
        plan.parallel = measure_parallel(engine, plan, prompts_ids, max_tokens, progress)
        if plan.parallel is not None:
            notes.append("executor: parallel SD modelled per bucket as tokens/iteration / (max(gamma T_d, "
                         "slowdown T_v(x_bar)) + comm), all measured by decoding the calibration prompts")
    plan.load = load.finish()
    return plan.refresh()


def get_plan(engine: EngineLike, method: str = DEFAULT_METHOD, *, build_if_missing: bool = False, quick: bool = True,
             progress: bool = True) -> Plan | None:
    """The stored plan for this engine and method; with build_if_missing, plan now (and save)
    when there is none or it is stale."""
    key = plan_key_for(engine, method)
    plan = load_plan(key)
    if plan is None and build_if_missing:
        if progress:
            print(f"[plan] no usable plan for {key}; profiling now ({'quick' if quick else 'full'} mode)",
                  file=sys.stderr)
        plan = build_plan(engine, method, quick=quick, progress=progress)
        save_if_quiet(plan)
    return plan
