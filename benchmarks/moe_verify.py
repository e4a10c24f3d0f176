"""A MoE target's verify cost T_v(x) against the planner's prediction, and the grouped expert pass
against one expert call per row (issue 57, items 1 and 4).

A random-weight Qwen3-MoE of Qwen3-30B-A3B's per-layer shapes scaled to fit 2 cores and memory
(stated below and in the output), bf16. T_v(x) is timed as the planner times it (one forward over
a random tree of x tokens after `--context` cached ones, `measure_verify_times`); the prediction is
the analytic model's (`DeviceModel.predict_tv` with this CPU measured by `measure_local_cpu`:
bandwidth and peak, the expected union of experts under uniform routing). Both as T_v(x) / T_v(1).
Then one MoE layer over x rows: grouped (each expert once over its rows, as the model runs) and a
loop of one expert call per (row, choice).

    python benchmarks/moe_verify.py [--layers 6] [--dim 1024] [--experts 128] [--used 8] [--expert-dim 384]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from specwood.models.config import ModelConfig
from specwood.models.transformer import Transformer
from specwood.planner.devices import expected_experts, measure_local_cpu
from specwood.planner.profiler import measure_verify_times, median_time

XS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def per_row(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same layer, one expert call per row and choice (what grouping avoids)."""
    probs = torch.softmax(layer.router(x), dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(layer.top_k, dim=-1)
    if layer.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(layer.top_k):
            e = int(experts[n, j])
            hidden = layer.ops.silu_mul(F.linear(x[n:n + 1], layer.w13[e]))
            out[n] += (F.linear(hidden, layer.w2[e]) * weights[n, j].to(x.dtype))[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--expert-dim", type=int, default=384)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    cfg = ModelConfig(arch="qwen3moe", vocab_size=32768, dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=4,
                      head_dim=128, intermediate_size=args.expert_dim, qk_norm=True, n_experts=args.experts,
                      n_experts_used=args.used, moe_intermediate_size=args.expert_dim, norm_topk_prob=True,
                      max_position_embeddings=4096, name="qwen3moe-scaled")
    torch.manual_seed(0)
    model = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    print(f"model: {cfg.name}: {args.layers} layers, dim {args.dim}, {args.experts} experts of width "
          f"{args.expert_dim}, {args.used} per token, 16 heads of 128 (4 KV), vocab 32768, bf16; "
          f"{cfg.n_params / 1e9:.2f} B params; context {args.context}; torch threads {torch.get_num_threads()}")
    measured = measure_verify_times(model, xs=XS, contexts=[args.context], repeats=7, refine=False,
                                    progress=False)[args.context]
    device = measure_local_cpu("bf16")
    predicted = {x: device.predict_tv(cfg, x, args.context, 2.0) for x in XS}
    print(f"\nT_v(x) / T_v(1): measured T_v(1) {measured[1] * 1e3:.1f} ms, predicted {predicted[1] * 1e3:.1f} ms "
          f"(local CPU: {device.mem_bw / 1e9:.0f} GB/s, {device.peak_flops / 1e9:.0f} GFLOP/s)")
    # "anchored": the measured T_v(1) plus the model's growth, as a plan that timed T_v(1) on the
    # machine (the starter plan does) would predict; the pure model misses the fixed per-forward cost
    print("| x | experts woken (uniform) | measured | predicted | error | anchored at T_v(1) | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    errors, anchored_errors = [], []
    for x in XS:
        m, p = measured[x] / measured[1], predicted[x] / predicted[1]
        a = (measured[1] + predicted[x] - predicted[1]) / measured[1]
        errors.append(abs(p - m) / m)
        anchored_errors.append(abs(a - m) / m)
        print(f"| {x} | {expected_experts(args.experts, args.used, x):.1f} | {m:.2f} | {p:.2f} "
              f"| {100 * (p - m) / m:+.0f}% "
              f"| {a:.2f} | {100 * (a - m) / m:+.0f}% |")
    print(f"mean |error| {100 * statistics.mean(errors):.1f}% "
          f"(anchored {100 * statistics.mean(anchored_errors):.1f}%), "
          f"max {100 * max(errors):.1f}% (anchored {100 * max(anchored_errors):.1f}%)")
    layer = model.layers[0].feed_forward
    print("\none MoE layer: grouped expert pass against one expert call per row and choice")
    print("| rows | grouped ms | per row ms | per row / grouped |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in (1, 4, 8, 16, 32):
            x = torch.randn(rows, args.dim, dtype=torch.bfloat16)
            g, r = median_time(lambda: layer(x), 7), median_time(lambda: per_row(layer, x), 7)
            print(f"| {rows} | {g * 1e3:.2f} | {r * 1e3:.2f} | {r / g:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
