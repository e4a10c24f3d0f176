"""Memory of the default pair in its default weight modes against the size of its GGUF files: the
process's resident set after loading (kernels built, floats released) and the bytes the two models
hold in tensors (weights, KV caches not included).

    python benchmarks/pair_memory.py
"""
import os

import torch

import specwood
from specwood.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_model


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tensor_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    files = sum(os.path.getsize(ensure_model(m, progress=False)) for m in (DEFAULT_TARGET, DEFAULT_DRAFT))
    before = rss_bytes()
    engine = specwood.load(progress=False)
    after = rss_bytes()
    held = tensor_bytes(engine.target) + tensor_bytes(engine.draft_model)
    print(f"modes: target {engine.target.weight_mode}, draft {engine.draft_model.weight_mode}")
    print(f"GGUF files: {files / 1e9:.3f} GB")
    print(f"tensors held by the two models: {held / 1e9:.3f} GB ({held / files:.2f}x the files)")
    print(f"process RSS after loading: {after / 1e9:.3f} GB ({after / files:.2f}x the files; "
          f"{before / 1e9:.3f} GB before loading: torch and the libraries)")


if __name__ == "__main__":
    main()
