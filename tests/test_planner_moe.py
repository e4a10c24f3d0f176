"""The analytic planner knows MoE targets: a tree's verify reads the experts its rows route to,
so T_v(x) grows with x where a dense model's stays flat below the ridge, and the plan takes
smaller trees (or none) for the MoE model than for a dense one of the same active size."""
from __future__ import annotations

import pytest

from specwood.planner.analytic import build_analytic_plan
from specwood.planner.devices import PRESETS, expected_experts, get_device


def test_the_expected_union_of_experts():
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert expected_experts(128, 8, 1000) == pytest.approx(128, rel=1e-6)
    woken = [expected_experts(128, 8, x) for x in range(1, 65)]
    assert all(a < b for a, b in zip(woken, woken[1:]))


def test_moe_verify_cost_grows_with_the_tree_and_the_plan_drafts_less(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path))  # no stored plans or AAT fits
    device = get_device("a100")
    moe, dense = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-8b"]
    ratio = {name: [device.predict_tv(cfg, x, 512) / device.predict_tv(cfg, 1, 512) for x in (1, 8, 32)]
             for name, cfg in (("moe", moe), ("dense", dense))}
    assert ratio["dense"][2] < 1.05  # memory-bound: 32 rows cost what one does
    assert ratio["moe"][1] > 3 and ratio["moe"][2] > 6  # 8 rows wake ~52 experts, 32 ~112 of 128
    moe_plan = build_analytic_plan("a100", "qwen3-30b-a3b", "qwen3-0.6b")
    dense_plan = build_analytic_plan("a100", "qwen3-8b", "qwen3-0.6b")
    for ctx in (128, 2048):
        moe_x, dense_x = moe_plan.choose(ctx)[1], dense_plan.choose(ctx)[1]
        assert moe_x < dense_x, (ctx, moe_x, dense_x)


def test_a_measured_union_of_experts_replaces_the_uniform_bound():
    """Routing measured on trees (profiler.measure_expert_union: distinct experts a layer's x rows
    wake) feeds the analytic model in place of the uniform bound: a router that sends every row to
    the same few experts makes a wide tree cost what a narrow one does."""
    import torch

    from specwood.models.testing import random_state_dict, random_tiny_config
    from specwood.models.transformer import build_model
    from specwood.planner.devices import union_curve
    from specwood.planner.profiler import measure_expert_union

    cfg = random_tiny_config("qwen3moe", n_experts=8, n_experts_used=2)
    model = build_model(cfg, random_state_dict(cfg, seed=3), torch.float32)
    union = measure_expert_union(model, (1, 2, 4, 8), ctx=16, trees=2)
    assert union[1] == 2  # one row wakes its k experts
    assert all(2 <= union[x] <= min(8, 2 * x) for x in union) and union[8] > union[1]
    woken = union_curve({1: 2.0, 8: 3.0}, 8, 2)  # a router that concentrates
    assert woken(1) == 2.0 and woken(4) == pytest.approx(2 + 3 / 7) and woken(64) <= 8
    device, moe = get_device("a100"), PRESETS["qwen3-30b-a3b"]
    concentrated = union_curve({1: 8.0, 8: 9.0, 32: 12.0}, 128, 8)
    spread = [device.predict_tv(moe, x, 512) for x in (1, 32)]
    narrow = [device.predict_tv(moe, x, 512, woken=concentrated) for x in (1, 32)]
    assert narrow[0] == pytest.approx(spread[0]) and narrow[1] < spread[1] / 4
