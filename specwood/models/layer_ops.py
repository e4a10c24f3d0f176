"""The small operations of a decoder layer -- RMSNorm, the rotary embedding, the SiLU-gated product,
attention, a MoE router's logits -- in torch operators, or in one C++ call each on an AVX512 or AVX2 CPU
(`kernels/layer_ops.cpp`).

The model's modules hold one of these objects as `ops` and call it; `Transformer.use_layer_kernels`
swaps the torch implementation for the kernels where they fit. At a few rows a forward the torch
versions are mostly dispatch (BENCHMARKS.md §7o).
"""
from __future__ import annotations

import sys

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specwood.models.kernels import AVX512_FLAGS, CpuKernel, build_for_this_cpu, cpu_flags
from specwood.models.rope import apply_rope

# -ffp-contract=off: RoPE's products and sums rounded one by one, as torch's operators do.
# AVX512-BF16 where the CPU has it: bf16 attention multiplies pairs without widening them.
AVX512_KERNEL = CpuKernel("specwood_layer_ops", "layer_ops.cpp",
                          ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-ffp-contract=off", "-fopenmp"]
                          + (["-mavx512bf16"] if "avx512_bf16" in cpu_flags() else []),
                          AVX512_FLAGS, "the fused layer operations")
# The same source on AVX2 + FMA (kernels/avx512_on_avx2.h): the same bits at half the vector width.
AVX2_KERNEL = CpuKernel("specwood_layer_ops_avx2", "layer_ops.cpp",
                        ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-DSPECWOOD_AVX2"],
                        ("avx2", "fma"), "the fused layer operations")
KERNEL = build_for_this_cpu(AVX512_KERNEL, AVX2_KERNEL)  # this CPU's build


class TorchLayerOps:
    """The reference implementations (any device, any dtype)."""

    def __deepcopy__(self, memo: dict) -> "TorchLayerOps":
        # stateless and shared by every module (the kernels' version holds a compiled extension
        # module, which cannot be copied): a copied model points at the same operations
        return self

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # normalise in fp32 like the reference implementations, so bf16 stays close to them
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, (H + 2 H_kv) D], cos/sin [B, 1, T, D] -> q [B, H, T, D] and k, v [B, H_kv, T, D], q
        and k rotated."""
        B, T, width = qkv.shape
        hd = width // (n_heads + 2 * n_kv)
        q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
        q = q.reshape(B, T, n_heads, hd).transpose(1, 2)
        k = k.reshape(B, T, n_kv, hd).transpose(1, 2)
        v = v.reshape(B, T, n_kv, hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's gated product: GELU (tanh approximation) of the gate times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def router_logits(self, x: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """A MoE router's logits for rows x [N, dim]: the module itself here (row-exact as far
        as its kernel is: MKL's fp32 matmul is not)."""
        return router(x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, H_kv, S, D], mask: a bool [B, 1, T, S] on CUDA, an additive
        [B, 1, groups*T, S] bias on a CPU (see cpu_attention_mask) -> [B, T, H D]. `scale`
        multiplies q.k (None: 1/sqrt(D))."""
        B, H, T, D = q.shape
        n_kv = k.shape[1]
        if not q.is_cuda:  # the query heads of a KV head as the rows of one call
            out = F.scaled_dot_product_attention(q.reshape(B, n_kv, H // n_kv * T, D), k, v,
                                                 attn_mask=mask, scale=scale).view(B, H, T, D)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv != H, scale=scale)
        return out.transpose(1, 2).reshape(B, T, H * D)


class KernelLayerOps(TorchLayerOps):
    """The same operations as single calls into `kernels/layer_ops.cpp` (CPU, fp32 or bf16).

    Not bit-identical to the torch versions (their own exp, summation order), but row-exact,
    which is what lossless tree verification needs of them. Attention runs here for blocks of any
    size -- decode steps, drafts, trees of any width, prompt chunks: one attention for rows of any
    kind, so the K/V of a token computed in a prompt chunk equal those computed one token a step
    (prefix reuse is bit-exact against a fresh prefill) and a wide tree's node attends as the
    one-token forward along its path. On the 2-core Zen 4 it also prefills faster than torch's
    flash attention did for chunks (BENCHMARKS.md §19d)."""

    def __init__(self, kernel: Any = None) -> None:
        """`kernel`: a built module of `kernels/layer_ops.cpp` (default: this checkout's, built on
        first use); benchmarks pass an earlier revision's."""
        self.kernel = kernel if kernel is not None else KERNEL.load()
        if self.kernel is None:
            raise RuntimeError(KERNEL.failure)

    @staticmethod
    def fits(dim: int, head_dim: int, intermediate: int, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and dim % 16 == 0 and head_dim % 16 == 0 \
            and head_dim <= 256 and intermediate % 16 == 0

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """A model built for the CPU may be moved to a GPU or cast after: then torch's versions run."""
        return x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self.takes(x) or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return self.kernel.rms_norm(flat, weight, eps).view(x.shape)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As TorchLayerOps.rope_qk, but q comes back as [B, T, H, D] (the kernel attention's
        layout: a view of qkv, rotated in place)."""
        if not self.takes(qkv):
            return super().rope_qk(qkv, cos, sin, n_heads, n_kv)
        B, T, width = qkv.shape
        hd = width // (n_heads + 2 * n_kv)
        if cos.shape[0] != B:  # one set of positions for the whole batch
            cos, sin = cos.expand(B, -1, -1, -1), sin.expand(B, -1, -1, -1)
        self.kernel.rope_(qkv.view(B * T, width), cos.reshape(B * T, hd).contiguous(),
                          sin.reshape(B * T, hd).contiguous(), n_heads + n_kv, hd)
        heads = qkv.view(B, T, n_heads + 2 * n_kv, hd)
        q = heads[:, :, :n_heads]
        k = heads[:, :, n_heads:n_heads + n_kv].transpose(1, 2)
        v = heads[:, :, n_heads + n_kv:].transpose(1, 2)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.takes(gate_up):
            return super().silu_mul(gate_up)
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        return self.kernel.silu_mul(flat.contiguous()).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    def router_logits(self, x: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """Each row's dots alone, in one order (`linear_rows`), for a router that is a plain
        linear: which experts a token gets must not depend on the rows beside it, and MKL's fp32
        matmul (the router of a model in fp32, as on a CPU without bf16) sums in an order that
        does. A packed one (bf16 on oneDNN) keeps its kernel, row-exact already."""
        w = router.weight if isinstance(router, nn.Linear) and router.bias is None else None
        if w is None or not self.takes(x) or w.dtype != x.dtype or x.shape[-1] % 16 or not w.is_cpu:
            return super().router_logits(x, router)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return self.kernel.linear_rows(flat, w.contiguous()).view(*x.shape[:-1], w.shape[0])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """q [B, T, H, D] from rope_qk here (torch's layout where rope_qk handed over to torch),
        the rest as TorchLayerOps.attention."""
        if not self.takes(q):
            return super().attention(q, k, v, mask, scale)
        B, T, H, D = q.shape
        if mask.shape[0] != B:
            mask = mask.expand(B, -1, -1, -1)
        return self.kernel.attention(q, k, v, mask, D ** -0.5 if scale is None else scale)


TORCH_OPS = TorchLayerOps()
_kernel_ops: KernelLayerOps | None = None


def kernel_layer_ops() -> KernelLayerOps | None:
    """The kernels' implementation, or None where they cannot be built (see KERNEL.failure)."""
    global _kernel_ops, _fallback_said
    if _kernel_ops is None and KERNEL.load() is not None:
        _kernel_ops = KernelLayerOps()
    if _kernel_ops is None and not _fallback_said and not KERNEL.missing_flags():
        _fallback_said = True  # a failed build (no compiler): one line, then torch's operations
        print(f"[load] {KERNEL.failure}; the layers' small operations run on torch instead", file=sys.stderr)
    return _kernel_ops


_fallback_said = False
