"""GGUF checkpoints -> (ModelConfig, canonical float weights), and their tokenizers. The header is
read by specwood.models.gguf_file and the tensor data dequantised by specwood.models.gguf_dequant.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specwood.errors import ModelFileError
from specwood.models.config import ModelConfig
from specwood.models.canonical import check_dropped_bias, check_layers, layer_index, split_fused, validate_state_dict
from specwood.models.gguf_dequant import dequantize_tensor, unpermute_qk

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from specwood.models.gguf_file import (_PERMUTED_QK_ARCHS, _TRUNCATED_FIX, GGUFTensorInfo, canonical_name,
                                       config_from_gguf, gguf_name, read_gguf_header)


_threads_lock = threading.Lock()
_threads_users = 0
_threads_saved = 0


def _single_torch_thread_enter() -> None:
    # Counted, so loads running concurrently in one process restore the caller's setting only once.
    global _threads_users, _threads_saved
    with _threads_lock:
        if _threads_users == 0:
            _threads_saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _threads_users += 1


def _single_torch_thread_exit() -> None:
    global _threads_users
    with _threads_lock:
        _threads_users -= 1
        if _threads_users == 0:
            torch.set_num_threads(_threads_saved)


def load_gguf(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    layers: range | None = None,
    progress: bool | None = None,
    skip: Callable[[ModelConfig], Collection[str]] | None = None,
    lazy: bool = False,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a GGUF file -> (config, canonical float weights in ``dtype``); see specwood.models.loader.

    `skip(config)` names weights not to decode: they come back as meta tensors of their shape (a q4
    build runs them from the file's own values; Transformer.load_canonical leaves them unwritten).
    `lazy`: each weight is decoded when it is first taken from the returned DecodedOnUse (for a
    build that requantises each layer as it loads it: the floats of one layer at a time)."""
    path = Path(path)
    header = read_gguf_header(path)
    config = config_from_gguf(header)
    check_layers(config, layers)
    wanted: list[tuple[str, GGUFTensorInfo]] = []
    for gname, info in header.tensors.items():
        cname = canonical_name(gname, config.arch)
        if cname is None:
            continue
        li = layer_index(cname)
        if li is not None and layers is not None and li not in layers:
            continue
        wanted.append((cname, info))
    sd: dict[str, torch.Tensor] = {}

    def placeholder(info: GGUFTensorInfo) -> torch.Tensor:
        return torch.empty(tuple(info.shape) or (1,), dtype=dtype, device="meta")

    left = set(skip(config)) if skip is not None else set()
    for cname, info in [w for w in wanted if w[0] in left]:
        sd[cname] = placeholder(info)
    wanted = [w for w in wanted if w[0] not in left]
    permute = config.arch in _PERMUTED_QK_ARCHS
    file_names = lambda name: gguf_name(name, config.arch)  # noqa: E731 - errors name tensors as the file does
    if progress is None:
        progress = header.file_size > (256 << 20) and sys.stderr.isatty()

    # np.memmap rather than mmap.mmap: views into it stay valid however long anything keeps them.
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, file untouched

    def convert(item: tuple[str, GGUFTensorInfo]) -> torch.Tensor:
        cname, info = item
        t = dequantize_tensor(mm, info, dtype, path)
        return _unpermuted(t, cname, config) if permute else t

    def file_error(e: Exception) -> ModelFileError:  # view/reshape failures: a tensor table inconsistent with the data
        return ModelFileError(f"{path}: cannot decode tensor data ({e}); {_TRUNCATED_FIX}")

    try:
        for gname, info in header.tensors.items():
            if gname.startswith("blk.") and gname.endswith(".bias") and canonical_name(gname, config.arch) is None:
                check_dropped_bias(path, gname, dequantize_tensor(mm, info, torch.float32, path))
        if config.rope_scaling and config.rope_scaling.get("rope_type") == "freq_factors":
            freqs = dequantize_tensor(mm, header.tensors["rope_freqs.weight"], torch.float32, path)
            config.rope_scaling["freq_factors"] = freqs.tolist()
        if config.rope_scaling and config.rope_scaling.get("rope_type") == "longrope":  # Phi-3's factor tensors
            for key, tensor in (("long_factor", "rope_factors_long.weight"),
                                ("short_factor", "rope_factors_short.weight")):
                if tensor not in header.tensors:
                    raise ModelFileError(f"{path}: missing tensor {tensor} (LongRoPE needs both factor tensors)")
                config.rope_scaling[key] = dequantize_tensor(mm, header.tensors[tensor], torch.float32, path).tolist()
    except (ValueError, RuntimeError) as e:
        raise file_error(e) from None
    if lazy:
        for cname, info in wanted:
            sd[cname] = placeholder(info)
        # on a copy: checking decodes nothing
        validate_state_dict(config, _split(config, dict(sd)), path, layers, file_names)
        infos = dict(wanted)

        def decode(cname: str) -> torch.Tensor:
            try:
                return convert((cname, infos[cname]))
            except (ValueError, RuntimeError) as e:
                raise file_error(e) from None

        out = DecodedOnUse(sd, set(infos), decode)
        split_fused(config, out)  # a fused tensor (Phi-3's) is decoded now, to be split
        return config, out
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(i.n_bytes for _, i in wanted), desc=f"loading {path.name}", unit="B",
                   unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False, dynamic_ncols=True)

    # Parallel over tensors (torch releases the GIL) with single-threaded torch ops: intra-op OpenMP
    # threads spin at barriers and were 7x slower than one thread on a busy 2-core machine.
    order = sorted(wanted, key=lambda it: -it[1].n_bytes)  # biggest first: no lone embedding at the tail
    try:
        _single_torch_thread_enter()
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            for (cname, info), t in zip(order, pool.map(convert, order)):
                sd[cname] = t
                if bar is not None:
                    bar.update(info.n_bytes)
    except (ValueError, RuntimeError) as e:
        raise file_error(e) from None
    finally:
        _single_torch_thread_exit()
        if bar is not None:
            bar.close()
        # drops the mapping; not `del`, which pyflakes misreads in convert()'s closure
        mm = None  # type: ignore[assignment]
    split_fused(config, sd)
    validate_state_dict(config, sd, path, layers, file_names)
    return config, sd


def _split(config: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    split_fused(config, sd)
    return sd


def _unpermuted(t: torch.Tensor, cname: str, config: ModelConfig) -> torch.Tensor:
    """q and k of the archs whose GGUF conversion permuted them, back in the checkpoint's order."""
    if cname.endswith(("attention.wq.weight", "attention.wq.bias")):
        return unpermute_qk(t, config.n_heads).contiguous()
    if cname.endswith(("attention.wk.weight", "attention.wk.bias")):
        return unpermute_qk(t, config.n_kv_heads).contiguous()
    return t


class DecodedOnUse(dict):
    """A state dict whose `pending` weights are decoded from the file when first read (`[name]`,
    `pop`); until then they hold meta tensors of their shape. Only item access decodes: iterate
    over it with keys, not values or items."""

    def __init__(self, placeholders: dict[str, torch.Tensor], pending: set[str],
                 decode: Callable[[str], torch.Tensor]):
        super().__init__(placeholders)
        self.pending, self._decode = pending, decode

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.pending:
            super().__setitem__(name, self._decode(name))
            self.pending.discard(name)
        return super().__getitem__(name)

    def pop(self, name: str, *default: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if name not in self:
            return super().pop(name, *default)
        value = self[name]
        super().pop(name)
        return value


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_cache_dir(path: Path) -> Path:
    """Where the converted tokenizer of ``path`` lives: next to a registry model (keyed by its sha256),
    else under $SPECWOOD_CACHE/tokenizers keyed by the file's absolute path, size and mtime."""
    from specwood.models.registry import cache_dir

    marker = path.with_name(path.name + ".verified")
    st = path.stat()
    try:
        info = json.loads(marker.read_text())
        if info.get("size") == st.st_size and info.get("mtime_ns") == st.st_mtime_ns:
            return path.parent / f"tokenizer-{info['sha256'][:16]}"
    except (OSError, ValueError, KeyError):
        pass
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{path.stem}-{key}"


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer embedded in a GGUF file, converted by transformers once and cached as an HF folder."""
    from transformers import AutoTokenizer

    path = Path(path)
    cached = _tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry is rebuilt below
            shutil.rmtree(cached, ignore_errors=True)

    header = read_gguf_header(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelFileError(
            f"{path}: transformers cannot convert the GGUF tokenizer ({type(e).__name__}: {e}); "
            "use the model's Hugging Face folder instead"
        ) from None
    template = header.metadata.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template  # transformers' GGUF conversion drops it
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process cached it first; theirs is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
