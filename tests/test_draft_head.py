"""The feature-level draft head (EAGLE): lossless with every tree shape, the reduced vocabulary
never loses a token, files (ours and EAGLE's layout) load or fail in one line, and training
raises acceptance and resumes where it stopped. (Every method mixed in one batch, the head
included, is tests/test_batching.py; its sampling law is tests/test_engine_statistics.py.)"""
from __future__ import annotations

import json
import random

import pytest
import torch

from specwood.drafting.eagle_files import load_eagle_head
from specwood.drafting.head import DraftHead, untrained_head
from specwood.drafting.head_files import load_head, match_target_weights, read_head_file, save_head
from specwood.drafting.head_training import TrainSettings, choose_draft_vocab, target_features, train_head, windows_of
from specwood.engine.api import Engine
from specwood.errors import ModelFileError, SpecwoodError

from conftest import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer

SHAPES = {"chain": {"depth": 4}, "eagle": {"budget": 8, "depth": 3, "topk": 3}, "dyspec": {"budget": 6},
          "dyspec-threshold": {"budget": 6, "threshold": 0.05}, "static": {"budget": 6, "branching": [2, 2, 1]},
          "sequoia": {"budget": 8}, "pld": {"budget": 4}}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompts(n: int, vocab: int = TINY_VOCAB, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(rnd.randint(1, 40))] for _ in range(n)]


def greedy_matches_ar(engine: Engine, shape: str, options: dict, n: int = 3, max_tokens: int = 30) -> float:
    """Greedy output with the head equals ar's on n prompts; the mean AAT."""
    aats = []
    for prompt in prompts(n, engine.target_config.vocab_size):
        ref = engine.generate(prompt, max_tokens=max_tokens).token_ids
        out = engine.generate(prompt, max_tokens=max_tokens, method="head", shape=shape, **options)
        assert out.token_ids == ref, (shape, prompt)
        aats.append(out.stats.get("mean_accepted_tokens", 1.0))
    return sum(aats) / len(aats)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_with_the_head_equals_ar(tiny_engine, shape):
    aat = greedy_matches_ar(tiny_engine, shape, SHAPES[shape])
    if shape != "pld":
        assert aat > 1.3, f"the trained head's drafts are hardly accepted ({aat})"


def test_target_tokens_outside_the_draft_vocabulary_are_emitted(tiny_pair, tiny_tokenizer):
    """A head whose vocabulary lacks every token ar emits: every draft is rejected, and the
    verifier's bonus tokens carry the whole output."""
    target = tiny_pair.target
    engine = Engine(target, tiny_tokenizer)
    cases = prompts(3, seed=1)
    emitted = set()
    for prompt in cases:
        emitted |= set(engine.generate(prompt, max_tokens=25).token_ids)
    vocab = [t for t in range(TINY_VOCAB) if t not in emitted]
    engine.draft_head = untrained_head(target, vocab, seed=3)
    for prompt in cases:
        ref = engine.generate(prompt, max_tokens=25).token_ids
        out = engine.generate(prompt, max_tokens=25, method="head", shape="chain", depth=3)
        assert out.token_ids == ref
        assert out.stats["acceptance_rate"] == 0.0 and out.stats["spec_steps"] > 0
    assert set(out.token_ids) <= emitted and not set(out.token_ids) & set(vocab)


def test_sampling_with_the_head_is_reproducible_and_valid(tiny_engine):
    a = tiny_engine.generate([5, 6, 7], max_tokens=30, method="head", temperature=0.9, seed=11)
    b = tiny_engine.generate([5, 6, 7], max_tokens=30, method="head", temperature=0.9, seed=11)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def test_method_head_needs_a_head(tiny_pair, tiny_tokenizer):
    engine = Engine(tiny_pair.target, tiny_tokenizer)
    with pytest.raises(SpecwoodError, match="needs a draft head; pass --head"):
        engine.generate([1, 2, 3], max_tokens=4, method="head")
    with pytest.raises(SpecwoodError, match="does not use option"):
        Engine(tiny_pair.target, tiny_tokenizer, head=tiny_pair.head).generate([1, 2], method="head", shape="chain",
                                                                                topk=3)


# --- files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("int8", [False, True])
def test_head_file_round_trip(tiny_pair, tmp_path, int8):
    head = tiny_pair.head
    path = save_head(head, tmp_path / "head.safetensors", int8=int8)
    spec, vocab, state = read_head_file(path)
    assert spec == head.spec and torch.equal(vocab, head.draft_vocab)
    loaded = load_head(path, tiny_pair.target)
    assert isinstance(loaded, DraftHead)
    ref = load_head(save_head(head, tmp_path / "exact.safetensors"), tiny_pair.target, fast=False)
    for name, t in ref.trainable_state().items():
        got = state[name]
        if int8 and t.dim() == 2:  # per-row int8 with an fp16 scale: half a step, plus the scale's rounding
            row_max = t.float().abs().amax(1, keepdim=True)
            assert ((got - t.float()).abs() <= row_max * (0.5 / 127 + 2 ** -10) + 1e-7).all(), name
        else:
            assert torch.equal(got, t.float()), name
    engine = Engine(tiny_pair.target, make_tiny_tokenizer(), head=loaded)
    assert greedy_matches_ar(engine, "eagle", SHAPES["eagle"], n=2) > 1.3


def test_bad_head_files_fail_in_one_line(tiny_pair, tmp_path):
    target = tiny_pair.target
    with pytest.raises(ModelFileError, match="not found; train one with `specwood train-drafter`"):
        load_head(tmp_path / "missing.safetensors", target)
    path = save_head(tiny_pair.head, tmp_path / "head.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="unreadable or truncated"):
        load_head(cut, target)
    other = make_tiny_model(vocab_size=96, seed=4)
    with pytest.raises(SpecwoodError, match=r"trained for a target with \d+ tokens and hidden size 64.*has 96 and 64"):
        load_head(path, other)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ModelFileError, match="not a specwood draft head"):
        load_head(tmp_path / "foreign.safetensors", target)


def write_eagle_folder(head: DraftHead, folder, with_input_norm: bool, as_bin: bool = False) -> None:
    """A head's weights in EAGLE-1's published layout (config.json + weights; no vocabulary head)."""
    c = head.config
    sizes = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
    layer = head.layers[0]
    q, k, v = layer.attention.wqkv.weight.data.split(sizes)
    gate, up = layer.feed_forward.w13.weight.data.split(c.intermediate_size)
    tensors = {"fc.weight": head.fc.weight.data, "fc.bias": head.fc.bias.data,
               "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
               "layers.0.self_attn.v_proj.weight": v,
               "layers.0.self_attn.o_proj.weight": layer.attention.wo.weight.data,
               "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
               "layers.0.mlp.down_proj.weight": layer.feed_forward.w2.weight.data,
               "layers.0.post_attention_layernorm.weight": layer.ffn_norm.weight.data,
               "embed_tokens.weight": head.tok_embeddings.weight.data}
    if c.qkv_bias:
        for n, b in zip("qkv", layer.attention.wqkv.bias.data.split(sizes)):
            tensors[f"layers.0.self_attn.{n}_proj.bias"] = b
    if with_input_norm:
        tensors["layers.0.input_layernorm.weight"] = layer.attention_norm.weight.data
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.n_heads,
              "num_key_value_heads": c.n_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": c.norm_eps,
              "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "bias": True}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: t.contiguous().clone() for k, t in tensors.items()}
    if as_bin:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("as_bin", [False, True])
def test_eagle_layout_loads_the_same_head(tiny_pair, tmp_path, as_bin):
    """A head written in EAGLE's layout (random weights, whole vocabulary) loads to the same
    logits, drafts losslessly, and a folder without the input norm runs the layer without one."""
    target = tiny_pair.target
    head = untrained_head(target, seed=7)
    write_eagle_folder(head, tmp_path / "eagle", with_input_norm=True, as_bin=as_bin)
    loaded = load_eagle_head(tmp_path / "eagle", target)
    pairs = head.pair_inputs(torch.tensor([3, 9, 27]), torch.randn(3, 64))
    pos = torch.arange(3)
    assert torch.allclose(loaded.head(loaded.hidden(pairs[None], pos)), head.head(head.hidden(pairs[None], pos)),
                          atol=1e-5)
    write_eagle_folder(head, tmp_path / "eagle1", with_input_norm=False)
    plain = load_head(tmp_path / "eagle1", target)
    assert isinstance(plain.layers[0].attention_norm, torch.nn.Identity) and not plain.spec.input_norm
    engine = Engine(target, make_tiny_tokenizer(), head=plain)
    greedy_matches_ar(engine, "eagle", SHAPES["eagle"], n=2)


def test_bad_eagle_folders_fail_in_one_line(tiny_pair, tmp_path):
    target = tiny_pair.target
    folder = tmp_path / "e"
    write_eagle_folder(untrained_head(target), folder, with_input_norm=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(SpecwoodError, match="trained for a target with 1000 tokens"):
        load_eagle_head(folder, target)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ModelFileError, match="missing or invalid 'hidden_size'"):
        load_eagle_head(folder, target)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFileError, match="no config.json"):
        load_eagle_head(folder, target)


# --- training -------------------------------------------------------------------------------------


def test_training_raises_acceptance_and_resumes_bit_for_bit(tiny_pair, tmp_path):
    target = tiny_pair.target
    engine = Engine(target, make_tiny_tokenizer())
    g = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(24):
        prompt = torch.randint(TINY_VOCAB, (3,), generator=g).tolist()
        sequences.append(prompt + engine.generate(prompt, max_tokens=48, temperature=1.0, seed=i).token_ids)
    vocab = choose_draft_vocab(sequences, TINY_VOCAB, 96)
    assert len(vocab) == 96 and len(set(vocab.tolist())) == 96
    windows = windows_of(sequences, 16)
    features = target_features(target, windows)
    settings = TrainSettings(steps=120, batch=8, window=16, lr=3e-3, warmup=10, seed=1, checkpoint_every=1000)
    whole, record = train_head(target, windows, features, vocab, settings)
    first, last = record.curve[0], record.curve[-1]
    assert last[1] < first[1] / 3 and last[2] < first[2] and last[3] > first[3] + 0.3, (first, last)

    untrained = greedy_aat(target, untrained_head(target, vocab, seed=1))
    trained = greedy_aat(target, match_target_weights(whole, target))
    assert trained > untrained + 0.5, (untrained, trained)

    # interrupted after its first step (max_seconds=0), then resumed: the same head, bit for bit
    out = tmp_path / "head.safetensors"
    train_head(target, windows, features, vocab, TrainSettings(**{**settings.__dict__, "max_seconds": 0.0}), out=out)
    assert torch.load(str(out) + ".ckpt", weights_only=False)["step"] == 1
    resumed, rec2 = train_head(target, windows, features, vocab, settings, out=out)
    assert len(rec2.curve) == settings.steps and rec2.curve[-1][:3] == record.curve[-1][:3]
    for name, t in whole.trainable_state().items():
        assert torch.equal(t, resumed.trainable_state()[name]), name
    with pytest.raises(SpecwoodError, match="other training settings"):
        train_head(target, windows, features, vocab, TrainSettings(**{**settings.__dict__, "lr": 1e-3}), out=out)


def greedy_aat(target, head) -> float:
    engine = Engine(target, make_tiny_tokenizer(), head=head)
    return greedy_matches_ar(engine, "chain", {"depth": 4}, n=4, max_tokens=32)


def test_head_auto_loads_the_shipped_head_for_its_target(tiny_pair, tmp_path, monkeypatch, tiny_tokenizer):
    """load(head="auto") takes specwood/heads/<target name>.safetensors where it exists, nothing
    otherwise; "none" never loads one."""
    import specwood
    from specwood.drafting import head_files as head_mod
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen2", vocab_size=tiny_pair.target.config.vocab_size, dim=64)
    folder = save_hf_folder(tmp_path / "tiny-target", cfg, random_state_dict(cfg, seed=1))
    tiny_tokenizer.save_pretrained(folder)
    monkeypatch.setattr(head_mod, "HEADS_DIR", tmp_path / "heads")
    assert specwood.load(str(folder), None, dtype="fp32", progress=False, head="auto").draft_head is None
    save_head(tiny_pair.head, tmp_path / "heads" / "tiny-target.safetensors")
    engine = specwood.load(str(folder), None, dtype="fp32", progress=False, head="auto")
    assert isinstance(engine.draft_head, DraftHead)
    ref = engine.generate([5, 6, 7], max_tokens=12)
    assert engine.generate([5, 6, 7], max_tokens=12, method="head").token_ids == ref.token_ids
    assert specwood.load(str(folder), None, dtype="fp32", progress=False, head="none").draft_head is None


def test_training_prompts_cut_functions_as_the_parser_does():
    """`drafter_data.source_segment` (lines split once a file) gives `ast.get_source_segment`'s text
    for every function: line ends \\n, \\r\\n and a lone \\r, a form feed inside a line (not a line end to
    the parser), and non-ASCII text before a node (the parser's offsets count UTF-8 bytes)."""
    import ast

    from specwood.drafter_data import source_lines, source_segment, stdlib_files

    odd = ("def a(x):\r\n    return x\r\n\rdef b(y):\n    s = 'é\x0c ü'; t = {'k': 1}\n    return s\n"
           "class C:\n    def m(self): return 'ø'  # ü\n\n    async def n(self):\n        pass\n")
    sources = [odd] + [f.read_text(encoding="utf-8") for f in stdlib_files()[:12]]
    checked = 0
    for source in sources:
        lines = source_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Return, ast.Assign)):
                assert source_segment(lines, node) == ast.get_source_segment(source, node), ast.dump(node)[:80]
                checked += 1
    assert checked > 100
