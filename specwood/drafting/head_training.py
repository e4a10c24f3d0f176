"""Training a feature-level draft head for a target by self-distillation (EAGLE-1's recipe).

The target reads windows of text once; its features f_t (final-normed hidden states) are kept.
The head reads the pairs (x_{t+1}, f_t + noise) and is trained so that its output g_t matches
f_{t+1} (smooth L1: the features it will feed itself deeper in a tree) and its draft-vocabulary
distribution matches the target's own next-token distribution softmax(W f_{t+1}) (soft
cross-entropy; W: the target's vocabulary rows, frozen). The noise makes it robust to reading
its own imperfect g instead of f. Only the fusion and the layer learn; the token table and the
vocabulary rows stay the target's.

`train_head` is seeded and resumable: a checkpoint (weights, optimiser, step, random state) is
written every `checkpoint_every` steps next to the output, and a rerun with the same settings
goes on from it.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F

from specwood.drafting.head import DraftHead, untrained_head
from specwood.drafting.head_files import save_head
from specwood.errors import SpecwoodError
from specwood.models.transformer import Transformer


@dataclass
class TrainSettings:
    draft_vocab_size: int = 32768  # the target tokens the head may propose (the most frequent in the data)
    intermediate_size: int | None = None  # the layer's MLP width (None: the target's)
    window: int = 256  # tokens per training sequence
    batch: int = 4  # windows per step
    steps: int = 2000
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    feature_weight: float = 1.0  # smooth L1 between g_t and f_{t+1}
    token_weight: float = 0.1  # soft cross-entropy against the target's distribution
    noise: float = 0.1  # uniform noise U(-a, a) on the input features, times their RMS
    seed: int = 0
    checkpoint_every: int = 100
    max_seconds: float | None = None  # stop (and checkpoint) after this much training time
    bf16: bool = False  # matmuls in bf16 (autocast; CPUs with AVX512-BF16 run them several times faster)


@dataclass
class TrainRecord:
    """The training curve: (step, feature loss, token loss, top-1 agreement with the target)."""

    curve: list[tuple[int, float, float, float]] = field(default_factory=list)
    seconds: float = 0.0


def choose_draft_vocab(sequences: Iterable[list[int]], vocab_size: int, n: int) -> torch.Tensor:
    """The `n` token ids seen most often in `sequences` (ties: the lower id first), topped up with
    the lowest unseen ids; sorted."""
    n = min(n, vocab_size)
    counts = Counter(t for seq in sequences for t in seq)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
    if len(chosen) < n:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][:n - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def windows_of(sequences: Iterable[list[int]], window: int, separator: int | None = None) -> torch.Tensor:
    """The sequences one after another (with `separator` between them, e.g. an end-of-text token),
    cut into windows of `window` tokens [N, window]; a shorter tail is dropped."""
    stream: list[int] = []
    for seq in sequences:
        stream += list(seq) + ([separator] if separator is not None else [])
    n = len(stream) // window
    if n == 0:
        raise SpecwoodError(f"less than {window} tokens of training text; add text or lower the window")
    return torch.tensor(stream[:n * window], dtype=torch.long).reshape(n, window)


@torch.inference_mode()
def target_features(target: Transformer, windows: torch.Tensor, batch: int = 4, progress: bool = False
                    ) -> torch.Tensor:
    """The target's features [N, window, dim] of each window (read on its own from position 0)."""
    from tqdm import tqdm

    out = []
    positions = torch.arange(windows.shape[1], device=target.device)
    bar = tqdm(range(0, len(windows), batch), desc="target features", unit="batch", disable=not progress)
    for a in bar:
        hidden = target.hidden(windows[a:a + batch].to(target.device), positions)
        out.append(target.features(hidden).to(torch.bfloat16).cpu())
    return torch.cat(out)


def head_losses(head: DraftHead, tokens: torch.Tensor, features: torch.Tensor, settings: TrainSettings,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(feature loss, token loss, top-1 agreement) of the head over windows `tokens` [B, T] with the
    target's `features` [B, T, dim]: pair t is (x_{t+1}, f_t) and should give f_{t+1}."""
    f = features.float()
    f_in = f[:, :-1]
    if settings.noise > 0 and head.training:
        rms = f_in.pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(f_in.shape, generator=generator) * 2 - 1
        f_in = f_in + settings.noise * rms * u
    pairs = head.pair_inputs(tokens[:, 1:], f_in)
    g = head.hidden(pairs, torch.arange(pairs.shape[1], device=head.device))
    want = f[:, 1:]
    feature_loss = F.smooth_l1_loss(g, want)
    with torch.no_grad():
        p = torch.softmax(head.cut_logits(want), -1)
    logq = torch.log_softmax(head.cut_logits(g), -1)
    token_loss = -(p * logq).sum(-1).mean()
    agree = (logq.argmax(-1) == p.argmax(-1)).float().mean()
    return feature_loss, token_loss, agree


def _lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    t = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_head(target: Transformer, windows: torch.Tensor, features: torch.Tensor, draft_vocab: torch.Tensor,
               settings: TrainSettings, out: str | Path | None = None, progress: bool = False,
               name: str = "", about: dict | None = None) -> tuple[DraftHead, TrainRecord]:
    """Train a head on the target's `features` of `windows`; save it to `out` (with a resumable
    checkpoint beside it) when given. Returns the head in fp32 and the training curve. `about`
    (e.g. the command and the data) is recorded in the head's spec."""
    from tqdm import tqdm

    torch.manual_seed(settings.seed)
    head = untrained_head(target, draft_vocab, settings.intermediate_size, seed=settings.seed, dtype=torch.float32,
                          name=name)
    trainable = [p for n, p in head.named_parameters() if not n.startswith(("tok_embeddings.", "output."))]
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    record, step = TrainRecord(), 0
    ckpt = Path(str(out) + ".ckpt") if out is not None else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if _resumable(state["settings"]) != _resumable(asdict(settings)):
            raise SpecwoodError(f"{ckpt} was written with other training settings; delete it to start over")
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, record = state["step"], TrainRecord(**state["record"])
    head.train()
    t0 = time.perf_counter() - record.seconds
    bar = tqdm(total=settings.steps, initial=step, desc="train draft head", unit="step", disable=not progress)
    while step < settings.steps:
        idx = torch.randint(len(windows), (settings.batch,), generator=gen)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, settings)
        with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            feature_loss, token_loss, agree = head_losses(head, windows[idx], features[idx], settings, gen)
        loss = settings.feature_weight * feature_loss + settings.token_weight * token_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        feature_loss, token_loss, agree = feature_loss.detach(), token_loss.detach(), agree.detach()
        torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
        opt.step()
        step += 1
        record.curve.append((step, float(feature_loss), float(token_loss), float(agree)))
        bar.update(1)
        bar.set_postfix(feat=f"{float(feature_loss):.3f}", tok=f"{float(token_loss):.3f}", top1=f"{float(agree):.2f}")
        record.seconds = time.perf_counter() - t0
        out_of_time = settings.max_seconds is not None and record.seconds >= settings.max_seconds
        if ckpt is not None and (step % settings.checkpoint_every == 0 or step == settings.steps or out_of_time):
            _checkpoint(ckpt, head, opt, gen, step, record, settings)
        if out_of_time:
            break
    bar.close()
    head.eval().requires_grad_(False)
    head.spec = type(head.spec)(**{**asdict(head.spec), "trained": {
        "steps": step, "seconds": round(record.seconds, 1), "settings": asdict(settings),
        "final": list(record.curve[-1][1:]) if record.curve else None, **(about or {})}})
    if out is not None:
        save_head(head, out, int8=True)
    return head, record


def _resumable(settings: dict) -> dict:
    """The settings a checkpoint must agree on to be resumed (not when to stop or save)."""
    return {k: v for k, v in settings.items() if k not in ("max_seconds", "checkpoint_every")}


def _checkpoint(path: Path, head: DraftHead, opt: torch.optim.Optimizer, gen: torch.Generator, step: int,
                record: TrainRecord, settings: TrainSettings) -> None:
    tmp = path.with_name(path.name + ".tmp")
    own = {k: v for k, v in head.state_dict().items() if not k.startswith(("tok_embeddings.", "output."))}
    torch.save({"head": own,
                "optimizer": opt.state_dict(), "generator": gen.get_state(), "step": step,
                "record": asdict(record), "settings": asdict(settings)}, tmp)
    tmp.replace(path)
