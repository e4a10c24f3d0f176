"""Q6_K weights on our kernel: the kernel equals its reference, rows are independent of the batch,
the shipped file's Q6_K values are ggml's bit for bit, and a model whose fused linears mix Q4_K
and Q6_K parts (as Q4_K_M files do) stays token-identical to `ar` for every method."""
from typing import Any, Callable

import pytest
import torch
from conftest import assert_every_method_matches_ar
from test_w4a8 import assert_rows_independent, quantized_activations, reference

from specwood.engine.api import Engine
from specwood.models.q6k import Q6Linear, Q6Weights, pack_q6, quantize_q6, unpack_q6
from specwood.models.transformer import build_model
from specwood.models.w4a8 import Q4Linear, StackedLinear, q4_unavailable_reason, quantize_q4

pytestmark = pytest.mark.skipif(q4_unavailable_reason() is not None, reason=str(q4_unavailable_reason()))


def random_q6(n: int, k: int, seed: int = 0) -> Q6Weights:
    """Every code and scale code the format allows, negative scales included."""
    g = torch.Generator().manual_seed(seed)
    return Q6Weights(torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                     torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8),
                     (torch.rand(n, -(-k // 256), generator=g) * 0.01).half())


@pytest.mark.parametrize("k", [64, 96, 256, 896, 1536])  # whole and partial superblocks
def test_pack_q6_round_trip_and_kernel_size(k):
    w = random_q6(64, k, seed=k)
    lin = Q6Linear(w)
    assert lin.packed.shape == (2, lin.kernel.q6_block_bytes(k // 32))  # the kernel's own size
    assert all(torch.equal(a, b) for a, b in zip(lin.weights, w))
    assert torch.equal(pack_q6(unpack_q6(lin.packed, k)), lin.packed)
    if k % 256 == 0:
        assert lin.packed.numel() == 64 * k * 210 // 256  # Q6_K's own 6.5625 bits a weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_q6_linear_equals_reference(dtype, rows):
    lin = Q6Linear(random_q6(96, 896, seed=rows), torch.randn(96))
    x = (torch.randn(rows, 896) * 3).to(dtype)
    x[0, :32] = 0  # a group of zeros
    out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    ref = reference(lin, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < tol


def test_q6_rows_are_independent_of_the_batch():
    lin = Q6Linear(random_q6(160, 512, seed=3), torch.randn(160))
    assert_rows_independent(lin, torch.randn(19, 512) * torch.rand(19, 1) * 10)
    # a fused linear whose parts differ in type is row-exact too
    mixed = StackedLinear([Q4Linear(quantize_q4(torch.randn(64, 512))), lin])
    assert_rows_independent(mixed, torch.randn(19, 512))


def test_quantize_q6_stays_within_half_a_step():
    w = torch.randn(64, 896) * torch.rand(64, 1)
    w[1] = 0.0
    q = quantize_q6(w)
    steps = q.scales().abs().repeat_interleave(16, 1)
    assert int(q.codes.max()) <= 63 and torch.equal(q.dequantize()[1], w[1])
    assert ((q.dequantize() - w).abs() <= steps * 0.5 + 1e-6).all()


def test_q6_values_are_llamacpp_values_on_the_shipped_file():
    """The default target's Q6_K tensors (half the layers' attn_v and ffn_down, the output head)
    are read as ggml dequantises them, bit for bit, and the kernel's packed copy keeps them; the
    head's product is the fp64 one within what the activations' rounding allows."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as Q

    from specwood.models.gguf_dequant import dequantize_tensor
    from specwood.models.gguf_file import canonical_name, read_gguf_header
    from specwood.models.gguf_kquants import kquant_weights
    from specwood.models.registry import DEFAULT_TARGET, ensure_model

    path = ensure_model(DEFAULT_TARGET, progress=False)
    header = read_gguf_header(path)
    q6 = [g for g, i in header.tensors.items() if i.ggml_type == Q.Q6_K]
    assert "output.weight" in q6 and any("ffn_down" in g for g in q6) and any("attn_v" in g for g in q6)
    layer = min(int(g.split(".")[1]) for g in q6 if g.startswith("blk."))
    exact = kquant_weights(path, range(layer, layer + 1))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for gname in [g for g in q6 if g.startswith(f"blk.{layer}.")] + ["output.weight"]:
        w = exact[canonical_name(gname)]
        assert isinstance(w, Q6Weights), gname
        rows = slice(0, 4096)  # the head has 151,936 rows: a slice keeps this quick
        part = Q6Weights(*(t[rows] for t in w))
        ref = dequantize_tensor(mm, header.tensors[gname], torch.float32)[rows]
        assert torch.equal(part.dequantize(), ref), gname
        lin = Q6Linear(part)
        assert torch.equal(lin.weight, ref), gname
        x = torch.randn(3, ref.shape[1])
        exact_product = x.double() @ ref.double().t()
        ours = lin(x).double()
        # int8 activations per 32 inputs: each carries at most half a step of max|x|/127
        bound = (x.abs().reshape(3, -1, 32).amax(-1) / 254).repeat_interleave(32, 1).double() @ ref.double().abs().t()
        assert ((ours - exact_product).abs() <= bound * 1.01 + 1e-4).all(), gname
        assert torch.allclose(ours, quantized_activations(x) @ ref.double().t(), rtol=1e-5, atol=1e-4), gname


def stored_copy(model: torch.nn.Module, quantise: Callable[[str, torch.Tensor], Any]) -> torch.nn.Module:
    """A q4 model whose layers' linears hold `quantise(name, weight)` as a GGUF file's values."""
    exact = {name: quantise(name, w) for name, w in model.canonical_state_dict().items()
             if w.dim() == 2 and name.startswith("layers.")}
    return build_model(model.config, model.canonical_state_dict(), torch.float32,
                       max_positions=model.max_positions, q4=True, q4_exact=exact)


def exact_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A q4 model as a Q4_K_M file gives it: q, k, gate, up and o in Q4_K, v and down in Q6_K
    (so each layer's fused qkv mixes the two types)."""
    return stored_copy(model, lambda name, w: quantize_q6(w) if name.endswith(
        ("attention.wv.weight", "feed_forward.w2.weight")) else quantize_q4(w))


def test_mixed_types_run_as_stored_and_every_method_matches_ar(tiny_pair, tiny_tokenizer):
    target = exact_copy(tiny_pair.target)
    assert target.weight_mode == "q4"
    for block in target.layers:
        qkv = block.attention.wqkv
        assert isinstance(qkv, StackedLinear) and [type(p) for p in qkv.parts] == [Q4Linear, Q6Linear]
        assert isinstance(block.feed_forward.w2, Q6Linear) and isinstance(block.feed_forward.w13, Q4Linear)
    # the tiny vocabulary (264) does not fit the kernel's blocks of 32: the head stays in floats, named
    assert type(target.output) is not Q4Linear and target.weights_in_floats == ["output.weight"]
    engine = Engine(target, tiny_tokenizer, draft=exact_copy(tiny_pair.draft))
    assert_every_method_matches_ar(engine)
