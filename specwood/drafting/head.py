"""A feature-level draft head (EAGLE): one decoder layer that drafts from the target's own features.

The target already computes, for every token it verifies, the feature f_t (its final-normed
hidden state) that its vocabulary head turns into the next token's logits. The head reads the
pair (token x_{t+1}, feature f_t), fused by one linear `fc` over their concatenation
[embedding(x_{t+1}), f_t], runs one decoder layer over the pairs before it (its own small KV
cache), and predicts the next feature g_{t+1}; the target's vocabulary head, cut down to the
head's draft vocabulary (the N tokens the target emits most), turns g into draft logits. Deeper
in a tree, a node's own g stands in for the target feature it does not have yet.

It drafts at a few percent of a target step: one layer instead of 28, a 32k-row head instead of
152k. The token table is the target's (shared, never copied); logits outside the draft
vocabulary are -inf, so q is a distribution over the whole vocabulary and both verifiers stay
exact (a target token outside it is the verifier's bonus token, never lost).

A head is a `Transformer` of one layer whose `embed` is the fusion and whose `head` is the cut
vocabulary projection, so the batched row forward, the KV cache, the CPU kernels and the
weight modes all work on it unchanged. Its files: specwood.drafting.head_files (ours) and
specwood.drafting.eagle_files (EAGLE's published Hugging Face layout).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from specwood.drafting.head_source import FeatureHeadSource
from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.config import ModelConfig
from specwood.models.rope import rope_tables
from specwood.models.transformer import Transformer

@dataclass(frozen=True)
class HeadSpec:
    """What a head is, beyond the target's shape it shares: saved with its weights."""

    target_name: str
    target_vocab_size: int
    dim: int
    intermediate_size: int
    draft_vocab_size: int
    input_norm: bool = True  # EAGLE-1 feeds the fused pair to attention without a norm
    fc_bias: bool = True
    # the layer's attention where it differs from the target's (None: the target's)
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    trained: dict[str, Any] | None = None  # how it was made: command, steps, data, losses

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HeadSpec":
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as e:
            raise ModelFileError(f"draft head metadata is malformed ({e}); retrain it with `specwood train-drafter`") from None


class DraftHead(Transformer):
    """One decoder layer over (token, feature) pairs; logits over the draft vocabulary, -inf elsewhere."""

    source_class = FeatureHeadSource  # what the scheduler drafts with on a row of the head's pool

    def __init__(self, config: ModelConfig, spec: HeadSpec, max_positions: int | None = None):
        super().__init__(head_config(config, spec), max_positions=max_positions)
        self.spec = spec
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=spec.fc_bias)
        self.output = nn.Linear(config.dim, spec.draft_vocab_size, bias=False)
        self.norm = None  # g is a feature like the target's final-normed f: the head projects it as it is
        if not spec.input_norm:
            self.layers[0].attention_norm = nn.Identity()
        self.register_buffer("draft_vocab", torch.zeros(spec.draft_vocab_size, dtype=torch.long), persistent=False)

    def pair_inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head's input rows [n, 2 dim]: each token's embedding beside the feature before it."""
        emb = self.tok_embeddings(tokens.to(self.device))
        return torch.cat([emb.to(self.dtype), features.to(device=self.device, dtype=self.dtype)], -1)

    def embed(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.fc(pairs)

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary: the draft vocabulary's, -inf elsewhere."""
        cut = self.cut_logits(hidden)
        full = cut.new_full((*cut.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_vocab] = cut
        return full

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def cut_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only (training's soft cross-entropy)."""
        return self.output(hidden).float()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a head file stores: the fusion and the layer (the token table and the vocabulary
        rows are the target's)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("tok_embeddings.", "output."))}


def head_config(target: ModelConfig, spec: HeadSpec) -> ModelConfig:
    """The head's layer shape: the target's, with one layer and what the spec sets."""
    own = {k: getattr(spec, k) for k in ("n_heads", "n_kv_heads", "head_dim", "qkv_bias", "rope_theta", "norm_eps")
           if getattr(spec, k) is not None}
    return replace(target, n_layers=1, intermediate_size=spec.intermediate_size, **own)


def target_vocab_rows(target: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The target's vocabulary-head rows of tokens `ids` [N, dim] (fp32): the token table's rows
    for a tied head (looked up, never dequantised whole), else the head's dequantised weight."""
    if target.config.tie_embeddings and target.tok_embeddings is not None:
        return target.tok_embeddings(ids.to(target.device)).float()
    return target.output.weight[ids.to(target.device)].float()


def check_head_fits(spec: HeadSpec, target: Transformer, where: str) -> None:
    c = target.config
    if spec.target_vocab_size != c.vocab_size or spec.dim != c.dim:
        raise SpecwoodError(
            f"draft head {where}{' ' if where else ''}was trained for a target with {spec.target_vocab_size} tokens and hidden size "
            f"{spec.dim} ({spec.target_name or 'unnamed'}), but this target has {c.vocab_size} and {c.dim}; "
            "train one for it with `specwood train-drafter`")
    if not (target.is_first and target.is_last):
        raise SpecwoodError("a draft head needs the whole target model on one device (not a pipeline stage)")


def new_head(target: Transformer, spec: HeadSpec, draft_vocab: torch.Tensor, state: dict[str, torch.Tensor] | None,
             dtype: torch.dtype | None = None, seed: int = 0, where: str = "") -> DraftHead:
    """A head for `target` sharing its token table; `state` (trainable_state names) or, without
    one, a random start (the trainer's: small weights, so an untrained head is near-uniform).
    `where` names the file in errors."""
    check_head_fits(spec, target, where)
    dtype = dtype or target.dtype
    draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).reshape(-1)
    if len(draft_vocab) != spec.draft_vocab_size or len(set(draft_vocab.tolist())) != len(draft_vocab) or (
            len(draft_vocab) and not 0 <= int(draft_vocab.min()) <= int(draft_vocab.max()) < spec.target_vocab_size):
        raise ModelFileError(f"draft head vocabulary must be {spec.draft_vocab_size} distinct token ids below "
                             f"{spec.target_vocab_size}")
    with torch.device("meta"):
        head = DraftHead(target.config, spec, max_positions=target.max_positions)
    head = head.to(dtype).to_empty(device=target.device)
    head.rope_cos, head.rope_sin = rope_tables(head.config, head.max_positions, target.device)
    head.draft_vocab = draft_vocab.to(target.device)
    head.tok_embeddings = target.tok_embeddings  # shared
    head.output.weight.data = target_vocab_rows(target, draft_vocab).to(dtype)
    own = dict(head.named_parameters())
    trainable = {k: p for k, p in own.items() if not k.startswith(("tok_embeddings.", "output."))}
    if state is None:
        g = torch.Generator().manual_seed(seed)
        for name, p in trainable.items():
            if name.endswith("norm.weight"):
                p.data = torch.ones(p.shape, dtype=dtype)
            elif name.endswith(".bias"):
                p.data = torch.zeros(p.shape, dtype=dtype)
            else:
                p.data = (torch.randn(p.shape, generator=g) * 0.5 / p.shape[1] ** 0.5).to(dtype)
    else:
        missing = sorted(set(trainable) - set(state))
        if missing:
            raise ModelFileError(f"draft head file is missing tensor {missing[0]} (incomplete or wrong file)")
        for name, p in trainable.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ModelFileError(f"draft head tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.data = t.to(device=target.device, dtype=dtype)
    return head.eval().requires_grad_(False)


def untrained_head(target: Transformer, draft_vocab: torch.Tensor | list[int] | None = None,
                   intermediate_size: int | None = None, seed: int = 0, dtype: torch.dtype | None = None,
                   name: str = "") -> DraftHead:
    """A randomly initialised head for `target` (the trainer's start; tests): the draft vocabulary
    defaults to the whole vocabulary, the layer's MLP to the target's width."""
    c = target.config
    vocab = torch.arange(c.vocab_size) if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
    spec = HeadSpec(target_name=name or c.name, target_vocab_size=c.vocab_size, dim=c.dim,
                    intermediate_size=intermediate_size or c.intermediate_size, draft_vocab_size=len(vocab))
    return new_head(target, spec, vocab, None, dtype=dtype, seed=seed)
