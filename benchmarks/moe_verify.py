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
fixed cost of a call), at the weight mode's bytes per weight, with the uniform-routing bound on
the experts a layer wakes and with the union measured on other random trees
(`measure_expert_union`). Both as T_v(x) / T_v(1). Then where T_v's growth goes (the MoE layers,
timed by hooks, against the rest), one MoE layer over x rows for float and k-quant experts:
grouped (the model's pass) and a loop of one expert call per (row, choice); and the bytes the
experts take in each mode.

    python benchmarks/moe_verify.py [--modes bf16 q4] [--layers 6] [--dim 1024] [--experts 128] [--used 8]
        [--expert-dim 384] [--context 256] [--threads N] [--init scaled|normal-0.02]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specwood.models.config import ModelConfig
from specwood.models.experts import KQuantExperts
from specwood.models.q6k import quantize_q6
from specwood.models.transformer import MoEFeedForward, Transformer, build_model
from specwood.models.w4a8 import quantize_q4
from specwood.planner.analytic import WEIGHT_BYTES
from specwood.planner.devices import expected_experts, measure_local_cpu, moe_ops, union_curve
from specwood.planner.profiler import (_verify_callable, measure_expert_union, measure_verify_times, median_time,
                                       random_tree)

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


def verify_table(model: Transformer, mode: str, context: int) -> dict[int, float]:
    """T_v(x) / T_v(1) measured against the analytic model (the CPU measured by measure_local_cpu),
    with the uniform-routing bound and with the union of experts measured on other random trees
    than the timed ones; each prediction pure and anchored at the measured T_v(1) (what a plan
    that timed T_v(1) here predicts: the model leaves out the forward's fixed costs). Nothing in
    the model is fit to these timings: every x is held out. Returns the measured union."""
    cfg = model.config
    measured = measure_verify_times(model, xs=XS, contexts=[context], repeats=7, refine=False, progress=False)[context]
    union = measure_expert_union(model, XS, context, trees=4, seed=2)
    woken = union_curve(union, cfg.n_experts, cfg.n_experts_used)
    device, weight = measure_local_cpu(mode), WEIGHT_BYTES[mode]
    uniform = {x: device.predict_tv(cfg, x, context, weight) for x in XS}
    routed = {x: device.predict_tv(cfg, x, context, weight, woken=woken) for x in XS}
    print(f"\n{mode}: T_v(x) / T_v(1): measured T_v(1) {measured[1] * 1e3:.1f} ms, predicted {uniform[1] * 1e3:.1f} ms "
          f"at {weight} bytes a weight ({device.note})")
    print("| x | experts a layer: uniform; measured | measured | uniform routing | error | anchored | error "
          "| measured union | error | anchored | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[str, list[float]] = {}
    for x in XS:
        m = measured[x] / measured[1]
        cells = {"uniform": uniform[x] / uniform[1], "uniform anchored": (measured[1] + uniform[x] - uniform[1]) / measured[1],
                 "union": routed[x] / routed[1], "union anchored": (measured[1] + routed[x] - routed[1]) / measured[1]}
        for name, p in cells.items():
            errors.setdefault(name, []).append(abs(p - m) / m)
        print(f"| {x} | {expected_experts(cfg.n_experts, cfg.n_experts_used, x):.1f}; {union[x]:.1f} | {m:.2f} | "
              + " | ".join(f"{p:.2f} | {100 * (p - m) / m:+.0f}%" for p in cells.values()) + " |")
    print("mean |error| over x > 1 (max): " + ", ".join(
        f"{name} {100 * statistics.mean(e[1:]):.1f}% ({100 * max(e):.1f}%)" for name, e in errors.items()))
    return union


def split_table(model: Transformer, mode: str, context: int, union: dict[int, float], repeats: int = 7) -> None:
    """Where T_v(x) goes: the MoE layers' expert passes (timed by hooks inside the same forwards)
    and the rest, measured and as the analytic model counts them (`moe_ops` with the measured
    union against the rest of `forward_ops`), each as growth over x = 1: which part the model
    gets wrong."""
    cfg, device = model.config, measure_local_cpu(mode)
    woken = union_curve(union, cfg.n_experts, cfg.n_experts_used)
    spent = [0.0]

    def start(module, args):
        module.started = time.perf_counter()

    def stop(module, args, out):
        spent[0] += time.perf_counter() - module.started

    hooks = [h for b in model.layers for h in (b.feed_forward.register_forward_pre_hook(start),
                                              b.feed_forward.register_forward_hook(stop))]
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(context + max(XS) + 1)
    cache.k.normal_()
    cache.v.normal_()
    cache.length = context
    fns = {x: _verify_callable(model, cache, context, random_tree(x, gen, cfg.vocab_size)) for x in XS}
    samples: dict[int, list[tuple[float, float]]] = {x: [] for x in XS}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(repeats):  # round-robin over x, as the profiler times them
            for x, fn in fns.items():
                spent[0] = 0.0
                t0 = time.perf_counter()
                fn()
                samples[x].append((time.perf_counter() - t0, spent[0]))
    for h in hooks:
        h.remove()
    weight = WEIGHT_BYTES[mode]

    def predicted_moe(x: int) -> float:
        return sum(device.matmul_time(m, k, n, count, weight) for m, k, n, count, _ in moe_ops(cfg, x, woken))

    print(f"\n{mode}: where T_v(x) goes, growth over x = 1 in ms (medians of {repeats}; MoE = the layers' expert "
          "passes, router and routing included)")
    print("| x | measured MoE | predicted MoE | measured rest | predicted rest |")
    print("|---:|---:|---:|---:|---:|")
    med = {x: (statistics.median(t for t, _ in samples[x]), statistics.median(m for _, m in samples[x])) for x in XS}
    base_moe, base_rest = med[1][1], med[1][0] - med[1][1]
    p_total = {x: device.predict_tv(cfg, x, context, weight, woken=woken) for x in XS}
    for x in XS:
        moe, rest = med[x][1] - base_moe, med[x][0] - med[x][1] - base_rest
        p_moe = predicted_moe(x) - predicted_moe(1)
        p_rest = p_total[x] - predicted_moe(x) - (p_total[1] - predicted_moe(1))
        print(f"| {x} | {moe * 1e3:+.1f} | {p_moe * 1e3:+.1f} | {rest * 1e3:+.1f} | {p_rest * 1e3:+.1f} |")
    print(f"at x = 1: measured MoE {base_moe * 1e3:.1f} ms, rest {base_rest * 1e3:.1f} ms; predicted MoE "
          f"{predicted_moe(1) * 1e3:.1f} ms, rest {(p_total[1] - predicted_moe(1)) * 1e3:.1f} ms")


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
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--init", choices=("scaled", "normal-0.02"), default="scaled",
                    help="random weights: scaled to keep activations O(1), or all N(0, 0.02) (BENCHMARKS §32a's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch="qwen3moe", vocab_size=32768, dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=4,
                      head_dim=128, intermediate_size=args.expert_dim, qk_norm=True, n_experts=args.experts,
                      n_experts_used=args.used, moe_intermediate_size=args.expert_dim, norm_topk_prob=True,
                      max_position_embeddings=4096, name="qwen3moe-scaled")
    torch.manual_seed(0)
    source = Transformer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if args.init == "normal-0.02":  # tiny norms: every token's hidden state alike, its routing too
                p.normal_(0, 0.02)
            elif name.endswith("norm.weight"):  # "scaled": activations O(1), routing spread over the experts
                p.normal_(1.0, 0.1)
            elif name == "tok_embeddings.weight":
                p.normal_(0, 1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    sd = source.canonical_state_dict()
    print(f"model: {cfg.name}: {args.layers} layers, dim {args.dim}, {args.experts} experts of width "
          f"{args.expert_dim}, {args.used} per token, 16 heads of 128 (4 KV), vocab 32768; "
          f"{cfg.n_params / 1e9:.2f} B params; context {args.context}; torch threads {torch.get_num_threads()}; "
          f"init {args.init}")
    layers, sizes = {}, {}
    for mode in args.modes:
        exact = q4_k_m_values(sd) if mode == "q4" else None
        model = build_model(cfg, dict(sd), torch.bfloat16, q4=mode == "q4", q4_exact=exact)
        del exact
        union = verify_table(model, mode, args.context)
        split_table(model, mode, args.context, union)
        sizes[mode] = experts_bytes(model)
        layers[mode] = model.layers[0].feed_forward
        if len(args.modes) > 1 and mode != args.modes[-1]:  # one model in memory at a time, its first layer kept
            del model
    print("\nexperts' bytes held: | mode | all layers | per layer | per expert (gate, up, down) |")
    print("|---|---:|---:|---:|")
    for mode, experts in sizes.items():
        print(f"| {mode} | {experts / 2**20:.1f} MiB | {experts / args.layers / 2**20:.1f} MiB | "
              f"{experts / args.layers / args.experts / 2**10:.0f} KiB |")
    layer_table({("float experts" if m == "bf16" else "k-quant experts"): layer for m, layer in layers.items()},
                args.dim, torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
