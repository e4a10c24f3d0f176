"""Analytic device models: predict T_v(x, ctx) and T_d(x, ctx) for hardware we do not have.

A forward over x tokens after ctx cached ones is a list of matmuls (weights, attention, head);
each costs max(compute time, memory time) -- a per-operation roofline -- and the forward adds
them up. FPGA boards are modelled as a PE array of rows x cols MACs at a clock (the seed paper's
FlightLLM variants), whose utilisation has ceiling effects in the number of token rows M:

* M <= rows: the rows hold floor(rows / M) K-slices of each of the M tokens, so a GEMV (M = 1)
  uses every PE and e.g. M = 48 on 64 rows uses 75 % of them;
* M > rows: ceil(M / rows) passes, utilisation M / (rows * ceil(M / rows));
* the N output features go over the cols with utilisation N / (cols * ceil(N / cols)).

GPU/CPU profiles use peak dense FLOP/s and bandwidth times efficiency factors.
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from specwood.errors import SpecwoodError
from specwood.models.config import ModelConfig

FPGA_CLOCK_HZ = 225e6  # FlightLLM's U280 design clock; the seed paper does not restate it


@dataclass(frozen=True)
class DeviceModel:
    name: str
    kind: str  # "fpga", "gpu" or "cpu"
    peak_flops: float  # dense FLOP/s at the weight dtype
    mem_bw: float  # bytes/s
    pe_rows: int | None = None
    pe_cols: int | None = None
    clock_hz: float | None = None
    bw_efficiency: float = 0.8  # achieved / peak bandwidth
    flops_efficiency: float = 1.0
    overhead_s: float = 0.0  # fixed cost per forward (launches, host round trip)
    call_s: float = 0.0  # fixed cost per matmul call (a CPU op's dispatch; a MoE layer makes one per woken expert)
    note: str = ""

    @classmethod
    def pe_array(cls, name: str, rows: int, cols: int, bw_gbs: float, clock_hz: float = FPGA_CLOCK_HZ,
                 note: str = "") -> "DeviceModel":
        # The seed paper's Table IV AR throughputs scale exactly with HBM bandwidth and imply ~20 GB
        # moved per Llama-3.1-8B token (16 GB of fp16 weights): ~80 % achieved bandwidth.
        return cls(name, "fpga", 2.0 * rows * cols * clock_hz, bw_gbs * 1e9, rows, cols, clock_hz,
                   bw_efficiency=0.8, note=note)

    # --- roofline of one matmul ---------------------------------------------------------------

    def utilisation(self, m: int, n: int) -> float:
        if self.pe_rows is None or self.pe_cols is None:
            return 1.0
        r, c = self.pe_rows, self.pe_cols
        rows = (r // m) * m / r if m <= r else m / (r * math.ceil(m / r))
        cols = n / (c * math.ceil(n / c))
        return rows * cols

    def matmul_time(self, m: float, k: int, n: int, count: float, bytes_per_elem: float) -> float:
        """`count` matmuls [m, k] x [k, n] whose right operand (weights or KV) is read from memory."""
        flops = 2.0 * m * k * n * count
        compute = flops / (self.peak_flops * self.flops_efficiency * self.utilisation(m, n))
        memory = k * n * count * bytes_per_elem / (self.mem_bw * self.bw_efficiency)
        return max(compute, memory) + count * self.call_s

    @property
    def ridge_tokens(self) -> float:
        """Where a 2-byte-weight GEMM turns compute-bound: x_R ~ peak / (bandwidth per weight)."""
        return self.peak_flops * self.flops_efficiency / (self.mem_bw * self.bw_efficiency)

    # --- model forwards ------------------------------------------------------------------------

    def forward_time(self, cfg: ModelConfig, x: int, ctx: int, weight_bytes: float = 2.0,
                     kv_bytes: float = 2.0, woken: Callable[[int], float] | None = None) -> float:
        """One forward over x tokens after ctx cached tokens (tree attention: every token reads
        the whole prefix plus at most x tree slots). `woken`: a MoE layer's distinct experts for x
        rows, measured (profiler.measure_expert_union, union_curve); None: the uniform-routing bound."""
        total = self.overhead_s
        for m, k, n, count, kind in forward_ops(cfg, x, ctx, woken):
            total += self.matmul_time(m, k, n, count, weight_bytes if kind == "w" else kv_bytes)
        return total

    def predict_tv(self, cfg: ModelConfig, x: int, ctx: int, weight_bytes: float = 2.0,
                   woken: Callable[[int], float] | None = None) -> float:
        return self.forward_time(cfg, x, ctx, weight_bytes, woken=woken)

    def predict_td(self, draft: ModelConfig | None, x: int, ctx: int, method: str = "dyspec",
                   weight_bytes: float = 2.0) -> float:
        """Drafting a tree of x tokens: the draft forwards the method needs (see draft_forwards)."""
        if draft is None:
            return 0.0
        return sum(self.forward_time(draft, tokens, ctx, weight_bytes) * n
                   for n, tokens in draft_forwards(method, x))


def forward_ops(cfg: ModelConfig, x: int, ctx: int, woken: Callable[[int], float] | None = None
                ) -> list[tuple[float, int, int, float, str]]:
    """(M, K, N, count, operand) for every matmul of a forward; operand "w" = weights, "kv" = cache.
    Attention groups the query heads that share a KV head (GQA), so M = x * group. A sliding
    layer's queries read at most its window. MoE layers (`moe_ops`) read only the experts routed to."""
    hd, nh, nkv, d, inter, layers = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.dim, cfg.intermediate_size, cfg.n_layers
    group = nh // nkv
    spans = [ctx + x if kind == "full_attention" or not cfg.sliding_window else min(ctx, cfg.sliding_window) + x
             for kind in (cfg.layer_types or ["full_attention"] * layers)]
    mlp = moe_ops(cfg, x, woken) if cfg.n_experts else [
        (x, d, 2 * inter, layers, "w"),  # gate + up
        (x, inter, d, layers, "w"),  # down
    ]
    attention = [op for span in sorted(set(spans)) for op in (
        (x * group, hd, span, spans.count(span) * nkv, "kv"),  # Q K^T
        (x * group, span, hd, spans.count(span) * nkv, "kv"))]  # P V
    return [
        (x, d, (nh + 2 * nkv) * hd, layers, "w"),  # q, k, v
        (x, nh * hd, d, layers, "w"),  # attention output
        *mlp,
        *attention,
        (x, d, cfg.vocab_size, 1, "w"),  # LM head
    ]


def expected_experts(n_experts: int, used: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` rows wake when each routes to `used` of
    `n_experts` uniformly: E (1 - (1 - k/E)^x). The bound a tree's verify reads under uniform
    routing; real routers concentrate (fewer experts), so it is the planner's pessimistic side."""
    return n_experts * (1.0 - (1.0 - used / n_experts) ** tokens)


def union_curve(points: dict[int, float], n_experts: int, used: int) -> Callable[[int], float]:
    """A union of experts measured at some x (profiler.measure_expert_union) as the analytic model's
    `woken`: linear between measured x, and past the last one growing as the uniform bound grows."""
    xs = sorted(points)

    def woken(x: int) -> float:
        if x <= xs[0]:
            return points[xs[0]] * x / xs[0]
        if x >= xs[-1]:
            return min(n_experts, points[xs[-1]] * expected_experts(n_experts, used, x)
                       / expected_experts(n_experts, used, xs[-1]))
        hi = next(i for i, v in enumerate(xs) if v >= x)
        a, b = xs[hi - 1], xs[hi]
        return points[a] + (points[b] - points[a]) * (x - a) / (b - a)

    return woken


def moe_ops(cfg: ModelConfig, x: int, woken: Callable[[int], float] | None = None
            ) -> list[tuple[float, int, int, float, str]]:
    """A MoE layer's matmuls over x rows: the router, then each woken expert once over the rows
    routed to it (grouped, as the model runs them): the weights of the union of experts are read
    (`woken(x)` experts a layer, measured on the workload, else the uniform-routing bound), and
    x * k rows of expert work are done in all. Each woken expert also pays call_s twice (a float
    expert's two matmul calls on a CPU; the k-quant experts run in one call a projection but pay
    about as much per expert beyond their bytes for their few rows: BENCHMARKS history, models §32b)."""
    d, inter, layers = cfg.dim, cfg.moe_intermediate_size, cfg.n_layers
    union = (min(woken(x), float(cfg.n_experts)) if woken is not None
             else expected_experts(cfg.n_experts, cfg.n_experts_used, x))
    rows = x * cfg.n_experts_used / union  # rows per woken expert, on average
    return [
        (x, d, cfg.n_experts, layers, "w"),  # the router
        (rows, d, 2 * inter, layers * union, "w"),  # each woken expert's gate + up
        (rows, inter, d, layers * union, "w"),  # and down
    ]


def draft_forwards(method: str, x: int) -> list[tuple[int, int]]:
    """(number of draft forwards, tokens per forward) to draft a tree of x tokens.

    chain: one token per forward; dyspec (heap): one forward per expanded node, about half the
    nodes, 2 tokens each; pld: none; layer-wise shapes (static, sequoia, prior, eagle,
    dyspec-threshold, early-exit): one forward per level, depth ~ 1.5 ln x + 1 (Eq. 11's Depth(x)).
    """
    from specwood.drafting.shapes import SHAPE_CLASSES

    n = x - 1
    if n <= 0 or (method in SHAPE_CLASSES and not SHAPE_CLASSES[method].needs_model):  # pld
        return []
    if method == "chain":
        return [(n, 1)]
    if method == "dyspec":
        f = max(1, math.ceil(n / 2))
        return [(f, 2)]
    depth = min(n, math.ceil(1.5 * math.log(x)) + 1)
    return [(depth, max(1, math.ceil(x / depth)))]


# ---------------------------------------------------------------------------------------------
# built-in profiles


def _gpu(name: str, tflops: float, gbs: float, note: str) -> DeviceModel:
    # 80 % of peak bandwidth and 70 % of peak tensor throughput are typical for decoding kernels
    return DeviceModel(name, "gpu", tflops * 1e12, gbs * 1e9, bw_efficiency=0.8, flops_efficiency=0.7, note=note)


PROFILES: dict[str, DeviceModel] = {
    d.name: d
    for d in (
        # seed paper Table IV (FlightLLM scaled to four boards)
        DeviceModel.pe_array("u280", 64, 48, 460, note="AMD Alveo U280, 64x48 PE, 460 GB/s HBM"),
        DeviceModel.pe_array("vhk158", 128, 64, 819, note="AMD Versal VHK158, 128x64 PE, 819 GB/s HBM"),
        DeviceModel.pe_array("v80", 128, 128, 819, note="AMD Alveo V80, 128x128 PE, 819 GB/s HBM"),
        DeviceModel.pe_array("u250", 128, 128, 77, note="AMD Alveo U250, 128x128 PE, 77 GB/s DDR"),
        # published dense bf16 tensor throughput (fp32 accumulate) and memory bandwidth
        _gpu("a100", 312, 2039, "NVIDIA A100 SXM 80GB"),
        _gpu("h100", 989, 3350, "NVIDIA H100 SXM"),
        _gpu("l40", 181, 864, "NVIDIA L40"),
        _gpu("rtx3090", 71, 936, "NVIDIA GeForce RTX 3090"),
        _gpu("rtx4090", 165, 1008, "NVIDIA GeForce RTX 4090"),
    )
}
ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "3090": "rtx3090", "4090": "rtx4090", "cpu": "local-cpu"}


def device_names() -> list[str]:
    return sorted(PROFILES) + ["local-cpu"]


def get_device(name: str, dtype: str = "bf16") -> DeviceModel:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key == "local-cpu":
        return measure_local_cpu(dtype)
    if key not in PROFILES:
        raise SpecwoodError(f"unknown device '{name}'; choose local or one of: {', '.join(device_names())}")
    return PROFILES[key]


@functools.cache
def measure_local_cpu(dtype: str = "bf16", seconds: float = 1.5) -> DeviceModel:
    """Measure this CPU: read bandwidth from a large tensor reduction, matmul FLOP/s at `dtype`
    (about a second). The numbers are achieved rates, so the efficiencies are 1."""
    import torch

    def median_s(fn, n: int) -> float:
        fn()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    big = torch.ones(48 * 2**20, dtype=torch.float32)  # 192 MiB: far beyond any cache
    bw = big.numel() * 4 / median_s(lambda: big.sum(), 5)
    del big
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.bfloat16, "fp32": torch.float32}.get(dtype, torch.bfloat16)
    n = 1024
    a, b = torch.randn(n, n).to(tdtype), torch.randn(n, n).to(tdtype)
    flops = 2.0 * n**3 / median_s(lambda: a @ b, 5)
    # a small matmul's fixed cost: what a MoE layer pays per woken expert beside reading its weights
    x, w = torch.randn(1, 64).to(tdtype), torch.randn(64, 64).to(tdtype)
    call = median_s(lambda: [torch.nn.functional.linear(x, w) for _ in range(100)], 5) / 100
    return DeviceModel("local-cpu", "cpu", flops, bw, bw_efficiency=1.0, flops_efficiency=1.0, call_s=call,
                       note=f"measured: {bw / 1e9:.1f} GB/s read, {flops / 1e9:.0f} GFLOP/s {dtype} matmul, "
                            f"{call * 1e6:.0f} µs a small matmul call")


# ---------------------------------------------------------------------------------------------
# model shapes without weights


def _cfg(arch: str, vocab: int, dim: int, layers: int, heads: int, kv: int, inter: int, tie: bool = False,
         name: str = "", ctx: int = 32768) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                       intermediate_size=inter, tie_embeddings=tie, qkv_bias=arch == "qwen2",
                       max_position_embeddings=ctx, name=name)


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": _cfg("llama", 32000, 4096, 32, 32, 32, 11008, name="llama2-7b", ctx=4096),
    "llama2-13b": _cfg("llama", 32000, 5120, 40, 40, 40, 13824, name="llama2-13b", ctx=4096),
    "vicuna-7b": _cfg("llama", 32000, 4096, 32, 32, 32, 11008, name="vicuna-7b", ctx=4096),
    "vicuna-13b": _cfg("llama", 32000, 5120, 40, 40, 40, 13824, name="vicuna-13b", ctx=4096),
    "llama3.1-8b": _cfg("llama", 128256, 4096, 32, 32, 8, 14336, name="llama3.1-8b", ctx=131072),
    "llama-68m": _cfg("llama", 32000, 768, 2, 12, 12, 3072, name="llama-68m", ctx=2048),
    "qwen2.5-0.5b": _cfg("qwen2", 151936, 896, 24, 14, 2, 4864, tie=True, name="qwen2.5-0.5b"),
    "qwen2.5-1.5b": _cfg("qwen2", 151936, 1536, 28, 12, 2, 8960, tie=True, name="qwen2.5-1.5b"),
    "qwen2.5-7b": _cfg("qwen2", 152064, 3584, 28, 28, 4, 18944, name="qwen2.5-7b"),
    "qwen3-0.6b": replace(_cfg("qwen3", 151936, 1024, 28, 16, 8, 3072, tie=True, name="qwen3-0.6b", ctx=40960),
                          head_dim=128, qk_norm=True),
    "qwen3-8b": replace(_cfg("qwen3", 151936, 4096, 36, 32, 8, 12288, name="qwen3-8b", ctx=40960),
                        head_dim=128, qk_norm=True),
    "qwen3-30b-a3b": replace(_cfg("qwen3moe", 151936, 2048, 48, 32, 4, 6144, name="qwen3-30b-a3b", ctx=40960),
                             head_dim=128, qk_norm=True, n_experts=128, n_experts_used=8, moe_intermediate_size=768,
                             norm_topk_prob=True),
}
# analytic default drafts: a same-family small model, else an EAGLE/LongSpec-style one-layer draft
DEFAULT_DRAFTS = {"llama2-7b": "llama-68m", "llama2-13b": "llama-68m", "vicuna-7b": "llama-68m",
                  "vicuna-13b": "llama-68m", "qwen2.5-1.5b": "qwen2.5-0.5b", "qwen2.5-7b": "qwen2.5-0.5b",
                  "qwen3-8b": "qwen3-0.6b", "qwen3-30b-a3b": "qwen3-0.6b"}


def one_layer_draft(target: ModelConfig) -> ModelConfig:
    """An EAGLE/LongSpec-style draft: one decoder layer at the target's width plus its LM head."""
    return replace(target, n_layers=1, name=f"{target.name or 'target'}-1layer")


def resolve_config(name_or_path: str, target: ModelConfig | None = None) -> ModelConfig:
    """A model's shape without loading weights: a preset, "one-layer" (needs the target), a
    registry name or .gguf file (GGUF header only) or a Hugging Face folder (config.json)."""
    import json
    from pathlib import Path

    key = str(name_or_path).strip()
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    if key.lower() in ("one-layer", "eagle", "1layer"):
        if target is None:
            raise SpecwoodError("a one-layer draft needs the target's shape")
        return one_layer_draft(target)
    from specwood.models.registry import REGISTRY, ensure_model

    path = ensure_model(key.lower()) if key.lower() in REGISTRY else Path(key).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from specwood.models.gguf_file import config_from_gguf, read_gguf_header

        return config_from_gguf(read_gguf_header(path))
    raise SpecwoodError(f"unknown model shape '{name_or_path}': give a preset ({', '.join(sorted(PRESETS))}), "
                        "a registry name, a .gguf file or a Hugging Face folder")


def default_draft_name(target: str) -> str:
    from specwood.models.registry import default_draft_for

    return DEFAULT_DRAFTS.get(target.strip().lower()) or default_draft_for(target) or "one-layer"


def analytic_tables(device: DeviceModel, target: ModelConfig, draft: ModelConfig | None, method: str,
                    contexts: Sequence[int], x_max: int = 128, weight_bytes: float = 2.0
                    ) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]]]:
    """Predicted T_v and T_d at every x in 1..x_max for each context bucket."""
    tv = {c: {x: device.predict_tv(target, x, c, weight_bytes) for x in range(1, x_max + 1)} for c in contexts}
    td = {c: {x: device.predict_td(draft, x, c, method, weight_bytes) for x in range(1, x_max + 1)} for c in contexts}
    return tv, td
