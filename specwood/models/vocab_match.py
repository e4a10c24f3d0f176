"""Whether a draft model speaks the target's vocabulary: the same token string at every id.

Speculation hands the draft's token ids to the target as they are, so a draft whose id 1234 is
another string than the target's would propose nonsense (never wrong output: the target verifies
every token, but nothing would be accepted). Equal vocabulary sizes do not prove it (Qwen2.5 and
Llama 3 pad differently; two families may both have 151,936 rows). The token strings are read from
the GGUF's `tokenizer.ggml.tokens` (a scan of the header, ~0.1 s for 150k tokens, where gguf's own
reader takes 12 s to open the file) or a Hugging Face folder's tokenizer.json.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

from specwood.errors import ModelFileError, SpecwoodError
from specwood.models.gguf_file import _ARRAY, _STRING, GGUF_MAGIC, _Cursor


def vocabulary(path: str | os.PathLike[str]) -> list[str] | None:
    """The token string of each id (a GGUF file or an HF folder), None where the file holds none."""
    path = Path(path)
    if path.is_dir():
        return _tokenizer_json_vocabulary(path / "tokenizer.json")
    return _gguf_vocabulary(path)


def check_same_vocabulary(target: str | os.PathLike[str], draft: str | os.PathLike[str],
                          target_name: str, draft_name: str) -> None:
    """SpecwoodError in one line when the draft's token strings differ from the target's at some
    id both have (ids past the shorter list are padding and never drafted)."""
    t, d = vocabulary(target), vocabulary(draft)
    if t is None or d is None:
        return  # a file without its vocabulary: the sizes are still checked when the engine is built
    n = min(len(t), len(d))
    differ = next((i for i in range(n) if t[i] != d[i]), None)
    if differ is None:
        return
    count = sum(t[i] != d[i] for i in range(n))
    raise SpecwoodError(
        f"the draft '{draft_name}' ({len(d)} tokens) does not share the vocabulary of the target '{target_name}' "
        f"({len(t)} tokens): {count} ids differ, the first {differ} ({t[differ]!r} in the target, {d[differ]!r} in "
        "the draft); pick a draft of the target's model family, or --draft none (model-free drafts: suffix, auto)")


def _gguf_vocabulary(path: Path) -> list[str] | None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if size < 24 or mm[:4] != GGUF_MAGIC:
                return None
            cur = _Cursor(mm, path, size)
            cur.pos = 8
            _, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
            for _ in range(min(n_kv, size)):
                key = cur.string()
                vtype = cur.scalar("<I")
                if key == "tokenizer.ggml.tokens" and vtype == _ARRAY:
                    etype, count = cur.scalar("<I"), cur.scalar("<Q")
                    if etype != _STRING or count > size:
                        return None
                    return [cur.string() for _ in range(count)]
                cur.value(vtype, key, {})
    except (OSError, ValueError, ModelFileError):
        return None  # the loader reports a bad file in its own words
    return None


def _tokenizer_json_vocabulary(path: Path) -> list[str] | None:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    by_id: dict[int, str] = {}
    if isinstance(vocab, dict):  # BPE / WordPiece: token -> id
        by_id.update((int(i), str(t)) for t, i in vocab.items())
    elif isinstance(vocab, list):  # Unigram: [token, score] at each id
        by_id.update((i, str(entry[0])) for i, entry in enumerate(vocab) if entry)
    else:
        return None
    for added in spec.get("added_tokens") or []:
        by_id[int(added["id"])] = str(added["content"])
    if not by_id:
        return None
    return [by_id.get(i, "") for i in range(max(by_id) + 1)]
