"""The q4 weight mode: our W4A8 kernel equals its reference, each row's result is independent of
the other rows (what keeps tree verification lossless), the GGUF's Q4_K values are kept as
llama.cpp holds them, and every speculative method is token-identical to `ar` in this mode."""
import argparse

import numpy as np
import pytest
import torch
from conftest import assert_every_method_matches_ar
from torch import nn

from specwood.engine.api import Engine
from specwood.models.linears import Int8Linear
from specwood.models.transformer import build_model
from specwood.models.w4a8 import (GROUP, QuantEmbedding, Q4Linear, pack_q4, q4_unavailable_reason, quantize_q4,
                                  unpack_q4)

pytestmark = pytest.mark.skipif(q4_unavailable_reason() is not None, reason=str(q4_unavailable_reason()))


def random_q4(n: int, k: int, seed: int = 0, bias: bool = False) -> tuple[Q4Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return Q4Linear(quantize_q4(w), b), w


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies, in float64: the activations quantised per group of 32 inputs
    (symmetric int8, round half to even, the scale's reciprocal in fp32)."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    scale = g.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g * (1 / scale)).clamp(-127, 127)
    return (q.double() * scale.double()).reshape(m, k)


def reference(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: quantized_activations times the dequantised weights."""
    out = quantized_activations(x) @ lin.weight.double().t()  # weight: d * sc * q - dmin * m
    return out + lin.bias.double() if lin.bias.numel() else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_q4_linear_equals_reference(dtype, rows):
    lin, w = random_q4(64, 96, bias=True)
    x = (torch.randn(rows, 96) * 3).to(dtype)
    x[0, :GROUP] = 0  # a group of zeros
    out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 64)
    ref = reference(lin, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < tol
    # and near the float weights: 4-bit weights and int8 activations
    exact = x.double() @ w.double().t() + lin.bias.double()
    assert ((out.double() - exact).norm() / exact.norm()) < 0.15


def assert_rows_independent(lin: nn.Module, x: torch.Tensor) -> None:
    """Row-exact: a row's output is bit-identical whatever the other rows are, in tiles of up to 8
    rows or alone, with one thread or two (the threads split the output channels)."""
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batch = lin(x)
            alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
            assert torch.equal(batch, alone)
            assert torch.equal(lin(x[3:11]), batch[3:11])
            assert torch.equal(lin(x[5:9]), batch[5:9])
            outs.append(batch)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(old)


def test_q4_rows_are_independent_of_the_batch():
    lin, _ = random_q4(160, 320, seed=1, bias=True)
    assert_rows_independent(lin, torch.randn(19, 320) * torch.rand(19, 1) * 10)  # tiles of 8, 8 and 3


@pytest.mark.parametrize("k", [64, 96, 256, 896])  # superblocks of 8 groups, whole and partial (the 0.5B draft: 896)
def test_quantize_q4_stores_what_it_rounds_to(k):
    w = torch.randn(64, k) * torch.rand(64, 1)
    w[0, :GROUP] = 5.0  # a constant group
    w[1] = 0.0  # a row of zeros
    w[2, GROUP:2 * GROUP] = -torch.rand(GROUP)  # a group below zero
    q = quantize_q4(w)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert int(q.sub_scales.max()) <= 63 and int(q.sub_mins.max()) <= 63 and q.super_scales.dtype == torch.float16
    assert q.super_scales.shape == (64, -(-k // 256))
    deq = q.dequantize()
    # every weight within half a step of its float (the range of each group is covered)
    assert ((deq - w).abs() <= q.scales().repeat_interleave(GROUP, 1) * 0.5 + 1e-6).all()
    assert torch.equal(deq[1], w[1])
    lin = Q4Linear(q)
    assert lin.packed.shape == (2, lin.kernel.q4_block_bytes(k // GROUP))  # the kernel's own size
    back = lin.weights
    assert all(torch.equal(a, b) for a, b in zip(back, q))  # the packed layout unpacks to the same values
    assert torch.equal(lin.weight, deq)
    assert torch.equal(pack_q4(unpack_q4(lin.packed, k)), lin.packed)


def test_q4_values_are_llamacpp_values_on_the_shipped_file():
    """Q4_K exactness on real blocks: the values read from the default target's GGUF give llama.cpp's
    dequantised values bit for bit (fp32), and so do the kernel's packed copy and the token table's
    rows."""
    from specwood.models.gguf_dequant import dequantize_tensor
    from specwood.models.gguf_file import read_gguf_header
    from specwood.models.gguf_kquants import kquant_weights
    from specwood.models.registry import DEFAULT_TARGET, ensure_model

    path = ensure_model(DEFAULT_TARGET, progress=False)
    exact = kquant_weights(path, range(0, 1))
    assert "layers.0.attention.wq.weight" in exact and "layers.0.feed_forward.w1.weight" in exact
    header = read_gguf_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for gname, cname in [("blk.0.attn_q.weight", "layers.0.attention.wq.weight"),
                         ("blk.0.ffn_up.weight", "layers.0.feed_forward.w3.weight")]:
        ref = dequantize_tensor(mm, header.tensors[gname], torch.float32)
        mine = exact[cname].dequantize()
        assert torch.equal(mine, ref), gname
        assert torch.equal(Q4Linear(exact[cname]).weight, ref), gname
    # the token table is Q4_K in this file too: kept as codes, rows dequantised on lookup
    table = QuantEmbedding(kquant_weights(path, range(0))["tok_embeddings.weight"], torch.float32)
    ids = torch.tensor([[0, 151643, 17]])
    rows = table(ids)[0]
    ref = dequantize_tensor(mm, header.tensors["token_embd.weight"], torch.float32)[ids[0]]
    assert torch.equal(rows, ref)
    assert table.packed.numel() == ref.shape[1] // 2 * table.num_embeddings  # 4 bits a weight


def q4_copy(model: nn.Module) -> nn.Module:
    """Float weights quantised to 4 bits (q4-lite: a float checkpoint has no Q4_K values to keep)."""
    return build_model(model.config, model.canonical_state_dict(), torch.float32,
                       max_positions=model.max_positions, q4_lite=True)


def test_q4_model_stays_close_to_fp32(tiny_pair):
    model = tiny_pair.target
    q4 = q4_copy(model)
    assert q4.weight_mode == "q4-lite"
    assert sum(isinstance(m, Q4Linear) for m in q4.layers.modules()) == 4 * len(q4.layers)
    # the tiny vocabulary (257) is no multiple of 16: its head goes to int8
    assert isinstance(q4.output, Int8Linear)
    x = torch.randint(0, 256, (1, 40))
    ref, out = model(x, torch.arange(40))[0], q4(x, torch.arange(40))[0]
    assert ((out - ref).norm() / ref.norm()) < 0.15
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_every_method_matches_ar_in_q4_mode(tiny_pair, tiny_tokenizer):
    """fp32 activations: the q4 linears are row-exact, so trees verify to what one-token steps give."""
    engine = Engine(q4_copy(tiny_pair.target), tiny_tokenizer, draft=q4_copy(tiny_pair.draft))
    assert_every_method_matches_ar(engine)


def test_load_q4_mode(tiny_checkpoint_files, tiny_tokenizer, monkeypatch):
    import specwood
    import specwood.models.loader as loader

    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tiny_tokenizer)
    files = tiny_checkpoint_files
    # q4 on an F32 file: no k-quant weights to keep, so every weight stays in floats, said in one line
    engine = specwood.load(files.gguf, None, dtype="q4", progress=False)
    assert (engine.target.weight_mode in ("bf16", "fp32")
            and len(engine.target.weights_in_floats) == 7 * files.config.n_layers + 1)
    from specwood.engine.api import weights_in_floats_note

    note = weights_in_floats_note(files.gguf, engine.target)
    assert "\n" not in note and "layers.0.attention.wq.weight (F32)" in note and "more" in note
    engine = specwood.load(files.gguf, files.gguf, dtype="q4-lite", draft_dtype="q4-lite", progress=False)
    assert engine.target.weight_mode == "q4-lite" and engine.draft_model.weight_mode == "q4-lite"
    # an F32 token table is no Q4_K one: the target keeps it in floats; a draft stores it in 4 bits
    assert not isinstance(engine.target.tok_embeddings, QuantEmbedding)
    assert isinstance(engine.draft_model.tok_embeddings, QuantEmbedding)
    ids = [3, 4, 5, 6]
    assert engine.generate(ids, max_tokens=6, method="dyspec").token_ids == engine.generate(ids, max_tokens=6).token_ids
    with pytest.raises(specwood.SpecwoodError, match="runs on the CPU|CUDA is not available"):
        specwood.load(files.gguf, None, dtype="q4", device="cuda" if torch.cuda.is_available() else "cuda:0",
                      progress=False)


def test_cli_accepts_q4():
    from specwood.cli import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--dtype", "q4", "--draft-dtype", "q4"])
    assert args.dtype == "q4" and args.draft_dtype == "q4"


def test_a_cpu_without_avx2_gets_one_line_naming_int8(monkeypatch):
    """Where the kernel cannot run, loading q4 stops before any model is read, with one line."""
    import specwood
    from specwood.models import kernels, kquant_kernels, w4a8

    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "sse4_2"})  # what such a CPU reports
    chosen = kquant_kernels.kquant_kernel()
    assert chosen is kquant_kernels.AVX2_KERNEL  # the least such a CPU would need, named in the line
    fresh = kernels.CpuKernel(chosen.name, chosen.source.name, chosen.cflags, chosen.required, chosen.use)
    monkeypatch.setattr(w4a8, "KERNEL", fresh)
    reason = w4a8.q4_unavailable_reason()
    assert reason is not None and "avx2" in reason and "--dtype int8" in reason and "\n" not in reason
    with pytest.raises(specwood.SpecwoodError, match="--dtype int8"):
        specwood.load("/nonexistent/model.gguf", None, dtype="q4", progress=False)


def test_the_kernel_is_avx512_vnni_where_the_cpu_has_it_else_avx2(monkeypatch):
    from specwood.models import kernels, kquant_kernels

    cases = [({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, kquant_kernels.VNNI_KERNEL),
             ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, kquant_kernels.AVX2_KERNEL),
             ({"avx2", "fma", "f16c"}, kquant_kernels.AVX2_KERNEL)]
    for flags, kernel in cases:
        monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
        assert kquant_kernels.kquant_kernel() is kernel, flags


def test_auto_weight_mode_is_q4_for_q4k_gguf_targets_and_for_drafts(tiny_checkpoint_files, tiny_tokenizer, monkeypatch):
    """--dtype auto runs a Q4_K GGUF (the shipped target) in q4, other targets in floats; a draft
    runs in q4-lite whatever its file; a CPU without VNNI keeps the older defaults (float, int4 draft)."""
    import specwood
    import specwood.models.loader as loader
    from specwood.engine.api import gguf_is_q4k
    from specwood.models import kernels
    from specwood.models.linears import int4_available

    assert gguf_is_q4k("qwen2.5-coder-1.5b-instruct")  # Q4_K_M: most layer weights are Q4_K
    files = tiny_checkpoint_files
    assert not gguf_is_q4k(files.gguf) and not gguf_is_q4k(files.hf)  # F32 blocks, a float folder
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tiny_tokenizer)
    engine = specwood.load(files.gguf, files.gguf, progress=False)
    assert engine.target.weight_mode in ("bf16", "fp32") and engine.draft_model.weight_mode == "q4-lite"
    ids = [3, 4, 5, 6]
    assert engine.generate(ids, max_tokens=6, method="dyspec").token_ids == engine.generate(ids, max_tokens=6).token_ids
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx2", "avx512f"})  # no VNNI
    engine = specwood.load(files.gguf, files.gguf, progress=False)
    assert engine.draft_model.weight_mode == ("int4" if int4_available() else engine.target.weight_mode)


def test_quantising_in_row_chunks_gives_the_whole_tables_values():
    """quantize_q4 takes a big table `rows` at a time (its float temporaries are twice the table);
    every field equals one pass over the whole, a chunk ending inside a 32-row block included."""
    w = torch.randn(5000, 256, generator=torch.Generator().manual_seed(3)) * torch.rand(5000, 1) * 4
    whole, chunked = quantize_q4(w, rows=10 ** 9), quantize_q4(w, rows=1000)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
