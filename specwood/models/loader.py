"""Checkpoint loading front door: resolve a name or path, dispatch to the GGUF or HF loader.

Every loader returns ``(ModelConfig, state_dict)`` in the canonical layout of specwood.models.canonical.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specwood.models.config import ModelConfig
from specwood.models.gguf_loader import load_gguf, load_gguf_tokenizer
from specwood.models.hf_loader import load_hf_folder, load_hf_tokenizer
from specwood.models.registry import REGISTRY, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_checkpoint(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, layers: range | None = None,
    skip: Callable[[ModelConfig], Collection[str]] | None = None, lazy: bool = False,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Load a registry model, a .gguf file or a Hugging Face folder -> (config, canonical weights, path).

    `skip` (GGUF files): the weights not to decode, as meta tensors; `lazy` (GGUF files): each weight
    decoded when first taken (see load_gguf)."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        config, sd = load_hf_folder(path, dtype, layers)
    else:
        config, sd = load_gguf(path, dtype, layers, skip=skip, lazy=lazy)
    if str(name_or_path).strip().lower() in REGISTRY:
        config.name = str(name_or_path).strip().lower()  # registry names are what reports should show
    elif not config.name:
        config.name = str(name_or_path)
    return config, sd, path


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a registry model, .gguf file (converted once, then cached) or HF folder."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return load_hf_tokenizer(path)
    return load_gguf_tokenizer(path)
