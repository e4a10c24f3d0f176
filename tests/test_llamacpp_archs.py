"""llama.cpp (the `llamacpp` extra) decodes test_architectures' tiny models and a tiny Llama, written
as F32 GGUFs with a vocabulary llama.cpp accepts, to the same 32 greedy tokens as we do from the same token ids,
with the same logits at every position: our reading of each architecture's GGUF (tensor names,
metadata, RoPE, norms, sliding windows, experts) agrees with llama.cpp's."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specwood.models.testing import (byte_level_tokens, make_tiny_tokenizer, random_state_dict,
                                     random_tiny_config, write_gguf)
from test_architectures import VOCAB, hf_tiny
from test_hf_parity import our_greedy

pytestmark = pytest.mark.usefixtures("llama_cpp_required", "one_torch_thread")

# qwen2 is test_llamacpp.py's tiny model (its tied random embeddings repeat one token greedily)
ARCHS = ["qwen3", "gemma3", "phi3", "qwen3moe", "granite", "olmo2", "smollm3", "llama"]
PROMPT = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
N_NEW = 32  # prompt + tokens: 48 positions, past Gemma 3's window of 8
# Largest |logit difference| allowed (logits of scale ~4). Both sides run fp32 weights and an fp32
# KV cache, so only summation order differs (measured <= 4e-6). Gemma 3 is the exception: ggml's CPU
# GELU looks the gate up in a table of fp16 values (input and output rounded to half), which alone
# moves its logits by ~1.5e-3 (test_gemma3_gap_is_ggmls_fp16_gelu); a misread file moves them by >0.1.
TOLERANCE = {"gemma3": 4e-3}
DEFAULT_TOLERANCE = 1e-4


def llama_cpp_greedy(path, prompt: list[int], n: int, n_ctx: int) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's greedy tokens (prompt, then one token at a time on its KV cache) and the logits
    it gave at every position it was fed."""
    import llama_cpp

    # fp32 K and V: the default fp16 cache would round them by ~1e-3, as large as what we look for
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        assert llm.n_vocab() == VOCAB and llm.n_ctx() == n_ctx  # both sides pick Phi-3's LongRoPE factors by it
        llm.eval(prompt)
        out: list[int] = []
        while True:
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if len(out) == n:
                break
            llm.eval([out[-1]])
        return out, torch.from_numpy(np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
    finally:
        llm.close()


_decoded: dict[str, SimpleNamespace] = {}


def decoded_for(arch: str, tmp_path_factory) -> SimpleNamespace:
    """Both runtimes on one architecture's file (made once per run): our model as `load` builds it
    from the GGUF, its greedy tokens and logits, and llama.cpp's."""
    from specwood.engine.api import load
    from specwood.models import loader
    from specwood.models.hf_loader import load_hf_folder

    if arch in _decoded:
        return _decoded[arch]
    folder = tmp_path_factory.mktemp(arch) / "hf"
    if arch == "llama":  # random canonical weights, q and k permuted in the file as llama.cpp's converter does
        cfg = random_tiny_config(arch, vocab_size=VOCAB, max_position_embeddings=512)
        weights = cfg, random_state_dict(cfg, seed=3)
    else:
        hf_tiny(arch).save_pretrained(folder)
        weights = load_hf_folder(folder, torch.float32)
    path = write_gguf(folder.parent / f"{arch}.gguf", *weights, "F32", tokens=byte_level_tokens(VOCAB))
    with pytest.MonkeyPatch.context() as mp:  # the tiny tokenizer, not one converted from the file
        mp.setattr(loader, "load_tokenizer", lambda path: make_tiny_tokenizer())
        model = load(path, None, dtype="fp32", progress=False).target
    tokens = our_greedy(model, PROMPT, N_NEW)
    seq = torch.tensor([PROMPT + tokens[:-1]])  # every position llama.cpp was fed
    with torch.inference_mode():
        logits = model(seq, torch.arange(seq.shape[1]))[0]
    lc_tokens, lc_logits = llama_cpp_greedy(path, PROMPT, N_NEW, model.max_positions)
    _decoded[arch] = SimpleNamespace(arch=arch, model=model, seq=seq, tokens=tokens, logits=logits,
                                     lc_tokens=lc_tokens, lc_logits=lc_logits)
    return _decoded[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_same_greedy_tokens_and_logits(arch: str, tmp_path_factory) -> None:
    d = decoded_for(arch, tmp_path_factory)
    assert d.lc_logits.shape == d.logits.shape == (len(PROMPT) + N_NEW - 1, VOCAB)
    # logits that tell tokens apart; Gemma 3's tiny model settles on one token within a few steps,
    # so the logits at all 47 positions (past its window) carry most of the comparison
    assert d.logits.std() > 0.5
    diff = (d.lc_logits - d.logits).abs().max().item()
    assert diff <= TOLERANCE.get(d.arch, DEFAULT_TOLERANCE), (d.arch, diff)
    assert d.lc_tokens == d.tokens, d.arch


class _GgmlGelu:
    """Our layer operations with the gated GELU as ggml's CPU computes it: the gate rounded to fp16,
    GELU looked up in a table of fp16 results (outside [-10, 10]: 0 or the input itself)."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        table = torch.nn.functional.gelu(gate.half().float(), approximate="tanh").half().float()
        return torch.where(gate <= -10, 0.0, torch.where(gate >= 10, gate, table)) * up


def test_gemma3_gap_is_ggmls_fp16_gelu(tmp_path_factory) -> None:
    """Gemma 3's larger tolerance is ggml's GELU and nothing in the file: with the same rounding in
    our forward most of the difference to llama.cpp goes."""
    d = decoded_for("gemma3", tmp_path_factory)
    ffs = [block.feed_forward for block in d.model.layers]
    plain_ops = ffs[0].ops
    try:
        for ff in ffs:
            ff.ops = _GgmlGelu(plain_ops)
        with torch.inference_mode():
            rounded = d.model(d.seq, torch.arange(d.seq.shape[1]))[0]
    finally:
        for ff in ffs:
            ff.ops = plain_ops
    plain = (d.lc_logits - d.logits).abs().max().item()
    assert (d.lc_logits - rounded).abs().max().item() <= plain / 2, plain  # measured 5.0e-4 of 1.5e-3
