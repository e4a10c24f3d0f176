"""Validate the pipeline simulator (specwood/planner/pipeline_sim.py) against real pipeline runs on
this machine, and draw its plots.

1. measure t(w) (each stage's real forward at width w, the draft's level forward on rank 0) and
   P(w) (the real fixed-width drafting on calibration prompts, verdicts from the target's greedy
   output) on a small random model pair, for 2 stages and 4 stages (oversubscribed: 4 ranks on
   this machine's cores);
2. run the real pipeline (`PipelineExecutor`, gloo, one thread per rank): SpecPipe at several w,
   plain PP and PP + SpecInfer, same prompts, greedy (outputs checked identical);
3. print predicted vs measured mean TBT (the per-step overhead calibrated once, on the PP run),
   plot TBT vs w (model + measured points) and a per-stage timeline of a traced run (Fig. 12);
4. the paper's 8-stage setting (a device model) as TBT vs w for m = 2, 4, 8, 16 (Fig. 10).

    python benchmarks/pipeline_sim.py [--out benchmarks/results/specpipe/pipeline_sim] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from specwood.planner import pipeline_sim as sim  # noqa: E402


def small_pair(dim: int = 256, n_layers: int = 8, draft_layers: int = 2):
    """A random target whose later layers change little (residual outputs scaled down), and as draft
    its first `draft_layers` layers with the same norm and head: they agree often, not always."""
    from conftest import TINY_VOCAB, make_tiny_tokenizer

    from specwood.engine.api import Engine
    from specwood.models.config import ModelConfig
    from specwood.models.transformer import Transformer, build_model

    cfg = ModelConfig(arch="qwen2", vocab_size=TINY_VOCAB, dim=dim, n_layers=n_layers, n_heads=8, n_kv_heads=4,
                      intermediate_size=3 * dim, max_position_embeddings=1024, tie_embeddings=False, qkv_bias=True,
                      rope_theta=10000.0, eos_token_ids=[256], name="sim-target")
    torch.manual_seed(0)
    target = Transformer(cfg).eval().requires_grad_(False)
    sd = target.canonical_state_dict()
    for k, v in sd.items():
        late = k.startswith("layers.") and int(k.split(".")[1]) >= draft_layers
        if late and k.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            v.mul_(0.15)
    sd["output.weight"].mul_(4.0)
    target = build_model(cfg, sd, torch.float32, max_positions=1024)
    from dataclasses import replace

    dcfg = replace(cfg, n_layers=draft_layers, name="sim-draft")
    dsd = {k: v for k, v in target.canonical_state_dict().items()
           if not k.startswith("layers.") or int(k.split(".")[1]) < draft_layers}
    draft = build_model(dcfg, dsd, torch.float32, max_positions=1024)
    engine = Engine(target, make_tiny_tokenizer(), draft=draft, target_name="sim-target", draft_name="sim-draft")
    engine.eos_token_ids = set()  # random weights: an early EOS would leave a run without decode steps
    return engine


PROMPTS = ["def add(a, b):", "Once upon a time", "1, 2, 3, 4, 5, 1, 2, 3,", "import os\nimport"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/specpipe/pipeline_sim")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="fewer prompts and widths (a smoke run)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from specwood.engine.specpipe.launch import PipelineExecutor

    engine = small_pair()
    stages_list = [int(s) for s in args.stages.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    if args.quick:
        widths = widths[:3]
    cores = len(os.sched_getaffinity(0))
    tree = {"name": "static"}
    results: dict = {"cores": cores, "widths": widths, "topk": args.topk, "runs": {}}
    torch.set_num_threads(1)
    for m in stages_list:
        from specwood.planner.calibration import CALIBRATION_PROMPTS, encode_prompts

        calib = encode_prompts(engine, CALIBRATION_PROMPTS[:4], raw=True)
        p_meas = sim.measure_hit_rates(engine, widths, args.topk, m, prompts=calib, tokens=args.max_tokens)
        measured: dict[str, list] = {}
        traced = None
        with PipelineExecutor(engine, m, width=widths[0], topk=args.topk, threads=1) as ex:
            # the stages exactly as the launcher split them (its ranks idle meanwhile)
            times = sim.measure_step_times(engine, m, widths, ctx=64, reps=7, layers=ex.layers)
            ex.generate(prompts[0], raw=True, max_tokens=4, mode="pp")  # warm-up
            for text in prompts:
                ref = None
                for name, kw in [("pp", {"mode": "pp"}), ("specinfer", {"mode": "specinfer", "tree": tree})] + \
                        [(f"w={w}", {"mode": "specpipe", "width": w}) for w in widths]:
                    res = ex.generate(text, raw=True, max_tokens=args.max_tokens, **kw)
                    ref = ref or res.token_ids
                    assert res.token_ids == ref, f"{name} differs"
                    measured.setdefault(name, []).append(res.stats)
            best_w = min(widths, key=lambda w: sim.mean_tbt(measured[f"w={w}"]))
            traced = ex.generate(prompts[0], raw=True, max_tokens=args.max_tokens, mode="specpipe", width=best_w,
                                 trace=True)
        pp_meas = sim.mean_tbt(measured["pp"])
        overhead = max(0.0, (pp_meas - times.pass_time(1)) / m)
        aat = statistics.mean(s["mean_accepted_tokens"] for s in measured["specinfer"])
        n_tree = 20
        p_fn = sim.Curve(p_meas)
        rows = []
        for w in widths:
            pr = sim.predict_run(times, p_fn, w, cores=cores, overhead=overhead, refill=m - 1, tree_nodes=n_tree,
                                 aat=aat, draft_tree=0.0)
            paper = sim.predict_run(times, p_fn, w, cores=cores, overhead=overhead)
            ss = measured[f"w={w}"]
            hit = statistics.mean(s["hit_rate"] for s in ss)
            rows.append({"w": w, "P_emulated": round(p_meas[w], 3), "hit_rate_real": round(hit, 3),
                         "t_w_ms": round(pr["t_w"] * 1e3, 3), "pred_ms": round(pr["specpipe"] * 1e3, 3),
                         "pred_eq2_ms": round(paper["specpipe"] * 1e3, 3),
                         "meas_ms": round(sim.mean_tbt(ss) * 1e3, 3)})
        si_pred = sim.predict_run(times, p_fn, 1, cores=cores, overhead=overhead, tree_nodes=n_tree, aat=aat)
        results["runs"][m] = {
            "stage_ms": {r: {w: round(v * 1e3, 3) for w, v in d.items()} for r, d in times.stage.items()},
            "draft_ms": {w: round(v * 1e3, 3) for w, v in times.draft.items()},
            "overhead_ms": round(overhead * 1e3, 3), "pp_meas_ms": round(pp_meas * 1e3, 3),
            "pp_pred_no_overhead_ms": round(times.pass_time(1) * 1e3, 3),
            "specinfer_meas_ms": round(sim.mean_tbt(measured["specinfer"]) * 1e3, 3),
            "specinfer_pred_ms": round(si_pred["specinfer"] * 1e3, 3), "specinfer_aat": round(aat, 3),
            "rows": rows, "best_w_measured": best_w,
            "best_w_planner": sim.best_width(
                lambda w: sim.step_time(times.specpipe_stage_times(w), cores, overhead), p_fn, m, widths, m - 1)[0],
        }
        print(json.dumps({m: results["runs"][m]}, indent=1), flush=True)
        sim.plot_timeline(traced.stats["per_stage"], out / f"timeline_m{m}.png",
                          f"SpecPipe timeline: {m} stages, w={best_w}, k={args.topk} (small random pair, CPU)")
        results["runs"][m]["timeline_steps"] = traced.stats["pipeline_steps"]
    # TBT vs w plot: measured-model curves with measured points, per m
    table, meas, pp = {}, {}, {}
    for m, run in results["runs"].items():
        table[m] = {r["w"]: r["pred_ms"] / 1e3 for r in run["rows"]}
        meas[m] = {r["w"]: r["meas_ms"] / 1e3 for r in run["rows"]}
        pp[m] = run["pp_meas_ms"] / 1e3
    sim.plot_tbt_vs_w(table, out / "tbt_vs_w_measured.png", "predicted (lines) vs measured (dots), this machine",
                      pp=pp, measured=meas)
    paper = sim.PaperSetting()
    rep = paper.report(sim.DEFAULT_MS, sim.DEFAULT_WIDTHS)
    results["paper"] = rep
    sim.plot_tbt_vs_w(sim.sweep(paper.t, paper.p, sim.DEFAULT_MS, range(1, 129)), out / "tbt_vs_w_paper.png",
                      "E(T) vs w — paper setting (model)", pp={m: sim.tbt_pp(paper.t(1), m) for m in sim.DEFAULT_MS})
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out}/results.json and plots", file=sys.stderr)


if __name__ == "__main__":
    main()
