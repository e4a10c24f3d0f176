"""Linear layers on quantised or prepacked weights, swapped in for nn.Linear at load time:
OneDnnLinear (large fp32 weights on oneDNN's matmul), PackedLinear (bf16 in oneDNN's blocked
layout), Int4Linear (weight-only int4, for drafts) and Int8Linear (W8A8, row-exact), with the int8
quantisers they use and checks for torch's kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def weight_of(linear: nn.Module) -> torch.Tensor:
    """A linear's weight [N, K]: its parameter's data, or the dequantised copy a quantised one gives."""
    w = linear.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(linear).__name__} has no weight tensor")
    return w.data


def cpu_packing_available() -> bool:
    """oneDNN's packed bf16 linear: it refuses CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_fp32_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on oneDNN's matmul, nothing fused after it: `weight` plain [N, K] or
    reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(nn.Linear):
    """An fp32 nn.Linear (the same weight and bias tensors, so ties and state dicts are unchanged)
    whose forward runs oneDNN's matmul instead of F.linear.

    On CPU F.linear's fp32 kernel (MKL) reads a one-row input's weights on one core and a 2-12-row
    input's at about half the speed of one row; oneDNN uses both cores at every row count: for the
    1.5B target's layer shapes 1.6x faster at 1 row, 2-4x at 2-12 rows (tree verification), 2.3x at
    256 (prefill chunks) on a 2-core Zen 5; 1.2-2.9x with oneDNN held to AVX2 (BENCHMARKS §39;
    not measured on an Intel CPU, whose MKL paths may differ). Results differ from
    F.linear's in the last bits (another summation order), as a different row count's already do.
    oneDNN's fixed cost per call (~11 us here) loses on small weights, hence MIN_WEIGHT; autograd
    has no rule for the op, so inputs that need gradients go through F.linear, as does a module
    moved off the CPU after loading.
    """

    # elements of the smallest weight worth it: 1024 x 512 breaks even at one row
    MIN_WEIGHT = 1 << 19

    @classmethod
    def takes(cls, linear: nn.Module) -> bool:
        if type(linear) is not nn.Linear:
            return False
        w = linear.weight
        return (w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() >= cls.MIN_WEIGHT
                and onednn_fp32_available())

    @classmethod
    def adopt(cls, linear: nn.Module) -> "OneDnnLinear":
        """`linear` itself, now running on oneDNN (no copy of its weights is made)."""
        linear.__class__ = cls
        return linear  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """A bf16 Linear whose weight is reordered once, at load time, into oneDNN's blocked layout.

    F.linear re-packs the weight on every call; for decode-sized inputs (a few rows) that makes it
    read weights at ~15 GB/s where the pre-packed kernel reaches ~20 GB/s on our 2-core CPU, with
    bit-identical results. CPU only.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.data, 1)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight (a dense copy), for exporting; the forward never needs it."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)


def int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


class Int4Linear(nn.Module):
    """Weight-only int4 Linear (asymmetric, per group of 32 inputs) on torch's CPU int4 kernel.

    For draft models only: drafting may be approximate without costing losslessness, and the
    kernel reads a quarter of the bf16 bytes (~3x faster per token on our CPU). Group 32 with a
    scale and a minimum is the layout of GGUF's Q4_K sub-blocks, so Q4_K weights survive nearly
    unchanged. The int4 kernel's cost grows with the rows it multiplies (3.4x one row's at 8 rows,
    28x at 64), so inputs of more than INT4_MAX_ROWS rows (a prompt prefill, a batch of drafts, a
    wide tree layer) go through a second copy of the same int4 weights made for many rows: W8A8
    (Int8Linear) where torch has the int8 kernels -- half the bytes of a bf16 copy and faster from
    4 rows -- else bf16, pre-packed. Activations are bf16.
    """

    GROUP = 32
    INT4_MAX_ROWS = 3

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.data.float()
        n, k = w.shape
        g = w.reshape(n, k // self.GROUP, self.GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        # the kernel computes (q - 8) * scale + zero
        self.scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        self.bias = linear.bias.data.to(torch.bfloat16) if linear.bias is not None else None
        self.in_features, self.out_features = k, n
        # the same int4 weights (as the kernel sees them) for many-row inputs
        sz = self.scales_zeros.float()  # [groups, n, 2]
        deq = ((q.reshape(n, k // self.GROUP, self.GROUP).float() - 8) * sz[..., 0].t()[..., None]
               + sz[..., 1].t()[..., None])
        del q, g, w
        dense = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        dense.weight.data = deq.reshape(n, k).to(torch.bfloat16)
        del deq
        if int8_available():
            self.many_rows: nn.Module = Int8Linear(dense)
        else:
            self.many_rows = PackedLinear(dense) if cpu_packing_available() else dense

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight [N, K] (bf16, a fresh copy, read back through the int4 kernel),
        e.g. to build a reference model with the same draft."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.GROUP, self.scales_zeros).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if flat.shape[0] > self.INT4_MAX_ROWS:
            out = self.many_rows(flat)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.GROUP, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def int8_available() -> bool:
    return hasattr(torch, "_int_mm")


def qlinear_available() -> bool:
    """oneDNN's quantised linear with prepacked weights (x86 CPU builds of torch), on a CPU with a
    VNNI instruction: without one, oneDNN multiplies u8 by s8 with vpmaddubsw, whose int16 sums of
    two products saturate (255 * 127 * 2 > 32767), and the results are wrong by some 10%."""
    from specwood.models.kernels import cpu_flags

    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
            and hasattr(torch.ops.onednn, "qlinear_pointwise")
            and bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}))


def quantize_weight_int8(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], fp32 scales [N]): symmetric per output channel, levels
    -127..127. Converted in chunks of rows, so a vocabulary-sized head never exists in fp32 whole."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, dtype=torch.float32, device=w.device)
    for a in range(0, n, chunk):
        wf = w[a:a + chunk].float()
        s = wf.abs().amax(1).clamp(min=1e-12) / 127
        q[a:a + chunk] = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[a:a + chunk] = s
    return q, scales


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    # abs().amax() in the input dtype is exact and much faster than vector_norm(inf, dtype=fp32)
    return x.abs().amax(-1, keepdim=True).float().div_(127.0).clamp_(min=1e-30)


def quantize_rows_int8(x: torch.Tensor, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) symmetric int8: x [M, K] float -> (int8 [M, K], fp32 scales [M, 1]),
    x ~ q * scale, q in -127..127 (round half up). With `offset` the codes are returned as uint8
    q + 128 (what oneDNN's fast u8 x s8 kernels take, with zero point 128).

    Each row's result depends on that row alone: a token's quantisation is the same whatever
    else is in the batch, which keeps the int8 weight mode lossless against its own
    autoregressive output. (Every step is a max or one correctly rounded elementwise operation,
    so vectorised and scalar loops, and the split across threads, cannot change a value.) Few
    ops on purpose: at a few rows each costs more in dispatch than in arithmetic."""
    scale = _row_scales(x)
    # |x / scale| <= 127 up to one rounding; + 128.5 and truncation = round half up, + 128
    u = torch.div(x, scale).add_(128.5).to(torch.uint8)
    return (u, scale) if offset else (u.bitwise_xor_(0x80).view(torch.int8), scale)  # u - 128, bitwise


class Int8Linear(nn.Module):
    """W8A8 Linear: int8 weights (symmetric, per output channel, quantised once at load; no float
    copy is kept) times per-token dynamically quantised activations, multiplied exactly in
    integers, then rescaled by activation scale x weight scale. Two kernels:

    * "qlinear": oneDNN's quantised linear (torch.ops.onednn.qlinear_pointwise) on a weight
      prepacked once, uint8 activations with zero point 128 (the VNNI u8 x s8 instruction; an int8
      input falls to oneDNN's reference kernel) and activation scale 1 -- the per-token scales are
      applied after, since the op only takes one activation scale per call. Fastest here from 2 rows.
    * "int_mm": torch._int_mm (int8 x int8 -> int32) on the plain [N, K] weight (any device).

    Lossy against the float weights (about 8 bits for each of the two operands), but row-exact:
    the integer products are exact and every other step is elementwise per row, so a token's
    output does not depend on the other rows of the batch -- verifying a tree in one forward
    gives each node exactly what a one-token forward along its path would give (the rest of the
    model, attention above all, has to be row-exact too for bit-identical logits). Activations in
    and out are in the model dtype (bf16 or fp32).
    """

    # torch._int_mm on CUDA wants more than 16 rows and K, N in multiples of 8; the CPU kernel takes any shape
    CUDA_MIN_ROWS = 17
    # buffers (register_buffer): the [N, K] codes for int_mm (None when prepacked for qlinear), the
    # per-channel scales, the bias
    qweight: torch.Tensor | None
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Module, kernel: str | None = None):
        super().__init__()
        w = weight_of(linear)
        n, k = w.shape
        q, scales = quantize_weight_int8(w)
        self.in_features, self.out_features = k, n
        if kernel is None:
            kernel = "qlinear" if q.device.type == "cpu" and qlinear_available() else "int_mm"
        if kernel not in ("qlinear", "int_mm"):
            raise ValueError(f"unknown int8 kernel {kernel!r}")
        self.kernel = kernel
        if kernel == "qlinear":
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)  # the one copy: [K, N] blocked
            self.register_buffer("zero_points", torch.zeros(n, dtype=torch.int64), persistent=False)
            self.qweight = None
        else:
            self.register_buffer("qweight", q, persistent=False)  # _int_mm reads its transposed view
        self.register_buffer("scales", scales, persistent=False)
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", bias.data.float().clone() if bias is not None else None, persistent=False)

    def int8_weight(self) -> torch.Tensor:
        """The int8 codes [N, K] (a copy when prepacked)."""
        return self.qweight if self.qweight is not None else self.packed.to_dense().t().contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (fp32, a fresh copy), e.g. to build a reference model; the
        forward never needs it."""
        return self.int8_weight().float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features) if x.dim() != 2 else x
        if self.kernel == "qlinear" or self.qweight is None:  # (int_mm holds qweight)
            u, xs = quantize_rows_int8(flat, offset=True)
            # acc * 1.0 * weight scale, in fp32 (the activation scale 1 keeps it exact per row)
            out = torch.ops.onednn.qlinear_pointwise(u, 1.0, 128, self.packed, self.scales, self.zero_points, None,
                                                     1.0, 0, torch.float32, "none", [], "").mul_(xs)
        else:
            q, xs = quantize_rows_int8(flat)
            m = q.shape[0]
            if q.is_cuda and m < self.CUDA_MIN_ROWS:
                acc = torch._int_mm(F.pad(q, (0, 0, 0, self.CUDA_MIN_ROWS - m)), self.qweight.t())[:m]
            else:
                acc = torch._int_mm(q, self.qweight.t())
            out = torch.mul(acc, xs).mul_(self.scales)  # int32 x fp32 -> fp32; then the weight scales
        if self.bias is not None:
            out = out.add_(self.bias)
        out = out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)
