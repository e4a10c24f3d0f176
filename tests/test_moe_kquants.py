"""A Qwen3-MoE GGUF's k-quant expert tensors run as the file stores them (KQuantExperts) in the
default weight mode: held at the file's size, each expert's product what the kernel computes from
the file's own values, logits close to the dequantised fp32 forward's, a row's bits independent of
its batch, every speculative method token-identical to ar; an expert type the kernels do not run
is one line naming it and the tensor."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specwood.errors import ModelFileError
from specwood.models import loader
from specwood.models.gguf_file import canonical_name, read_gguf_header
from specwood.models.testing import make_tiny_tokenizer, random_tiny_config, write_q4_k_m_gguf
from test_w4a8 import quantized_activations

VOCAB = 264  # the tiny tokenizer's 259 tokens, padded
EXPERTS = 8


def moe_config(**overrides):
    """A tiny Qwen3-MoE whose widths are k-quant superblocks (256): 8 experts, 2 a token."""
    sizes = dict(vocab_size=VOCAB, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=EXPERTS,
                 n_experts_used=2, moe_intermediate_size=256, eos_token_ids=[256], bos_token_id=None,
                 max_position_embeddings=128)
    return random_tiny_config("qwen3moe", **{**sizes, **overrides})


@pytest.fixture(scope="module")
def q4_available():
    from specwood.models.w4a8 import q4_unavailable_reason

    if q4_unavailable_reason() is not None:
        pytest.skip(str(q4_unavailable_reason()))


@pytest.fixture
def tiny_tokens(monkeypatch):
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: make_tiny_tokenizer())


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """Q4_K_M-style files (gate and up Q4_K, down Q6_K), and one whose gate, up and down are
    Q4_K, Q5_K and Q8_0 (gate and up in two kernel calls)."""
    root = tmp_path_factory.mktemp("moe")
    cfg = moe_config()
    return {"q4_k_m": write_q4_k_m_gguf(root / "q4km.gguf", cfg, seed=5),
            "mixed": write_q4_k_m_gguf(root / "mixed.gguf", cfg, seed=7,
                                       types={"experts.w3.weight": "Q5_K", "experts.w2.weight": "Q8_0"})}


def test_the_default_mode_runs_the_experts_as_stored(q4_available, tiny_tokens, moe_files):
    """Default mode on a Q4_K_M MoE file: the experts are KQuantExperts holding the file's bytes
    (not floats), their dequantised values are the fp32 load's bit for bit, each expert's product
    is quantised activations times those values, and the logits stay close to the fp32 forward's."""
    from specwood.engine.api import load
    from specwood.models.experts import KQuantExperts

    path = moe_files["q4_k_m"]
    q4 = load(path, None, progress=False)  # the default mode
    assert q4.target.weight_mode == "q4"
    assert not [n for n in q4.target.weights_in_floats if n.startswith("layers.")]
    file_bytes = {canonical_name(g): i.n_bytes for g, i in read_gguf_header(path).tensors.items()}
    fp32 = load(path, None, dtype="fp32", progress=False)
    reference = fp32.target.canonical_state_dict()
    for i, block in enumerate(q4.target.layers):
        ff, p = block.feed_forward, f"layers.{i}.feed_forward.experts."
        assert isinstance(ff.w13, KQuantExperts) and isinstance(ff.w2, KQuantExperts)
        assert (ff.w13.op_names, ff.w2.op_names) == (["q4_linear"], ["q6_linear"])
        stored = file_bytes[p + "w1.weight"] + file_bytes[p + "w3.weight"] + file_bytes[p + "w2.weight"]
        held = ff.w13.nbytes + ff.w2.nbytes
        assert stored <= held <= 1.03 * stored, (held, stored)  # Q4_K's scale codes a byte each: 4.625 bits, not 4.5
        floats = 3 * EXPERTS * 256 * 256 * 2  # what bf16 experts would hold
        assert held < floats / 2.5
    exported = q4.target.canonical_state_dict(torch.float32)
    for name in [n for n in reference if ".experts." in n]:
        assert torch.equal(exported[name], reference[name]), name
    w2 = q4.target.layers[1].feed_forward.w2
    x = torch.randn(5, 256)
    for e in (0, 3, 7):
        ours = w2(e, x).double()
        assert torch.allclose(ours, quantized_activations(x) @ w2.weight[e].double().t(), rtol=1e-5, atol=1e-4)
    tokens = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, exact = q4.target(tokens, torch.arange(48)), fp32.target(tokens, torch.arange(48))
    # int8 activations and bf16 around the kernels: mean KL 0.0081 here (0.006-0.016 over files of
    # seeds 5-8), where a dense Qwen3 of the same widths from the same kind of file is at 0.013-0.08
    kl = F.kl_div(ours.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert kl.item() < 0.05
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("kind, activations", [("q4_k_m", "auto"), ("mixed", "auto"), ("q4_k_m", "fp32")])
def test_a_rows_output_does_not_depend_on_its_batch(q4_available, tiny_tokens, moe_files, kind, activations,
                                                    monkeypatch):
    """The k-quant MoE layer gives each row, alone or among 63 others routed anywhere, the same
    bits: its router's logits and its experts' kernels are row-exact and its k outputs are summed
    in expert order. The one kernel call for all experts (`grouped`) gives the bits of one call
    per expert. `fp32`: activations in fp32, as a CPU without bf16 (AVX2) runs the default mode,
    where the router is a plain fp32 linear (this failed there while MKL computed it)."""
    from specwood.engine import api
    from specwood.engine.api import load

    if activations == "fp32":
        monkeypatch.setattr(api, "cpu_has_bf16", lambda: False)
    model = load(moe_files[kind], None, dtype="q4", progress=False).target
    assert model.dtype == (torch.float32 if activations == "fp32" else api.resolve_dtype("auto", "cpu"))
    ff = model.layers[0].feed_forward
    if kind == "mixed":  # gate and up in two calls of two types, down in a third
        assert (ff.w13.op_names, ff.w2.op_names) == (["q4_linear", "q5_linear"], ["q8_linear"])
    x = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(1)).to(model.dtype)
    with torch.inference_mode():
        batch = ff(x)[0]
        alone = torch.cat([ff(x[:, i:i + 1])[0] for i in range(64)])
    assert torch.equal(batch, alone)
    assert len(torch.unique(ff.router(x[0]).topk(2).indices)) == EXPERTS  # every expert ran in the batch
    counts = [5, 0, 17, 1, 9, 0, 20, 12]  # whole and partial tiles of 8 rows, experts without rows
    rows = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(2)).to(model.dtype)
    starts = [sum(counts[:e]) for e in range(EXPERTS)]
    with torch.inference_mode():
        for experts in (ff.w13, ff.w2):  # inputs of 256 both (hidden size, expert width)
            one_by_one = torch.cat([experts(e, rows[starts[e]:starts[e] + c]) for e, c in enumerate(counts) if c])
            assert torch.equal(experts.grouped(rows, counts), one_by_one)
    from specwood.models.kquant_kernels import AVX2_KERNEL, VNNI_KERNEL

    if not VNNI_KERNEL.missing_flags():  # the AVX2 build's grouped ops give the AVX512 build's bits
        vnni, avx2 = VNNI_KERNEL.load(), AVX2_KERNEL.load()
        for experts in (ff.w13, ff.w2):
            for op, packed in zip(experts.op_names, experts.packed()):
                name = op.replace("_linear", "_experts")
                assert torch.equal(getattr(vnni, name)(rows, packed, counts), getattr(avx2, name)(rows, packed, counts))


def test_speculative_methods_match_ar_with_kquant_experts(q4_available, tiny_tokens, moe_files):
    """Greedy speculation on the k-quant MoE target emits exactly ar's tokens: model-free drafts,
    and trees from the same file as a q4-lite draft (its Q6_K tensors requantised to 4 bits, so
    it agrees with the target often but not always)."""
    from specwood.engine.api import load

    path = moe_files["q4_k_m"]
    engine = load(path, path, progress=False)
    assert (engine.target.weight_mode, engine.draft_model.weight_mode) == ("q4", "q4-lite")
    prompt = "def add(a, b):"
    ref = engine.generate(prompt, max_tokens=24, raw=True)
    for method in ("pld", "suffix", "chain", "dyspec"):
        out = engine.generate(prompt, max_tokens=24, raw=True, method=method)
        assert out.token_ids == ref.token_ids, method
        if method == "chain":  # drafts accepted and rejected: the trees were verified, not skipped
            assert 1 < out.stats["mean_accepted_tokens"] < 5


def test_an_expert_type_the_kernels_do_not_run_is_one_line(q4_available, tiny_tokens, tmp_path):
    """Q3_K experts: the q4 mode (the default for this file) names the type and the tensor in one
    line and says what to use; bf16 dequantises them."""
    from specwood.engine.api import load

    path = write_q4_k_m_gguf(tmp_path / "q3.gguf", moe_config(n_layers=1), types={"experts.w2.weight": "Q3_K"})
    with pytest.raises(ModelFileError) as info:
        load(path, None, progress=False)
    message = str(info.value)
    assert "\n" not in message and "blk.0.ffn_down_exps.weight" in message and "Q3_K" in message
    assert "--dtype bf16" in message
    assert load(path, None, dtype="bf16", progress=False).target.weight_mode == "bf16"


def test_bf16_experts_are_packed_with_the_same_bits():
    """bf16 on a CPU packs each float expert once for oneDNN (PackedExperts, as PackedLinear for the
    linears: F.linear would re-pack it every call), with the unpacked experts' bits."""
    from specwood.models.experts import PackedExperts
    from specwood.models.linears import cpu_packing_available
    from specwood.models.testing import random_state_dict
    from specwood.models.transformer import build_model

    if not cpu_packing_available():
        pytest.skip("oneDNN's packed bf16 linear does not run on this CPU")
    cfg = moe_config(n_layers=1)
    sd = random_state_dict(cfg, seed=4)
    packed, plain = (build_model(cfg, sd, torch.bfloat16, pack=pack) for pack in (True, False))
    assert isinstance(packed.layers[0].feed_forward.w13, PackedExperts)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(packed(tokens, torch.arange(24)), plain(tokens, torch.arange(24)))
    assert torch.equal(packed.canonical_state_dict()["layers.0.feed_forward.experts.w2.weight"],
                       plain.canonical_state_dict()["layers.0.feed_forward.experts.w2.weight"])
