"""Draft head files: our own safetensors (the spec in the metadata, optionally int8 weights), the
heads that ship with the package, and loading either ours or an EAGLE folder onto a target's kernels."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from safetensors.torch import save_file

from specwood.drafting.eagle_files import load_eagle_head
from specwood.drafting.head import DraftHead, HeadSpec, new_head
from specwood.errors import ModelFileError
from specwood.models.layer_ops import KernelLayerOps
from specwood.models.linears import quantize_weight_int8
from specwood.models.transformer import Transformer
from specwood.models.w4a8 import Q4Linear

HEAD_FORMAT = "specwood-draft-head"
HEAD_VERSION = 1
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # the heads that ship with the package


def shipped_head(target_name: str) -> Path | None:
    """The head shipped for a registry target (specwood/heads/<name>.safetensors), if any."""
    path = HEADS_DIR / f"{Path(str(target_name)).name}.safetensors"
    return path if path.is_file() else None


def save_head(head: DraftHead, path: str | os.PathLike[str], int8: bool = False) -> Path:
    """Write the head's own weights (not the target's token table or vocabulary rows) and its spec
    to one safetensors file. `int8` stores each weight matrix as int8 codes with a per-row scale
    (a quarter of fp32's bytes; the shipped head); written to a temporary name, then renamed."""
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
    mode = target.weight_mode
    if mode in ("q4", "q4-lite"):
        head.quantize_q4(lite=True)
        fc = head.fc
        if isinstance(fc, nn.Linear) and Q4Linear.fits(fc.out_features, fc.in_features):
            head.fc = Q4Linear.from_linear(fc)
        head.quantize_int8(head=True)  # shapes the 4-bit kernel does not take
    elif mode == "int8":
        head.quantize_int8(head=True)
    elif head.device.type == "cpu" and head.dtype == torch.bfloat16:
        head.pack_for_cpu()
    if isinstance(target.layers[0].attention.ops, KernelLayerOps):
        head.use_layer_kernels()
    return head
