"""The pipeline simulator (specwood/planner/pipeline_sim.py): SpecPipe's E(T) (Eq. 1-2), plain PP
and PP + SpecInfer on hand-computed cases; the planner's w = argmin E(T); the paper setting's
trend; measuring t(w) and P(w) on tiny models; the timeline plot from a real (in-process) run."""
from __future__ import annotations

import math

import pytest
import torch

from specwood.engine.api import Engine
from specwood.engine.specpipe.jobs import Job
from specwood.planner import pipeline_sim as sim
from specwood.sampling import SamplingParams

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy
from pipeline_local import run_local


def test_formulas_on_hand_computed_cases():
    assert sim.tbt_specpipe(0.010, 0.8, 4) == pytest.approx(0.010 + 0.2 * 4 * 0.010)  # 18 ms
    assert sim.tbt_specpipe(0.010, 0.8, 4, refill=3) == pytest.approx(0.016)
    assert sim.tbt_specpipe(0.010, 1.0, 16) == pytest.approx(0.010)  # never a miss: one step per token
    assert sim.tbt_specpipe(0.010, 0.0, 8) == pytest.approx(0.090)  # always a miss: worse than PP's 80 ms
    assert sim.tbt_specpipe_stages([0.010, 0.012, 0.008], 0.5) == pytest.approx(0.012 + 0.5 * 0.030)
    assert sim.tbt_specpipe_stages([0.01] * 4, 0.7) == pytest.approx(sim.tbt_specpipe(0.01, 0.7, 4))
    assert sim.tbt_pp(0.005, 8) == pytest.approx(0.040)
    assert sim.tbt_specinfer(0.010, 4, 2.5, t_draft=0.005) == pytest.approx(0.018)
    assert sim.tree_aat([1, 1, 3], {1: 0.5, 3: 0.8}.get) == pytest.approx(1 + 0.5 + 0.25 + 0.2)
    assert sim.tree_aat([1] * 5, lambda b: 1.0) == 6
    assert sim.step_time([0.001, 0.003]) == 0.003
    assert sim.step_time([0.001] * 4, cores=2, overhead=0.0005) == pytest.approx(0.0025)
    for bad in (lambda: sim.tbt_specpipe(0.01, 1.5, 2), lambda: sim.tbt_specinfer(0.01, 2, 0.5)):
        with pytest.raises(ValueError):
            bad()


def test_curve_interpolates_and_clamps():
    c = sim.Curve({1: 1.0, 4: 4.0, 8: 2.0})
    assert [c(0), c(1), c(2), c(4), c(6), c(8), c(100)] == pytest.approx([1, 1, 2, 4, 3, 2, 2])


P_TABLE = {1: 0.5, 2: 0.7, 4: 0.85, 8: 0.9, 16: 0.92}


def t_lin(w):
    return 1e-3 * (1 + w / 16)


def test_planner_picks_argmin_and_depends_on_m():
    # m = 8: E = 5.3125, 3.825, 2.75, 2.7, 3.28 ms -> w = 8;  m = 2: 2.125, 1.8, 1.625, 1.8, 2.32 -> w = 4
    w8, e8 = sim.best_width(t_lin, P_TABLE.get, 8, P_TABLE)
    w2, e2 = sim.best_width(t_lin, P_TABLE.get, 2, P_TABLE)
    assert (w8, w2) == (8, 4)
    assert e8 == pytest.approx(1.5e-3 * 1.8) and e2 == pytest.approx(1.25e-3 * 1.3)
    table = sim.sweep(t_lin, P_TABLE.get, [2, 8], P_TABLE)
    for m, w in ((2, w2), (8, w8)):
        assert min(table[m], key=table[m].get) == w
    # ties go to the smaller width (cheaper for the same latency)
    assert sim.best_width(lambda w: 1.0, lambda w: 0.9, 4, [16, 4, 8])[0] == 4


def test_paper_setting_trend():
    """U-shape: falls while P(w) grows, best where P saturates before the 64-token leap of t(w)."""
    s = sim.PaperSetting()
    rep = s.report([2, 4, 8, 16], range(1, 129))
    e8 = rep["tbt_ms"][8]
    assert e8[1] > e8[16] > e8[64] and e8[65] > e8[64] and e8[128] > e8[64]
    best = rep["best"][8]
    assert best["w"] == 64
    assert best["pp_ms"] == pytest.approx(302.39, abs=0.01)
    assert 4.0 < best["speedup_vs_pp"] < 6.5 and best["speedup_vs_specinfer"] > 1.5
    # longer pipelines gain more (a miss costs more, the PP baseline costs more still)
    assert rep["best"][16]["speedup_vs_pp"] > rep["best"][8]["speedup_vs_pp"] > rep["best"][2]["speedup_vs_pp"]


@pytest.fixture(scope="module")
def tiny():
    target = make_tiny_model(seed=0, n_layers=3)
    return Engine(target, make_tiny_tokenizer(), draft=perturbed_copy(target, 0.3, seed=1))


def test_hit_rate_emulation(tiny):
    prompt = tiny.encode("def add(a, b):", raw=True)
    ref = tiny.generate(prompt, max_tokens=24, method="ar").token_ids
    same = sim.emulate_specpipe(tiny.target, prompt, ref, 2, 1, 3, tiny.emit_limit)  # the target drafting itself
    assert same["misses"] == 0 and same["hits"] == len(ref)  # the first token too: the prompt root has children
    # the token after the prompt is verified at once; the first level then needs m - 1 = 2 steps to
    # reach the last stage, after which every step verifies a token
    assert same["steps"] == same["tokens"] + 1
    p = sim.measure_hit_rates(tiny, [1, 8], 4, 2, prompts=[prompt], tokens=24)
    assert 0.0 < p[1] <= p[8] <= 1.0
    pp = sim.emulate_specpipe(tiny.draft_model, prompt, ref, 4, 4, 3, tiny.emit_limit)
    assert pp["steps"] >= pp["tokens"] + 2 * pp["misses"]  # every miss stalls m - 1 steps


def test_measure_step_times_and_predict(tiny):
    times = sim.measure_step_times(tiny, 3, [1, 4], ctx=16, reps=1)
    assert sorted(times.stage) == [0, 1, 2] and all(set(d) == {1, 4} for d in times.stage.values())
    assert all(v > 0 for d in times.stage.values() for v in d.values()) and set(times.draft) == {1, 4}
    ts = times.specpipe_stage_times(4)
    assert ts[0] == pytest.approx(times.stage[0][4] + times.draft[4]) and ts[2] == times.stage[2][1]
    pr = sim.predict_run(times, lambda w: 0.5, 4, overhead=1e-3, tree_nodes=3, aat=2.0)
    assert pr["specpipe"] == pytest.approx((max(ts) + 1e-3) * (1 + 0.5 * 3))
    assert pr["pp"] == pytest.approx(times.pass_time(1) + 3e-3)
    assert pr["specinfer"] == pytest.approx((times.pass_time(4) + 3e-3) / 2.0)


def test_timeline_from_a_traced_run(tiny, tmp_path):
    torch.set_num_threads(1)
    jobs = [(Job(tiny.encode("Once upon a time", raw=True), 16, SamplingParams(), "specpipe", 4, 4, trace=True), None)]
    results, _ = run_local(tiny.target, tiny.draft_model, tiny.tokenizer, tiny.eos_token_ids, jobs, 2)
    per = results[0].stats["per_stage"]
    assert [len(s["trace"]) for s in per] == [results[0].stats["pipeline_steps"]] * 2
    for s in per:
        for row in s["trace"]:
            assert all(b >= a for a, b in zip(row, row[1:]))  # phases in order within a step
    path = sim.plot_timeline(per, tmp_path / "timeline.png")
    assert path.stat().st_size > 1000
    table = sim.sweep(t_lin, P_TABLE.get, [2, 8], P_TABLE)
    assert sim.plot_tbt_vs_w(table, tmp_path / "tbt.png", pp={2: 0.01}).stat().st_size > 1000
    assert math.isfinite(sim.mean_tbt([results[0].stats]))
