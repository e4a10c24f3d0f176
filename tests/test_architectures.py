"""The architectures beyond the Llama family's first three (docs/models.md): tiny random models made
by transformers' own classes, saved with save_pretrained and written as llama.cpp-style GGUFs, run
by us with transformers' fp32 logits (1e-4 over >= 64 positions, past the sliding window where
there is one) and greedy tokens; every speculative method token-identical to our `ar` on them;
bad files and unknown types give one-line errors."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from conftest import perturbed_copy
from specwood.errors import ModelFileError
from specwood.models.config import ModelConfig
from specwood.models.gguf_loader import load_gguf
from specwood.models.hf_loader import load_hf_folder
from specwood.models.layer_kinds import LayerKind, layer_kinds, window_mask
from specwood.models.testing import make_tiny_tokenizer, write_gguf
from specwood.models.transformer import build_model
from test_hf_parity import hf_greedy, our_greedy

transformers = pytest.importorskip("transformers")

VOCAB = 264  # the tiny tokenizer's 259 tokens, padded
N_POSITIONS = 96  # > 64 positions compared, past Gemma's window of 8


def hf_tiny(arch: str):
    """A tiny random model of transformers' own class for `arch`, with weights scaled so that
    activations stay O(1) (the default init's 0.02 would make every logit nearly equal)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  pad_token_id=None)
    if arch == "qwen3":  # head_dim 32 is not hidden / heads = 16
        cfg = transformers.Qwen3Config(**common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3moe":  # 8 experts of width 32, 2 a token, their probabilities renormalised
        cfg = transformers.Qwen3MoeConfig(**common, num_hidden_layers=2, head_dim=32, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "gemma3":  # a global layer among sliding ones of window 8, each on its own RoPE base
        cfg = transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=30.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "granite":  # the four multipliers (Granite 3's 12, 0.22, 8 make this random model
        # repeat one token: its own embedding outweighs what its layers add)
        cfg = transformers.GraniteConfig(**common, num_hidden_layers=2, tie_word_embeddings=False,
                                         embedding_multiplier=4.0, attention_multiplier=0.125,
                                         residual_multiplier=0.4, logits_scaling=1.25)
        cls = transformers.GraniteForCausalLM
    elif arch == "olmo2":  # norms after attention and MLP only; q and k each normed as a whole
        cfg = transformers.Olmo2Config(**common, num_hidden_layers=2)
        cls = transformers.Olmo2ForCausalLM
    elif arch == "smollm3":  # RoPE skipped on every 4th layer (its default no_rope_layer_interval)
        cfg = transformers.SmolLM3Config(**common, num_hidden_layers=4)
        cls = transformers.SmolLM3ForCausalLM
    else:  # phi3: fused qkv and gate-up, LongRoPE pretrained on 128 positions, 256 in all
        g = torch.Generator().manual_seed(11)
        common["max_position_embeddings"] = 256
        cfg = transformers.Phi3Config(
            **common, num_hidden_layers=2, tie_word_embeddings=False, original_max_position_embeddings=128,
            rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                             "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
                             "long_factor": (1 + 4 * torch.rand(8, generator=g)).tolist()})
        cls = transformers.Phi3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 1:  # norms: around 1 (Gemma's are stored as w in 1 + w)
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


_files: dict[str, tuple] = {}


def files_for(arch: str, tmp_path_factory) -> tuple:
    """(arch, the transformers model, its save_pretrained folder, the same weights as a GGUF),
    made once per test module run."""
    if arch not in _files:
        hf = hf_tiny(arch)
        folder = tmp_path_factory.mktemp(arch) / "hf"
        hf.save_pretrained(folder)
        config, sd = load_hf_folder(folder, torch.float32)
        _files[arch] = arch, hf, folder, write_gguf(folder.parent / f"{arch}.gguf", config, sd, "F32")
    return _files[arch]


ARCHS = ["qwen3", "gemma3", "phi3", "qwen3moe", "granite", "olmo2", "smollm3"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_files(request, tmp_path_factory):
    return files_for(request.param, tmp_path_factory)


def positions_for(arch: str) -> int:
    return 128 if arch == "phi3" else 512  # Phi-3: within its pretrained length, the short factors


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(tiny_files, source):
    arch, hf, folder, gguf = tiny_files
    config, sd = load_hf_folder(folder, torch.float32) if source == "hf" else load_gguf(gguf, torch.float32)
    assert config.arch == arch
    ours = build_model(config, sd, torch.float32, max_positions=positions_for(arch))
    tokens = torch.randint(0, VOCAB, (1, N_POSITIONS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(tokens).logits
        diff = (ours(tokens, torch.arange(N_POSITIONS)) - expected).abs().max().item()
        assert diff <= 1e-4, diff
        assert expected.std() > 0.5  # logits that tell tokens apart: the comparison means something
        prompt = tokens[0, :8].tolist()
        assert our_greedy(ours, prompt, 64) == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize("arch,neutral", [
    ("granite", {"embed_scale": None}), ("granite", {"attention_scale": None}), ("granite", {"residual_scale": None}),
    ("granite", {"logit_scale": None}), ("smollm3", {"nope_layers": None}),
    ("olmo2", {"qk_norm": False, "qk_norm_whole": False}),
], ids=["embedding", "attention", "residual", "logits", "nope", "olmo2-qk-norm"])
def test_each_addition_is_needed_for_parity(tmp_path_factory, arch, neutral):
    """Each field an architecture adds moves the logits well past the parity tolerance when left
    out (so the parity tests above check it): Granite's four multipliers, SmolLM3's NoPE layers,
    OLMo 2's q/k norm (its norms' placement is the layer's whole shape)."""
    _, hf, folder, _ = files_for(arch, tmp_path_factory)
    config, sd = load_hf_folder(folder, torch.float32)
    if not neutral.get("qk_norm", True):
        sd = {k: v for k, v in sd.items() if "q_norm" not in k and "k_norm" not in k}
    without = build_model(dataclasses.replace(config, **neutral), sd, torch.float32, max_positions=128)
    tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert (without(tokens, torch.arange(64)) - hf(tokens).logits).abs().max().item() > 1e-2


def test_phi3_long_factors_past_the_pretrained_length(tmp_path_factory):
    """Built for more positions than it was pretrained on, Phi-3 runs LongRoPE's long factors (and
    the attention factor), as transformers does over a sequence that long; the short ones differ."""
    _, hf, folder, _ = files_for("phi3", tmp_path_factory)
    config, sd = load_hf_folder(folder, torch.float32)
    long_model = build_model(config, sd, torch.float32, max_positions=256)
    short_model = build_model(config, sd, torch.float32, max_positions=128)
    tokens = torch.randint(0, VOCAB, (1, 160), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = hf(tokens).logits
        assert (long_model(tokens, torch.arange(160)) - expected).abs().max().item() <= 1e-4
        short = tokens[:, :100]
        assert (long_model(short, torch.arange(100)) - hf(short).logits).abs().max().item() > 1e-2
        assert (short_model(short, torch.arange(100)) - hf(short).logits).abs().max().item() <= 1e-4


def test_config_read_from_the_folder(tiny_files):
    arch, hf, folder, gguf = tiny_files
    config, _ = load_hf_folder(folder, torch.float32)
    from_gguf, _ = load_gguf(gguf, torch.float32)
    kinds = layer_kinds(config)
    if arch == "qwen3":
        assert config.head_dim == 32 and config.qk_norm and not config.qkv_bias and config.tie_embeddings
    if arch == "gemma3":
        assert kinds == [LayerKind(8, 1), LayerKind(8, 1), LayerKind(None, 0), LayerKind(8, 1)]
        assert config.sandwich_norms and config.hidden_act == "gelu_tanh" and config.final_logit_softcap == 30.0
        assert config.rope_scaling["rope_type"] == "linear" and config.rope_local_theta == 1e4
        assert math.isclose(config.embed_scale, 8.0) and math.isclose(config.attention_scale, 32 ** -0.5)
    if arch == "phi3":
        assert config.rope_scaling["rope_type"] == "longrope" and len(config.rope_scaling["long_factor"]) == 8
    if arch == "qwen3moe":
        assert (config.n_experts, config.n_experts_used, config.moe_intermediate_size) == (8, 2, 32)
        assert config.norm_topk_prob and config.qk_norm
    if arch == "granite":
        assert (config.embed_scale, config.attention_scale, config.residual_scale, config.logit_scale) == \
            (4.0, 0.125, 0.4, 1.25)
    if arch == "olmo2":
        assert not config.pre_norms and config.sandwich_norms and config.qk_norm and config.qk_norm_whole
    if arch == "smollm3":
        assert config.nope_layers == [3] and kinds == [LayerKind()] * 3 + [LayerKind(None, None)]
    else:
        assert config.nope_layers is None
    assert layer_kinds(from_gguf) == kinds
    for field in ("head_dim", "qk_norm", "qk_norm_whole", "pre_norms", "sandwich_norms", "nope_layers", "hidden_act",
                  "tie_embeddings", "rope_local_theta", "final_logit_softcap", "rope_theta", "n_experts",
                  "n_experts_used", "moe_intermediate_size"):
        assert getattr(from_gguf, field) == getattr(config, field), field
    for field in ("embed_scale", "attention_scale", "residual_scale", "logit_scale"):  # float32 in a GGUF
        ours, theirs = getattr(from_gguf, field), getattr(config, field)
        assert ours == theirs or math.isclose(ours, theirs, rel_tol=1e-6), field


# ----------------------------------------------------------------------------- speculative methods


@pytest.fixture(scope="module")
def arch_engine(tiny_files):
    """(arch, an fp32 engine on the tiny model): a perturbed copy of it as the draft model (the
    same architecture and vocabulary; perturbed by 0.15, it gets 1.4-10 tokens a step accepted
    on these models, so both accepted paths and rejections are exercised) and an untrained
    draft head (its drafts are rarely right, but every one is verified)."""
    from specwood.drafting.head import untrained_head
    from specwood.engine.api import Engine

    arch, _, folder, _ = tiny_files
    config, sd = load_hf_folder(folder, torch.float32)
    target = build_model(config, sd, torch.float32, max_positions=positions_for(arch))
    engine = Engine(target, make_tiny_tokenizer(), draft=perturbed_copy(target, 0.15, seed=1),
                    head=untrained_head(target, seed=3), target_name=f"tiny-{arch}", draft_name=f"tiny-{arch}-draft")
    return arch, engine



def every_method() -> list[str]:
    from specwood.methods import method_names

    return method_names()  # those the sequential executor runs: ar, every tree shape, head, suffix, duo, auto, ...


def test_every_method_matches_autoregressive(arch_engine, one_thread_private_cache):
    """Each method alone (Engine.generate) emits `ar`'s tokens: the tree shapes first checked here
    at their default (full-size) trees, the rest at test_batching's small ones; on Gemma 3 the
    prompts and answers run past its window of 8."""
    from test_batching import TINY_OPTIONS, quiet_prepare, store_auto_plan

    arch, engine = arch_engine
    store_auto_plan(engine)
    full_size = ("chain", "dyspec", "sequoia", "pld", "suffix", "early-exit")
    prepared = {m: quiet_prepare(engine, m, {} if m in full_size else TINY_OPTIONS[m]) for m in every_method()}
    for prompt in ["def add(a, b):", "1, 2, 3, 1, 2, 3, 1, 2,"]:
        ref = engine.generate(prompt, max_tokens=40, raw=True)
        assert len(ref.token_ids) == 40 or ref.finish_reason == "stop"
        for method, factory in prepared.items():
            out = engine.run(engine.new_request(prompt, max_tokens=40, raw=True, method=method, prepared=factory))
            assert out.token_ids == ref.token_ids, (arch, method, prompt)


def test_every_method_in_one_batch_matches_autoregressive(arch_engine, one_thread_private_cache):
    """Every method twice in one scheduler batch (prompts of 9 to 45 tokens, half of the requests
    joining mid-stream, newcomers prefilled in chunks beside the others' decode steps): each
    request emits what `ar` alone emits, and every method that drafts speculated."""
    import random

    from specwood.engine.scheduler import SchedulerConfig
    from test_batching import Job, assert_like_ar, assert_pools_free, random_prompt, run_jobs, store_auto_plan

    arch, engine = arch_engine
    store_auto_plan(engine)
    names = every_method()
    rnd = random.Random(57)
    jobs = [Job(method, random_prompt(rnd, rnd.randint(9, 45)), max_tokens=rnd.randint(12, 24),
                start_step=0 if i < 6 else 2 * (i - 5))
            for i, method in enumerate(names + names[::-1])]
    sched = engine.make_scheduler(SchedulerConfig(max_batch=6, prefill_chunk_tokens=16), drafts=())
    run_jobs(engine, sched, jobs)
    assert_like_ar(engine, jobs)
    spec = [j for j in jobs if j.method not in ("ar", "pld")]  # pld drafts only where the context repeats
    # a request whose prompt is followed by EOS ends with its prefill, before a step could draft (on
    # the random OLMo 2 and SmolLM3, one or two of these prompts); every method still drafts in the other
    drafting = [j for j in spec if j.request.result.token_ids or j.request.result.finish_reason != "stop"]
    assert {j.method for j in drafting} == {j.method for j in spec}, arch
    assert all(j.request.result.stats.get("spec_steps", 0) > 0 for j in drafting), arch
    assert_pools_free(sched)


def test_every_method_with_prefix_reuse_matches_autoregressive(arch_engine, one_thread_private_cache):
    """A conversation's first turn, then every method's second turn (its prompt: the first turn,
    its answer and a new message) on a scheduler with a prefix cache: each starts from the cached
    first turn (target and draft model) and emits what `ar` alone emits on the whole prompt."""
    import random

    from specwood.engine.scheduler import SchedulerConfig
    from test_batching import TINY_OPTIONS, quiet_prepare, store_auto_plan

    arch, engine = arch_engine
    store_auto_plan(engine)
    rnd = random.Random(5)
    sched = engine.make_scheduler(SchedulerConfig(max_batch=4, reuse=True, prefix_bytes=10 ** 8),
                                  drafts=(engine.draft_model, engine.draft_head))

    def run(prompt: list[int], method: str):
        request = engine.new_request(prompt, max_tokens=16, method=method, scheduler=sched,
                                     prepared=quiet_prepare(engine, method, TINY_OPTIONS[method]))
        sched.submit(request)
        sched.run_until_done([request])
        assert request.error is None, (arch, method, request.error)
        return request

    first = [rnd.randrange(32, 127) for _ in range(30)]
    answer = run(first, "ar").result.token_ids
    for method in every_method():
        prompt = first + answer + [rnd.randrange(32, 127) for _ in range(6)]
        request = run(prompt, method)
        assert request.result.token_ids == engine.generate(prompt, max_tokens=16).token_ids, (arch, method)
        if method != "head":  # its draft head reads the target's features of every prompt token: no reuse
            assert request.cached_tokens >= len(first), (arch, method, request.cached_tokens)
    assert sched.executor.reuse.cache.stats.hit_tokens["draft"] > 0
    assert not sched.running and sched.executor.cache.free_rows == sched.max_batch


def test_bf16_runs_close_to_fp32_and_stays_lossless(tiny_files):
    """bf16 weights and activations (packed linears, the layer kernels): logits near fp32's, and
    speculative decoding token-identical to bf16 ar."""
    from specwood.engine.api import Engine

    arch, _, folder, _ = tiny_files
    models = {dtype: build_model(*load_hf_folder(folder, dtype), dtype, max_positions=positions_for(arch))
              for dtype in (torch.float32, torch.bfloat16)}
    assert models[torch.bfloat16].weight_mode == "bf16"
    tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full, half = (models[d](tokens, torch.arange(64)) for d in (torch.float32, torch.bfloat16))
    assert ((half - full).norm() / full.norm()).item() < 0.1  # a MoE router's choice may flip in bf16
    assert (half.argmax(-1) == full.argmax(-1)).float().mean().item() > 0.8
    target = models[torch.bfloat16]
    engine = Engine(target, make_tiny_tokenizer(), draft=perturbed_copy(models[torch.float32], 0.3, seed=1))
    ref = engine.generate("def add(a, b):", max_tokens=32, raw=True)
    for method in ("chain", "dyspec", "pld"):
        assert engine.generate("def add(a, b):", max_tokens=32, raw=True, method=method).token_ids == ref.token_ids


# ----------------------------------------------------------------------------- sliding windows


def test_window_counts_from_each_tree_nodes_own_position():
    """A tree node's window is the last W tokens of its own path: prefix slots then its ancestors."""
    prefix = 5
    # two branches after the prefix: slot 5 -> 6 -> 7 and slot 5 -> 8
    parents = {5: None, 6: 5, 7: 6, 8: 5}
    mask = torch.zeros(4, 9, dtype=torch.bool)
    for row, node in enumerate([5, 6, 7, 8]):
        mask[row, :prefix] = True
        while node is not None:
            mask[row, node] = True
            node = parents[node]
    cut = window_mask(mask, 3)
    assert cut[2].nonzero().flatten().tolist() == [5, 6, 7]  # depth 3: its own path only
    assert cut[3].nonzero().flatten().tolist() == [4, 5, 8]  # position 6: the prefix's last, its parent, itself
    assert cut[0].nonzero().flatten().tolist() == [3, 4, 5]


def test_tree_forward_equals_path_forwards_on_sliding_layers(tmp_path_factory):
    """Verifying a tree in one forward gives each node the logits of a plain forward along its
    path, on a model whose sliding window (8) the prompt and paths run past."""
    _, _, folder, _ = files_for("gemma3", tmp_path_factory)
    config, sd = load_hf_folder(folder, torch.float32)
    model = build_model(config, sd, torch.float32, max_positions=64)
    prompt = list(range(10, 22))
    n = len(prompt)
    paths = {0: [30], 1: [30, 31], 2: [30, 31, 32], 3: [30, 40], 4: [50]}  # node -> its path's tokens
    parents = {0: None, 1: 0, 2: 1, 3: 0, 4: None}
    cache = model.new_cache(64)
    from specwood.models.prefill import prefill

    prefill(model, cache, prompt)
    mask = torch.zeros(len(paths), n + len(paths), dtype=torch.bool)
    mask[:, :n] = True
    for node in paths:
        a = node
        while a is not None:
            mask[node, n + a] = True
            a = parents[a]
    tokens = torch.tensor([[paths[i][-1] for i in range(len(paths))]])
    positions = torch.tensor([n + len(paths[i]) - 1 for i in range(len(paths))])
    with torch.inference_mode():
        tree = model(tokens, positions, mask, cache, torch.arange(n, n + len(paths)))[0]
        for node, path in paths.items():
            full = torch.tensor([prompt + path])
            plain = model(full, torch.arange(full.shape[1]))[0, -1]
            assert (tree[node] - plain).abs().max().item() <= 1e-4, node


# ----------------------------------------------------------------------------- errors


def one_line_error(load, *args) -> str:
    """The ModelFileError `load(*args)` raises: its message, asserted to be one line."""
    with pytest.raises(ModelFileError) as e:
        load(*args)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def without_tensor(folder, name: str) -> None:
    """Drop tensor `name` from a saved Hugging Face folder's (single) safetensors file."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[name]
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_missing_qk_norm_names_the_tensor(tmp_path):
    """A Qwen3 file without one layer's q norm: one line naming the tensor as the file does."""
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen3")
    sd = random_state_dict(cfg)
    folder = save_hf_folder(tmp_path / "hf", cfg, sd)
    without_tensor(folder, "model.layers.1.self_attn.q_norm.weight")
    assert ("missing tensor(s) model.layers.1.self_attn.q_norm.weight"
            in one_line_error(load_hf_folder, folder, torch.float32))
    del sd["layers.1.attention.q_norm.weight"]
    path = write_gguf(tmp_path / "q.gguf", cfg, sd, "F32")
    assert "missing tensor(s) blk.1.attn_q_norm.weight" in one_line_error(load_gguf, path, torch.float32)


def test_tensor_not_matching_metadata_names_it(tmp_path):
    from specwood.models.testing import random_state_dict, random_tiny_config

    cfg = random_tiny_config("gemma3")
    sd = random_state_dict(cfg)
    sd["layers.2.attention.k_norm.weight"] = torch.ones(16)  # head_dim is 32
    path = write_gguf(tmp_path / "g.gguf", cfg, sd, "F32")
    assert "tensor blk.2.attn_k_norm.weight has shape (16,)" in one_line_error(load_gguf, path, torch.float32)


def test_wrong_expert_count_names_the_tensor(tmp_path):
    """A Qwen3-MoE file whose metadata counts other experts than its tensors hold: one line naming
    the first tensor that disagrees (the GGUF's router, stored [experts, dim]; the folder's first
    expert past the ones it has, or the first one too many)."""
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen3moe")  # 4 experts
    sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, sd, "F32", extra_metadata={"qwen3moe.expert_count": 8})
    msg = one_line_error(load_gguf, path, torch.float32)
    assert "tensor blk.0.ffn_gate_inp.weight has shape (4, 64), the model config implies (8, 64)" in msg
    folder = save_hf_folder(tmp_path / "hf", cfg, sd)
    raw = json.loads((folder / "config.json").read_text())
    key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    for experts, says in ((6, r"experts\.4\.\w+_proj\.weight is missing"),
                          (3, r"experts\.3\.\w+_proj\.weight is an expert too many")):
        (folder / "config.json").write_text(json.dumps({**raw, key: experts}))
        msg = one_line_error(load_hf_folder, folder, torch.float32)
        assert re.search(rf"tensor model\.layers\.0\.mlp\.{says}: the config says {experts} experts, the checkpoint "
                         r"has 4 \(numbered 0\.\.3\)", msg), msg


@pytest.mark.parametrize("arch,metadata,says", [
    ("qwen3", {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0},
     "unsupported rope scaling type 'yarn'"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": "local"},
     "sliding_window_pattern is 'local', neither a period"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": [True, False]},
     "not one sliding flag for each of the file's 4"),
    ("gemma3", {"gemma3.attention.sliding_window": 8.5},
     "'gemma3.attention.sliding_window' is 8.5, not an integer"),
], ids=["rope-yarn", "pattern-string", "pattern-length", "window-fraction"])
def test_unknown_rope_scaling_or_sliding_window_in_a_gguf(tmp_path, arch, metadata, says):
    """Read with the header, before a weight is decoded: one line naming the file."""
    from specwood.models.testing import random_state_dict, random_tiny_config

    cfg = random_tiny_config(arch)
    path = write_gguf(tmp_path / "x.gguf", cfg, random_state_dict(cfg), "F32", extra_metadata=metadata)
    msg = one_line_error(load_gguf, path, torch.float32)
    assert msg.startswith(str(path)) and says in msg, msg


def test_a_gguf_per_layer_sliding_pattern_applies_to_any_architecture(tmp_path):
    """llama.cpp's sliding_window_pattern (a flag per layer) is read for every architecture, not
    only Gemma 3's (it was ignored, and the window applied to every layer)."""
    from specwood.models.testing import random_state_dict, random_tiny_config

    cfg = random_tiny_config("qwen3")
    path = write_gguf(tmp_path / "x.gguf", cfg, random_state_dict(cfg), "F32",
                      extra_metadata={"qwen3.attention.sliding_window": 8,
                                      "qwen3.attention.sliding_window_pattern": [False, True]})
    config, _ = load_gguf(path, torch.float32)
    assert layer_kinds(config) == [LayerKind(), LayerKind(8, 0)]


def test_qwen3_sliding_layers_from_max_window_layers_match_transformers(tmp_path):
    """A Qwen3 config.json of transformers < 5 (use_sliding_window, no layer_types): the layers from
    max_window_layers on slide, as transformers runs them (they all slid, silently, before)."""
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, head_dim=32, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1, max_position_embeddings=512)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("layer_types")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    config, sd = load_hf_folder(tmp_path / "hf", torch.float32)
    assert layer_kinds(config) == [LayerKind(), LayerKind(8, 0)]
    ours = build_model(config, sd, torch.float32, max_positions=64)
    all_sliding = build_model(dataclasses.replace(config, layer_types=None), sd, torch.float32, max_positions=64)
    tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        expected = hf(tokens).logits
        assert (ours(tokens, torch.arange(64)) - expected).abs().max().item() <= 1e-4
        assert (all_sliding(tokens, torch.arange(64)) - expected).abs().max().item() > 1e-2  # the old reading


def test_unknown_architecture_lists_the_ones_we_run(tmp_path):
    from specwood.models.testing import random_state_dict, random_tiny_config

    cfg = random_tiny_config("llama")
    path = write_gguf(tmp_path / "x.gguf", cfg, random_state_dict(cfg), "F32", arch="gemma2")
    with pytest.raises(ModelFileError) as e:
        load_gguf(path, torch.float32)
    msg = str(e.value)
    assert "'gemma2'" in msg and all(a in msg for a in ("qwen3", "gemma3", "phi3")) and "\n" not in msg


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["chunked_attention", "full_attention"]}, "unsupported layer type 'chunked_attention'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
    ({"hidden_act": "relu"}, "unsupported MLP activation 'relu'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": "every 6th"},
     "sliding_window_pattern is 'every 6th', not a whole number"),
])
def test_unknown_types_are_one_line_errors(change, match):
    cfg = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 64, **change}
    with pytest.raises(ModelFileError, match=match) as e:
        config = ModelConfig.from_hf(cfg)
        build_model(config, {}, torch.float32)  # (RoPE types are checked when the config is read)
    assert "\n" not in str(e.value)


def test_gemma3_query_scalar_and_pattern_from_an_older_config_json():
    """transformers < 5 config.json: rope_local_base_freq and sliding_window_pattern."""
    cfg = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 12,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 64,
           "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "query_pre_attn_scalar": 24, "rope_scaling": None}
    config = ModelConfig.from_hf(cfg)
    globals_ = [i for i, k in enumerate(layer_kinds(config)) if k.window is None]
    assert globals_ == [5, 11] and config.rope_local_theta == 1e4
    assert math.isclose(config.attention_scale, 24 ** -0.5) and config.tie_embeddings
    json.dumps(config.to_dict())  # stays serialisable


# ----------------------------------------------------------------------------- the GGUF k-quant mode


@pytest.mark.parametrize("arch", ARCHS)
def test_q4_mode_runs_the_files_kquants_and_stays_lossless(tmp_path, monkeypatch, arch):
    """q4 (the default for a GGUF on a CPU with the kernels) on a Q4_K_M-style file: every layer
    linear runs on the k-quant kernels as the file stores it (Phi-3's fused qkv and gate-up split
    by rows; Qwen3-MoE's experts as KQuantExperts), their dequantised values equal the fp32 load's,
    and speculative decoding stays token-identical to ar."""
    from specwood.engine.api import load
    from specwood.models import loader
    from specwood.models.experts import KQuantExperts
    from specwood.models.testing import longrope_scaling, random_tiny_config, write_q4_k_m_gguf
    from specwood.models.w4a8 import KQuantLinear, q4_unavailable_reason

    if q4_unavailable_reason() is not None:
        pytest.skip(str(q4_unavailable_reason()))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: make_tiny_tokenizer())
    sizes = dict(vocab_size=VOCAB, dim=256, intermediate_size=512, n_heads=4, n_kv_heads=2, eos_token_ids=[256],
                 bos_token_id=None, max_position_embeddings=128)
    head_dim = {"qwen3": 128}.get(arch, 64)
    extra = {"gemma3": {"attention_scale": head_dim ** -0.5, "embed_scale": 16.0},
             "phi3": {"rope_scaling": longrope_scaling(head_dim // 2)},
             "qwen3moe": {"n_experts": 8, "moe_intermediate_size": 256}}.get(arch, {})
    cfg = random_tiny_config(arch, head_dim=head_dim, **sizes, **extra)
    path = str(write_q4_k_m_gguf(tmp_path / f"{arch}.gguf", cfg, seed=5))
    q4 = load(path, None, dtype="q4", progress=False)
    assert q4.target.weight_mode == "q4"
    assert not [n for n in q4.target.weights_in_floats if n.startswith("layers.")]  # the F32 token table may be
    for block in q4.target.layers:
        assert isinstance(block.attention.wqkv, KQuantLinear) or type(block.attention.wqkv).__name__ == "StackedLinear"
        # a Mixture-of-Experts layer's router (F32 in the file, as llama.cpp keeps it) stays in floats
        assert isinstance(block.feed_forward.w2, KQuantExperts if arch == "qwen3moe" else KQuantLinear)
    reference = load(path, None, dtype="fp32", progress=False).target.canonical_state_dict()
    exported = q4.target.canonical_state_dict(torch.float32)
    for name, ref in reference.items():
        if name.startswith("layers.") and ref.dim() >= 2 and "router" not in name:  # the file's k-quants
            assert torch.equal(exported[name], ref), name
        else:  # kept in floats, in the activations' dtype
            assert torch.equal(exported[name], ref.to(q4.dtype).float()), name
    prompt = "def add(a, b):"
    ref = q4.generate(prompt, max_tokens=24, raw=True)
    for method in ("pld", "early-exit"):
        assert q4.generate(prompt, max_tokens=24, raw=True, method=method).token_ids == ref.token_ids, method


def test_mistral_sliding_window_now_applies():
    """Mistral v0.1's window (every layer sliding) is honoured through the same layer kinds:
    transformers' logits past the window, which the forward ignored before."""
    from specwood.models.hf_export import to_hf_model
    from specwood.models.testing import random_state_dict, random_tiny_config

    cfg = random_tiny_config("mistral", vocab_size=VOCAB, sliding_window=8)
    assert set(layer_kinds(cfg)) == {LayerKind(8, 0)}
    sd = random_state_dict(cfg, seed=4)
    ours, hf = build_model(cfg, sd, torch.float32), to_hf_model(cfg, sd, torch.float32)
    unwindowed = build_model(random_tiny_config("mistral", vocab_size=VOCAB), sd, torch.float32)
    tokens = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = hf(tokens).logits
        assert (ours(tokens, torch.arange(64)) - expected).abs().max().item() <= 1e-4
        assert (unwindowed(tokens, torch.arange(64)) - expected).abs().max().item() > 1e-2


# ----------------------------------------------------------------------------- Granite, OLMo 2, SmolLM3 configs


def test_smollm3_nope_layers_from_either_config_key():
    """SmolLM3's layers without RoPE from `no_rope_layers` (1 = RoPE) or, without it, every
    `no_rope_layer_interval`-th layer; a list that is not a flag per layer is one line."""
    cfg = {"model_type": "smollm3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 6,
           "num_attention_heads": 2, "intermediate_size": 64}
    assert ModelConfig.from_hf(cfg).nope_layers == [3]  # the default interval, 4
    assert ModelConfig.from_hf({**cfg, "no_rope_layer_interval": 2}).nope_layers == [1, 3, 5]
    config = ModelConfig.from_hf({**cfg, "no_rope_layers": [1, 0, 1, 1, 0, 1]})
    assert config.nope_layers == [1, 4] and [k.rope for k in layer_kinds(config)] == [0, None, 0, 0, None, 0]
    assert dataclasses.replace(config, n_layers=3).nope_layers == [1]  # an early-exit draft's layers
    with pytest.raises(ModelFileError, match="no_rope_layers is not one 0/1 flag for each of the 6 layers") as e:
        ModelConfig.from_hf({**cfg, "no_rope_layers": [1, 0, 1]})
    assert "\n" not in str(e.value)


def test_neutral_multipliers_add_no_operation():
    """Granite's multipliers at 1 (config.json or GGUF) are left out of the config, so its layers
    run the Llama layer's forward unchanged, as the default pair's do (no multiply by 1 per layer)."""
    from specwood.models.testing import random_tiny_config
    from specwood.models.transformer import Transformer

    cfg = {"model_type": "granite", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 64, "embedding_multiplier": 1.0,
           "attention_multiplier": 1.0, "residual_multiplier": 1, "logits_scaling": 1.0}
    config = ModelConfig.from_hf(cfg)
    assert (config.embed_scale, config.attention_scale, config.residual_scale, config.logit_scale) == (None,) * 4
    for c in (config, random_tiny_config("qwen2"), random_tiny_config("llama")):
        assert all(block.llama_layer for block in Transformer(c).layers), c.arch
    with pytest.raises(ModelFileError, match="residual_multiplier is -0.5, not a positive number"):
        ModelConfig.from_hf({**cfg, "residual_multiplier": -0.5})


def test_olmo2_missing_post_norm_names_the_tensor(tmp_path):
    """OLMo 2 has no input norms: a file without a layer's MLP output norm is one line naming it as
    the file does (its post_feedforward_layernorm, llama.cpp's post_ffw_norm)."""
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("olmo2")
    sd = random_state_dict(cfg)
    assert not any(name.endswith(("attention_norm.weight", "ffn_norm.weight")) for name in sd)
    folder = save_hf_folder(tmp_path / "hf", cfg, sd)
    without_tensor(folder, "model.layers.1.post_feedforward_layernorm.weight")
    msg = one_line_error(load_hf_folder, folder, torch.float32)
    assert "missing tensor(s) model.layers.1.post_feedforward_layernorm.weight" in msg, msg
    del sd["layers.1.ffn_post_norm.weight"]
    path = write_gguf(tmp_path / "o.gguf", cfg, sd, "F32")
    assert "missing tensor(s) blk.1.post_ffw_norm.weight" in one_line_error(load_gguf, path, torch.float32)
