"""A compact Llama-family decoder with one pure forward over explicit positions and mask.

`forward(tokens, positions, mask, cache, slots)` is all the engine needs: autoregressive decoding
is a one-token forward, verifying a token tree is a forward over the tree's nodes with the tree
mask, and a pipeline stage is the same class built over a layer range.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from specwood.errors import ContextLengthError, ModelFileError, SpecwoodError
from specwood.models.cache import KVCache, Rows, kv_bytes_per_slot
from specwood.models.canonical import layer_norm_weights
from specwood.models.config import ModelConfig
from specwood.models.experts import Experts, FloatExperts, KQuantExperts, PackedExperts
from specwood.models.layer_kinds import LayerKind, layer_kinds, window_mask
from specwood.models.layer_ops import TORCH_OPS, KernelLayerOps, TorchLayerOps, kernel_layer_ops
from specwood.models.linears import (Int4Linear, Int8Linear, OneDnnLinear, PackedLinear, cpu_packing_available,
                                     int4_available, int8_available, weight_of)
from specwood.models.rope import rope_tables

if TYPE_CHECKING:
    from specwood.models.gguf_kquants import KQuantWeights


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
    cos: torch.Tensor  # [B, 1, T, head_dim], of the layer kind's rotary tables
    sin: torch.Tensor
    # [B, 1, T, S] bool on CUDA; an additive [B, 1, groups*T, S] bias on a CPU (the kind's window applied)
    mask: torch.Tensor
    slots: torch.Tensor | None  # [T] or [B, T]
    rows: Rows


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        # q, k and v in one matmul: one weight read and one kernel launch per layer
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        # Qwen3 / Gemma 3: each head of q and k RMS-normed before RoPE; OLMo 2: all of q's heads as
        # one vector, and all of k's (None: nothing to do)
        self.qk_norm_whole = c.qk_norm_whole
        q_width, k_width = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim) if c.qk_norm_whole else (c.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(k_width, c.norm_eps) if c.qk_norm else None
        self.scale = c.attention_scale  # None: 1/sqrt(head_dim)
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
        if self.q_norm is not None:
            qkv = self.normed_qk(qkv)
        q, k, v = self.ops.rope_qk(qkv, blk.cos, blk.sin, self.n_heads, self.n_kv)
        if cache is not None:
            if blk.slots is None:
                raise ValueError("a forward over a cache needs the slots to write")
            cache.write(layer, blk.slots, k, v, blk.rows)
            k, v = cache.read(layer, blk.mask.shape[-1], blk.rows)
        return self.ops.attention(q, k, v, blk.mask, self.scale)

    def normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, (H + 2 H_kv) D] with each head of q and k RMS-normed, or q and k each as a
        whole (a new tensor: rope_qk may rotate it in place)."""
        B, T, _ = qkv.shape
        if self.q_norm is None or self.k_norm is None:
            raise ValueError("normed_qk on a model without q/k norms")
        if self.qk_norm_whole:
            q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
            return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        heads = qkv.view(B, T, self.n_heads + 2 * self.n_kv, self.hd)
        q = self.q_norm(heads[:, :, :self.n_heads])
        k = self.k_norm(heads[:, :, self.n_heads:self.n_heads + self.n_kv])
        return torch.cat([q, k, heads[:, :, self.n_heads + self.n_kv:]], dim=2).view(B, T, -1)


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(c.dim, 2 * c.intermediate_size, bias=False)  # gate and up fused
        self.w2 = nn.Linear(c.intermediate_size, c.dim, bias=False)
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.silu_mul(self.w13(x)))


class GeluTanhFeedForward(FeedForward):
    """Gemma's gated MLP: GELU (tanh approximation) on the gate instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.gelu_tanh_mul(self.w13(x)))


FEED_FORWARDS = {"silu": FeedForward, "gelu_tanh": GeluTanhFeedForward}


class MoEFeedForward(nn.Module):
    """Top-k routed experts (Qwen3-MoE): a softmax over the router's logits, the k most likely
    experts per token (their probabilities renormalised with norm_topk_prob), each expert's
    SiLU-gated MLP weighted by its probability. Each expert runs once over all the rows routed to
    it, never once per row; a row's k outputs are summed in expert order whatever else is in the
    batch, so a token's result does not depend on its neighbours (tree verification stays exact).
    The experts' weights are FloatExperts, or KQuantExperts (a GGUF's k-quants as stored, q4 mode)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.router = nn.Linear(c.dim, c.n_experts, bias=False)
        self.w13: Experts = FloatExperts(c.n_experts, 2 * c.moe_intermediate_size, c.dim)  # gate and up
        self.w2: Experts = FloatExperts(c.n_experts, c.dim, c.moe_intermediate_size)
        self.top_k, self.norm_topk_prob = c.n_experts_used, c.norm_topk_prob
        self.ops = TORCH_OPS

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [N, dim] -> each row's k experts' weights and indices [N, k] (fp32, int64)."""
        probs = torch.softmax(self.ops.router_logits(flat, self.router), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)  # [N, k]
        experts, by_expert = experts.sort(dim=-1)  # a row's choices in expert order: the order they are summed in
        weights = weights.gather(-1, by_expert).to(x.dtype).flatten()
        choices = experts.flatten()  # [N k]: row n's j-th choice at n * k + j
        order = choices.argsort(stable=True)  # grouped by expert
        routed = flat[order // self.top_k]  # each expert's rows, one expert after another
        counts = torch.bincount(choices, minlength=self.w13.n_experts).tolist()
        per_choice = torch.empty_like(routed)
        per_choice[order] = self.w2.grouped(self.ops.silu_mul(self.w13.grouped(routed, counts)), counts)
        per_choice = (per_choice * weights[:, None]).view(len(flat), self.top_k, -1)
        out = per_choice[:, 0]
        for j in range(1, self.top_k):  # added one choice at a time, whatever the batch
            out = out + per_choice[:, j]
        return out.view(x.shape)


class Block(nn.Module):
    # an RMSNorm; None where the inputs are not normed (OLMo 2), nn.Identity in a draft head without one
    attention_norm: nn.Module | None

    def __init__(self, c: ModelConfig, kind: LayerKind = LayerKind()):
        super().__init__()
        self.kind = kind  # which of the forward's row blocks (mask, rotary tables) this layer reads
        # the inputs of attention and MLP normed (all but OLMo 2)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps) if c.pre_norms else None
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps) if c.pre_norms else None
        self.feed_forward = MoEFeedForward(c) if c.n_experts else FEED_FORWARDS[c.hidden_act](c)
        # Gemma 3, OLMo 2: the attention's and the MLP's outputs normed, before the residual add
        self.attention_post_norm = RMSNorm(c.dim, c.norm_eps) if c.sandwich_norms else None
        self.ffn_post_norm = RMSNorm(c.dim, c.norm_eps) if c.sandwich_norms else None
        self.residual_scale = c.residual_scale  # Granite: the outputs scaled before the residual add
        self.llama_layer = c.pre_norms and not c.sandwich_norms and c.residual_scale is None

    def forward(self, x: torch.Tensor, blocks: list[RowBlock], cache: KVCache | None, layer: int) -> torch.Tensor:
        if self.llama_layer and self.attention_norm is not None and self.ffn_norm is not None:
            # nothing added: the default pair's forward, no other op (llama_layer: both norms there)
            x = x + self.attention(self.attention_norm(x), blocks, cache, layer)
            return x + self.feed_forward(self.ffn_norm(x))
        h = self.attention(x if self.attention_norm is None else self.attention_norm(x), blocks, cache, layer)
        x = x + self.residual(h if self.attention_post_norm is None else self.attention_post_norm(h))
        h = self.feed_forward(x if self.ffn_norm is None else self.ffn_norm(x))
        return x + self.residual(h if self.ffn_post_norm is None else self.ffn_post_norm(h))

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """What a sublayer adds to the residual stream: its output, scaled where the config says."""
        return h if self.residual_scale is None else h * self.residual_scale


class Blocks(nn.ModuleList):
    """A model's layers: an nn.ModuleList that tells the type checker its items are Blocks."""

    if TYPE_CHECKING:
        @overload
        def __getitem__(self, idx: slice) -> Blocks: ...
        @overload
        def __getitem__(self, idx: int) -> Block: ...
        def __getitem__(self, idx: int | slice) -> Block | Blocks: ...
        def __iter__(self) -> Iterator[Block]: ...


class Transformer(nn.Module):
    """The whole model, or the pipeline stage holding layers `layers` (a range)."""

    # the parts a pipeline stage may lack (None): the token table on the first stage, the final
    # norm and the vocabulary head on the last. The table and the head are modules with a
    # `weight`: nn.Embedding / nn.Linear, or what quantisation put there (QuantEmbedding, Q4Linear, ...)
    tok_embeddings: nn.Module | None
    norm: nn.Module | None
    output: nn.Module | None
    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor

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
        kinds = layer_kinds(config)
        self.layers = Blocks(Block(config, kinds[i]) for i in self.layer_range)
        self.kinds = tuple(dict.fromkeys(block.kind for block in self.layers))  # each kind once, in order
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
        # the MLP's input norm (the attention's may be an EAGLE-1 head's Identity), or its output norm
        # where there is none (OLMo 2)
        block = self.layers[0]
        norm = block.ffn_norm if block.ffn_norm is not None else block.ffn_post_norm
        if norm is None:
            raise ValueError("a layer without any norm")
        return norm.weight.dtype

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes one cache slot of this model (or stage) takes: K and V of every layer."""
        c = self.config
        return kv_bytes_per_slot(len(self.layers), c.n_kv_heads, c.head_dim, self.dtype)

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
        blocks = self.row_blocks(tokens.shape[:2], positions, mask, cache, slots, rows)
        return self.layers_over(self.embed(tokens), {kind: [blk] for kind, blk in blocks.items()}, cache)

    def hidden_packed(self, parts: Sequence[tuple[torch.Tensor, ...]], cache: KVCache) -> torch.Tensor:
        """Several padded blocks (tokens [B, T(, dim)], positions, mask, slots, rows) in one pass
        over the layers: each weight is read once for all of them (a decode step riding along
        with a prefill chunk costs a few rows of compute, not a second pass over the weights).
        Hidden states [N, dim] of every block's B*T tokens, block after block."""
        per_part = [self.row_blocks(t.shape[:2], p, m, cache, s, r) for t, p, m, s, r in parts]
        blocks = {kind: [b[kind] for b in per_part] for kind in per_part[0]}
        embedded = [self.embed(t).flatten(0, 1) for t, *_ in parts]
        x = embedded[0] if len(embedded) == 1 else torch.cat(embedded)
        return self.layers_over(x[None], blocks, cache)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.is_first or self.tok_embeddings is None:  # (the first stage has the table)
            return tokens
        x = self.tok_embeddings(tokens)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype first
            x = x * torch.tensor(self.config.embed_scale).to(x.dtype)
        return x

    def layers_over(self, x: torch.Tensor, blocks: dict[LayerKind, list[RowBlock]], cache: KVCache | None
                    ) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            x = block(x, blocks[block.kind], cache, i)
        return x

    def row_blocks(self, size: tuple[int, ...], positions: torch.Tensor, mask: torch.Tensor | None,
                   cache: KVCache | None, slots: torch.Tensor | None, rows: Rows) -> dict[LayerKind, RowBlock]:
        """What the layers need of a [B, T] block, built once per forward for each kind of layer
        this model (or stage) has: rotary tables of its positions ([T] or [B, T]) and its
        attention mask (bool [T, S] or [B, T, S]; None = causal over the T inputs), cut to the
        kind's window."""
        masks: dict[int | None, torch.Tensor] = {}  # kinds of one window (differing in RoPE) share a mask
        return {kind: self.row_block(size, positions, mask, cache, slots, rows, kind, masks) for kind in self.kinds}

    def row_block(self, size: tuple[int, ...], positions: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None, slots: torch.Tensor | None, rows: Rows,
                  kind: LayerKind = LayerKind(), masks: dict[int | None, torch.Tensor] | None = None) -> RowBlock:
        """row_blocks' block for the layers of one kind (`masks`: those already built, by window)."""
        T = size[1]
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if masks is not None and kind.window in masks:
            mask = masks[kind.window]
        else:
            mask = self.kind_mask(T, mask, cache, kind.window)
            if masks is not None:
                masks[kind.window] = mask
        if kind.rope is None:  # a NoPE layer: the identity rotation (cos 1, sin 0), exact in every dtype
            shape = (positions.shape[0], 1, T, self.rope_cos.shape[-1])
            return RowBlock((size[0], T), self.rope_cos.new_ones(shape), self.rope_sin.new_zeros(shape), mask,
                            slots, rows)
        if kind.rope:  # the kind's own rotary table, after the global one (rope_tables)
            positions = positions + kind.rope * self.max_positions
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        return RowBlock((size[0], T), cos, sin, mask, slots, rows)

    def kind_mask(self, T: int, mask: torch.Tensor | None, cache: KVCache | None, window: int | None) -> torch.Tensor:
        """The mask the layers of one window take (see RowBlock.mask)."""
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        mask = mask.unsqueeze(1)  # [B, 1, T, S] broadcasts over heads
        if cache is not None:
            cache.check_room(mask.shape[-1])
        if window is not None:
            mask = window_mask(mask, window)
        if mask.device.type != "cuda":
            c = self.config
            mask = cpu_attention_mask(mask, c.n_heads // c.n_kv_heads, self.dtype)
        return mask

    def head(self, x: torch.Tensor, output_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
        """Final norm and vocabulary projection (last stage) of the selected rows, fp32 logits."""
        if isinstance(output_rows, tuple):
            x = x[output_rows[0], output_rows[1]]
        elif output_rows is not None:
            x = x[:, output_rows]
        return self.vocab_logits(x)

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output is None or self.norm is None:
            raise ValueError("only the last pipeline stage has the vocabulary head")
        logits = self.output(self.norm(hidden)).float()
        cap, divisor = self.config.final_logit_softcap, self.config.logit_scale
        if divisor is not None:  # Granite
            logits = logits / divisor
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a feature-level draft head reads of this model (last stage): the final-normed
        hidden states, the vectors the vocabulary head projects (EAGLE's features)."""
        if self.norm is None:
            raise ValueError("only the last pipeline stage has the final norm")
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
        inter = c.moe_intermediate_size if c.n_experts else c.intermediate_size
        if self.device.type != "cpu" or not KernelLayerOps.fits(c.dim, c.head_dim, inter, self.dtype):
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
                setattr(m, "ops", ops)  # noqa: B010 (a module's own attribute, not a registered part)

    def pack_for_cpu(self) -> bool:
        """Swap every bf16 Linear for a PackedLinear (and float MoE experts for PackedExperts), or
        run every large fp32 one on oneDNN (OneDnnLinear); True if anything was swapped."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            large = [m for m in self.modules() if OneDnnLinear.takes(m)]
            for linear in large:
                OneDnnLinear.adopt(linear)
            return bool(large)
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not cpu_packing_available():
            return False
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child))
                elif type(child) is FloatExperts:
                    setattr(module, name, PackedExperts(child))
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
                if (type(child) is nn.Linear and child.in_features % Int4Linear.GROUP == 0
                        and child.out_features % 16 == 0):
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

    def quantize_q4(self, exact: Mapping[str, KQuantWeights] | None = None, embeddings: bool = False,
                    lite: bool = False, layers: Sequence[int] | None = None) -> list[str]:
        """Put the linears, the vocabulary head included, on our k-quant kernels
        (specwood.models.w4a8, specwood.models.q6k) where their shapes fit.

        `exact` maps canonical weight names to a GGUF file's quantised values (Q4_K, Q5_K, Q6_K
        and Q8_0; Q4_0 and Q5_0 in Q8_0's form, gguf_kquants.kquant_weights): a linear
        whose parts are all there runs them as the file stores them (a fused linear whose parts
        differ in type runs as a StackedLinear), as do a MoE layer's experts (KQuantExperts), and
        such a token table becomes a QuantEmbedding. The
        others stay in floats, in the model's dtype, and their names are returned so the loader can
        say so: never silently coarser than the file. With `lite` (q4-lite, and drafts) they are
        quantised to 4 bits from their floats instead, and with `embeddings` any token table is
        stored in 4 bits: faster, lossier (BENCHMARKS.md, fidelity). `layers` (local indices): those
        layers' linears only (a load quantising each layer as it arrives), no token table or head."""
        from specwood.models.q6k import Q6Linear, Q6Weights
        from specwood.models.q8_0 import Q8Linear, Q8Weights
        from specwood.models.w4a8 import (GROUP, Q4Linear, Q4Weights, Q5Linear, Q5Weights, QuantEmbedding,
                                          StackedLinear, quantize_q4)

        self.q4_lite = lite
        exact = usable_exact(exact, lite)
        kinds = {Q4Weights: Q4Linear, Q5Weights: Q5Linear, Q6Weights: Q6Linear, Q8Weights: Q8Linear}
        targets = self._q4_targets(exact, layers)
        table = self.tok_embeddings if layers is None else None
        stored_table = exact.get("tok_embeddings.weight") if table is not None else None
        if stored_table is not None:
            self.tok_embeddings = QuantEmbedding(stored_table, self.dtype)  # kept exactly
        elif table is not None and embeddings and self.config.dim % GROUP == 0:
            self.tok_embeddings = QuantEmbedding(quantize_q4(weight_of(table)), self.dtype)
        in_floats = []
        for owner, attr, names in targets:
            child = getattr(owner, attr)
            if type(child) not in (nn.Linear, FloatExperts):
                continue
            found = [exact.get(name) for name in names]
            if not kernels_fit(child, len(names)):
                in_floats += [] if lite else names  # q4-lite: int8 (build_model)
            elif all(f is not None for f in found) and type(child) is FloatExperts:
                setattr(owner, attr, KQuantExperts(found, child.n_experts))
            elif all(f is not None for f in found):
                # one kernel call per run of a type (a run holds one weight type: its own cat)
                runs: list[list[Any]] = [list(run) for _, run in groupby(found, key=type)]
                biases = (child.bias.split([sum(f.codes.shape[0] for f in run) for run in runs])
                          if child.bias is not None else [None] * len(runs))
                linears = [kinds[type(run[0])](type(run[0]).cat(run), b) for run, b in zip(runs, biases)]
                setattr(owner, attr, linears[0] if len(linears) == 1 else StackedLinear(linears))
            elif lite:
                setattr(owner, attr, KQuantExperts.from_floats(child) if type(child) is FloatExperts
                        else Q4Linear.from_linear(child))
            else:
                in_floats += [n for n, f in zip(names, found) if f is None]
        return in_floats

    def _q4_targets(self, exact: Mapping[str, KQuantWeights],
                    layers: Sequence[int] | None = None) -> list[tuple[nn.Module, str, list[str]]]:
        """The linears (and MoE experts) quantize_q4 puts on the k-quant kernels: (owner, attribute,
        canonical source names); with `layers` (local indices) those layers' only."""
        ffn = "feed_forward.experts" if self.config.n_experts else "feed_forward"
        parts = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"), "attention.wo": ("attention.wo",),
                 "feed_forward.w13": (f"{ffn}.w1", f"{ffn}.w3"), "feed_forward.w2": (f"{ffn}.w2",)}
        targets: list[tuple[nn.Module, str, list[str]]] = []
        for local in range(len(self.layer_range)) if layers is None else layers:
            i = self.layer_range[local]
            for fused, sources in parts.items():
                owner_name, attr = fused.split(".")
                targets.append((getattr(self.layers[local], owner_name), attr,
                                [f"layers.{i}.{src}.weight" for src in sources]))
        if layers is not None:
            return targets
        if self.output is not None:
            tied = self.config.tie_embeddings and "output.weight" not in exact
            targets.append((self, "output", ["tok_embeddings.weight" if tied else "output.weight"]))
        return targets

    def weights_taken_as_stored(self, exact: Mapping[str, KQuantWeights] | None, lite: bool = False) -> set[str]:
        """The canonical weights quantize_q4(exact, lite=lite) runs from the file's own values and never
        reads in floats: a loader need not decode them (a 1.5B target in fp32 would be 6 GB for nothing)."""
        exact = usable_exact(exact, lite)
        taken: set[str] = set()
        needed: set[str] = set()
        for owner, attr, names in self._q4_targets(exact):
            fits = kernels_fit(getattr(owner, attr), len(names))
            (taken if fits and all(n in exact for n in names) else needed).update(names)
        if self.tok_embeddings is not None:
            (taken if "tok_embeddings.weight" in exact else needed).add("tok_embeddings.weight")
        return taken - needed

    @property
    def weight_mode(self) -> str:
        """How the linears hold their weights: q4 (the file's k-quants), q4-lite, int8, int4, or the
        model dtype (bf16/fp32)."""
        from specwood.models.w4a8 import KQuantLinear

        if any(isinstance(m, (KQuantLinear, KQuantExperts)) for m in self.modules()):
            return "q4-lite" if self.q4_lite else "q4"
        kinds = {type(m) for m in self.layers.modules()}
        if Int4Linear in kinds:  # before int8: an Int4Linear holds an Int8Linear for many rows
            return "int4"
        if Int8Linear in kinds:
            return "int8"
        return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    # --- weights in canonical (loader) names ---------------------------------------------------

    def load_canonical(self, sd: dict[str, torch.Tensor], consume: bool = False,
                       after_layer: Callable[[int], object] | None = None) -> None:
        """Take weights named as the loaders name them (separate q/k/v and gate/up) and fuse them.

        A meta tensor in `sd` stands for a weight the loader left in the file (weights_taken_as_stored):
        its parameter stays unwritten, for quantize_q4 to replace. `consume` removes from `sd` what
        it takes as it goes, so each layer's sources are freed once fused instead of all of them
        staying beside all the fused copies (the load's peak memory). `after_layer(local)` runs once
        each layer's weights are in place (build_model quantises the layer there)."""
        c = self.config
        take = sd.pop if consume else sd.__getitem__
        params = dict(self.named_parameters())
        self.weights_left_in_file: set[str] = set()

        def put(own: dict[str, torch.Tensor]) -> None:
            for name, t in own.items():
                param = params.pop(name)  # not kept here: after_layer may replace its module
                if param.shape != t.shape:
                    raise ModelFileError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
                if t.is_meta:
                    self.weights_left_in_file.add(name)
                else:
                    param.data = t.to(device=param.device, dtype=param.dtype)

        try:
            own: dict[str, torch.Tensor] = {}
            if self.is_first:
                own["tok_embeddings.weight"] = take("tok_embeddings.weight")
            if self.is_last:
                own["norm.weight"] = take("norm.weight")
                own["output.weight"] = (take("output.weight") if "output.weight" in sd else
                                        own["tok_embeddings.weight"] if self.is_first else
                                        take("tok_embeddings.weight"))
            put(own)
            for local, i in enumerate(self.layer_range):
                p, q = f"layers.{i}.", f"layers.{local}."
                own = {q + "attention.wqkv.weight": torch.cat([take(p + f"attention.w{n}.weight") for n in "qkv"])}
                if c.qkv_bias:
                    own[q + "attention.wqkv.bias"] = torch.cat([take(p + f"attention.w{n}.bias") for n in "qkv"])
                own[q + "attention.wo.weight"] = take(p + "attention.wo.weight")
                for extra in layer_norm_weights(c):
                    own[q + extra] = take(p + extra)
                if c.n_experts:
                    own[q + "feed_forward.router.weight"] = take(p + "feed_forward.router.weight")
                    own[q + "feed_forward.w13.weight"] = torch.cat([take(p + "feed_forward.experts.w1.weight"),
                                                                    take(p + "feed_forward.experts.w3.weight")], dim=1)
                    own[q + "feed_forward.w2.weight"] = take(p + "feed_forward.experts.w2.weight")
                else:
                    own[q + "feed_forward.w13.weight"] = torch.cat([take(p + "feed_forward.w1.weight"),
                                                                    take(p + "feed_forward.w3.weight")])
                    own[q + "feed_forward.w2.weight"] = take(p + "feed_forward.w2.weight")
                put(own)
                del own
                if after_layer is not None:
                    after_layer(local)
        except KeyError as e:
            raise ModelFileError(f"checkpoint is missing tensor {e.args[0]} (incomplete or wrong model file)") from None
        if self.is_first and self.is_last and c.tie_embeddings and self.output is not None \
                and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # one copy in memory

    def canonical_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Weights under the loaders' names (unfused), e.g. to build a reference HF model: views of
        float weights, and a quantised linear's (or token table's) exact dequantised values, the
        file's own where the model runs them as stored. `dtype` casts each tensor as it is taken,
        so a quantised model never holds a whole fp32 copy at once."""
        c, sd = self.config, {}

        def put(name: str, t: torch.Tensor) -> None:
            sd[name] = t if dtype is None else t.to(dtype)

        if self.tok_embeddings is not None:  # the first stage
            put("tok_embeddings.weight", weight_of(self.tok_embeddings))
        if self.norm is not None and self.output is not None:  # the last stage
            put("norm.weight", weight_of(self.norm))
            if not (c.tie_embeddings and self.is_first):
                put("output.weight", weight_of(self.output))
        sizes = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
        for local, i in enumerate(self.layer_range):
            blk, p = self.layers[local], f"layers.{i}."
            for n, w in zip("qkv", blk.attention.wqkv.weight.data.split(sizes)):
                put(p + f"attention.w{n}.weight", w)
            if c.qkv_bias:
                for n, b in zip("qkv", blk.attention.wqkv.bias.data.split(sizes)):
                    put(p + f"attention.w{n}.bias", b)
            put(p + "attention.wo.weight", blk.attention.wo.weight.data)
            ff = blk.feed_forward
            if isinstance(ff, MoEFeedForward):  # (c.n_experts)
                put(p + "feed_forward.router.weight", ff.router.weight.data)
                w1, w3 = ff.w13.weight.data.split(c.moe_intermediate_size, dim=1)
                put(p + "feed_forward.experts.w1.weight", w1)
                put(p + "feed_forward.experts.w3.weight", w3)
                put(p + "feed_forward.experts.w2.weight", ff.w2.weight.data)
            else:
                w1, w3 = ff.w13.weight.data.split(c.intermediate_size)
                put(p + "feed_forward.w1.weight", w1)
                put(p + "feed_forward.w3.weight", w3)
                put(p + "feed_forward.w2.weight", blk.feed_forward.w2.weight.data)
            for extra in layer_norm_weights(c):
                put(p + extra, weight_of(blk.get_submodule(extra.removesuffix(".weight"))))
        return sd


def kernels_fit(module: nn.Module, parts: int) -> bool:
    """Whether the k-quant kernels take `module`'s weights: a float linear, or float experts made of
    `parts` equal parts (gate and up), whose outputs (per part) and inputs are multiples of 32."""
    from specwood.models.w4a8 import Q4Linear

    if type(module) is FloatExperts:
        return KQuantExperts.fits(module.out_features // parts, module.in_features)
    return type(module) is nn.Linear and Q4Linear.fits(module.out_features, module.in_features)


def usable_exact(exact: Mapping[str, KQuantWeights] | None, lite: bool) -> Mapping[str, KQuantWeights]:
    """The file's quantised weights a q4 build runs as stored: all of them, or with `lite` (q4-lite)
    the Q4_K ones only (the rest are requantised to 4 bits from floats)."""
    from specwood.models.w4a8 import Q4Weights

    if exact is None or not lite:
        return exact if exact is not None else {}
    if hasattr(exact, "only"):  # a file's tensors decoded when looked up (gguf_kquants.KQuantTensors)
        return exact.only(Q4Weights)
    return {name: w for name, w in exact.items() if type(w) is Q4Weights}


def weights_taken_as_stored(config: ModelConfig, exact: Mapping[str, KQuantWeights] | None,
                            lite: bool = False) -> set[str]:
    """Transformer.weights_taken_as_stored for a model of `config`, before any weight is read."""
    with torch.device("meta"):
        return Transformer(config).weights_taken_as_stored(exact, lite)


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", layers: range | None = None,
                max_positions: int | None = None, pack: bool = True, int4: bool = False, int8: bool = False,
                int8_head: bool = False, q4: bool = False, q4_lite: bool = False,
                q4_exact: Mapping[str, KQuantWeights] | None = None,
                q4_embeddings: bool = False, layer_kernels: bool = True, consume: bool = False) -> Transformer:
    """Instantiate (without random init) and load canonical weights; bf16 on a CPU gets packed
    weights (see PackedLinear) unless `pack` is False, int4 weights with `int4` (drafts), or W8A8
    int8 layer linears with `int8` (`dtype` is then the activations' dtype; `int8_head` quantises
    the vocabulary head too). `q4` runs the GGUF's Q4_K and Q6_K weights (`q4_exact`) as the file
    stores them on our k-quant kernels and keeps every other weight in `dtype` (their names end
    up in `model.weights_in_floats`); `q4_lite` quantises those to 4 bits instead (int8 where a
    shape does not fit the kernel), and `q4_embeddings` stores any token table in 4 bits too
    (drafts). On a CPU with AVX512 the layers' small operations run on our kernels unless
    `layer_kernels` is False (see specwood.models.layer_ops). `consume` lets the load empty
    `state_dict` as it goes (the caller's last use of it). Meta tensors in `state_dict` are weights
    left in the file for the q4 kernels to take (weights_taken_as_stored); ValueError if one is not."""
    if sum((int4, int8, q4 or q4_lite)) > 1:
        raise ValueError("int4, int8 and q4 weights exclude each other")
    with torch.device("meta"):
        model = Transformer(config, layers, max_positions)
    model = model.to(dtype).to_empty(device=device)  # allocate once, in the final dtype
    model.rope_cos, model.rope_sin = rope_tables(config, model.max_positions, device)  # fp32 tables
    model = model.eval().requires_grad_(False)
    # q4-lite requantises each layer as it arrives: with a lazily decoded state dict the load holds
    # one layer's floats, not the whole model's (a 0.5B draft's 2 GB in fp32)
    after_layer = (lambda local: model.quantize_q4(q4_exact, lite=True, layers=[local])) if q4_lite else None
    model.load_canonical(state_dict, consume=consume, after_layer=after_layer)
    if int4:
        model.quantize_int4()
    if q4 or q4_lite:
        model.weights_in_floats = model.quantize_q4(q4_exact, embeddings=q4_embeddings, lite=q4_lite)
        if q4_lite:
            model.quantize_int8(head=True)  # linears of shapes the q4 kernel cannot take
    unwritten = model.weights_left_in_file & {name for name, _ in model.named_parameters()}
    if unwritten:  # a weight left in the file that no kernel took would be read uninitialised
        raise ValueError(f"weights {sorted(unwritten)[:3]} were not decoded and no q4 kernel took them")
    if int8:
        if not model.quantize_int8(head=int8_head):
            raise SpecwoodError("int8 weights need torch._int_mm (torch >= 2.2)")
    if pack:
        model.pack_for_cpu()  # whatever int4 left (e.g. odd-sized layers)
    if layer_kernels:
        model.use_layer_kernels()
    return model
