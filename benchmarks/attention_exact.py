"""The kernel attention's fp32 scores and probabilities, this checkout's against another
revision's, to the last bit: a check for changes to `kernels/layer_ops.cpp` that are meant to
reorganise the work without changing a single rounding.

The attention's bf16 output hides most rounding differences (an fp32 ulp of a score rarely moves a
bf16 output), so the tests' comparisons of outputs cannot prove such a change exact. Here both
builds get a hook that keeps every scored token's scores (after the scale and mask) and
probabilities before they are rounded; the two are compared over random shapes (the default
pair's head layouts and others), masks and contexts, on one thread.

    python benchmarks/attention_exact.py --against c7d2689
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specwood.models.layer_ops import KERNEL
from specwood.models.transformer import cpu_attention_mask

REPO = Path(__file__).resolve().parents[1]
SOURCE = "specwood/models/kernels/layer_ops.cpp"
SOFTMAX = "  // Softmax of each head's scores, in the order of the visible keys."
SOFTMAX_END = "    inverse[g] = n > 0 ? 1.f / sum16(total) : 0.f;\n  }\n"


def with_hook(text: str) -> str:
    """`text` (layer_ops.cpp) keeping the scores before the softmax and the probabilities before the
    values are weighed, returned (and cleared) by a `dump()` function."""
    for anchor in (SOFTMAX, SOFTMAX_END):
        if anchor not in text:
            raise SystemExit(f"layer_ops.cpp has no line {anchor.strip()!r} to hook; compare revisions with it")
    text = text.replace("namespace {\n", "namespace {\nstd::vector<float> g_dump;\n", 1)
    keep = "  g_dump.insert(g_dump.end(), scores.begin(), scores.end());\n"
    text = text.replace(SOFTMAX, keep + SOFTMAX, 1).replace(SOFTMAX_END, SOFTMAX_END + keep, 1)
    return text.replace('  mod.def("attention"',
                        '  mod.def("dump", []() { auto r = g_dump; g_dump.clear(); return r; });\n'
                        '  mod.def("attention"', 1)


def build(name: str, text: str, folder: Path):
    src = folder / f"{name}.cpp"
    src.write_text(with_hook(text))
    return load(name=name, sources=[str(src)], build_directory=str(folder), extra_cflags=KERNEL.cflags, verbose=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="git revision to compare with")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    old_text = subprocess.run(["git", "show", f"{args.against}:{SOURCE}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    old = build("attention_exact_old", old_text, folder)
    new = build("attention_exact_new", (REPO / SOURCE).read_text(), folder)
    torch.set_num_threads(1)  # one thread: the hook's buffer is filled in order
    g = torch.Generator().manual_seed(1)
    differ = cases = values = 0
    for heads, kv, dim in [(12, 2, 128), (14, 2, 64), (6, 1, 128), (8, 2, 64), (4, 4, 128), (5, 1, 64), (9, 1, 128),
                           (10, 2, 128), (6, 1, 64), (2, 1, 128)]:
        for context, tokens in [(1, 1), (5, 3), (17, 1), (37, 9), (300, 8), (1000, 3)]:
            for dtype in (torch.bfloat16, torch.float32):
                q = torch.randn(2, tokens, heads, dim, generator=g).to(dtype)
                k, v = (torch.randn(2, kv, context + tokens, dim, generator=g).to(dtype) for _ in range(2))
                mask = torch.rand(2, 1, tokens, context + tokens, generator=g) < 0.7
                mask[..., 0] = True
                bias = cpu_attention_mask(mask, heads // kv, dtype)
                out_new, kept_new = new.attention(q, k, v, bias, dim ** -0.5), new.dump()
                out_old, kept_old = old.attention(q, k, v, bias, dim ** -0.5), old.dump()
                cases += 1
                values += len(kept_new)
                if not (torch.equal(out_new, out_old) and kept_new == kept_old):
                    differ += 1
                    print(f"differs: {heads}/{kv} heads of {dim}, context {context}, {tokens} tokens, {dtype}")
    print(f"{cases} cases, {values:,} fp32 scores and probabilities compared: {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
