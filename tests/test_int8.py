"""The int8 (W8A8) weight mode: Int8Linear equals its integer reference, each row's result is
independent of the other rows (what keeps tree verification lossless), the whole model stays
close to fp32, and every speculative method is token-identical to `ar` in this mode."""
import pytest
import torch
from conftest import assert_every_method_matches_ar
from torch import nn

from specwood.engine.api import Engine
from specwood.models.linears import (Int8Linear, PackedLinear, cpu_packing_available, int8_available, qlinear_available,
                                     quantize_rows_int8,
                                     quantize_weight_int8)
from specwood.models.transformer import build_model

pytestmark = [pytest.mark.skipif(not int8_available(), reason="torch._int_mm missing"),
              pytest.mark.usefixtures("one_torch_thread")]


KERNELS = ["int_mm"] + (["qlinear"] if qlinear_available() else [])


def int8_copy(model, dtype=torch.float32, **kw):
    sd = {k: v.to(dtype) for k, v in model.canonical_state_dict().items()}
    return build_model(model.config, sd, dtype, max_positions=model.max_positions, int8=True, **kw)


def reference(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """Dequantised int8 weights times fake-quantised activations, in float64."""
    q, s = quantize_rows_int8(x)
    xd = q.double() * s.double()
    out = xd @ (lin.int8_weight().double() * lin.scales.double()[:, None]).t()
    return out + lin.bias.double() if lin.bias is not None else out


def test_weight_quantisation_is_symmetric_per_channel():
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.rand(40, 1) * 3
    q, s = quantize_weight_int8(w, chunk=16)  # several chunks
    assert q.dtype == torch.int8 and s.shape == (40,)
    assert q.abs().amax(1).eq(127).all()  # every row's largest weight maps to +-127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()


def test_activation_quantisation():
    x = torch.randn(4, 300) * 5
    x[1] = 0
    q, s = quantize_rows_int8(x)
    u, s2 = quantize_rows_int8(x, offset=True)
    assert q.dtype == torch.int8 and u.dtype == torch.uint8 and torch.equal(s, s2) and s.shape == (4, 1)
    assert torch.equal(u.to(torch.int16) - 128, q.to(torch.int16))
    assert torch.equal(q.float(), torch.floor(x / s + 0.5))  # round half up
    assert q.abs().amax(1).tolist() == [127, 0, 127, 127]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_reference(dtype, kernel):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    q = Int8Linear(lin, kernel)
    assert q.kernel == kernel
    assert not any(t.is_floating_point() and t.dim() == 2 for t in q.buffers())  # no float weight copy
    wq, ws = quantize_weight_int8(lin.weight)
    assert torch.equal(q.int8_weight(), wq) and torch.equal(q.scales, ws)
    x = (torch.randn(2, 7, 256) * 3).to(dtype)
    out = q(x)
    assert out.dtype == dtype and out.shape == (2, 7, 96)
    ref = reference(q, x.reshape(-1, 256)).reshape(2, 7, 96)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # and it approximates the float layer (8 bits each for weights and activations)
    exact = lin(x.float())
    assert ((out.float() - exact).norm() / exact.norm()) < 0.02


def test_int_mm_is_exact_at_the_extremes():
    """int32 products and sums must be exact (no int16 saturation) for the widest layer's K."""
    g = torch.Generator().manual_seed(0)
    k = 8960
    a = torch.where(torch.rand(5, k, generator=g) < 0.5, -127, 127).to(torch.int8)
    b = torch.where(torch.rand(48, k, generator=g) < 0.5, -127, 127).to(torch.int8)
    a[0], b[0] = 127, 127  # the largest possible sum
    a[1], b[1] = -127, 127
    out = torch._int_mm(a, b.t())
    assert torch.equal(out.long(), a.long() @ b.long().t())
    assert out[0, 0] == 127 * 127 * k


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_are_independent_of_the_batch(dtype, kernel):
    """A row's output is bit-identical whatever other rows share the matmul (1..32 rows): the
    condition for verifying a tree in one forward to match one-token forwards exactly."""
    torch.manual_seed(1)
    q = Int8Linear(nn.Linear(192, 80, bias=True), kernel)
    x = (torch.randn(32, 192) * torch.rand(32, 1) * 10).to(dtype)
    alone = torch.cat([q(x[i:i + 1]) for i in range(32)])
    for m in (2, 3, 4, 8, 16, 17, 32):
        assert torch.equal(q(x[:m]), alone[:m]), m
        # and in another company: the same rows after unrelated ones
        mixed = torch.cat([torch.randn(5, 192).to(dtype) * 100, x[:m]])
        assert torch.equal(q(mixed)[5:], alone[:m]), m


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_rows_independent_on_real_shapes(kernel):
    """The same at the default target's shapes (oneDNN picks kernels by shape), on 2 threads."""
    torch.manual_seed(2)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n, k in ((256, 1536), (1536, 8960)):
            q = Int8Linear(nn.Linear(k, n, bias=False), kernel)
            x = torch.randn(40, k).to(torch.bfloat16)
            alone = torch.cat([q(x[i:i + 1]) for i in range(40)])
            for m in (2, 4, 9, 24, 40):
                assert torch.equal(q(x[:m]), alone[:m]), (n, k, m)
    finally:
        torch.set_num_threads(old)


def test_int8_model_stays_close_to_fp32(tiny_pair):
    model = tiny_pair.target
    q8 = int8_copy(model)
    assert q8.weight_mode == "int8" and model.weight_mode == "fp32"
    linears = [m for m in q8.layers.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * len(q8.layers)
    assert not any(type(m) is nn.Linear for m in q8.layers.modules())
    assert type(q8.output) is nn.Linear  # the head stays in the model dtype unless asked
    assert isinstance(int8_copy(model, int8_head=True).output, Int8Linear)
    assert {m.kernel for m in linears} == {KERNELS[-1]}  # qlinear where oneDNN has it
    x = torch.randint(0, 256, (1, 40))
    ref, out = model(x, torch.arange(40))[0], q8(x, torch.arange(40))[0]
    assert ((out - ref).norm() / ref.norm()) < 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_int8_bf16_activations_pack_the_head(tiny_pair):
    q8 = int8_copy(tiny_pair.target, torch.bfloat16)
    # packed where oneDNN takes bf16 (not on CPUs with AVX2 only, where it would raise)
    assert q8.dtype == torch.bfloat16 and isinstance(q8.output, PackedLinear if cpu_packing_available() else nn.Linear)
    x = torch.randint(0, 256, (1, 12))
    assert q8(x, torch.arange(12)).dtype == torch.float32


@pytest.mark.parametrize("head,kernel", [(False, KERNELS[-1]), (True, KERNELS[-1]), (False, "int_mm")])
def test_every_method_matches_ar_in_int8_mode(tiny_pair, tiny_tokenizer, head, kernel):
    """fp32 activations: the int8 linears are row-exact, and fp32 attention is nearly so. (With
    bf16 activations tree and one-token attention round differently, by up to a bf16 ulp, as in
    the plain bf16 mode; a quantisation step can then flip, so a near-tie can break either way.)"""
    target = build_model(tiny_pair.target.config, tiny_pair.target.canonical_state_dict(),
                         max_positions=tiny_pair.target.max_positions)
    target.quantize_int8(head=head, kernel=kernel)
    draft = int8_copy(tiny_pair.draft)
    engine = Engine(target, tiny_tokenizer, draft=draft)
    assert_every_method_matches_ar(engine)


def test_load_int8_mode(tiny_checkpoint_files, tiny_tokenizer, monkeypatch):
    import specwood
    import specwood.models.loader as loader

    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tiny_tokenizer)
    files = tiny_checkpoint_files
    engine = specwood.load(files.gguf, files.gguf, dtype="int8", draft_dtype="int8", progress=False)
    assert engine.target.weight_mode == "int8" and engine.draft_model.weight_mode == "int8"
    assert engine.dtype in (torch.bfloat16, torch.float32)
    # the vocabulary head is int8 too (faster per step); the token lookup keeps a float embedding
    assert isinstance(engine.target.output, Int8Linear) and isinstance(engine.draft_model.output, Int8Linear)
    assert engine.target.tok_embeddings.weight.dtype == engine.dtype
    ids = [3, 4, 5, 6]
    assert engine.generate(ids, max_tokens=6, method="dyspec").token_ids == engine.generate(ids, max_tokens=6).token_ids
    plain = specwood.load(files.gguf, files.gguf, dtype="fp32", draft_dtype="int8", progress=False)
    assert plain.target.weight_mode == "fp32" and plain.draft_model.weight_mode == "int8"
    assert plain.draft_model.dtype == torch.float32  # int8 drafts take the target's activation dtype


def test_cli_accepts_int8():
    import argparse

    from specwood.cli import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--dtype", "int8", "--draft-dtype", "int8"])
    assert args.dtype == "int8" and args.draft_dtype == "int8"
