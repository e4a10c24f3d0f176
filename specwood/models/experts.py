"""A Mixture-of-Experts layer's expert weights: one projection (gate and up fused, or down) of every
expert in one module, run over each expert's routed rows (`grouped`: every expert's rows one
expert after another, each expert's weights read once for all its rows).

`FloatExperts` holds them as a float tensor [E, N, K]. `KQuantExperts` holds a GGUF file's k-quant
expert tensors (`ffn_{gate,up,down}_exps`, [E, N, K]) as the file stores them, on the same kernels
and in the same packed layout as a dense KQuantLinear: a 3-D tensor's blocks are its experts' 2-D
weights one after another (N rows each, N a multiple of 32, so no block of 32 output channels
straddles two experts), packed once as [E * N, K] and viewed as [E, N / 32, bytes of a block].
Expert e reads only its own slice. `grouped` runs all the experts of a pass in one kernel call (the
rows quantised once, the work spread over (expert, block) pairs): the per-expert Python and
dispatch costs of a loop of calls would be most of a pass's time at a MoE's small expert widths.
Gate and up of one expert run in one call where the file stores them in one type (as a dense fused
gate/up linear), else one call per type, side by side.
"""
from __future__ import annotations

from itertools import groupby
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specwood.models.amx import tile_path
from specwood.models.linears import onednn_linear
from specwood.models.q6k import Q6Linear, Q6Weights
from specwood.models.q8_0 import Q8Linear, Q8Weights
from specwood.models.w4a8 import (Q4Linear, Q4Weights, Q5Linear, Q5Weights, KQuantLinear, kquant_matmul, quantize_q4,
                                  require_q4)

# each weight type's linear: its kernel op and packed layout
LINEARS: dict[type, type[KQuantLinear]] = {Q4Weights: Q4Linear, Q5Weights: Q5Linear, Q6Weights: Q6Linear,
                                           Q8Weights: Q8Linear}


class FloatExperts(nn.Module):
    """Every expert's weight of one projection, floats [E, N, K]."""

    def __init__(self, n_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.n_experts, self.out_features, self.in_features = n_experts, out_features, in_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (the rows routed to `expert`) -> [M, N]."""
        return F.linear(x, self.weight[expert])

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [R, K]: counts[e] rows of expert e, expert after expert -> [R, N]: one matmul an expert."""
        return one_call_an_expert(self, x, counts)


def one_call_an_expert(experts: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`grouped` as a loop: experts(e, its rows) for each expert with rows."""
    outs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outs.append(experts(expert, x[start:start + count]))
            start += count
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class PackedExperts(nn.Module):
    """bf16 float experts on a CPU, each expert's weight reordered once into oneDNN's blocked layout
    (as PackedLinear does for a linear: F.linear re-packs a bf16 weight on every call, which at an
    expert's few rows costs most of the call), with F.linear's bits."""

    def __init__(self, experts: FloatExperts):
        super().__init__()
        self.n_experts, self.out_features = experts.n_experts, experts.out_features
        self.in_features = experts.in_features
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in experts.weight.data]

    @property
    def weight(self) -> torch.Tensor:
        """The plain weights [E, N, K] (a dense copy), for exporting; the forward never needs them."""
        return torch.stack([p.to_dense() for p in self.packed])

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed[expert])

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return one_call_an_expert(self, x, counts)


class KQuantExperts(nn.Module):
    """Every expert's weight of one projection in the file's k-quant types, on our kernels.

    Built from `parts`: the projection's source tensors (gate and up, or down alone), each the
    file's weights of all experts as one [E * N_i, K] KQuantWeights (expert e's rows e * N_i onward).
    Row-exact as KQuantLinear: a row's output never depends on the other rows of the call."""

    no_bias: torch.Tensor  # buffer (register_buffer): the kernels' empty bias

    def __init__(self, parts: list[Any], n_experts: int):
        super().__init__()
        self.kernel, self.tiles = require_q4(), tile_path()
        self.n_experts = n_experts
        self.in_features = parts[0].codes.shape[1]
        self.out_features = sum(p.codes.shape[0] for p in parts) // n_experts
        self.op_names: list[str] = []  # one kernel call per run of parts of one type
        for i, (kind, run) in enumerate(groupby(parts, key=type)):
            linear = LINEARS[kind]
            members = list(run)
            # each expert's rows of every part of the run, one after the other: [E * N_run, K]
            fields = [torch.cat([f.reshape(n_experts, -1, *f.shape[1:]) for f in same], 1).flatten(0, 1)
                      for same in zip(*members)]
            packed = linear.pack(kind(*fields))
            self.register_buffer(f"packed_{i}", packed.view(n_experts, -1, packed.shape[1]), persistent=False)
            self.op_names.append(linear.op)
        self.register_buffer("no_bias", torch.empty(0), persistent=False)

    @staticmethod
    def fits(rows_per_part: int, in_features: int) -> bool:
        """Whether the kernels take experts of this shape (rows of each part, inputs)."""
        return Q4Linear.fits(rows_per_part, in_features)

    @classmethod
    def from_floats(cls, experts: FloatExperts) -> KQuantExperts:
        """Float experts quantised to Q4_K's form (q4-lite)."""
        w = experts.weight.data
        return cls([quantize_q4(w.reshape(-1, w.shape[-1]))], experts.n_experts)

    def packed(self) -> list[torch.Tensor]:
        """Each run's packed weights [E, N_run / 32, bytes of a block]."""
        return [getattr(self, f"packed_{i}") for i in range(len(self.op_names))]

    @property
    def nbytes(self) -> int:
        """Bytes the experts' weights take here."""
        return sum(p.numel() for p in self.packed())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weights [E, N, K] (fp32, a fresh copy), e.g. for a reference model."""
        linears = {linear.op: linear for linear in LINEARS.values()}
        runs = []
        for op, packed in zip(self.op_names, self.packed()):
            flat = packed.reshape(-1, packed.shape[-1])
            weights = linears[op].unpack(flat, self.in_features).dequantize()
            runs.append(weights.view(self.n_experts, -1, self.in_features))
        return runs[0] if len(runs) == 1 else torch.cat(runs, 1)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (the rows routed to `expert`) -> [M, N] in x's dtype."""
        outs = [kquant_matmul(self.kernel, self.tiles, op, x, packed[expert], self.no_bias)
                for op, packed in zip(self.op_names, self.packed())]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [R, K]: counts[e] rows of expert e, expert after expert -> [R, N] in x's dtype, one
        kernel call for all the experts (per type): the bits of one `forward` call per expert."""
        x = x.contiguous()
        outs = [getattr(self.kernel, op.replace("_linear", "_experts"))(x, packed, counts)
                for op, packed in zip(self.op_names, self.packed())]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


# what a MoE layer's gate-up and down projections are, whichever form its weights take
Experts = FloatExperts | PackedExperts | KQuantExperts
