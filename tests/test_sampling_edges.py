"""Sampling at the edges: temperatures that underflow behave as greedy, rows that overflow or hold
NaN fall back to their argmax, and no id past the tokenizer's real tokens is sampled or emitted."""
from __future__ import annotations

import pytest
import torch

from specwood.engine.output import OutputStream
from specwood.engine.vocab import emit_limit
from specwood.models.testing import make_tiny_tokenizer
from specwood.sampling import SamplingParams, next_token, sample_token, target_probs
from specwood.tree.token_tree import TokenTree
from specwood.verify import verify


@pytest.mark.parametrize("t", [1e-38, 5e-324, 1e-6])
def test_underflowing_temperatures_are_greedy(t):
    params = SamplingParams(temperature=t, top_p=0.5, top_k=3)
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-6], [0.0, -1.0, 5.0, 4.0]])
    assert params.greedy
    assert torch.equal(target_probs(logits, params), torch.eye(4)[[1, 2]])
    assert next_token(logits, params, None).tolist() == [1, 2]


def test_rows_that_overflow_or_hold_nan_fall_back_to_their_argmax():
    params = SamplingParams(temperature=1e-4)
    logits = torch.tensor([[1e36, -1e36, 0.0], [0.0, float("nan"), 1.0], [0.0, 2.0, 1.0]])
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [1.0, 0.0, 0.0] and probs[1].tolist() == [0.0, 0.0, 1.0]
    assert probs[2].argmax() == 1 and probs[2].sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("top_p,top_k", [(5e-324, 0), (1e-300, 1), (1.0, 10 ** 9), (0.5, 1)])
def test_extreme_top_p_and_top_k(top_p, top_k):
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
    logits = torch.tensor([[0.1, 2.0, float("-inf"), 1.0]])
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and probs[0, 2] == 0
    g = torch.Generator().manual_seed(0)
    assert all(int(sample_token(probs, g)) in (0, 1, 3) for _ in range(50))


def test_sampling_an_empty_or_nan_row_is_an_error_not_a_token():
    for row in ([0.0, 0.0, 0.0], [0.5, float("nan"), 0.5]):
        with pytest.raises(RuntimeError, match="empty or not finite"):
            sample_token(torch.tensor([row]), None)


def test_small_draws_on_python_floats_equal_the_torch_draw_bit_for_bit(monkeypatch):
    """draw_token's path for few probabilities (Python floats) picks the index its torch path picks
    for the same rows and uniforms: peaked, flat, zero-padded and unnormalised rows, fp32 and fp64,
    and a uniform scaled onto the cdf's very end (the fix-up back to the last possible token). Either
    path may serve a request."""
    import specwood.sampling as sampling

    g = torch.Generator().manual_seed(5)
    cases = []
    for trial in range(3000):
        width, rows = int(torch.randint(1, 200, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        p = torch.rand(rows, width, generator=g) ** 6 + 1e-30
        if trial % 3 == 0:
            p[:, width - width // 2:] = 0.0  # a zero tail: u near 1 lands past the last non-zero
        if trial % 7 == 0:
            p[:, : width // 3] = 0.0
        p = p.double() if trial % 11 == 0 else p
        p = p / p.sum(-1, keepdim=True) if trial % 2 else p
        u = torch.rand(rows, dtype=torch.float64, generator=g)
        if trial % 5 == 0:
            u[:] = 1.0  # u * total == total: past the zero tail, back to the last non-zero
        if bool((p.sum(-1) > 0).all()):
            cases.append((p[0], u[:1]) if trial % 13 == 0 else (p, u))
    small = [sampling.draw_token(p, u) for p, u in cases]
    monkeypatch.setattr(sampling, "_PYTHON_DRAW_MAX", -1)  # every draw on the torch path
    strays = 0
    for (p, u), got in zip(cases, small):
        want = sampling.draw_token(p, u)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (p, u)
        strays += int(bool((u == 1.0).all()) and bool((p.reshape(-1, p.shape[-1])[:, -1] == 0).all()))
    assert strays > 50  # the fix-up ran on both paths


def test_sample_index_is_sample_token_as_an_int():
    """The drafters' one-distribution draw takes the same uniform from the generator and gives the
    same token as sample_token, on both of draw_token's paths (few and many probabilities)."""
    from specwood.sampling import sample_index

    for width in (5, 32, 1024, 1025, 4000):
        for seed in range(40):
            q = torch.rand(width, generator=torch.Generator().manual_seed(seed)) ** 3
            q[width // 2:] = 0.0 if seed % 2 else q[width // 2:]
            g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            assert [int(sample_token(q, g1)) for _ in range(3)] == [sample_index(q, g2) for _ in range(3)]
    with pytest.raises(ValueError, match="one distribution"):
        sample_index(torch.ones(2, 4), None)


def test_a_drafted_padding_id_is_rejected_and_never_emitted():
    """The sampling verifier with a draft that put all its mass on a padding id (-inf for the
    target): the child is rejected, the correction comes from the target's real tokens."""
    V = 6
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, float("-inf"), float("-inf")])
    params = SamplingParams(temperature=0.7, seed=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tree = TokenTree.with_root(0, "sampled")
        q = torch.zeros(V)
        q[5] = 1.0
        tree.add_node(0, 5)
        tree.child_dists[0] = q  # the law the root's children were drawn from
        v = verify(tree, torch.stack([logits, logits]), params, g)
        assert v.accepted == [] and v.next_token < 4


def test_emit_limit_counts_the_tokenizers_real_tokens():
    tok = make_tiny_tokenizer()  # 259 tokens
    assert emit_limit(tok, 264) == 259 and emit_limit(tok, 200) == 200

    class GGUFStyle:  # a converted GGUF vocabulary names its padding "[PAD<id>]"
        def __len__(self):
            return 10

        def convert_ids_to_tokens(self, i):
            return f"[PAD{i}]" if i >= 7 else f"t{i}"

    assert emit_limit(GGUFStyle(), 10) == 7


def test_requests_never_choose_padding_ids_and_the_output_refuses_them(tiny_model_factory):
    from specwood.engine.api import Engine

    tok = make_tiny_tokenizer()
    engine = Engine(tiny_model_factory(seed=0), tok)
    assert engine.emit_limit == 259 < engine.target_config.vocab_size
    logits = torch.zeros(2, 264)
    logits[:, 262] = 50.0  # a padding id the model likes best
    logits[1, 7] = 1.0
    for t in (0.0, 1e-38, 0.8):
        params = engine.new_request("hi", temperature=t, seed=0, max_tokens=2).params
        assert params.emit_limit == 259
        probs = target_probs(logits, params)
        assert probs[:, 259:].sum() == 0 and torch.isfinite(probs).all()
        g = torch.Generator().manual_seed(1)
        assert (next_token(logits, params, g) < 259).all()
        tree = TokenTree.with_root(0, "selected" if params.greedy else "sampled")
        tree.add_node(0, 262)
        v = verify(tree, logits, params, g)
        assert v.accepted == [] and v.next_token < 259
    out = OutputStream(tok, 3, 8, set(), emit_limit=engine.emit_limit)
    out.push_step([65])
    with pytest.raises(RuntimeError, match="token id 263"):
        out.push_step([263])
