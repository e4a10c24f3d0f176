"""A tree forward with its tree mask equals, node by node, the causal forward of the node's path;
cache compaction equals recomputation; stage-sliced models chain to the full model."""
import pytest
import torch
from hypothesis import given, settings, HealthCheck, strategies as st

from specwood.errors import ContextLengthError
from specwood.models.transformer import build_model
from specwood.tree.token_tree import TokenTree

V = 96


@st.composite
def prefix_and_tree(draw):
    prefix = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=12))
    n = draw(st.integers(1, 16))
    tree = TokenTree.with_root(draw(st.integers(0, V - 1)))
    for i in range(1, n):
        tree.add_node(draw(st.integers(0, i - 1)), draw(st.integers(0, V - 1)))
    return prefix, tree


def causal_logits(model, tokens):
    return model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=prefix_and_tree())
def test_tree_forward_equals_path_forward(tiny_pair, case):
    model = tiny_pair.target
    prefix, tree = case
    cache = model.new_cache(64)
    L = len(prefix)
    model(torch.tensor([prefix]), torch.arange(L), None, cache, torch.arange(L))
    out = model(torch.tensor([tree.tokens]), tree.positions(L), tree.attention_mask(L), cache,
                torch.arange(L, L + len(tree)))[0]
    for node in range(len(tree)):
        path_tokens = prefix + [tree.tokens[i] for i in tree.path_to(node)]
        ref = causal_logits(model, path_tokens)[-1]
        assert torch.allclose(out[node], ref, atol=1e-4), f"node {node}"


def test_cache_compaction_equals_recompute(tiny_pair):
    model = tiny_pair.target
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, V, (7,), generator=g).tolist()
    tree = TokenTree.with_root(3)
    a = tree.add_node(0, 5)
    tree.add_node(0, 9)
    b = tree.add_node(a, 11)
    tree.add_node(a, 12)
    c = tree.add_node(b, 40)
    cache = model.new_cache(64)
    L = len(prefix)
    model(torch.tensor([prefix]), torch.arange(L), None, cache, torch.arange(L))
    model(torch.tensor([tree.tokens]), tree.positions(L), tree.attention_mask(L), cache, torch.arange(L, L + len(tree)))
    path = tree.path_to(c)
    cache.compact([L + i for i in path], L)
    assert cache.length == L + len(path)
    ref_cache = model.new_cache(64)
    seq = prefix + [tree.tokens[i] for i in path]
    model(torch.tensor([seq]), torch.arange(len(seq)), None, ref_cache, torch.arange(len(seq)))
    n = len(seq)
    assert torch.allclose(cache.k[:, :, :, :n], ref_cache.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, :, :, :n], ref_cache.v[:, :, :, :n], atol=1e-5)
    # and the next token's logits agree
    nxt = torch.tensor([[7]])
    pos = torch.tensor([n])
    m = torch.ones(1, n + 1, dtype=torch.bool)
    x = model(nxt, pos, m, cache, pos)
    y = model(nxt, pos, m, ref_cache, pos)
    assert torch.allclose(x, y, atol=1e-5)


def test_stage_sliced_models_chain_to_full(tiny_pair):
    model = tiny_pair.target
    sd = model.canonical_state_dict()
    n = model.config.n_layers
    stages = [build_model(model.config, sd, torch.float32, layers=r) for r in (range(0, 1), range(1, 2), range(2, n))]
    assert stages[0].tok_embeddings is not None and stages[0].output is None
    assert stages[1].tok_embeddings is None and stages[1].output is None
    assert stages[2].output is not None
    tokens = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10)
    caches = [s.new_cache(16) for s in stages]
    h = tokens
    for s, c in zip(stages, caches):
        h = s(h, pos, None, c, pos)
    ref = model(tokens, pos)
    assert torch.allclose(h, ref, atol=1e-5)


def test_full_cache_raises_clear_error(tiny_pair):
    model = tiny_pair.target
    cache = model.new_cache(4)
    with pytest.raises(ContextLengthError, match="cache holds 4"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5), None, cache, torch.arange(5))


def test_position_beyond_context_raises(tiny_pair):
    model = tiny_pair.target
    with pytest.raises(ContextLengthError, match="context"):
        model.check_positions(model.max_positions)
    model.check_positions(model.max_positions - 1)
    from specwood.models.prefill import prefill

    with pytest.raises(ContextLengthError):
        prefill(model, model.new_cache(model.max_positions + 8), list(range(model.max_positions + 1)))


def test_packed_rows_equal_each_row_alone(tiny_pair):
    """Rows of very different lengths (prefill chunks, trees, one-token steps) go in separate
    padded blocks of ONE forward (`forward_rows` packs them): each row's logits, hidden states
    and cache entries equal those of the row run alone."""
    from specwood.models.batch import RowInput, forward_rows, similar_lengths
    from specwood.models.prefill import prefill

    model = tiny_pair.target
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 5, 14, 3, 20)]
    tree = TokenTree.with_root(4)
    for parent, token in [(0, 7), (0, 8), (1, 2), (3, 11)]:
        tree.add_node(parent, token)

    def inputs(cache):
        rows = []
        for row, prompt in enumerate(prompts):
            if row < 3:  # already prefilled: a one-token step, a tree, a one-token step
                L = len(prompt)
                t = tree if row == 1 else TokenTree.with_root(prompt[0])
                rows.append(RowInput(row, torch.tensor(t.tokens), t.positions(L), torch.arange(L, L + len(t)),
                                     t.attention_mask(L), torch.arange(len(t))))
            else:  # a prefill chunk of 3 or 20 tokens
                pos = torch.arange(len(prompt))
                rows.append(RowInput(row, torch.tensor(prompt), pos, pos,
                                     torch.ones(len(prompt), len(prompt), dtype=torch.bool).tril(), pos))
        return rows

    assert similar_lengths([len(x.tokens) for x in inputs(None)]) == [[4], [1, 3], [0, 2]]
    packed, alone = model.new_cache(64, 5), model.new_cache(64, 5)
    for cache in (packed, alone):
        for row in range(3):
            prefill(model, cache, prompts[row], row=row)
    together = forward_rows(model, packed, inputs(packed))
    for x, out in zip(inputs(alone), together):
        ref = forward_rows(model, alone, [x])[0]
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, atol=1e-5)
        n = int(x.slots.max()) + 1
        assert torch.allclose(packed.k[:, x.row, :, :n], alone.k[:, x.row, :, :n], atol=1e-5)
    stage = build_model(model.config, model.canonical_state_dict(), layers=range(0, 1))
    cache = stage.new_cache(64, 5)
    rows = inputs(cache)
    hidden = forward_rows(stage, cache, rows)
    for x, h in zip(rows, hidden):
        assert torch.allclose(h, forward_rows(stage, stage.new_cache(64, 5), [x])[0], atol=1e-5)


@pytest.mark.parametrize("hidden", [False, True])
def test_pad_rows_places_each_row_as_a_copy_per_row_would(hidden):
    """`pad_rows` scatters every row in a fixed number of ops: the same tensors as writing each
    row into its place one by one (token ids or hidden states, masks of different widths)."""
    from specwood.models.batch import RowInput, pad_rows

    g = torch.Generator().manual_seed(3)
    rows = []
    for row, (n, s) in enumerate([(3, 7), (1, 12), (5, 5), (2, 12), (4, 9)]):
        tokens = torch.randn(n, 6, generator=g) if hidden else torch.randint(0, V, (n,), generator=g)
        pos = torch.randint(0, 50, (n,), generator=g)
        rows.append(RowInput(row, tokens, pos, pos + 100, torch.rand(n, s, generator=g) < 0.5, torch.arange(n)))
    for inputs in (rows, [rows[1], rows[3]]):  # widths that differ, and widths that are all the same
        tokens, positions, slots, mask = pad_rows(inputs, scratch_slot=99)
        T, S = max(len(x.tokens) for x in inputs), max(x.mask.shape[1] for x in inputs)
        want_mask = torch.zeros(len(inputs), T, S, dtype=torch.bool)
        want_mask[:, :, 0] = True
        want_slots = torch.full((len(inputs), T), 99)
        want_tokens = torch.zeros(len(inputs), T, *inputs[0].tokens.shape[1:], dtype=inputs[0].tokens.dtype)
        want_positions = torch.zeros(len(inputs), T, dtype=torch.long)
        for b, x in enumerate(inputs):
            n, s = x.mask.shape
            want_tokens[b, :n], want_positions[b, :n], want_slots[b, :n] = x.tokens, x.positions, x.slots
            want_mask[b, :n] = False
            want_mask[b, :n, :s] = x.mask
        assert torch.equal(tokens, want_tokens) and torch.equal(positions, want_positions)
        assert torch.equal(slots, want_slots) and torch.equal(mask, want_mask)
