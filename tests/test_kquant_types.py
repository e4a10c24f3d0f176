"""Q5_K and Q8_0 on our kernel (Q4_0 and Q5_0 held as Q8_0): the readers give ggml's values bit for
bit (gguf-py's own dequantisation, on the shipped draft file's Q5_0 / Q8_0 tensors and on blocks of
every code), the packed layouts round-trip at the file's size, the kernel equals its reference, rows
are independent of the batch, and a model whose linears mix every type stays token-identical to
`ar` for every method."""
import numpy as np
import pytest
import torch
from conftest import assert_every_method_matches_ar
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as ggml_dequantize
from test_q6k import stored_copy
from test_w4a8 import assert_rows_independent, reference

from specwood.engine.api import Engine
from specwood.models.gguf_kquants import _q4_0_parts, _q5_0_parts, _q5k_parts, _q8_0_parts
from specwood.models.q6k import Q6Linear, quantize_q6
from specwood.models.q8_0 import Q8Linear, Q8Weights, pack_q8, quantize_q8, unpack_q8
from specwood.models.w4a8 import (Q4Linear, Q5Linear, Q5Weights, StackedLinear, pack_q5, q4_unavailable_reason,
                                  quantize_q4, unpack_q5)

pytestmark = pytest.mark.skipif(q4_unavailable_reason() is not None, reason=str(q4_unavailable_reason()))


def random_q5(n: int, k: int, seed: int = 0) -> Q5Weights:
    """Every code, scale code and minimum code the format allows."""
    g = torch.Generator().manual_seed(seed)
    supers = -(-k // 256)
    return Q5Weights(torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8),
                     torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8),
                     torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8),
                     (torch.rand(n, supers, generator=g) * 0.01).half(),
                     (torch.rand(n, supers, generator=g) * 0.01).half())


def random_q8(n: int, k: int, seed: int = 0) -> Q8Weights:
    g = torch.Generator().manual_seed(seed)
    return Q8Weights(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                     ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.01).half())  # negative d too


@pytest.mark.parametrize("k", [64, 96, 256, 896, 1536])  # whole and partial superblocks
def test_packed_layouts_round_trip_at_the_files_size(k):
    for weights, linear, pack, unpack, size in ((random_q5(64, k, k), Q5Linear, pack_q5, unpack_q5, "q5_block_bytes"),
                                                (random_q8(64, k, k), Q8Linear, pack_q8, unpack_q8, "q8_block_bytes")):
        lin = linear(weights)
        assert lin.packed.shape == (2, getattr(lin.kernel, size)(k // 32))  # the kernel's own size
        assert all(torch.equal(a, b) for a, b in zip(lin.weights, weights))
        assert type(lin.weights) is type(weights)
        assert torch.equal(pack(unpack(lin.packed, k)), lin.packed)
    if k % 256 == 0:
        assert Q5Linear(random_q5(64, k)).packed.numel() == 64 * k * 180 // 256  # Q5_K's 5.625 bits, as the file
        assert Q8Linear(random_q8(64, k)).packed.numel() == 64 * k * 34 // 32  # Q8_0's 8.5 bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_q5_and_q8_linears_equal_reference(dtype, rows):
    for lin in (Q5Linear(random_q5(96, 896, seed=rows), torch.randn(96)),
                Q8Linear(random_q8(96, 896, seed=rows), torch.randn(96))):
        x = (torch.randn(rows, 896) * 3).to(dtype)
        x[0, :32] = 0  # a group of zeros
        out = lin(x)
        assert out.dtype == dtype and out.shape == (rows, 96)
        ref = reference(lin, x)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((out.double() - ref).abs().max() / ref.abs().max()) < tol, type(lin).__name__


def test_q5_and_q8_rows_are_independent_of_the_batch():
    x = torch.randn(19, 512) * torch.rand(19, 1) * 10
    assert_rows_independent(Q5Linear(random_q5(160, 512, seed=3), torch.randn(160)), x)
    assert_rows_independent(Q8Linear(random_q8(160, 512, seed=3), torch.randn(160)), x)
    mixed = StackedLinear([Q4Linear(quantize_q4(torch.randn(64, 512))), Q8Linear(quantize_q8(torch.randn(32, 512)))])
    assert_rows_independent(mixed, x)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks of random bytes with finite fp16 factors: every code the format can hold."""
    from gguf.quants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = 2 if qtype == Q.Q5_K else 1  # d (and dmin) lead every block
    factors = (np.random.default_rng(seed + 1).random((raw.shape[0], halves)) * 0.02 - 0.005).astype(np.float16)
    raw[:, :2 * halves] = factors.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype,read", [(Q.Q5_K, _q5k_parts), (Q.Q8_0, _q8_0_parts), (Q.Q4_0, _q4_0_parts),
                                        (Q.Q5_0, _q5_0_parts)])
def test_readers_give_ggmls_values(qtype, read):
    raw = random_blocks(qtype, 64, 512, seed=int(qtype))
    ours = read(torch.from_numpy(raw.copy()).reshape(-1), 64)
    expected = torch.from_numpy(ggml_dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(ours.dequantize(), expected)
    lin = (Q5Linear if qtype == Q.Q5_K else Q8Linear)(ours)
    assert torch.equal(lin.weight, expected)  # the packed copy keeps them


def test_the_shipped_drafts_q5_0_and_q8_0_tensors_are_ggmls_values():
    """The default draft's file is mostly Q5_0 (and Q8_0): read as Q8_0's form, exactly."""
    from specwood.models.gguf_file import canonical_name, read_gguf_header
    from specwood.models.gguf_kquants import kquant_weights
    from specwood.models.registry import DEFAULT_DRAFT, ensure_model

    path = ensure_model(DEFAULT_DRAFT, progress=False)
    header = read_gguf_header(path)
    exact = kquant_weights(path, range(0, 1))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    seen = set()
    for gname, info in header.tensors.items():
        if not gname.startswith("blk.0.") or info.ggml_type not in (Q.Q5_0, Q.Q8_0):
            continue
        w = exact[canonical_name(gname)]
        assert isinstance(w, Q8Weights), gname
        raw = np.asarray(mm[info.offset: info.offset + info.n_bytes]).reshape(info.shape[0], -1)
        assert torch.equal(w.dequantize(), torch.from_numpy(ggml_dequantize(raw, info.ggml_type).astype(np.float32)))
        seen.add(info.ggml_type)
    assert seen == {Q.Q5_0, Q.Q8_0}


@pytest.mark.parametrize("qtype,read", [(Q.Q5_K, _q5k_parts), (Q.Q8_0, _q8_0_parts), (Q.Q5_0, _q5_0_parts)])
def test_token_tables_keep_the_files_values(qtype, read):
    """A token table of any of these types is kept as stored and dequantised row by row on lookup
    (the shipped draft's table is Q5_0, its head Q8_0)."""
    from specwood.models.w4a8 import QuantEmbedding

    raw = random_blocks(qtype, 300, 256, seed=7)
    table = QuantEmbedding(read(torch.from_numpy(raw.copy()).reshape(-1), 300), torch.float32)
    expected = torch.from_numpy(ggml_dequantize(raw, qtype).astype(np.float32))
    ids = torch.tensor([[0, 299, 17], [5, 5, 123]])
    assert torch.equal(table(ids), expected[ids])
    assert table.packed.dtype in (torch.uint8, torch.int8) and table.packed.numel() == 300 * 256  # a byte a code


def every_type_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A q4 model whose linears come in every type the kernels run: q and k Q4_K, v Q6_K (a mixed
    fused qkv), o Q8_0, gate and up Q5_K, down Q8_0."""
    def quantise(name: str, w: torch.Tensor) -> object:
        if name.endswith("attention.wv.weight"):
            return quantize_q6(w)
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return quantize_q8(w)
        if name.endswith(("feed_forward.w1.weight", "feed_forward.w3.weight")):
            q = quantize_q4(w)
            return Q5Weights(q.codes * 2, q.sub_scales, q.sub_mins, (q.super_scales.float() / 2).half(), q.super_mins)
        return quantize_q4(w)

    return stored_copy(model, quantise)


def test_every_type_runs_as_stored_and_every_method_matches_ar(tiny_pair, tiny_tokenizer):
    target = every_type_copy(tiny_pair.target)
    assert target.weight_mode == "q4"
    for block in target.layers:
        assert [type(p) for p in block.attention.wqkv.parts] == [Q4Linear, Q6Linear]
        assert type(block.attention.wo) is Q8Linear and type(block.feed_forward.w2) is Q8Linear
        assert type(block.feed_forward.w13) is Q5Linear
    engine = Engine(target, tiny_tokenizer, draft=every_type_copy(tiny_pair.draft))
    assert_every_method_matches_ar(engine)


def test_the_avx2_build_gives_the_avx512_builds_bits():
    """On a CPU with AVX512-VNNI (where AVX2 runs too) both builds of the kernel give every type,
    row count (whole and partial tiles), thread split and input dtype the same bits: an AVX2 machine
    runs the model an AVX512 one runs. (On an AVX2-only CPU the AVX2 build is the kernel every other
    test here checks.)"""
    from specwood.models import amx_probe
    from specwood.models.kquant_kernels import AVX2_KERNEL, VNNI_KERNEL

    if VNNI_KERNEL.missing_flags():
        pytest.skip(f"compares against the AVX512-VNNI build: {VNNI_KERNEL.failure or 'no AVX512-VNNI here'}")
    vnni, avx2 = VNNI_KERNEL.load(), AVX2_KERNEL.load()
    assert vnni is not None and avx2 is not None, (VNNI_KERNEL.failure, AVX2_KERNEL.failure)
    assert amx_probe.first_difference(avx2, vnni, rows=(1, 3, 8, 13, 16, 17, 40)) is None


def test_the_avx2_dots_give_the_emulated_avx512_loops_bits():
    """The AVX2 build's own integer dots (one quarter of a block at a time, products summed in int16)
    give the bits of the AVX512 build's loop emulated on AVX2, which gives that build's bits (the
    emulation is lane for lane, test above): every type, tile and sub-tile size, thread split and
    input dtype. Runs on any CPU with AVX2, so on the AVX2-only machines that use that build."""
    from specwood.models import amx_probe
    from specwood.models.kquant_kernels import AVX2_EMULATED_DOTS_KERNEL, AVX2_KERNEL

    if AVX2_KERNEL.missing_flags():
        pytest.skip(f"needs AVX2: {', '.join(AVX2_KERNEL.missing_flags())} missing")
    avx2, emulated = AVX2_KERNEL.load(), AVX2_EMULATED_DOTS_KERNEL.load()
    assert avx2 is not None and emulated is not None, (AVX2_KERNEL.failure, AVX2_EMULATED_DOTS_KERNEL.failure)
    assert amx_probe.first_difference(avx2, emulated, rows=(1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 40)) is None
