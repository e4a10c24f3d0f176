"""GGUF files with malformed headers fail with one ModelFileError, never a traceback or an
allocation without bound: targeted bad metadata (strings, zeros, floats and absurd values where
counts belong, nested arrays, a block count the tensors do not have) and seeded random byte
flips over the whole header."""
from __future__ import annotations

import logging
import random

import pytest

from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.gguf_file import config_from_gguf, read_gguf_header
from specwood.models.loader import load_checkpoint
from specwood.models.testing import random_state_dict, random_tiny_config, write_gguf

CFG = random_tiny_config("qwen2")
SD = random_state_dict(CFG, seed=0)
ARCH = "qwen2"

BAD_METADATA = [
    ({f"{ARCH}.attention.head_count": "four"}, "head_count"),
    ({f"{ARCH}.attention.head_count": 0}, "head_count"),
    ({f"{ARCH}.attention.head_count": 2.5}, "head_count"),
    ({f"{ARCH}.attention.head_count_kv": 3}, "not a multiple"),  # of the 4 heads
    ({f"{ARCH}.block_count": 4_000_000_000}, "block_count"),
    ({f"{ARCH}.block_count": 1}, "block_count"),  # the file holds 2 layers
    ({f"{ARCH}.block_count": "2"}, "block_count"),
    ({f"{ARCH}.embedding_length": 0}, "embedding_length"),
    ({f"{ARCH}.context_length": 4_000_000_000}, "context_length"),
    ({f"{ARCH}.rope.freq_base": "big"}, "freq_base"),
    ({f"{ARCH}.attention.layer_norm_rms_epsilon": -1.0}, "epsilon"),
    ({f"{ARCH}.feed_forward_length": 0}, "feed_forward_length"),
    ({"general.alignment": 3}, "alignment"),
    ({"some.nested": [[1, 2], [3]]}, "nested array"),
]


@pytest.fixture(autouse=True)
def _quiet_gguf_writer():
    logging.getLogger("gguf").setLevel(logging.ERROR)  # "Duplicated key name": on purpose here


@pytest.mark.parametrize("metadata,needle", BAD_METADATA, ids=[n for _, n in BAD_METADATA])
def test_malformed_metadata_is_one_model_file_error(tmp_path, metadata, needle):
    path = write_gguf(tmp_path / "bad.gguf", CFG, SD, "F32", extra_metadata=metadata)
    with pytest.raises(ModelFileError, match=needle) as e:
        load_checkpoint(str(path))
    assert "\n" not in str(e.value) and str(e.value).startswith(str(path))


def test_random_header_corruption_never_escapes_as_another_error(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf", CFG, SD, "F32")
    good = path.read_bytes()
    header_end = read_gguf_header(path).data_offset
    rnd = random.Random(2026)
    outcomes = {"ok": 0, "refused": 0}
    bad = tmp_path / "fuzz.gguf"
    for _trial in range(400):
        data = bytearray(good)
        for _ in range(rnd.choice((1, 2, 4, 16))):
            i = rnd.randrange(header_end)
            data[i] = rnd.randrange(256) if rnd.random() < 0.7 else data[i] ^ (1 << rnd.randrange(8))
        if rnd.random() < 0.2:  # or cut it short
            data = data[: rnd.randrange(len(data))]
        bad.write_bytes(bytes(data))
        try:
            config_from_gguf(read_gguf_header(bad))
            outcomes["ok"] += 1
        except SpecwoodError as e:
            assert "\n" not in str(e) and str(e), e
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100, outcomes  # most corruptions are seen; the rest parse to a valid header
