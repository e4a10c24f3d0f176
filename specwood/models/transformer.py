"""A compact Llama-family decoder with one pure forward over explicit positions and mask.

`forward(tokens, positions, mask, cache, slots)` is all the engine needs: autoregressive decoding
is a one-token forward, verifying a token tree is a forward over the tree's nodes with the tree
mask, and a pipeline stage is the same class built over a layer range.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specwood.errors import ContextLengthError, ModelFileError, SpecwoodError
from specwood.models.cache import KVCache, Rows
from specwood.models.config import ModelConfig
from specwood.models.layer_ops import TORCH_OPS, KernelLayerOps, TorchLayerOps, kernel_layer_ops
from specwood.models.rope import rope_tables

if TYPE_CHECKING:
    from specwood.models.gguf_loader import KQuantWeights


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


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
        deq = (q.reshape(n, k // self.GROUP, self.GROUP).float() - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
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
    """oneDNN's quantised linear with prepacked weights (x86 CPU builds of torch)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
            and hasattr(torch.ops.onednn, "qlinear_pointwise"))


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

    def __init__(self, linear: nn.Module, kernel: str | None = None):
        super().__init__()
        w = linear.weight.data if isinstance(linear.weight, torch.Tensor) else linear.weight
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
        if self.kernel == "qlinear":
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def cpu_attention_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask [B, 1, groups*T, S] every layer's attention takes on a CPU, built once per forward.

    The query heads of each KV head attend as the rows of one SDPA call, so the mask is repeated
    per head of the group: SDPA's enable_gqa is 4-12x slower there for one query row over a long
    context (2.3 vs 0.19 ms per layer at 2k tokens; BENCHMARKS.md §7i), and never faster. It is an
    additive bias in the activations' dtype, which is what SDPA turns a bool mask into in every
    layer otherwise (with the repeat, 0.9 of a 0.5B draft's 16 ms forward; §7k)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1) if groups > 1 else bias


@dataclass
class RowBlock:
    """How a [B, T] block of a forward's tokens attends: the rotary tables of their positions, the
    mask over their cache rows' slots (built once per forward), where their K/V go, and which
    cache rows they are. A forward is one block, or several packed one after another (prefill
    chunks beside decode rows): the linears run on all tokens at once, attention block by block."""

    size: tuple[int, int]  # B, T
    cos: torch.Tensor  # [B, 1, T, head_dim]
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, T, S] bool on CUDA; an additive [B, 1, groups*T, S] bias on a CPU
    slots: torch.Tensor | None  # [T] or [B, T]
    rows: Rows


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        # q, k and v in one matmul: one weight read and one kernel launch per layer
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor, blocks: list[RowBlock], cache: KVCache | None, layer: int) -> torch.Tensor:
        # x is [B, T, dim] for one block, or [1, N, dim]: the blocks' tokens one after another
        qkv = self.wqkv(x)
        flat, parts, start = qkv.view(-1, qkv.shape[-1]), [], 0
        for blk in blocks:
            B, T = blk.size
            parts.append(self.attend(flat[start:start + B * T].view(B, T, -1), blk, cache, layer).view(B * T, -1))
            start += B * T
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.wo(out.view(*x.shape[:-1], -1))

    def attend(self, qkv: torch.Tensor, blk: RowBlock, cache: KVCache | None, layer: int) -> torch.Tensor:
        """One block's attention: qkv [B, T, (H + 2 H_kv) D] -> [B, T, H D]."""
        q, k, v = self.ops.rope_qk(qkv, blk.cos, blk.sin, self.n_heads, self.n_kv)
        if cache is not None:
            cache.write(layer, blk.slots, k, v, blk.rows)
            k, v = cache.read(layer, blk.mask.shape[-1], blk.rows)
        return self.ops.attention(q, k, v, blk.mask)


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(c.dim, 2 * c.intermediate_size, bias=False)  # gate and up fused
        self.w2 = nn.Linear(c.intermediate_size, c.dim, bias=False)
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.silu_mul(self.w13(x)))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor, blocks: list[RowBlock], cache: KVCache | None, layer: int) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), blocks, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or the pipeline stage holding layers `layers` (a range)."""

    def __init__(self, config: ModelConfig, layers: range | None = None, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.layer_range = layers if layers is not None else range(config.n_layers)
        if not (0 <= self.layer_range.start < self.layer_range.stop <= config.n_layers):
            raise ValueError(f"layer range {self.layer_range} outside 0..{config.n_layers}")
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == config.n_layers
        on_meta = torch.empty(0).device.type == "meta"
        # on meta the table is not initialised: Embedding's normal_ on meta imports torch._dynamo (~1 s a load)
        table = torch.empty(config.vocab_size, config.dim) if on_meta else None
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=table) if self.is_first else None
        self.layers = nn.ModuleList(Block(config) for _ in self.layer_range)
        self.norm = RMSNorm(config.dim, config.norm_eps) if self.is_last else None
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False) if self.is_last else None
        self.max_positions = max_positions or config.max_position_embeddings
        self.q4_lite = False  # quantize_q4's choice: every weight in 4 bits, not the file's types
        self.weights_in_floats: list[str] = []  # what quantize_q4 found no kernel for
        # under a meta-device context (build_model) the tables are filled in after allocation
        cos, sin = (torch.empty(0), torch.empty(0)) if on_meta else rope_tables(config, self.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attention_norm.weight.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), c.n_kv_heads, c.head_dim, max_len, batch, self.dtype, self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        output_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: Rows = None,
    ) -> torch.Tensor:
        """Run the stage.

        tokens: [B, T] ids on the first stage, else hidden states [B, T, dim] from the previous one.
        positions: [T] or [B, T] sequence positions (for RoPE); the caller keeps them inside the
            context (`check_positions`): checking here would cost a host sync per forward.
        mask: bool [T, S] or [B, T, S]; True = may attend. Column j is cache slot j (or, without a
            cache, input token j). None means causal over the T inputs.
        cache/slots/rows: write this step's K/V to `slots` ([T], or [B, T] per batch row) of the
            cache rows `rows` (None: cache row b is batch row b) and attend over their slots [0, S).
        output_rows: on the last stage, only compute logits for these input rows [T'] (saves the
            large vocabulary matmul for the prompt's earlier tokens), or for the (batch, token)
            index pairs (b [N], t [N]) of a padded batch, giving logits [N, V].
        Returns logits [B, T', V] or [N, V] (fp32) on the last stage, hidden states otherwise.
        """
        x = self.hidden(tokens, positions, mask, cache, slots, rows)
        return x if not self.is_last else self.head(x, output_rows)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
               cache: KVCache | None = None, slots: torch.Tensor | None = None, rows: Rows = None) -> torch.Tensor:
        """The embeddings (first stage) and this stage's layers: hidden states [B, T, dim]."""
        blk = self.row_block(tokens.shape[:2], positions, mask, cache, slots, rows)
        return self.layers_over(self.embed(tokens), [blk], cache)

    def hidden_packed(self, parts: list[tuple[torch.Tensor, ...]], cache: KVCache) -> torch.Tensor:
        """Several padded blocks (tokens [B, T(, dim)], positions, mask, slots, rows) in one pass
        over the layers: each weight is read once for all of them (a decode step riding along
        with a prefill chunk costs a few rows of compute, not a second pass over the weights).
        Hidden states [N, dim] of every block's B*T tokens, block after block."""
        blocks = [self.row_block(t.shape[:2], p, m, cache, s, r) for t, p, m, s, r in parts]
        embedded = [self.embed(t).flatten(0, 1) for t, *_ in parts]
        x = embedded[0] if len(embedded) == 1 else torch.cat(embedded)
        return self.layers_over(x[None], blocks, cache)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens) if self.is_first else tokens

    def layers_over(self, x: torch.Tensor, blocks: list[RowBlock], cache: KVCache | None) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            x = block(x, blocks, cache, i)
        return x

    def row_block(self, size: tuple[int, int], positions: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None, slots: torch.Tensor | None, rows: Rows) -> RowBlock:
        """What the layers need of a [B, T] block, built once per forward: rotary tables of its
        positions ([T] or [B, T]) and its attention mask (bool [T, S] or [B, T, S]; None = causal
        over the T inputs)."""
        T = size[1]
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        mask = mask.unsqueeze(1)  # [B, 1, T, S] broadcasts over heads
        if cache is not None:
            cache.check_room(mask.shape[-1])
        if mask.device.type != "cuda":
            c = self.config
            mask = cpu_attention_mask(mask, c.n_heads // c.n_kv_heads, self.dtype)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        return RowBlock((size[0], T), cos, sin, mask, slots, rows)

    def head(self, x: torch.Tensor, output_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
        """Final norm and vocabulary projection (last stage) of the selected rows, fp32 logits."""
        if isinstance(output_rows, tuple):
            x = x[output_rows[0], output_rows[1]]
        elif output_rows is not None:
            x = x[:, output_rows]
        return self.vocab_logits(x)

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(hidden)).float()

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a feature-level draft head reads of this model (last stage): the final-normed
        hidden states, the vectors the vocabulary head projects (EAGLE's features)."""
        return self.norm(hidden)

    def check_positions(self, last_position: int) -> None:
        """A clear error where a forward would run past the model's context."""
        if last_position >= self.max_positions:
            raise ContextLengthError(
                f"position {last_position} exceeds the model's context of {self.max_positions} tokens "
                "(shorten the prompt or lower --max-tokens)"
            )

    def use_layer_kernels(self) -> bool:
        """Run norms, RoPE, the gated product and attention through our C++ kernels (CPU, fp32 or
        bf16 activations, shapes they take); True if they are in use."""
        c = self.config
        if self.device.type != "cpu" or not KernelLayerOps.fits(c.dim, c.head_dim, c.intermediate_size, self.dtype):
            return False
        ops = kernel_layer_ops()
        if ops is None:
            return False
        self.use_ops(ops)
        return True

    def use_ops(self, ops: TorchLayerOps) -> None:
        """Point every module's small operations (norms, RoPE, gated product, attention) at `ops`."""
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops

    def pack_for_cpu(self) -> bool:
        """Swap every bf16 Linear for a PackedLinear; True if anything was packed."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not cpu_packing_available():
            return False
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child))
        return True

    def quantize_int4(self) -> bool:
        """Swap every Linear the int4 kernel can take for an Int4Linear (CPU, bf16
        models); True if anything was swapped. Lossy: meant for draft models."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not int4_available():
            return False
        swapped = False
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                # the kernel needs whole groups along K and N in multiples of 16
                if type(child) is nn.Linear and child.in_features % Int4Linear.GROUP == 0 and child.out_features % 16 == 0:
                    setattr(module, name, Int4Linear(child))
                    swapped = True
        return swapped

    def quantize_int8(self, head: bool = False, kernel: str | None = None) -> bool:
        """Swap every Linear of the layers (and the vocabulary head too with `head`) for an
        Int8Linear (W8A8); True if anything was swapped. The activations keep the model's dtype
        around the linears. Lossy against the float weights, but row-exact (see Int8Linear): the
        linears never make a tree's logits differ from one-token forwards along its paths."""
        if not int8_available():
            return False
        swapped = False
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and (head or child is not self.output):
                    setattr(module, name, Int8Linear(child, kernel))
                    swapped = True
        return swapped

    def quantize_q4(self, exact: dict[str, KQuantWeights] | None = None, embeddings: bool = False,
                    lite: bool = False) -> list[str]:
        """Put the linears, the vocabulary head included, on our k-quant kernels
        (specwood.models.w4a8, specwood.models.q6k) where their shapes fit.

        `exact` maps canonical weight names to a GGUF file's quantised values (Q4_K, Q5_K, Q6_K
        and Q8_0; Q4_0 and Q5_0 in Q8_0's form, gguf_loader.kquant_weights): a linear
        whose parts are all there runs them as the file stores them (a fused linear whose parts
        differ in type runs as a StackedLinear), and such a token table becomes a QuantEmbedding. The
        others stay in floats, in the model's dtype, and their names are returned so the loader can
        say so: never silently coarser than the file. With `lite` (q4-lite, and drafts) they are
        quantised to 4 bits from their floats instead, and with `embeddings` any token table is
        stored in 4 bits: faster, lossier (BENCHMARKS.md, fidelity)."""
        from specwood.models.q6k import Q6Linear, Q6Weights
        from specwood.models.q8_0 import Q8Linear, Q8Weights
        from specwood.models.w4a8 import (GROUP, Q4Linear, Q4Weights, Q5Linear, Q5Weights, QuantEmbedding, StackedLinear,
                                          quantize_q4)

        self.q4_lite = lite
        exact = {name: w for name, w in (exact or {}).items() if not lite or type(w) is Q4Weights}
        kinds = {Q4Weights: Q4Linear, Q5Weights: Q5Linear, Q6Weights: Q6Linear, Q8Weights: Q8Linear}
        parts = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"), "attention.wo": ("attention.wo",),
                 "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"), "feed_forward.w2": ("feed_forward.w2",)}
        targets: list[tuple[nn.Module, str, list[str]]] = []
        for local, i in enumerate(self.layer_range):
            for fused, sources in parts.items():
                owner_name, attr = fused.split(".")
                targets.append((getattr(self.layers[local], owner_name), attr,
                                [f"layers.{i}.{src}.weight" for src in sources]))
        if self.output is not None:
            tied = self.config.tie_embeddings and "output.weight" not in exact
            targets.append((self, "output", ["tok_embeddings.weight" if tied else "output.weight"]))
        if self.tok_embeddings is not None and exact.get("tok_embeddings.weight") is not None:
            self.tok_embeddings = QuantEmbedding(exact["tok_embeddings.weight"], self.dtype)  # kept exactly
        elif self.tok_embeddings is not None and embeddings and self.config.dim % GROUP == 0:
            self.tok_embeddings = QuantEmbedding(quantize_q4(self.tok_embeddings.weight.data), self.dtype)
        in_floats = []
        for owner, attr, names in targets:
            child = getattr(owner, attr)
            if type(child) is not nn.Linear:
                continue
            found = [exact.get(name) for name in names]
            if not Q4Linear.fits(child.out_features, child.in_features):
                in_floats += [] if lite else names  # q4-lite: int8 (build_model)
            elif all(f is not None for f in found):
                runs = [list(run) for _, run in groupby(found, key=type)]  # one kernel call per run of a type
                biases = (child.bias.split([sum(f.codes.shape[0] for f in run) for run in runs])
                          if child.bias is not None else [None] * len(runs))
                linears = [kinds[type(run[0])](type(run[0]).cat(run), b) for run, b in zip(runs, biases)]
                setattr(owner, attr, linears[0] if len(linears) == 1 else StackedLinear(linears))
            elif lite:
                setattr(owner, attr, Q4Linear.from_linear(child))
            else:
                in_floats += [n for n, f in zip(names, found) if f is None]
        return in_floats

    @property
    def weight_mode(self) -> str:
        """How the linears hold their weights: q4 (the file's k-quants), q4-lite, int8, int4, or the
        model dtype (bf16/fp32)."""
        from specwood.models.w4a8 import KQuantLinear

        if any(isinstance(m, KQuantLinear) for m in self.modules()):
            return "q4-lite" if self.q4_lite else "q4"
        kinds = {type(m) for m in self.layers.modules()}
        if Int4Linear in kinds:  # before int8: an Int4Linear holds an Int8Linear for many rows
            return "int4"
        if Int8Linear in kinds:
            return "int8"
        return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    # --- weights in canonical (loader) names ---------------------------------------------------

    def load_canonical(self, sd: dict[str, torch.Tensor]) -> None:
        """Take weights named as the loaders name them (separate q/k/v and gate/up) and fuse them."""
        c = self.config
        own: dict[str, torch.Tensor] = {}
        try:
            if self.is_first:
                own["tok_embeddings.weight"] = sd["tok_embeddings.weight"]
            if self.is_last:
                own["norm.weight"] = sd["norm.weight"]
                own["output.weight"] = sd["output.weight"] if "output.weight" in sd else sd["tok_embeddings.weight"]
            for local, i in enumerate(self.layer_range):
                p, q = f"layers.{i}.", f"layers.{local}."
                own[q + "attention_norm.weight"] = sd[p + "attention_norm.weight"]
                own[q + "ffn_norm.weight"] = sd[p + "ffn_norm.weight"]
                qkv = [sd[p + f"attention.w{n}.weight"] for n in "qkv"]
                own[q + "attention.wqkv.weight"] = torch.cat(qkv)
                if c.qkv_bias:
                    own[q + "attention.wqkv.bias"] = torch.cat([sd[p + f"attention.w{n}.bias"] for n in "qkv"])
                own[q + "attention.wo.weight"] = sd[p + "attention.wo.weight"]
                own[q + "feed_forward.w13.weight"] = torch.cat([sd[p + "feed_forward.w1.weight"], sd[p + "feed_forward.w3.weight"]])
                own[q + "feed_forward.w2.weight"] = sd[p + "feed_forward.w2.weight"]
        except KeyError as e:
            raise ModelFileError(f"checkpoint is missing tensor {e.args[0]} (incomplete or wrong model file)") from None
        params = dict(self.named_parameters())
        for name, t in own.items():
            if params[name].shape != t.shape:
                raise ModelFileError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
            params[name].data = t.to(device=params[name].device, dtype=params[name].dtype)
        if self.is_first and self.is_last and c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one copy in memory

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the loaders' names (views; unfused), e.g. to build a reference HF model."""
        c, sd = self.config, {}
        if self.is_first:
            sd["tok_embeddings.weight"] = self.tok_embeddings.weight.data
        if self.is_last:
            sd["norm.weight"] = self.norm.weight.data
            if not (c.tie_embeddings and self.is_first):
                sd["output.weight"] = self.output.weight.data
        sizes = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
        for local, i in enumerate(self.layer_range):
            blk, p = self.layers[local], f"layers.{i}."
            for n, w in zip("qkv", blk.attention.wqkv.weight.data.split(sizes)):
                sd[p + f"attention.w{n}.weight"] = w
            if c.qkv_bias:
                for n, b in zip("qkv", blk.attention.wqkv.bias.data.split(sizes)):
                    sd[p + f"attention.w{n}.bias"] = b
            sd[p + "attention.wo.weight"] = blk.attention.wo.weight.data
            w1, w3 = blk.feed_forward.w13.weight.data.split(c.intermediate_size)
            sd[p + "feed_forward.w1.weight"], sd[p + "feed_forward.w3.weight"] = w1, w3
            sd[p + "feed_forward.w2.weight"] = blk.feed_forward.w2.weight.data
            sd[p + "attention_norm.weight"] = blk.attention_norm.weight.data
            sd[p + "ffn_norm.weight"] = blk.ffn_norm.weight.data
        return sd


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", layers: range | None = None,
                max_positions: int | None = None, pack: bool = True, int4: bool = False, int8: bool = False,
                int8_head: bool = False, q4: bool = False, q4_lite: bool = False,
                q4_exact: dict[str, KQuantWeights] | None = None,
                q4_embeddings: bool = False, layer_kernels: bool = True) -> Transformer:
    """Instantiate (without random init) and load canonical weights; bf16 on a CPU gets packed
    weights (see PackedLinear) unless `pack` is False, int4 weights with `int4` (drafts), or W8A8
    int8 layer linears with `int8` (`dtype` is then the activations' dtype; `int8_head` quantises
    the vocabulary head too). `q4` runs the GGUF's Q4_K and Q6_K weights (`q4_exact`) as the file
    stores them on our k-quant kernels and keeps every other weight in `dtype` (their names end
    up in `model.weights_in_floats`); `q4_lite` quantises those to 4 bits instead (int8 where a
    shape does not fit the kernel), and `q4_embeddings` stores any token table in 4 bits too
    (drafts). On a CPU with AVX512 the layers' small operations run on our kernels unless
    `layer_kernels` is False (see specwood.models.layer_ops)."""
    if sum((int4, int8, q4 or q4_lite)) > 1:
        raise ValueError("int4, int8 and q4 weights exclude each other")
    with torch.device("meta"):
        model = Transformer(config, layers, max_positions)
    model = model.to(dtype).to_empty(device=device)  # allocate once, in the final dtype
    model.rope_cos, model.rope_sin = rope_tables(config, model.max_positions, device)  # fp32 tables
    model.load_canonical(state_dict)
    model = model.eval().requires_grad_(False)
    if int4:
        model.quantize_int4()
    if q4 or q4_lite:
        model.weights_in_floats = model.quantize_q4(q4_exact, embeddings=q4_embeddings, lite=q4_lite)
        if q4_lite:
            model.quantize_int8(head=True)  # linears of shapes the q4 kernel cannot take
    if int8:
        if not model.quantize_int8(head=int8_head):
            raise SpecwoodError("int8 weights need torch._int_mm (torch >= 2.2)")
    if pack:
        model.pack_for_cpu()  # whatever int4 left (e.g. odd-sized layers)
    if layer_kernels:
        model.use_layer_kernels()
    return model
