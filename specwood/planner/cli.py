"""`specwood plan`: measure (or model) the hardware, print the per-context plan, write plots.

Wire it into specwood/cli.py with:
    from specwood.planner.cli import add_plan_parser
    add_plan_parser(sub)          # sets func=run_plan_cli
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specwood.engine.protocols import EngineLike
from specwood.errors import SpecwoodError

if TYPE_CHECKING:
    from specwood.planner.fits import AATFit


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _aat(text: str) -> AATFit:
    from specwood.planner.fits import AATFit

    try:
        a, b, c = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--aat takes A,B,C (AAT(x) = A + B ln(x - C)), got {text!r}") from None
    return AATFit(a, b, c, r2=float("nan"), n_points=0)


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    from specwood.engine.backends import DRAFT_DTYPE_CHOICES

    p = subparsers.add_parser(
        "plan", help="profile the hardware and choose SD vs AR and the tree size per context length",
        description="Roofline planner: P_eff(x) = AAT(x) / (T_v(x) + T_d(x)) per context bucket. "
                    "--device local measures this machine; a device name (u280, vhk158, v80, u250, a100, h100, "
                    "l40, rtx3090, rtx4090, local-cpu) predicts it from an analytic model.")
    p.add_argument("--target", default=None, help="registry name, .gguf/HF path, or (analytic) a shape preset such as "
                                                   "llama2-7b, llama3.1-8b, qwen2.5-1.5b")
    p.add_argument("--draft", default="auto", help="draft name/path/preset; 'auto' = the target's default; "
                                                  "'one-layer' (analytic) = an EAGLE-style one-layer draft; 'none'")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16", "int8", "int4", "q4", "q4-lite"],
                   help="the local target's weight mode (auto, bf16, fp32, int8, q4, q4-lite), "
                        "or an analytic device's weights (int8, int4)")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPE_CHOICES,
                   help="the local draft's weight mode (auto = q4-lite on VNNI CPUs, else int4 on CPUs); "
                        "part of the plan's key")
    p.add_argument("--method", default="dyspec", help="speculative method to tune: dyspec, chain, static, sequoia, "
                                                     "eagle, dyspec-threshold, pld, early-exit, prior")
    p.add_argument("--device", default="local", help="'local' (measure here) or a device model name")
    p.add_argument("--torch-device", default="cpu", help="where the engine runs for --device local (cpu, cuda[:N])")
    p.add_argument("--max-context", type=int, default=None, help="cap the engine's context (local)")
    p.add_argument("--quick", action="store_true", help="fewer points, prompts and repeats (a minute or two)")
    p.add_argument("--contexts", type=_int_list, default=None, help="context buckets, e.g. 128,512,2048")
    p.add_argument("--aat", type=_aat, default=None, help="assumed AAT curve A,B,C for analytic devices")
    p.add_argument("--x-max", type=int, default=128, help="largest verification length an analytic plan considers")
    p.add_argument("--out", default=None, help="folder for the PNG plots (default: next to the stored plan)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--force", action="store_true", help="re-measure even if a stored plan exists")
    p.add_argument("--compare-trees", action="store_true",
                   help="with --method prior: AAT of prior-score vs width- and depth-based trees")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--no-parallel", action="store_true",
                   help="do not measure the parallel executor (DuoDecoding); auto then stays sequential")
    p.add_argument("--choose-config", action="store_true",
                   help="time every runtime configuration of the pair here (target and draft backend and weight "
                        "mode: torch bf16/int8/q4, llama.cpp) and store the fastest for --backend auto "
                        "(about a minute per configuration)")
    # the server's own plain step, timed before it measures a plan in the background: a plan far from it is not kept
    p.add_argument("--server-step-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--server-step-ctx", type=int, default=128, help=argparse.SUPPRESS)
    p.set_defaults(func=run_plan_cli)
    return p


def format_plan(plan: Any) -> str:
    """The plan as a text table: fits, then one row per context bucket."""
    import math

    lines = [f"plan: {plan.key.method} | target {plan.key.target} | draft {plan.key.draft} | {plan.key.dtype} | "
             f"{plan.key.device} ({plan.source})"]
    a = plan.aat
    r2 = "n/a" if math.isnan(a.r2) else f"{a.r2:.3f}"
    pts = ", ".join(f"{x}:{v:.2f}" for x, v in sorted(plan.aat_points.items())) or "none (assumed)"
    lines.append(f"AAT(x) = {a.A:.3f} + {a.B:.3f} ln(x - {a.C:.3f})   R² {r2}   measured {pts}"
                 + ("   (all buckets)" if plan.aat_by_context else ""))
    for ctx, f in sorted(plan.aat_by_context.items()):
        pts = ", ".join(f"{x}:{v:.2f}" for x, v in sorted(plan.aat_points_by_context.get(ctx, {}).items()))
        fr2 = "n/a" if math.isnan(f.r2) else f"{f.r2:.3f}"
        lines.append(f"AAT ctx {ctx:>6}: {f.A:.3f} + {f.B:.3f} ln(x - {f.C:.3f})   R² {fr2}   measured {pts}")
    for ctx, f in sorted(plan.rooflines.items()):
        ridge = "beyond range" if math.isinf(f.x_ridge) else f"{f.x_ridge:.1f}"
        lines.append(f"roofline ctx {ctx:>6}: P(x) = {f.a:.4g} x + {f.b:.4g} below x_R = {ridge}, "
                     f"P_max {f.p_max:.4g} tok/s, rel. error {f.rel_error:.1%}")
    lines.append("")
    lines.append(f"{'context':>8} {'decision':>10} {'x':>5} {'budget':>6} {'P_eff(x)':>10} {'P_AR':>9} "
                 f"{'speedup':>8} {'best SD x':>9}")
    for c in plan.choices:
        lines.append(f"{c.context:>8} {c.method:>10} {c.x:>5} {c.budget:>6} {c.p_eff:>10.2f} {c.p_ar:>9.2f} "
                     f"{c.speedup:>7.2f}x {c.x_best_sd:>9}")
    lines.append("(x = tokens per target forward incl. the root; budget = x - 1 drafted nodes; P in tokens/s)")
    pp = plan.parallel
    if pp is not None:
        lines.append(f"parallel executor (DuoDecoding), measured at ctx {pp.context}: {pp.tokens_per_s:.2f} tok/s, "
                     f"gamma {pp.gamma:.1f}, {pp.tokens_per_iteration:.2f} tokens/iteration, "
                     f"T_d {pp.t_draft_token_s * 1e3:.1f} ms/token, target {pp.target_slowdown:.2f}x slower "
                     f"beside the draft, comm {pp.comm_s * 1e3:.1f} ms")
        lines.append("executor per bucket: " + ", ".join(
            f"{c.context}: {c.executor} (parallel {c.p_parallel:.2f} tok/s)" for c in plan.choices))
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _local_plan(args: argparse.Namespace) -> Any:
    from specwood.engine.api import load
    from specwood.engine.args import needs_draft
    from specwood.planner.build import build_plan
    from specwood.planner.machine import busy
    from specwood.planner.store import load_plan, plan_key_for, plan_problems, save_if_quiet

    draft = None if (args.draft in (None, "none") or not needs_draft(args.method)) else args.draft
    engine = load(args.target, draft, dtype=args.dtype, draft_dtype=args.draft_dtype,
                           device=args.torch_device, max_context=args.max_context)
    key = plan_key_for(engine, args.method)
    plan = None if args.force else load_plan(key)
    mode = "quick" if args.quick else "full"
    if plan is not None and ((plan.mode == "quick" and mode == "full") or plan.mode == "timed"
                             or (args.contexts and sorted(args.contexts) != plan.contexts)):
        print(f"[plan] the stored plan is {plan.mode} over contexts {plan.contexts}; re-measuring", file=sys.stderr)
        plan = None
    if plan is not None:
        print(f"[plan] using the stored {plan.mode} plan from {plan.created} (--force to re-measure)",
              file=sys.stderr)
    else:
        # said up front: the measurement takes a while (the default pair, 2 cores: ~5 / ~25 minutes)
        print(f"[plan] measuring a {mode} plan for {engine.target_name} on {engine.device}: about "
              f"{'5' if args.quick else '25'} minutes for a 1.5B target on 2 CPU cores, less on faster hardware",
              file=sys.stderr)
        plan = build_plan(engine, args.method, quick=args.quick, contexts=args.contexts,
                          parallel=not args.no_parallel)
        problems = plan_problems(plan, args.server_step_s, args.server_step_ctx)
        if args.server_step_s is not None and (busy_line := busy(plan.load)) is not None:
            problems.append(busy_line)
        if problems and args.server_step_s is not None:  # measured for a server, which keeps its starter plan
            raise SpecwoodError(f"the measured plan is not stored: {'; '.join(problems)} (the machine was busy?)")
        if problems:  # asked for here: stored, with what looks wrong
            print(f"[plan] warning: {'; '.join(problems)} (measured while the machine was busy? run `specwood "
                  "plan --force` again when it is quiet)", file=sys.stderr)
        path = save_if_quiet(plan)  # never one measured beside other work (one line says so)
        if path is not None:
            print(f"[plan] saved {path}", file=sys.stderr)
    if args.compare_trees:
        _compare_trees(engine, plan, args.quick)
    return plan


def _compare_trees(engine: EngineLike, plan: Any, quick: bool) -> None:
    from specwood.planner.prior_tree import (HELD_OUT_CATEGORIES, compare_tree_methods, held_out_prompts,
                                             paired_difference)

    if plan.prior is None:
        print("[plan] --compare-trees needs --method prior", file=sys.stderr)
        return
    xs = [x for x in (4, 8, 12, 16, 24, 32) if x <= len(plan.prior.layout) + 1]
    names, ids = held_out_prompts(engine, HELD_OUT_CATEGORIES[: 3 if quick else None])
    engine.generate(ids[0], max_tokens=8, method="ar")  # warm-up
    print(f"[plan] comparing trees on {len(ids)} built-in prompts ({', '.join(names)})", file=sys.stderr)
    rows = compare_tree_methods(engine, plan.prior, xs, ids, 32 if quick else 64)
    print(f"{'x':>4} {'prior':>7} {'width':>7} {'depth':>7} {'prior-depth (±se)':>18}   AAT per target forward  |  "
          f"decode tok/s: {'prior':>7} {'width':>7} {'depth':>7}")
    for r in rows:
        diff, se = paired_difference(r["prior_per_prompt"], r["depth_per_prompt"])
        print(f"{r['x']:>4} {r['prior']:>7.3f} {r['width']:>7.3f} {r['depth']:>7.3f} {f'{diff:+.2f} ± {se:.2f}':>18}   "
              f"{'':22}|  {'':14}{r['prior_tok_s']:>7.2f} {r['width_tok_s']:>7.2f} {r['depth_tok_s']:>7.2f}")


def run_plan_cli(args: argparse.Namespace) -> int:
    from specwood.planner.analytic import build_analytic_plan
    from specwood.planner.store import plan_path, save_plan

    if args.choose_config:
        from specwood.planner.configs import choose_config, format_choice

        if args.device.strip().lower() != "local":
            raise SpecwoodError("--choose-config times this machine; drop --device or use --device local")
        choice = choose_config(args.target, args.draft, args.method, device=args.torch_device,
                               contexts=args.contexts or (128, 512), max_context=args.max_context)
        print(json.dumps(choice.to_dict()) if args.json else format_choice(choice))
        return 0
    if args.device.strip().lower() == "local":
        plan = _local_plan(args)
    else:
        from specwood.models.registry import DEFAULT_TARGET

        dtype = "bf16" if args.dtype == "auto" else args.dtype
        contexts = args.contexts or [128, 512, 2048]
        plan = build_analytic_plan(args.device, str(args.target or DEFAULT_TARGET), args.draft, method=args.method,
                                   dtype=dtype, contexts=contexts, aat=args.aat, x_max=args.x_max)
        save_plan(plan)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(format_plan(plan))
    if not args.no_plots:
        from specwood.planner.plots import plot_plan

        out = Path(args.out) if args.out else plan_path(plan.key).with_suffix("")
        for path in plot_plan(plan, out):
            print(f"[plan] wrote {path}", file=sys.stderr)
    return 0
