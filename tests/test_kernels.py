"""CPU weight layouts: pre-packed bf16 linears are bit-identical to plain ones; int4 draft
linears approximate the weights closely, and an int4 draft leaves the output lossless."""
import torch
from torch import nn

from specwood.engine.api import Engine
from specwood.models.linears import Int4Linear, PackedLinear, cpu_packing_available
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
