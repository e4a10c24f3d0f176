"""A pipeline simulator for SpecPipe (seed 002, §3.3.3) and its baselines on the same stages.

Expected time between tokens (TBT) of an m-stage pipeline, from the per-stage step time t(w) at
level width w and the hit rate P(w) (the chance that the target's next token is among the drafted
children of the verified token):

  SpecPipe        E(T) = t(w) + (1 − P(w))·r·t(w)     r = m: the paper's Eq. 2 (a miss refills the
                  pipeline); r = m − 1 is what this repo's lock-step loop pays (a miss costs m − 1
                  stall steps, then the refill root is verified); Eq. 1 with unequal stages:
                  max_i t_i(w) + (1 − P(w))·Σ_i t_i(w)
  plain PP        Σ_i t_i(1) = m·t_pp                  (one token per full pass)
  PP + SpecInfer  (Σ_i t_i(n) + t_draft) / AAT         (one whole n-node tree per full pass; AAT =
                  expected tokens per tree, the accepted path plus the target's token)

The planner picks w = argmin E(T) over the widths it can run. Inputs come from measurements
(`measure_step_times`: the real stage forwards at width w; `measure_hit_rates`: the real
fixed-width drafting (`FixedWidthSource`, `TreeMirror`) on calibration text, verdicts taken from
the target's greedy continuation), or from a device model (`paper_setting`: the paper's 8-stage
Llama-3.1-70B / RTX 3090 testbed, assumptions spelled out there). `validate` runs the real
pipeline (`PipelineExecutor`) and sets its TBT beside the prediction.

CLI: `python -m specwood.planner.pipeline_sim paper [--plot DIR]` prints TBT vs w for m = 2…16
and the speedups at m = 8; `benchmarks/pipeline_sim.py` runs the measured validation and plots.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from specwood.engine.protocols import EngineLike

Fn = Callable[[int], float]
DEFAULT_MS = (2, 4, 8, 16)
DEFAULT_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128)

# ---------------------------------------------------------------------------------------------
# formulas


def tbt_specpipe(t: float, p: float, m: int, refill: float | None = None) -> float:
    """Eq. 2: E(T) = t + (1 − P)·r·t with r = m (paper) unless `refill` steps are given."""
    _check_p(p)
    return t + (1.0 - p) * (m if refill is None else refill) * t


def tbt_specpipe_stages(ts: Sequence[float], p: float) -> float:
    """Eq. 1: max_i t_i + (1 − P)·Σ_i t_i (unequal stages)."""
    _check_p(p)
    return max(ts) + (1.0 - p) * sum(ts)


def tbt_pp(t_pp: float, m: int) -> float:
    """Plain pipeline parallelism: one token per full pass of m stages."""
    return m * t_pp


def tbt_specinfer(t_tree: float, m: int, aat: float, t_draft: float = 0.0) -> float:
    """PP + SpecInfer: one full pass (m steps of t_tree) per tree, plus the draft time if it is not
    hidden, over the expected tokens per tree."""
    if aat < 1.0:
        raise ValueError(f"AAT counts the target's own token too: it is >= 1, got {aat}")
    return (m * t_tree + t_draft) / aat


def tree_aat(branching: Sequence[int], hit: Fn) -> float:
    """Expected tokens per static tree: 1 + Σ_d Π_{j≤d} hit(b_j), where b_j is how many children
    each depth-(j−1) node has and hit(b) the chance that the target's token is among b candidates."""
    aat, reach = 1.0, 1.0
    for b in branching:
        reach *= hit(int(b))
        aat += reach
    return aat


def best_width(t: Fn, p: Fn, m: int, widths: Iterable[int], refill: float | None = None) -> tuple[int, float]:
    """The planner's choice: w = argmin E(T) (ties: the smaller w) and that E(T)."""
    best = min(((tbt_specpipe(t(w), p(w), m, refill), w) for w in widths), key=lambda x: (x[0], x[1]))
    return best[1], best[0]


def sweep(t: Fn, p: Fn, ms: Iterable[int] = DEFAULT_MS, widths: Iterable[int] = DEFAULT_WIDTHS,
          refill: Callable[[int], float] | None = None) -> dict[int, dict[int, float]]:
    """E(T) for every m and w: {m: {w: seconds}}."""
    widths = list(widths)
    return {m: {w: tbt_specpipe(t(w), p(w), m, refill(m) if refill else None) for w in widths} for m in ms}


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a hit rate is a probability, got {p}")


@dataclass
class Curve:
    """A measured quantity at a few widths, linearly interpolated between them (held flat outside)."""

    points: dict[int, float]

    def __call__(self, w: int) -> float:
        xs = sorted(self.points)
        if w <= xs[0]:
            return self.points[xs[0]]
        if w >= xs[-1]:
            return self.points[xs[-1]]
        hi = next(x for x in xs if x >= w)
        lo = max(x for x in xs if x <= w)
        if hi == lo:
            return self.points[lo]
        f = (w - lo) / (hi - lo)
        return self.points[lo] * (1 - f) + self.points[hi] * f


# ---------------------------------------------------------------------------------------------
# the paper's setting (a device model; the numbers are assumptions, not measurements)


@dataclass
class PaperSetting:
    """Seed 002's one-server testbed as a model: Llama-3.1-70B (80 layers, bf16) over m = 8 RTX 3090
    stages of 10 layers, Llama-3.2-1B drafting on its own GPU (hidden: never on the critical path).

    t(w): Fig. 9's shape, flat and leaping every 64 tokens: t_mem + (⌈w/64⌉ − 1)·t_block, where
    t_mem = 302.39 ms / 8 (the paper's PP TBT on HumanEval-X is one memory-bound pass) and t_block
    = 2·64·8.6e9 FLOP / 71 TFLOPS ≈ 15.5 ms (a 64-token block through 10 layers of 70B), plus
    `overhead` per step (pruning/transfer not hidden). P(w): a saturating curve from P(1) = 0.62 to
    0.95 with scale 12 tokens, matching the text ("P(w) would reach a plateau after tens of
    speculative tokens"; Fig. 10 itself is not in the text). SpecInfer: the <1,1,3,1,1,1,1,1> tree
    (20 nodes, inside one 64-token block), AAT from `tree_aat` with the same P."""

    t_mem: float = 0.30239 / 8
    t_block: float = 0.0155
    block: int = 64
    overhead: float = 0.0
    p1: float = 0.62
    p_inf: float = 0.95
    scale: float = 12.0
    branching: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
    m: int = 8

    def t(self, w: int) -> float:
        return self.t_mem + (math.ceil(w / self.block) - 1) * self.t_block + self.overhead

    def p(self, w: int) -> float:
        return self.p_inf - (self.p_inf - self.p1) * math.exp(-(w - 1) / self.scale)

    def tree_nodes(self) -> int:
        n, layer = 0, 1
        for b in self.branching:
            layer *= b
            n += layer
        return n

    def report(self, ms: Iterable[int] = DEFAULT_MS, widths: Iterable[int] = DEFAULT_WIDTHS) -> dict[str, Any]:
        widths = list(widths)
        table = sweep(self.t, self.p, ms, widths)
        out: dict[str, Any] = {
            "tbt_ms": {m: {w: round(v * 1e3, 2) for w, v in row.items()} for m, row in table.items()},
            "p": {w: round(self.p(w), 4) for w in widths}, "t_ms": {w: round(self.t(w) * 1e3, 2) for w in widths}}
        aat = tree_aat(self.branching, self.p)
        for m in table:
            w, best = best_width(self.t, self.p, m, widths)
            pp = tbt_pp(self.t(1), m)
            si = tbt_specinfer(self.t(self.tree_nodes() + 1), m, aat)
            out.setdefault("best", {})[m] = {"w": w, "specpipe_ms": round(best * 1e3, 2),
                                             "pp_ms": round(pp * 1e3, 2),
                                             "specinfer_ms": round(si * 1e3, 2), "speedup_vs_pp": round(pp / best, 2),
                                             "speedup_vs_specinfer": round(si / best, 2)}
        out["specinfer_aat"] = round(aat, 3)
        return out


# ---------------------------------------------------------------------------------------------
# measurements on an engine


@dataclass
class StepTimes:
    """Per-stage forward time (s) at each width, the draft's time per level, and the stage plan."""

    stage: dict[int, dict[int, float]]  # rank -> {nodes: seconds}
    draft: dict[int, float] = field(default_factory=dict)  # level width -> seconds (rank 0's draft forward)
    layers: list[list[int]] = field(default_factory=list)

    def specpipe_stage_times(self, w: int, draft_on_first: bool = True) -> list[float]:
        """SpecPipe's busy time per stage at width w: stage 0 takes the w-node level (and runs the
        draft over it when the draft shares rank 0), middle stages at most w nodes (pruned levels
        are smaller: an upper bound), the last stage the one verified node."""
        m = len(self.stage)
        ts = []
        for r in range(m):
            n = 1 if r == m - 1 else w
            drafting = r == 0 and draft_on_first and self.draft
            ts.append(Curve(self.stage[r])(n) + (Curve(self.draft)(w) if drafting else 0.0))
        return ts

    def pass_time(self, n: int) -> float:
        """One full pass of an n-node input through every stage (PP: n = 1; SpecInfer: the tree)."""
        return sum(Curve(s)(n) for s in self.stage.values())


def step_time(ts: Sequence[float], cores: int | None = None, overhead: float = 0.0) -> float:
    """A lock-step pipeline step: the slowest stage, or, with more busy ranks than `cores`, the
    total work shared by the cores; plus the per-step overhead (broadcasts, pruning, transfer)."""
    t = max(ts)
    if cores is not None and len(ts) > cores:
        t = max(t, sum(ts) / cores)
    return t + overhead


def measure_step_times(engine: EngineLike, stages: int, widths: Iterable[int], *, ctx: int = 128, reps: int = 5,
                       threads: int = 1, draft: bool = True, layers: Sequence[range] | None = None) -> StepTimes:
    """Median time of each stage's real forward over a w-node tree level (all nodes children of
    the last of `ctx` cached tokens, tree mask), the stage split as the pipeline makes it; and of
    the draft's forward over a w-node level with logits for every node (SpecPipe's token source).
    `layers`: the stage split (default: the launcher's, which weighs the draft's time on rank 0)."""
    from specwood.engine.specpipe.jobs import stage_ranges
    from specwood.engine.specpipe.launch import draft_load
    from specwood.models.transformer import build_model

    target = engine.target
    ranges = list(layers) if layers is not None else stage_ranges(target.config, stages,
                                                                   draft_load(engine) if draft else 0.0)
    sd = target.canonical_state_dict()
    widths = sorted(set(int(w) for w in widths) | {1})
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = StepTimes({}, {}, [list(r) for r in ranges])
        for r, rng in enumerate(ranges):
            stage = build_model(target.config, sd, target.dtype, layers=rng,
                                max_positions=max(target.max_positions, ctx + max(widths) + 1))
            rows = "last" if r == stages - 1 else None
            with torch.inference_mode():
                out.stage[r] = {w: _time_level(stage, ctx, w, reps, rows) for w in widths}
        with torch.inference_mode():
            if draft and engine.draft_model is not None:
                out.draft = {w: _time_level(engine.draft_model, ctx, w, reps, "all") for w in widths}
    finally:
        torch.set_num_threads(old)
    return out


def _time_level(model: Any, ctx: int, w: int, reps: int, rows: str | None) -> float:
    cache = model.new_cache(ctx + w + 1, 1)
    dim, dev = model.config.dim, model.device
    g = torch.Generator().manual_seed(0)

    def inputs(n: int) -> torch.Tensor:
        if model.is_first:
            return torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(dev)
        return torch.randn(1, n, dim, generator=g).to(dev, model.dtype)

    mask = torch.ones(ctx, ctx, dtype=torch.bool).tril()
    model(inputs(ctx), torch.arange(ctx, device=dev), mask.to(dev), cache, torch.arange(ctx, device=dev))
    cache.length = ctx
    tmask = torch.zeros(w, ctx + w, dtype=torch.bool)
    tmask[:, :ctx] = True
    tmask[:, ctx:] = torch.eye(w, dtype=torch.bool)
    x, pos, slots = inputs(w), torch.full((w,), ctx, device=dev), torch.arange(ctx, ctx + w, device=dev)
    out_rows = torch.tensor([w - 1], device=dev) if rows == "last" else None
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        model(x, pos, tmask.to(dev), cache, slots, output_rows=out_rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def emulate_specpipe(draft: Any, prompt: list[int], reference: list[int], width: int, topk: int,
                     m: int, emit_limit: int | None = None) -> dict[str, int]:
    """SpecPipe's tree dynamics with the draft alone: the real `FixedWidthSource` grows one level
    per step from the live tree's bottom, a verified node reaches the last stage m − 1 steps after
    it entered, and the verdict there is read off `reference` (the target's greedy continuation of
    `prompt`): HIT if the next token is one of the verified node's drafted children (the tree is
    pruned to its subtree), else MISS (the pipeline refills from that token). `emit_limit`: the
    engine's, so the draft never proposes a padding id the target would never emit."""
    from specwood.engine.specpipe.draft import FixedWidthSource
    from specwood.engine.specpipe.state import EMPTY, HIT, MISS, Level, LevelVerdict, TreeMirror

    seq = list(prompt) + list(reference)
    src = FixedWidthSource(draft, width, topk, len(seq) + (width + 1) * (m + 2) + 8, emit_limit=emit_limit)
    mirror = TreeMirror()
    first = Level(list(range(len(prompt))), [-1] * len(prompt), list(prompt), 0, True)
    entry: dict[int, int] = {}
    with torch.inference_mode():
        mirror.add(first)
        src.run(first, mirror)
        mirror.consumed(first.ids)
        entry[first.ids[-1]] = 1 - m  # the prompt has been through the pipeline already
        next_id, step, refill = len(prompt), 0, None
        hits = misses = steps = 0
        while True:
            level: Level | None
            if refill is not None:
                level, refill = Level([next_id], [-1], [refill[0]], refill[1], True), None
            else:
                level = src.next_level(mirror, next_id)
                if level is not None and level.position >= len(seq):
                    level = None
            if level is not None:
                mirror.add(level)
                src.run(level, mirror)
                for x in level.ids:
                    entry[x] = step
                next_id += len(level)
            root = mirror.root
            if root is not None and entry[root] + m - 1 <= step:
                pos = mirror.position[root] + 1
                if pos >= len(seq):
                    break
                kids = mirror.children(root)
                node = next((c for c in kids if mirror.token[c] == seq[pos]), None)
                if node is not None:
                    v = LevelVerdict(HIT, seq[pos], node, pos)
                    hits += 1
                else:
                    v = LevelVerdict(MISS if kids else EMPTY, seq[pos], -1, pos)
                    misses += 1
                    refill = (seq[pos], pos)
                mirror.apply(v)
                mirror.consumed([root])
                src.prune(v, mirror)
            step += 1
            steps += 1
    return {"hits": hits, "misses": misses, "steps": steps, "tokens": hits + misses}


def measure_hit_rates(engine: EngineLike, widths: Iterable[int], topk: int, m: int,
                      prompts: Sequence[list[int]] | None = None,
                      tokens: int = 48, n_prompts: int = 4) -> dict[int, float]:
    """P(w): the fixed-width draft's hit rate at each width on calibration prompts (default: the
    planner's chat calibration prompts), verdicts from the target's greedy output."""
    if engine.draft_model is None:
        raise ValueError("measuring P(w) needs the engine's draft model")
    if prompts is None:
        from specwood.planner.calibration import CALIBRATION_PROMPTS, encode_prompts

        prompts = encode_prompts(engine, CALIBRATION_PROMPTS[:n_prompts])
    refs = [engine.generate(list(p), max_tokens=tokens, method="ar").token_ids for p in prompts]
    out = {}
    for w in widths:
        hits = total = 0
        for p, ref in zip(prompts, refs):
            r = emulate_specpipe(engine.draft_model, list(p), ref, w, topk, m, getattr(engine, "emit_limit", None))
            hits, total = hits + r["hits"], total + r["tokens"]
        out[int(w)] = hits / max(1, total)
    return out


# ---------------------------------------------------------------------------------------------
# prediction and validation against the real pipeline


def predict_run(times: StepTimes, p: Fn, w: int, *, cores: int | None = None, overhead: float = 0.0,
                refill: float | None = None, tree_nodes: int = 0, aat: float | None = None,
                draft_tree: float = 0.0) -> dict[str, float]:
    """Predicted TBT (s) of SpecPipe at width w, plain PP and (if `aat`) PP + SpecInfer on `times`'
    stages. `refill`: stall steps per miss (None: the paper's m)."""
    m = len(times.stage)
    t_w = step_time(times.specpipe_stage_times(w), cores, overhead)
    out = {"specpipe": tbt_specpipe(t_w, p(w), m, refill), "t_w": t_w, "p_w": p(w),
           "pp": times.pass_time(1) + m * overhead}
    if aat is not None:
        out["specinfer"] = (times.pass_time(tree_nodes + 1) + m * overhead + draft_tree) / aat
    return out


def mean_tbt(stats: Sequence[dict[str, Any]]) -> float:
    """Mean decode TBT (s) over runs: decode time / tokens after the first (what E(T) predicts)."""
    vals = [1.0 / s["tokens_per_s"] for s in stats if s.get("tokens_per_s")]
    return statistics.mean(vals) if vals else float("nan")


# ---------------------------------------------------------------------------------------------
# the planner's choice of w for a pipeline about to start

AUTO_WIDTHS = (1, 2, 4, 8, 16)


def choose_width(engine: EngineLike, stages: int, topk: int, *, threads: int = 1, widths: Sequence[int] = AUTO_WIDTHS,
                 tokens: int = 24, n_prompts: int = 2, store: bool = True) -> dict[str, Any]:
    """`--width auto`: w = argmin E(T) = t(w) + (1 − P(w))·r·t(w) with r = m − 1 (the stall steps a
    miss costs this runtime), from a quick measurement on this engine: t(w) = the slowest stage's
    real forward over a w-node level (the draft's forward counted on rank 0, the cores shared as
    the ranks will share them) and P(w) = the real fixed-width drafting's hit rate on `n_prompts`
    calibration prompts x `tokens` tokens. Stored under the planner's cache, keyed by the models,
    stages, k and threads, so a later start reuses it ("source": "stored")."""
    import json
    import os

    from specwood.planner.store import plan_key_for, plans_dir

    key = plan_key_for(engine, method=f"specpipe-m{stages}-k{topk}-t{threads}")
    path = plans_dir() / key.filename().replace(".json", "-width.json")
    widths = sorted({int(w) for w in widths})
    if store and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key.to_dict() and data.get("widths") == widths:
                return {**data["choice"], "source": "stored"}
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # unreadable: measure again
    t0 = time.perf_counter()
    times = measure_step_times(engine, stages, widths, ctx=64, reps=2, threads=threads)
    p = measure_hit_rates(engine, widths, topk, stages, tokens=tokens, n_prompts=n_prompts)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    t = {w: step_time(times.specpipe_stage_times(w), cores // threads if cores else None) for w in widths}
    refill = stages - 1
    best, e_best = best_width(t.__getitem__, p.__getitem__, stages, widths, refill=refill)
    choice = {"width": best, "topk": topk, "predicted_tbt_ms": round(e_best * 1e3, 2), "refill_steps": refill,
              "tbt_ms": {str(w): round(tbt_specpipe(t[w], p[w], stages, refill) * 1e3, 2) for w in widths},
              "t_ms": {str(w): round(t[w] * 1e3, 2) for w in widths},
              "p": {str(w): round(p[w], 4) for w in widths},
              "measure_s": round(time.perf_counter() - t0, 2)}
    if store:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": key.to_dict(), "widths": widths, "choice": choice}, indent=1))
        except OSError:
            pass  # a read-only cache: measure again next time
    return {**choice, "source": "measured"}


# ---------------------------------------------------------------------------------------------
# plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tbt_vs_w(table: dict[int, dict[int, float]], path: Path, title: str = "",
                  pp: dict[int, float] | None = None, measured: dict[int, dict[int, float]] | None = None) -> Path:
    """TBT (ms) vs tree width per stage count (the paper's Fig. 10 analogue); dashed: plain PP;
    markers: measured TBTs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.6, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (m, row) in enumerate(sorted(table.items())):
        c = colors[i % len(colors)]
        ws = sorted(row)
        ax.plot(ws, [row[w] * 1e3 for w in ws], "-", color=c, lw=1.4, label=f"SpecPipe m={m} (E(T))")
        best = min(ws, key=lambda w: (row[w], w))
        ax.plot([best], [row[best] * 1e3], "*", color=c, ms=10)
        if pp and m in pp:
            ax.axhline(pp[m] * 1e3, color=c, ls=":", lw=1, label=f"plain PP m={m}")
        if measured and m in measured:
            mw = sorted(measured[m])
            ax.plot(mw, [measured[m][w] * 1e3 for w in mw], "o", color=c, ms=4, label=f"measured m={m}")
    ax.set_xlabel("tree width w (nodes per level)")
    ax.set_ylabel("TBT (ms)")
    ax.set_yscale("log")
    ax.set_title(title or "SpecPipe: expected TBT vs tree width")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


PHASES = (("compute", 1, 2, "tab:blue"), ("draft", 2, 3, "tab:purple"), ("prune", 4, 5, "tab:orange"),
          ("transfer", 5, 6, "tab:green"), ("wait", 0, 1, "0.85"), ("wait", 3, 4, "0.85"))


def plot_timeline(per_stage: Sequence[dict[str, Any]], path: Path, title: str = "",
                  window: tuple[float, float] | None = None) -> Path:
    """Per-stage timeline of a real run (the paper's Fig. 12 analogue) from the ranks' per-step
    traces (`Job.trace`): compute, draft (rank 0), pruning, transfer, waiting in broadcasts."""
    plt = _pyplot()
    traces = [s["trace"] for s in per_stage]
    t0 = min(tr[0][0] for tr in traces if tr)
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * len(traces)))
    seen = set()
    for r, tr in enumerate(traces):
        for name, a, b, color in PHASES:
            bars = [((s[a] - t0) * 1e3, (s[b] - s[a]) * 1e3) for s in tr if s[b] > s[a]]
            if window:
                bars = [x for x in bars if window[0] <= x[0] <= window[1]]
            label = name if name not in seen else None
            seen.add(name)
            ax.broken_barh(bars, (r - 0.35, 0.7), facecolors=color, label=label)
    ax.set_yticks(range(len(traces)), [f"stage {r}" + (" (+draft)" if r == 0 else "") for r in range(len(traces))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if window:
        ax.set_xlim(*window)
    ax.set_title(title or "pipeline timeline")
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specwood.planner.pipeline_sim",
                                 description="SpecPipe pipeline simulator (E(T) = t(w) + (1 - P(w))·m·t(w))")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pa = sub.add_parser("paper", help="the paper's 8-stage testbed as a device model")
    pa.add_argument("--overhead-ms", type=float, default=0.0, help="per-step pruning/transfer not hidden")
    pa.add_argument("--plot", default=None, help="write tbt_vs_w.png into this folder")
    pa.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    setting = PaperSetting(overhead=args.overhead_ms / 1e3)
    rep = setting.report(range(2, 17), DEFAULT_WIDTHS)
    if args.json:
        import json

        print(json.dumps(rep))
    else:
        ws = list(DEFAULT_WIDTHS)
        print("w        " + " ".join(f"{w:>7}" for w in ws))
        print("P(w)     " + " ".join(f"{rep['p'][w]:7.3f}" for w in ws))
        print("t(w) ms  " + " ".join(f"{rep['t_ms'][w]:7.1f}" for w in ws))
        for m in DEFAULT_MS:
            print(f"m={m:<2} ms  " + " ".join(f"{rep['tbt_ms'][m][w]:7.1f}" for w in ws))
        print(f"SpecInfer tree {setting.branching}: AAT {rep['specinfer_aat']}")
        for m in range(2, 17):
            b = rep["best"][m]
            print(f"m={m:<2}: best w {b['w']}, SpecPipe {b['specpipe_ms']} ms, PP {b['pp_ms']} ms, "
                  f"PP+SpecInfer {b['specinfer_ms']} ms -> {b['speedup_vs_pp']}x vs PP, "
                  f"{b['speedup_vs_specinfer']}x vs SpecInfer")
    if args.plot:
        ms = DEFAULT_MS
        widths = range(1, 129)
        table = sweep(setting.t, setting.p, ms, widths)
        path = plot_tbt_vs_w(table, Path(args.plot) / "tbt_vs_w_paper.png",
                             "SpecPipe E(T) vs w — paper setting (70B over RTX 3090 stages, model)",
                             pp={m: tbt_pp(setting.t(1), m) for m in ms})
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
