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
weight modes all work on it unchanged. Files: our own safetensors (`save_head`/`load_head`,
with the config in the metadata) and EAGLE's published Hugging Face layout (`load_eagle_head`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specwood.drafting.head_source import FeatureHeadSource
from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.config import ModelConfig
from specwood.models.layer_ops import KernelLayerOps
from specwood.models.rope import rope_tables
from specwood.models.transformer import Transformer

HEAD_FORMAT = "specwood-draft-head"
HEAD_VERSION = 1
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # the heads that ship with the package


def shipped_head(target_name: str) -> Path | None:
    """The head shipped for a registry target (specwood/heads/<name>.safetensors), if any."""
    path = HEADS_DIR / f"{Path(str(target_name)).name}.safetensors"
    return path if path.is_file() else None


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

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].ffn_norm.weight.dtype  # the input norm may be absent (EAGLE-1)

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


# --- files ----------------------------------------------------------------------------------------


def save_head(head: DraftHead, path: str | os.PathLike[str], int8: bool = False) -> Path:
    """Write the head's own weights (not the target's token table or vocabulary rows) and its spec
    to one safetensors file. `int8` stores each weight matrix as int8 codes with a per-row scale
    (a quarter of fp32's bytes; the shipped head); written to a temporary name, then renamed."""
    from safetensors.torch import save_file

    from specwood.models.transformer import quantize_weight_int8

    tensors: dict[str, torch.Tensor] = {"draft_vocab": head.draft_vocab.cpu()}
    for name, t in head.trainable_state().items():
        t = t.detach().cpu()
        if int8 and t.dim() == 2:
            codes, scales = quantize_weight_int8(t)
            tensors[name + ".q8"], tensors[name + ".scale"] = codes, scales.to(torch.float16)
        else:
            tensors[name] = t.float().contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": HEAD_FORMAT, "version": str(HEAD_VERSION),
                                           "spec": head.spec.to_json()})
    os.replace(tmp, path)
    return path


def read_head_file(path: str | os.PathLike[str]) -> tuple[HeadSpec, torch.Tensor, dict[str, torch.Tensor]]:
    """(spec, draft vocabulary, trainable state in fp32) of a head file; one-line errors for a
    missing, truncated or foreign file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"draft head file {path} not found; train one with `specwood train-drafter` "
                             "or pass the path of an existing head")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ModelFileError(f"draft head file {path} is unreadable or truncated ({type(e).__name__}: {e}); "
                             "copy or train it again") from None
    if meta.get("format") != HEAD_FORMAT:
        raise ModelFileError(f"{path} is not a specwood draft head (for EAGLE checkpoints pass their folder)")
    if meta.get("version") != str(HEAD_VERSION):
        raise ModelFileError(f"draft head {path} has format version {meta.get('version')}; this specwood reads "
                             f"version {HEAD_VERSION}")
    spec = HeadSpec.from_json(meta.get("spec", ""))
    if "draft_vocab" not in raw:
        raise ModelFileError(f"draft head file {path} has no draft_vocab tensor (incomplete file)")
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".q8"):
            base = name[:-3]
            if base + ".scale" not in raw:
                raise ModelFileError(f"draft head file {path} lacks {base}.scale (incomplete file)")
            state[base] = t.float() * raw[base + ".scale"].float()[:, None]
        elif not name.endswith(".scale") and name != "draft_vocab":
            state[name] = t.float()
    return spec, raw["draft_vocab"], state


def load_head(path: str | os.PathLike[str], target: Transformer, *, fast: bool = True) -> DraftHead:
    """A head file (ours, or an EAGLE folder: config.json + safetensors) ready to draft for
    `target`; with `fast` its weights take the target's kernels (`match_target_weights`)."""
    path = Path(path)
    if path.is_dir():
        from specwood.drafting.eagle_files import load_eagle_head

        head = load_eagle_head(path, target)
    else:
        spec, vocab, state = read_head_file(path)
        head = new_head(target, spec, vocab, state, where=str(path))
    return match_target_weights(head, target) if fast else head


def match_target_weights(head: DraftHead, target: Transformer) -> DraftHead:
    """Run the head on the kernels the target runs on: 4-bit (q4-lite) linears -- fusion, layer and
    vocabulary rows -- where the target is on our k-quant kernels, W8A8 where it is int8, and our
    layer kernels for the small operations where the target uses them. A draft's precision
    changes speed, never output."""
    from specwood.models.w4a8 import Q4Linear

    mode = target.weight_mode
    if mode in ("q4", "q4-lite"):
        head.quantize_q4(lite=True)
        if Q4Linear.fits(head.fc.out_features, head.fc.in_features):
            head.fc = Q4Linear.from_linear(head.fc)
        head.quantize_int8(head=True)  # shapes the 4-bit kernel does not take
    elif mode == "int8":
        head.quantize_int8(head=True)
    elif head.device.type == "cpu" and head.dtype == torch.bfloat16:
        head.pack_for_cpu()
    if isinstance(target.layers[0].attention.ops, KernelLayerOps):
        head.use_layer_kernels()
    return head
