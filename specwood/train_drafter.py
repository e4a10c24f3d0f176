"""`specwood train-drafter`: train a feature-level draft head for a target on this machine.

1. The target answers prompts built from templates and the standard library (batched, greedy,
   chat-templated: what the server will see) and reads standard-library source text.
2. The most frequent target tokens of that text become the draft vocabulary.
3. The target reads the text in windows; its features are cached on disk (resumable).
4. The head is trained by self-distillation (specwood.drafting.head_training) until its steps
   or the time budget run out, with checkpoints; a rerun of the same command goes on from them.

The finished head is a small safetensors file (int8 weights) for `--head PATH`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specwood.engine.config import SchedulerConfig
from specwood.errors import SpecwoodError


def add_train_drafter_parser(sub: Any) -> None:
    from specwood.engine.backends import DTYPE_CHOICES

    p = sub.add_parser("train-drafter", help="train a feature-level draft head (EAGLE-style) for a target, here",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="registry name, .gguf file or HF folder (default: the default target)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="the target's weight mode (as in generate)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="the head file (default: <cache>/heads/<target>.safetensors)")
    p.add_argument("--prompts", type=int, default=240, help="prompts the target answers (default 240)")
    p.add_argument("--answer-tokens", type=int, default=192, help="tokens per answer (default 192)")
    p.add_argument("--text-tokens", type=int, default=150_000,
                   help="tokens of standard-library source text (default 150,000)")
    p.add_argument("--window", type=int, default=256, help="tokens per training window (default 256)")
    p.add_argument("--draft-vocab", type=int, default=32768, help="the head's draft vocabulary (default 32768)")
    p.add_argument("--intermediate-size", type=int, default=4096, help="the head layer's MLP width (default 4096)")
    p.add_argument("--steps", type=int, default=1400, help="optimiser steps (default 1400)")
    p.add_argument("--batch", type=int, default=4, help="windows per step (default 4)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=90.0,
                   help="time budget for the whole run; training stops (checkpointed) when it is spent (default 90)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--fresh", action="store_true", help="ignore cached answers, features and checkpoints")
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specwood.engine.api import load
    from specwood.drafting.head_files import load_head
    from specwood.drafting.head_training import TrainSettings, train_head
    from specwood.engine.api import cpu_has_bf16
    from specwood.models.registry import DEFAULT_TARGET, cache_dir

    t_start = time.perf_counter()
    for name in ("prompts", "answer_tokens", "text_tokens", "window", "draft_vocab", "intermediate_size", "steps",
                 "batch"):
        if getattr(args, name) < (0 if name in ("prompts", "text_tokens") else 1):
            raise SpecwoodError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.window < 2:  # a window trains on next tokens: it needs two
        raise SpecwoodError(f"--window must be >= 2 tokens, got {args.window}")
    for flag, value in (("--lr", args.lr), ("--minutes", args.minutes)):
        if not value > 0:
            raise SpecwoodError(f"{flag} must be > 0, got {value}")
    if args.threads is not None and args.threads < 1:
        raise SpecwoodError(f"--threads must be >= 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target_name = str(args.target or DEFAULT_TARGET)
    out = Path(args.out) if args.out else cache_dir() / "heads" / f"{Path(target_name).stem}.safetensors"
    try:  # before minutes of work: the head (and its checkpoints) must have somewhere to go
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecwoodError(f"cannot write the head to {out}: {e.strerror or e}") from None
    data_key = hashlib.sha256(json.dumps([target_name, args.dtype, args.prompts, args.answer_tokens, args.text_tokens,
                                          args.window, args.seed, sys.version_info[:2]]).encode()).hexdigest()[:16]
    work = cache_dir() / "drafter" / data_key
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
        Path(str(out) + ".ckpt").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    print(f"[train-drafter] target {target_name}; data and checkpoints in {work}", file=sys.stderr)
    engine = load(target_name, None, dtype=args.dtype, device=args.device)
    if args.window > engine.max_context:
        raise SpecwoodError(f"--window {args.window} is longer than the target's context ({engine.max_context})")
    if not hasattr(engine.target, "features"):
        raise SpecwoodError("train-drafter reads the target's features: it needs the torch backend for the target")
    sequences = _answers(engine, args, work) + _text(engine, args, work)
    from specwood.drafting.head_training import choose_draft_vocab, windows_of

    vocab = choose_draft_vocab(sequences, engine.target_config.vocab_size, args.draft_vocab)
    eos = min(engine.eos_token_ids) if engine.eos_token_ids else None
    windows = windows_of(sequences, args.window, separator=eos)
    features = _features(engine, windows, work)
    spent = time.perf_counter() - t_start
    settings = TrainSettings(
        draft_vocab_size=args.draft_vocab, intermediate_size=args.intermediate_size, window=args.window,
        batch=args.batch, steps=args.steps, lr=args.lr, seed=args.seed,
        max_seconds=max(1.0, args.minutes * 60 - spent - 30), bf16=engine.device.type == "cpu" and cpu_has_bf16())
    print(f"[train-drafter] {len(windows)} windows of {args.window} tokens, draft vocabulary {len(vocab)}; "
          f"{spent / 60:.1f} min spent, training for up to {settings.max_seconds / 60:.1f} min", file=sys.stderr)
    about = {"command": "specwood train-drafter " + " ".join(_argv(args)), "windows": len(windows),
             "data": {"prompts": args.prompts, "answer_tokens": args.answer_tokens, "text_tokens": args.text_tokens}}
    _, record = train_head(engine.target, windows, features, vocab, settings, out=out, progress=True,
                           name=target_name, about=about)
    done = record.curve[-1][0] if record.curve else 0
    load_head(out, engine.target, fast=False)  # it loads (no need to put it on the kernels for that)
    status = "finished" if done >= args.steps else f"stopped at step {done} of {args.steps} (rerun to go on)"
    print(f"[train-drafter] {status}; head written to {out} ({out.stat().st_size / 1e6:.1f} MB)\n"
          f"use it: specwood generate \"PROMPT\" --method head --head {out}", file=sys.stderr)
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    """The options that shape the head, as a command line that reproduces it."""
    flags = ["target", "dtype", "prompts", "answer_tokens", "text_tokens", "window", "draft_vocab",
             "intermediate_size", "steps", "batch", "lr", "seed", "minutes"]
    return [f"--{f.replace('_', '-')} {getattr(args, f)}" for f in flags if getattr(args, f) is not None]


def _answers(engine: Any, args: argparse.Namespace, work: Path) -> list[list[int]]:
    """Chat-templated prompts and the target's greedy answers (token ids), cached in `work`."""
    from tqdm import tqdm

    from specwood.drafter_data import training_prompts

    cached = work / "answers.json"
    if cached.exists():
        return json.loads(cached.read_text())
    prompts = [engine.encode(p) for p in training_prompts(random.Random(args.seed), args.prompts)]
    fitting = [ids for ids in prompts if len(ids) + args.answer_tokens <= engine.max_context]
    if len(fitting) < len(prompts):
        print(f"[train-drafter] {len(prompts) - len(fitting)} of {len(prompts)} prompts do not fit the context of "
              f"{engine.max_context} tokens with their answers; skipped", file=sys.stderr)
    if not fitting:
        return []
    sched = engine.make_scheduler(SchedulerConfig(max_batch=8, max_queue=len(fitting)))
    bar = tqdm(total=len(fitting), desc="target answers", unit="prompt")
    requests = [engine.new_request(ids, max_tokens=args.answer_tokens, scheduler=sched,
                                   on_finish=lambda r: bar.update(1)) for ids in fitting]
    for req in requests:
        sched.submit(req)
    sched.run_until_done(requests)
    bar.close()
    failed = [r.error for r in requests if r.error is not None]
    if failed:
        raise SpecwoodError(f"the target failed on {len(failed)} training prompts: {failed[0]}")
    sequences = [r.prompt_ids + r.result.token_ids for r in requests]
    _write_json(cached, sequences)
    return sequences


def _text(engine: Any, args: argparse.Namespace, work: Path) -> list[list[int]]:
    """Standard-library source files as token ids, `--text-tokens` of them in all, cached in `work`."""
    from specwood.drafter_data import stdlib_texts

    cached = work / "text.json"
    if cached.exists():
        return json.loads(cached.read_text())
    if args.text_tokens == 0:
        return []
    texts = stdlib_texts(random.Random(args.seed + 1), max_chars=args.text_tokens * 5)
    sequences, total = [], 0
    for text in texts:
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))[: args.text_tokens - total]
        sequences.append(ids)
        total += len(ids)
        if total >= args.text_tokens:
            break
    _write_json(cached, sequences)
    return sequences


def _features(engine: Any, windows: torch.Tensor, work: Path) -> torch.Tensor:
    """The target's features of every window (bf16), cached in `work`; refuses up front where the
    memory or the disk cannot hold them."""
    from specwood.drafting.head_training import target_features

    cached = work / "features.pt"
    if cached.exists():
        features = torch.load(cached, weights_only=True)
        if features.shape[:2] == windows.shape:
            return features
    need = windows.numel() * engine.target_config.dim * 2
    free_disk = shutil.disk_usage(work).free
    free_mem = _available_memory()
    if need > free_disk:
        raise SpecwoodError(f"the target's features need {need / 1e9:.2f} GB of disk in {work} but "
                            f"{free_disk / 1e9:.2f} GB are free; free space or lower --text-tokens/--prompts")
    if free_mem is not None and 2 * need > free_mem:
        raise SpecwoodError(f"the target's features need {2 * need / 1e9:.2f} GB of memory (with training) but "
                            f"{free_mem / 1e9:.2f} GB are available; lower --text-tokens/--prompts")
    features = target_features(engine.target, windows, batch=4, progress=True)
    tmp = cached.with_name("features.pt.tmp")
    torch.save(features, tmp)
    os.replace(tmp, cached)
    return features


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
