"""Weight loaders: tiny GGUF files written in code (llama.cpp layout) and tiny HF folders come back as
exactly the canonical weights; broken files give one-line ModelFileErrors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.gguf_dequant import dequantize_tensor
from specwood.models.gguf_file import GGUFTensorInfo, read_gguf_header
from specwood.models.gguf_loader import load_gguf
from specwood.models.hf_export import to_hf_model
from specwood.models.hf_loader import load_hf_folder
from specwood.models.canonical import canonical_shapes
from specwood.models.loader import load_checkpoint
from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder, write_gguf

# Relative error a quantisation format may introduce on N(0, 1/sqrt(dim)) weights.
QUANT_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q5_0": 6e-2, "Q4_0": 1.2e-1}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written independently of the loader's inverse."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_cpp_style(path: Path, config, sd, qtype: str) -> Path:
    """A GGUF as llama.cpp's converter writes it, with its own q/k permutation (arch llama)."""
    permuted = {}
    for name, t in sd.items():
        a = t.float().numpy()
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            a = llama_cpp_permute(a, config.n_heads, config.n_heads)
        elif name.endswith(("attention.wk.weight", "attention.wk.bias")):
            a = llama_cpp_permute(a, config.n_heads, config.n_kv_heads)
        permuted[name] = torch.from_numpy(np.ascontiguousarray(a))
    return write_gguf(path, config, permuted, qtype, permute=False)


# ----------------------------------------------------------------------------- GGUF round trips


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0"])
def test_gguf_qwen2_roundtrip(tmp_path: Path, qtype: str) -> None:
    cfg = random_tiny_config("qwen2")
    sd = random_state_dict(cfg, seed=1)
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, sd, qtype)
    cfg2, sd2 = load_gguf(path, torch.float32)
    assert set(sd2) == set(sd) == set(canonical_shapes(cfg))
    for name, t in sd.items():
        assert sd2[name].dtype == torch.float32 and sd2[name].shape == t.shape, name
        tol = 0.0 if t.dim() == 1 else QUANT_TOL[qtype]  # 1-D tensors are always written as F32
        assert rel_err(sd2[name], t) <= tol, (name, rel_err(sd2[name], t))
    assert cfg2.arch == "qwen2" and cfg2.tie_embeddings and cfg2.qkv_bias
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim",
                  "max_position_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg2, field) == getattr(cfg, field), field
    assert math.isclose(cfg2.rope_theta, cfg.rope_theta) and math.isclose(cfg2.norm_eps, cfg.norm_eps, rel_tol=1e-6)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_llama_undoes_llama_cpp_permutation(tmp_path: Path, qtype: str) -> None:
    cfg = random_tiny_config("llama", qkv_bias=True)  # biases are permuted too
    sd = random_state_dict(cfg, seed=2)
    path = write_llama_cpp_style(tmp_path / "llama.gguf", cfg, sd, qtype)
    cfg2, sd2 = load_gguf(path, torch.float32)
    assert cfg2.arch == "llama" and not cfg2.tie_embeddings and cfg2.qkv_bias
    for name, t in sd.items():
        tol = 0.0 if (t.dim() == 1 or qtype == "F32") else QUANT_TOL[qtype]
        assert rel_err(sd2[name], t) <= tol, name
    if qtype == "F32":  # exact: any wrong row order would show up here
        assert torch.equal(sd2["layers.0.attention.wq.weight"], sd["layers.0.attention.wq.weight"])
        assert torch.equal(sd2["layers.1.attention.wk.bias"], sd["layers.1.attention.wk.bias"])


def test_gguf_layer_range_and_dtype(tmp_path: Path) -> None:
    cfg = random_tiny_config("llama", n_layers=4)
    sd = random_state_dict(cfg, seed=3)
    path = write_gguf(tmp_path / "l4.gguf", cfg, sd, "F16")
    _, part = load_gguf(path, torch.bfloat16, layers=range(1, 3))
    assert {k.split(".")[1] for k in part if k.startswith("layers.")} == {"1", "2"}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(part)
    assert all(t.dtype == torch.bfloat16 for t in part.values())
    with pytest.raises(SpecwoodError, match="layer range"):
        load_gguf(path, torch.float32, layers=range(3, 6))


def test_header_parser_agrees_with_gguf_reader(tmp_path: Path) -> None:
    cfg = random_tiny_config("qwen2")
    path = write_gguf(tmp_path / "h.gguf", cfg, random_state_dict(cfg), "Q8_0",
                      extra_metadata={"tokenizer.chat_template": "{{ messages }}"})
    ours = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert set(ours.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes and mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert math.isclose(ours.metadata[key], value, rel_tol=1e-6), key
        else:
            assert ours.metadata[key] == value, key
    assert ours.metadata["tokenizer.chat_template"] == "{{ messages }}"


def _random_blocks(qtype: gguf.GGMLQuantizationType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with finite fp16 scales at the positions each format keeps them."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scale_at = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2]}.get(qtype.name, [0])
    for pos in scale_at:
        b[:, pos : pos + 2] = rng.uniform(-2, 2, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_torch_dequantisers_match_gguf(name: str) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 2 * 256
    raw = _random_blocks(qtype, rows * cols // block, np.random.default_rng(0)).reshape(-1)
    info = GGUFTensorInfo("t", (rows, cols), int(qtype), 0, raw.size)
    ours = dequantize_tensor(raw, info, torch.float32, use_torch=True)
    ref = dequantize_tensor(raw, info, torch.float32, use_torch=False)
    assert ours.shape == (rows, cols)
    assert torch.equal(ours, ref)  # same arithmetic order: bit-identical to gguf.quants


# ----------------------------------------------------------------------------- broken GGUF files


def test_truncated_gguf(tmp_path: Path) -> None:
    cfg = random_tiny_config("qwen2")
    path = write_gguf(tmp_path / "t.gguf", cfg, random_state_dict(cfg), "F16")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 300, 10):  # in tensor data, in the header, in the magic
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as e:
            load_gguf(bad, torch.float32)
        msg = str(e.value)
        assert str(bad) in msg and "\n" not in msg
        assert "truncated" in msg or "not a GGUF" in msg or "bytes" in msg


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_gguf(bad, torch.float32)


def test_unknown_architecture(tmp_path: Path) -> None:
    cfg = random_tiny_config("llama")
    path = write_gguf(tmp_path / "g.gguf", cfg, random_state_dict(cfg), "F32", arch="gemma")
    with pytest.raises(ModelFileError) as e:
        load_gguf(path, torch.float32)
    assert "'gemma'" in str(e.value) and "qwen2" in str(e.value) and str(path) in str(e.value)


def test_missing_tensor(tmp_path: Path) -> None:
    cfg = random_tiny_config("llama")
    sd = random_state_dict(cfg)
    del sd["layers.1.feed_forward.w2.weight"]
    path = write_gguf(tmp_path / "m.gguf", cfg, sd, "F32")
    with pytest.raises(ModelFileError, match="missing tensor.*blk.1.ffn_down.weight"):  # as the file names it
        load_gguf(path, torch.float32)


# ----------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_folder_roundtrip(tmp_path: Path, arch: str) -> None:
    cfg = random_tiny_config(arch)
    sd = random_state_dict(cfg, seed=4)
    folder = save_hf_folder(tmp_path / arch, cfg, sd)
    cfg2, sd2 = load_hf_folder(folder, torch.float32)
    assert set(sd2) == set(sd)
    assert all(torch.equal(sd2[k], sd[k]) for k in sd)
    cfg2.name = cfg.name
    assert cfg2 == cfg


def test_hf_sharded_folder_and_layers(tmp_path: Path) -> None:
    cfg = random_tiny_config("llama", n_layers=3)
    sd = random_state_dict(cfg, seed=5)
    folder = save_hf_folder(tmp_path / "sharded", cfg, sd, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    cfg2, sd2 = load_hf_folder(folder, torch.bfloat16, layers=range(2, 3))
    assert {k for k in sd2 if k.startswith("layers.")} == {k for k in sd if k.startswith("layers.2.")}
    assert torch.equal(sd2["layers.2.attention.wq.weight"], sd["layers.2.attention.wq.weight"].bfloat16())


def test_hf_folder_errors(tmp_path: Path) -> None:
    cfg = random_tiny_config("qwen2")
    folder = save_hf_folder(tmp_path / "f", cfg, random_state_dict(cfg))
    st = next(folder.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        load_hf_folder(folder, torch.float32)
    st.unlink()
    with pytest.raises(ModelFileError, match="no \\*.safetensors"):
        load_hf_folder(folder, torch.float32)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8,
                                                    "num_hidden_layers": 1, "num_attention_heads": 2,
                                                    "intermediate_size": 8}))
    with pytest.raises(ModelFileError, match="unsupported architecture 'gpt2'"):
        load_hf_folder(folder, torch.float32)


def test_a_bias_our_layers_lack_is_skipped_only_when_zero(tmp_path: Path) -> None:
    """Llama's attention_bias gives o_proj a bias too; zeros (what converters write where the model
    has none) load as before, a non-zero one is a one-line error instead of a different model."""
    from safetensors.torch import load_file, save_file

    cfg = random_tiny_config("llama", qkv_bias=True)
    sd = random_state_dict(cfg, seed=6)
    folder = save_hf_folder(tmp_path / "hf", cfg, sd)
    st = next(folder.glob("*.safetensors"))
    tensors = load_file(st)
    assert not tensors["model.layers.1.self_attn.o_proj.bias"].any()  # as hf_export writes it
    assert torch.equal(load_hf_folder(folder, torch.float32)[1]["layers.1.attention.wq.bias"],
                       sd["layers.1.attention.wq.bias"])
    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.5
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"model.layers.1.self_attn.o_proj.bias is a non-zero bias"):
        load_hf_folder(folder, torch.float32)

    zero = write_gguf(tmp_path / "zero.gguf", cfg, {**sd, "blk.1.attn_output.bias": torch.zeros(cfg.dim)})
    loaded = load_gguf(zero, torch.float32)[1]
    assert torch.equal(loaded["layers.1.attention.wq.bias"], sd["layers.1.attention.wq.bias"])
    biased = write_gguf(tmp_path / "biased.gguf", cfg, {**sd, "blk.1.attn_output.bias": torch.full((cfg.dim,), 0.5)})
    with pytest.raises(ModelFileError, match=r"blk.1.attn_output.bias is a non-zero bias"):
        load_gguf(biased, torch.float32)


def test_load_checkpoint_dispatch(tiny_checkpoint_files) -> None:
    files = tiny_checkpoint_files
    for src in (files.gguf, files.hf, str(files.gguf)):
        cfg, sd, path = load_checkpoint(src, torch.float32)
        assert path == Path(src) and cfg.arch == "qwen2"
        assert torch.equal(sd["layers.1.attention.wv.bias"], files.state_dict["layers.1.attention.wv.bias"])
    _, sd, _ = load_checkpoint(files.hf, torch.float32, layers=range(0, 1))
    assert not any(k.startswith("layers.1.") for k in sd)


# ----------------------------------------------------------------------------- HF export


def reference_logits(cfg, sd: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """A plain float64 Llama-family forward over the canonical weights (rotate-half RoPE, GQA, SwiGLU)."""
    w = {k: v.double() for k, v in sd.items()}
    n, hd = tokens.shape[0], cfg.head_dim

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * g

    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [heads, n, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    x = w["tok_embeddings.weight"][tokens]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = norm(x, w[p + "attention_norm.weight"])
        q = lin(h, p + "attention.wq").view(n, cfg.n_heads, hd).transpose(0, 1)
        k = lin(h, p + "attention.wk").view(n, cfg.n_kv_heads, hd).transpose(0, 1)
        v = lin(h, p + "attention.wv").view(n, cfg.n_kv_heads, hd).transpose(0, 1)
        rep = cfg.n_heads // cfg.n_kv_heads
        q, k, v = rope(q), rope(k).repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + lin((att @ v).transpose(0, 1).reshape(n, -1), p + "attention.wo")
        h = norm(x, w[p + "ffn_norm.weight"])
        ff = torch.nn.functional.silu(lin(h, p + "feed_forward.w1")) * lin(h, p + "feed_forward.w3")
        x = x + lin(ff, p + "feed_forward.w2")
    x = norm(x, w["norm.weight"])
    head = w["tok_embeddings.weight"] if cfg.tie_embeddings else w["output.weight"]
    return x @ head.T


@pytest.mark.parametrize("arch,bias", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False)])
def test_to_hf_model_matches_reference(arch: str, bias: bool) -> None:
    cfg = random_tiny_config(arch, qkv_bias=bias)
    sd = random_state_dict(cfg, seed=7)
    model = to_hf_model(cfg, sd, torch.float32)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "mistral": "MistralForCausalLM"}[arch]
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = model(tokens[None]).logits[0]
    ref = reference_logits(cfg, sd, tokens)
    assert torch.allclose(hf.double(), ref, atol=1e-4, rtol=1e-4), (hf.double() - ref).abs().max()
    if cfg.tie_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_gguf_llama_logits_match_original_weights(tmp_path: Path) -> None:
    """End to end: llama.cpp-permuted GGUF -> loader -> transformers gives the original model's logits."""
    cfg = random_tiny_config("llama")
    sd = random_state_dict(cfg, seed=8)
    path = write_llama_cpp_style(tmp_path / "e2e.gguf", cfg, sd, "F32")
    cfg2, sd2 = load_gguf(path, torch.float32)
    tokens = torch.arange(10)
    assert torch.allclose(reference_logits(cfg2, sd2, tokens), reference_logits(cfg, sd, tokens))


# ----------------------------------------------------------------------------- lazy decoding


def test_lazy_gguf_decodes_each_weight_when_taken(tmp_path: Path) -> None:
    """load_gguf(lazy=True) gives the eager load's weights (llama.cpp's permuted q/k undone too), each
    decoded only when taken; a file cut in its tensor data fails as the eager load does."""
    cfg = random_tiny_config("llama", qkv_bias=True)
    path = write_llama_cpp_style(tmp_path / "lazy.gguf", cfg, random_state_dict(cfg, seed=4), "Q8_0")
    _, eager = load_gguf(path, torch.float32)
    _, lazy = load_gguf(path, torch.float32, lazy=True)
    assert set(lazy) == set(eager) and lazy.pending == set(eager)
    assert torch.equal(lazy["layers.0.attention.wq.weight"], eager["layers.0.attention.wq.weight"])
    assert lazy.pending == set(eager) - {"layers.0.attention.wq.weight"}
    for name in list(lazy):
        assert torch.equal(lazy.pop(name), eager[name]), name
    assert not lazy and not lazy.pending
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        _, part = load_gguf(cut, torch.float32, lazy=True)
        for name in list(part):
            part.pop(name)


def test_q4_lite_build_from_a_lazy_load_equals_the_eager_one(tmp_path: Path) -> None:
    """q4-lite requantises each layer as load_canonical puts it in place: from a lazily decoded state
    dict (what Engine loads drafts from) the model is the one an eager load builds, bit for bit."""
    from specwood.models.transformer import build_model
    from specwood.engine.api import q4_runs_here

    if not q4_runs_here("cpu"):
        pytest.skip("the q4 kernels need AVX2 or AVX512 here")
    cfg = random_tiny_config("qwen2")
    path = write_gguf(tmp_path / "lite.gguf", cfg, random_state_dict(cfg, seed=5), "Q8_0")
    models = [build_model(cfg, load_gguf(path, torch.float32, lazy=lazy)[1], torch.float32, q4_lite=True,
                          q4_embeddings=True, consume=True, max_positions=64) for lazy in (False, True)]
    tokens = torch.tensor([[3, 17, 99, 5, 42]])
    logits = [m(tokens, torch.arange(5)) for m in models]
    assert torch.equal(logits[0], logits[1])
