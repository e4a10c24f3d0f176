"""CPU weight layouts: pre-packed bf16 linears are bit-identical to plain ones; large fp32 linears
run on oneDNN with fp32 accuracy, their weights untouched; int4 draft linears approximate the
weights closely, and an int4 draft leaves the output lossless."""
import torch
from torch import nn

from specwood.engine.api import Engine
from specwood.models.linears import Int4Linear, OneDnnLinear, PackedLinear, cpu_packing_available, onednn_fp32_available
from specwood.models.testing import random_state_dict, random_tiny_config
from specwood.models.transformer import build_model


def bf16_copy(model, **kw):
    sd = {k: v.to(torch.bfloat16) for k, v in model.canonical_state_dict().items()}
    return build_model(model.config, sd, torch.bfloat16, max_positions=model.max_positions, **kw)


def test_packed_bf16_model_is_bit_identical(tiny_pair):
    plain = bf16_copy(tiny_pair.target, pack=False)
    packed = bf16_copy(tiny_pair.target)
    # packed where oneDNN takes bf16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT), plain elsewhere
    assert type(packed.layers[0].feed_forward.w13) is (PackedLinear if cpu_packing_available() else nn.Linear)
    x = torch.randint(0, 256, (1, 23))
    assert torch.equal(plain(x, torch.arange(23)), packed(x, torch.arange(23)))
    for k, v in plain.canonical_state_dict().items():
        assert torch.equal(v, packed.canonical_state_dict()[k]), k


def test_large_fp32_linears_run_on_onednn_with_their_own_weights():
    # w13 [2 x 1024, 512] and the tied head [1024, 512] reach MIN_WEIGHT; wqkv [1024, 512] too;
    # wo [512, 512] does not
    config = random_tiny_config("qwen2", dim=512, intermediate_size=1024, vocab_size=1024, n_layers=1,
                                n_heads=8, n_kv_heads=4)
    sd = random_state_dict(config)
    plain = build_model(config, dict(sd), pack=False)
    model = build_model(config, dict(sd))
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = OneDnnLinear if onednn_fp32_available() else nn.Linear
    assert kinds["output"] is want and kinds["layers.0.feed_forward.w13"] is want, kinds
    assert kinds["layers.0.attention.wo"] is nn.Linear, kinds
    assert model.output.weight is model.tok_embeddings.weight  # still one tied tensor
    for k, v in plain.canonical_state_dict().items():
        assert torch.equal(v, model.canonical_state_dict()[k]), k
    for rows in (1, 6, 70):
        x = torch.randint(0, 1024, (1, rows))
        a, b = plain(x, torch.arange(rows)), model(x, torch.arange(rows))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (rows, (a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # autograd has no rule for oneDNN's op: an input that needs gradients takes F.linear
    x = torch.randn(3, 512, requires_grad=True)
    model.output(x).sum().backward()
    assert torch.allclose(x.grad, model.output.weight.sum(0).expand(3, -1), rtol=1e-4, atol=1e-4)


def test_int4_linear_approximates_weights():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64, bias=True).to(torch.bfloat16)
    q = Int4Linear(lin)
    w, wq = lin.weight.float(), q.weight.float()
    assert ((w - wq).norm() / w.norm()) < 0.1
    # the 16 levels of every group of 32 span exactly its min..max
    g = w.reshape(64, 8, 32)
    assert torch.allclose(wq.reshape(64, 8, 32).amin(-1), g.amin(-1), atol=2e-2)
    x = torch.randn(5, 256).to(torch.bfloat16)
    ref = x.float() @ wq.t() + lin.bias.float()
    assert torch.allclose(q(x).float(), ref, atol=5e-2, rtol=2e-2)


def test_int4_draft_keeps_greedy_output_lossless(tiny_pair, tiny_tokenizer):
    draft = bf16_copy(tiny_pair.draft, int4=True)
    assert any(isinstance(m, Int4Linear) for m in draft.modules())
    assert draft.weight_mode == "int4"  # its many-row copy is int8, but the plan key says int4
    engine = Engine(tiny_pair.target, tiny_tokenizer, draft=draft)
    ref = engine.generate("def add(a, b):", max_tokens=40, raw=True)
    for method in ("chain", "dyspec", "eagle", "dyspec-threshold"):
        out = engine.generate("def add(a, b):", max_tokens=40, raw=True, method=method)
        assert out.token_ids == ref.token_ids, method
        assert out.stats["mean_accepted_tokens"] > 1.2, method  # the int4 draft still agrees often
