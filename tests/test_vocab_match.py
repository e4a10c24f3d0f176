"""A draft whose vocabulary is not the target's is refused at load, in one line naming both; the
token strings are read from tokenizer.json (HF folders) and from the GGUF header."""
from __future__ import annotations

import json
import shutil

import pytest

from specwood.engine.api import load
from specwood.errors import SpecwoodError
from specwood.models.testing import tiny_pair_folders
from specwood.models.vocab_match import check_same_vocabulary, vocabulary


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target, draft = tiny_pair_folders(root)
    other = root / "other"
    shutil.copytree(draft, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two ordinary tokens change places: same size, other strings
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    return target, draft, other


def test_the_same_family_passes_and_another_vocabulary_is_one_line(folders):
    target, draft, other = folders
    assert vocabulary(target) == vocabulary(draft) and len(vocabulary(target)) > 256
    check_same_vocabulary(target, draft, "t", "d")
    with pytest.raises(SpecwoodError) as e:
        load(target=str(target), draft=str(other), dtype="fp32", draft_dtype="fp32")
    msg = str(e.value)
    assert "\n" not in msg and str(other) in msg and str(target) in msg and "2 ids differ" in msg, msg
    engine = load(target=str(target), draft=str(draft), dtype="fp32", draft_dtype="fp32")
    assert engine.draft_model is not None


def test_gguf_vocabularies_are_read_from_the_header():
    from specwood.models.registry import ensure_model

    qwen = vocabulary(ensure_model("qwen2.5-coder-0.5b-instruct"))
    assert len(qwen) == 151_936 and qwen[:3] == ["!", '"', "#"]
    gemma = vocabulary(ensure_model("gemma3-270m"))
    assert len(gemma) == 262_144 and gemma[:3] == ["<pad>", "<eos>", "<bos>"]
    with pytest.raises(SpecwoodError, match="does not share the vocabulary"):
        check_same_vocabulary(ensure_model("qwen2.5-coder-1.5b-instruct"), ensure_model("gemma3-270m"),
                              "qwen2.5-coder-1.5b-instruct", "gemma3-270m")
