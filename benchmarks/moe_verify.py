"""A MoE target's verify cost T_v(x) against the planner's prediction, the grouped expert pass
against one expert call per row, and k-quant against float experts (issue 57, items 1 and 4).

A random-weight Qwen3-MoE of Qwen3-30B-A3B's per-layer shapes scaled to fit 2 cores and memory
(stated below and in the output), in the weight modes asked for (`--modes`): bf16 (packed linears,
float experts) and q4, the default for a GGUF (every weight as a Q4_K_M file stores it, the
random floats quantised to Q4_K with v and down projections in Q6_K, experts included: the
experts run as KQuantExperts). Both run the layers' kernels, as `specwood.load` builds them.

T_v(x) is timed as the planner times it (one forward over a random tree of x tokens after
`--context` cached ones, `measure_verify_times`); the prediction is the analytic model's
(`DeviceModel.predict_tv` with this CPU measured by `measure_local_cpu`: bandwidth, peak and the
fixed costs, the expected union of experts under uniform routing), at the weight mode's bytes per
weight. Both as T_v(x) / T_v(1). Then one MoE layer over x rows, for float and k-quant experts:
grouped (each woken expert once over its rows, as the model runs) and a loop of one expert call
per (row, choice); and the bytes the experts take in each mode.

    python benchmarks/moe_verify.py [--modes bf16 q4] [--layers 6] [--dim 1024] [--experts 128] [--used 8] [--expert-dim 384]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from specwood.models.config import ModelConfig
from specwood.models.experts import KQuantExperts
from specwood.models.q6k import quantize_q6
from specwood.models.transformer import MoEFeedForward, Transformer, build_model
from specwood.models.w4a8 import quantize_q4
from specwood.planner.analytic import WEIGHT_BYTES
from specwood.planner.devices import expected_experts, measure_local_cpu
from specwood.planner.profiler import measure_verify_times, median_time

XS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def per_row(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The same layer, one expert call per row and choice (what grouping avoids)."""
    probs = torch.softmax(layer.router(x), dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(layer.top_k, dim=-1)
    if layer.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(layer.top_k):
            e = int(experts[n, j])
            hidden = layer.ops.silu_mul(layer.w13(e, x[n:n + 1]))
            out[n] += (layer.w2(e, hidden) * weights[n, j].to(x.dtype))[0]
    return out


def q4_k_m_values(sd: dict[str, torch.Tensor]) -> dict[str, object]:
    """The canonical weights as a Q4_K_M file holds them (gguf_kquants.kquant_weights' form): the
    v and down projections and the head in Q6_K, the other layer weights and the token table in
    Q4_K; an expert tensor [E, N, K] as one [E * N, K] weight. Routers and norms stay in floats."""
    exact: dict[str, object] = {}
    for name, t in sd.items():
        if t.dim() < 2 or "router" in name:
            continue
        six = name.endswith(("attention.wv.weight", "w2.weight")) or name == "output.weight"
        flat = t.float().reshape(-1, t.shape[-1])
        exact[name] = quantize_q6(flat) if six else quantize_q4(flat)
    return exact


def experts_bytes(model: Transformer) -> int:
    """Bytes of every layer's expert weights, as the model holds them."""
    total = 0
    for block in model.layers:
        for experts in (block.feed_forward.w13, block.feed_forward.w2):
            total += experts.nbytes if isinstance(experts, KQuantExperts) else experts.weight.nbytes
    return total


def held_bytes(model: Transformer) -> int:
    """Bytes of every parameter and buffer (the rotary tables included)."""
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))


def verify_table(model: Transformer, mode: str, context: int) -> None:
    cfg = model.config
    measured = measure_verify_times(model, xs=XS, contexts=[context], repeats=7, refine=False, progress=False)[context]
    device = measure_local_cpu("bf16")
    predicted = {x: device.predict_tv(cfg, x, context, WEIGHT_BYTES[mode]) for x in XS}
    print(f"\n{mode}: T_v(x) / T_v(1): measured T_v(1) {measured[1] * 1e3:.1f} ms, predicted "
          f"{predicted[1] * 1e3:.1f} ms at {WEIGHT_BYTES[mode]} bytes a weight ({device.note})")
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
        print(f"| {x} | {expected_experts(cfg.n_experts, cfg.n_experts_used, x):.1f} | {m:.2f} | {p:.2f} | "
              f"{100 * (p - m) / m:+.0f}% | {a:.2f} | {100 * (a - m) / m:+.0f}% |")
    print(f"mean |error| {100 * statistics.mean(errors):.1f}% (anchored {100 * statistics.mean(anchored_errors):.1f}%), "
          f"max {100 * max(errors):.1f}% (anchored {100 * max(anchored_errors):.1f}%)")


def layer_table(layers: dict[str, MoEFeedForward], dim: int, dtype: torch.dtype) -> None:
    """Grouped against one call per row, for each kind of experts, the kinds alternated per row count."""
    print("\none MoE layer: grouped expert pass against one expert call per row and choice (median of 7)")
    print("| rows | " + " | ".join(f"{k} grouped ms | {k} per row ms | per row / grouped" for k in layers) + " |")
    print("|---:|" + "---:|---:|---:|" * len(layers))
    with torch.inference_mode():
        for rows in (1, 4, 8, 16, 32):
            x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)).to(dtype)
            cells = []
            for layer in layers.values():
                g, r = median_time(lambda: layer(x), 7), median_time(lambda: per_row(layer, x), 7)
                cells.append(f"{g * 1e3:.2f} | {r * 1e3:.2f} | {r / g:.2f}x")
            print(f"| {rows} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", choices=("bf16", "q4"), default=["bf16", "q4"])
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
    source = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0, 0.02)
    sd = source.canonical_state_dict()
    print(f"model: {cfg.name}: {args.layers} layers, dim {args.dim}, {args.experts} experts of width "
          f"{args.expert_dim}, {args.used} per token, 16 heads of 128 (4 KV), vocab 32768; "
          f"{cfg.n_params / 1e9:.2f} B params; context {args.context}; torch threads {torch.get_num_threads()}")
    layers, sizes = {}, {}
    for mode in args.modes:
        exact = q4_k_m_values(sd) if mode == "q4" else None
        model = build_model(cfg, dict(sd), torch.bfloat16, q4=mode == "q4", q4_exact=exact)
        del exact
        verify_table(model, mode, args.context)
        sizes[mode] = (experts_bytes(model), held_bytes(model))
        layers[mode] = model.layers[0].feed_forward
        if len(args.modes) > 1 and mode != args.modes[-1]:  # one model in memory at a time, its first layer kept
            del model
    print("\nbytes held: | mode | experts (all layers) | per layer | the whole model |")
    print("|---|---:|---:|---:|")
    for mode, (experts, whole) in sizes.items():
        print(f"| {mode} | {experts / 2**20:.1f} MiB | {experts / args.layers / 2**20:.1f} MiB | {whole / 2**20:.1f} MiB |")
    layer_table({("float experts" if m == "bf16" else "k-quant experts"): layer for m, layer in layers.items()},
                args.dim, torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
