"""The layer kernels (kernels/layer_ops.cpp): each equals its torch version within rounding, each
row's result (a MoE router's logits too) is independent of the other rows, attention over a tree
node's visible keys equals attention over the same keys laid out consecutively (what makes a tree
verify to exactly the one-token forwards along its paths), and the whole model keeps every method
lossless on either implementation."""
import pytest
import torch
from conftest import assert_every_method_matches_ar, make_tiny_model

from specwood.engine.api import Engine
from specwood.models.layer_ops import KERNEL, TORCH_OPS, KernelLayerOps, kernel_layer_ops
from specwood.models.transformer import build_model, cpu_attention_mask

pytestmark = pytest.mark.skipif(KERNEL.load() is None, reason=str(KERNEL.failure))

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_mul_equal_torch(dtype):
    g = torch.Generator().manual_seed(0)
    ops = kernel_layer_ops()
    x, w = (torch.randn(3, 5, 96, generator=g) * 4).to(dtype), torch.randn(96, generator=g).to(dtype)
    assert close(ops.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6), dtype)
    gu = (torch.randn(4, 2, 2 * 48, generator=g) * 6).to(dtype)
    assert close(ops.silu_mul(gu), TORCH_OPS.silu_mul(gu), dtype)
    # rows are independent of the batch
    assert torch.equal(ops.rms_norm(x[1:2, 3:4], w, 1e-6), ops.rms_norm(x, w, 1e-6)[1:2, 3:4])
    assert torch.equal(ops.silu_mul(gu[2:3]), ops.silu_mul(gu)[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_equals_torch_bit_for_bit(dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    B, T, H, Hkv = 2, 3, 6, 2
    qkv = torch.randn(B, T, (H + 2 * Hkv) * head_dim, generator=g).to(dtype)
    cos, sin = torch.randn(B, 1, T, head_dim, generator=g), torch.randn(B, 1, T, head_dim, generator=g)
    qa, ka, va = TORCH_OPS.rope_qk(qkv.clone(), cos, sin, H, Hkv)
    qb, kb, vb = kernel_layer_ops().rope_qk(qkv.clone(), cos, sin, H, Hkv)
    assert torch.equal(qa, qb.transpose(1, 2)) and torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", DTYPES)
# head sizes of the tiny models, the draft (64, 7 query heads a KV head) and the target (128, 6),
# and groups the kernel splits into blocks of 3 or 4 heads with a rest of 1, 2 or 3;
# contexts of several 16-key blocks, with odd numbers of visible keys (bf16 multiplies keys in pairs)
@pytest.mark.parametrize("head_dim, H, S", [(16, 6, 37), (64, 14, 301), (128, 6, 37), (128, 12, 300),
                                            (128, 10, 37), (128, 2, 37), (64, 12, 37)])
def test_attention_equals_torch_and_rows_are_independent(dtype, head_dim, H, S):
    g = torch.Generator().manual_seed(2)
    B, T, Hkv = 2, 4, 2
    q = torch.randn(B, T, H, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, head_dim, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    mask[..., 0] = True
    bias = cpu_attention_mask(mask, H // Hkv, dtype)
    ops = kernel_layer_ops()
    out = ops.attention(q, k, v, bias)
    assert close(out, TORCH_OPS.attention(q.transpose(1, 2), k, v, bias), dtype)
    alone = ops.attention(q[1:2, 2:3], k[1:2], v[1:2], cpu_attention_mask(mask[1:2, :, 2:3], H // Hkv, dtype))
    assert torch.equal(alone, out[1:2, 2:3])
    # the kernel scores and weighs a KV head's query heads several at a time: each head's result is
    # the one it gets alone
    G = H // Hkv
    for h in (0, G - 1, G, H - 1):
        head = ops.attention(q[:, :, h:h + 1].contiguous(), k[:, h // G:h // G + 1], v[:, h // G:h // G + 1],
                             cpu_attention_mask(mask, 1, dtype))
        assert torch.equal(head.view(B, T, head_dim), out.view(B, T, H, head_dim)[:, :, h])


@pytest.mark.parametrize("dtype", DTYPES)
def test_router_logits_are_each_rows_own(dtype):
    """A MoE router's logits on the kernel: close to the product, and each row's bits whatever rows
    share the call and however many threads run it (which experts a token gets must not depend on
    its batch: MKL's fp32 matmul gives a row alone other bits than the same row among 64, so a
    model in fp32 routed a tree's nodes differently from the one-token forwards). 13 outputs: three
    groups of four and one alone."""
    g = torch.Generator().manual_seed(12)
    ops = kernel_layer_ops()
    router = torch.nn.Linear(272, 13, bias=False).to(dtype)
    x = (torch.randn(64, 272, generator=g) * 2).to(dtype)
    with torch.inference_mode():
        out = ops.router_logits(x, router)
        exact = x.double() @ router.weight.double().t()
        assert out.dtype == dtype and close(out, exact, dtype)
        assert torch.equal(torch.cat([ops.router_logits(x[i:i + 1], router) for i in range(64)]), out)
        assert torch.equal(ops.router_logits(x.view(4, 16, 272), router), out.view(4, 16, 13))  # any leading dims
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(ops.router_logits(x, router), out)
        finally:
            torch.set_num_threads(threads)
        # torch's matmul is what it replaces, and what a router with a bias (none has one) still runs
        biased = torch.nn.Linear(272, 13).to(dtype)
        assert torch.equal(ops.router_logits(x, biased), biased(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_skips_masked_keys_before_summing(dtype):
    """A tree node sees its prefix and its ancestors among other nodes' slots; the same keys in
    consecutive slots (a one-token forward along its path) give the bit-identical result."""
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, S = 4, 2, 32, 50
    q = torch.randn(1, 1, H, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    visible = torch.rand(S, generator=g) > 0.5
    visible[0] = True
    ops = kernel_layer_ops()
    scattered = ops.attention(q, k, v, cpu_attention_mask(visible.view(1, 1, 1, S), H // Hkv, dtype))
    idx = visible.nonzero().flatten()
    n = idx.numel()
    packed = ops.attention(q, k[:, :, idx], v[:, :, idx], cpu_attention_mask(torch.ones(1, 1, 1, n, dtype=torch.bool),
                                                                           H // Hkv, dtype))
    assert torch.equal(scattered, packed)


def test_models_use_the_kernels_on_cpu(tiny_pair):
    model = build_model(tiny_pair.target.config, tiny_pair.target.canonical_state_dict(), torch.float32,
                        max_positions=tiny_pair.target.max_positions)
    assert isinstance(model.layers[0].attention.ops, KernelLayerOps) and isinstance(model.norm.ops, KernelLayerOps)
    plain = build_model(tiny_pair.target.config, tiny_pair.target.canonical_state_dict(), torch.float32,
                        max_positions=tiny_pair.target.max_positions, layer_kernels=False)
    assert plain.layers[0].feed_forward.ops is TORCH_OPS
    # the two implementations agree on a prompt and a decode step
    x = torch.randint(0, 256, (1, 40))
    assert torch.allclose(model(x, torch.arange(40)), plain(x, torch.arange(40)), atol=1e-4, rtol=1e-4)
    cache_a, cache_b = model.new_cache(64), plain.new_cache(64)
    for m, c in ((model, cache_a), (plain, cache_b)):
        m(x, torch.arange(40), None, c, torch.arange(40))
    step = torch.ones(1, 41, dtype=torch.bool)
    a = model(x[:, :1], torch.tensor([40]), step, cache_a, torch.tensor([40]))
    b = plain(x[:, :1], torch.tensor([40]), step, cache_b, torch.tensor([40]))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_every_method_matches_ar_on_torch_ops(tiny_tokenizer):
    """The torch implementation (CUDA, CPUs without AVX512) stays lossless too."""
    target = make_tiny_model(seed=0)
    draft = make_tiny_model(seed=0)
    for m in (target, draft):
        m.use_ops(TORCH_OPS)
    with torch.no_grad():  # a draft that agrees often but not always
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    assert_every_method_matches_ar(Engine(target, tiny_tokenizer, draft=draft))


def test_the_avx2_build_gives_the_avx512_builds_bits():
    """On an AVX512 CPU (where AVX2 runs too) both builds of layer_ops.cpp give the same bits for
    every operation, whole and partial vectors, masked keys, fp32 and bf16 -- except bf16 attention
    with heads of 64 or 128 on a CPU with AVX512-BF16, which multiplies bf16 pairs there (not
    compared). (On an AVX2-only CPU the AVX2 build is the kernel every other test here checks.)"""
    from specwood.models.layer_ops import AVX2_KERNEL, AVX512_KERNEL

    if AVX512_KERNEL.missing_flags():
        pytest.skip(f"compares against the AVX512 build: {AVX512_KERNEL.failure or 'no AVX512 here'}")
    wide, avx2 = KernelLayerOps(AVX512_KERNEL.load()), KernelLayerOps(AVX2_KERNEL.load())
    g = torch.Generator().manual_seed(11)
    for dtype in DTYPES:
        x, w = (torch.randn(7, 176, generator=g) * 3).to(dtype), torch.randn(176, generator=g).to(dtype)
        assert torch.equal(wide.rms_norm(x, w, 1e-6), avx2.rms_norm(x, w, 1e-6))
        gu = (torch.randn(5, 2 * 80, generator=g) * 8).to(dtype)  # exp's clamps at -87 and 88 included
        assert torch.equal(wide.silu_mul(gu), avx2.silu_mul(gu))
        router = torch.nn.Linear(176, 11, bias=False).to(dtype)
        assert torch.equal(wide.router_logits(x, router), avx2.router_logits(x, router))
        for head_dim in (16, 48, 64, 128):  # 48: a partial vector in RoPE's halves
            B, T, H, Hkv, S = 2, 3, 6, 2, 41
            qkv = torch.randn(B, T, (H + 2 * Hkv) * head_dim, generator=g).to(dtype)
            cos, sin = torch.randn(2, B, 1, T, head_dim, generator=g)
            a, b = wide.rope_qk(qkv.clone(), cos, sin, H, Hkv), avx2.rope_qk(qkv.clone(), cos, sin, H, Hkv)
            assert all(torch.equal(u, v) for u, v in zip(a, b))
            if dtype == torch.bfloat16 and head_dim in (64, 128):
                continue
            q = torch.randn(B, T, H, head_dim, generator=g).to(dtype)
            k, v = (torch.randn(B, Hkv, S, head_dim, generator=g).to(dtype) for _ in range(2))
            mask = torch.rand(B, 1, T, S, generator=g) > 0.4
            mask[..., 0] = True
            bias = cpu_attention_mask(mask, H // Hkv, dtype)
            assert torch.equal(wide.attention(q, k, v, bias), avx2.attention(q, k, v, bias)), (dtype, head_dim)
