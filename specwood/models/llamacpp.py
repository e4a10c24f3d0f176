"""llama.cpp backend: one GGUF file run by llama.cpp through llama-cpp-python's low-level API.

The committed sequence lives in llama.cpp's KV cache as sequence 0 (positions 0..n_past-1). A token
tree is ONE `llama_decode`: node i sits at pos = n_past + depth(i) and belongs to the sequences of
the leaves below it (leaf k -> sequence k, so every root-to-leaf path is one sequence). llama.cpp's
causal mask lets a token see the cells that share a sequence with it and sit at an earlier or equal
position, which for a tree is exactly "the prefix and my ancestors". A node shared by several leaves
couples their sequences, which llama.cpp only accepts with a unified KV buffer (kv_unified=True).
After verification `commit(path)` keeps the accepted path's cells with seq_rm/seq_keep/seq_cp; no
token is decoded twice.

Rounding: on quantised files llama.cpp multiplies a batch of rows with other kernels than one row
(repacked weights from 4 rows, another path from 8), so a tree's logits equal the one-token ones
only to rounding, and greedy speculative output can leave the backend's own autoregressive output
where the top two logits are that close. `exact=True` trades speed for identical rounding: no
weight repacking, flash attention on, and batches split into ubatches of EXACT_UBATCH rows, which
this CPU's kernels compute exactly as they compute one row (tests/test_llamacpp_backend.py).

Logits come back as float32 torch tensors padded (with -inf) or trimmed to `vocab_size`, the torch
model's vocabulary (config.vocab_size = rows of token_embd; llama.cpp's n_vocab counts the tokenizer's
tokens, which can differ).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specwood.errors import ContextLengthError, ModelFileError, SpecwoodError

INSTALL_FIX = ("CMAKE_ARGS=\"$(python3 -m specwood.bench.llama_cpu_flags)\" pip install 'specwood[llamacpp]' "
               "(llama-cpp-python is built from source for this CPU's instruction sets, AMX off)")
_backend_ready = False
EXACT_UBATCH = 4  # rows per ubatch in exact mode (measured: 1..7 rows round alike, 8 do not)


def import_llama_cpp() -> Any:
    """The llama_cpp module, or a one-line SpecwoodError saying how to install it."""
    global _backend_ready
    try:
        import llama_cpp
    except (ImportError, OSError) as e:  # OSError: the package is there but its shared library is not
        raise SpecwoodError(f"the llama.cpp backend needs llama-cpp-python ({e}); fix: {INSTALL_FIX}") from None
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp logs to stderr otherwise
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


def gguf_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A registry name or a .gguf path -> the GGUF file llama.cpp reads (HF folders are refused)."""
    from specwood.models.registry import resolve_model

    path = resolve_model(name_or_path)
    if path.is_dir():
        raise ModelFileError(f"{path}: the llama.cpp backend reads .gguf files, not Hugging Face folders; "
                             "convert it with llama.cpp's convert_hf_to_gguf.py or use --backend torch")
    return path


def default_threads() -> int:
    """The thread count torch uses, so both backends get the same cores."""
    return max(1, torch.get_num_threads())


class _LoadedGGUF:
    """A GGUF file loaded by llama.cpp (the weights), shared by every context made from it."""

    def __init__(self, path: Path, exact: bool = False) -> None:
        lc = self._lc = import_llama_cpp()
        self.path = path
        self.exact = exact
        if not path.is_file():
            raise ModelFileError(f"{path}: no such GGUF file")
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0  # a CPU backend; llama.cpp's GPU builds are out of scope
        mparams.use_extra_bufts = not exact  # repacked weights: faster batches, other rounding
        # read the file into llama.cpp's buffers instead of mapping it: the repacked tensors are
        # copies, and with the file mapped too both stayed resident (1.06 GB mapped + 0.66 GB
        # repacked for the 1.0 GB target file; BENCHMARKS.md §7e)
        if any(name == "load_mode" for name, _ in mparams._fields_):
            mparams.load_mode = lc.LLAMA_LOAD_MODE_NONE
        else:  # llama-cpp-python before the load modes
            mparams.use_mmap = False
        self.handle = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.handle:
            raise ModelFileError(f"{path}: llama.cpp cannot load this file (not a GGUF model, an architecture "
                                 "or tensor type this llama.cpp build lacks, or a truncated file)")

    def __del__(self) -> None:  # after the last context made from it (each holds a reference)
        try:
            if getattr(self, "handle", None):
                self._lc.llama_model_free(self.handle)
                self.handle = None
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class LlamaCppModel:
    """A llama.cpp context over one GGUF file with prefill / tree forward / commit / rollback.

    `weights` shares the loaded file of another runner (`runner.weights`): a second context (its
    own KV cache) without loading the file again, as each request of a llama.cpp draft needs.
    `exact`: the same rounding for every batch size (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_seq_max: int = 16, n_batch: int = 512, vocab_size: int | None = None,
                 weights: _LoadedGGUF | None = None, exact: bool = False) -> None:
        self._ctx: Any = None  # llama.cpp's context and batch (ctypes handles)
        self._batch: Any = None
        lc = self._lc = import_llama_cpp()
        self.weights: _LoadedGGUF | None = weights or _LoadedGGUF(Path(path), exact)
        self.exact = self.weights.exact
        self.path = self.weights.path
        self._model = self.weights.handle
        self.n_threads = n_threads or default_threads()
        self.n_ctx = min(n_ctx, lc.llama_model_n_ctx_train(self._model) or n_ctx)
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch  # one ubatch per tree: a tree is one forward
        if self.exact:
            cparams.n_ubatch = EXACT_UBATCH
            cparams.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED: the same attention kernel for every batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.kv_unified = True  # coupled sequences (tree nodes shared by several leaves) need it
        cparams.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise SpecwoodError(f"{self.path}: llama.cpp could not create a context of {self.n_ctx} tokens "
                                "(out of memory?); fix: a smaller --max-context")
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model)))
        self.vocab_size = vocab_size or self.n_vocab
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, n_seq_max)
        self.n_past = 0  # committed tokens (sequence 0)
        self._tree_seqs: list[list[int]] | None = None  # per node of the last tree: its sequences
        self._tree_parents: list[int] = []

    @classmethod
    def open(cls, name_or_path: str | os.PathLike[str], *, n_ctx: int = 4096, n_threads: int | None = None,
             n_seq_max: int = 16, n_batch: int = 512, vocab_size: int | None = None,
             exact: bool = False) -> "LlamaCppModel":
        """A registry name or .gguf path -> a runner (the model files are assembled as for torch)."""
        import_llama_cpp()  # the missing extra is the likelier mistake: say so before touching files
        return cls(gguf_path(name_or_path), n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_seq_max,
                   n_batch=n_batch, vocab_size=vocab_size, exact=exact)

    # --- plumbing ---------------------------------------------------------------------------------

    def decode_batch(self, tokens: Sequence[int], pos: Sequence[int], seqs: Sequence[Sequence[int]],
                     outputs: Sequence[bool]) -> None:
        """One llama_decode: token i at position pos[i] in sequences seqs[i]; logits where outputs[i]."""
        b = self._batch
        n = len(tokens)
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = pos[i]
            b.n_seq_id[i] = len(seqs[i])
            for j, s in enumerate(seqs[i]):
                b.seq_id[i][j] = s
            b.logits[i] = outputs[i]
        b.n_tokens = n
        rc = self._lc.llama_decode(self._ctx, b)
        if rc == 1:
            raise ContextLengthError(f"llama.cpp KV cache full ({self.n_ctx} tokens); fix: a larger context")
        if rc != 0:
            raise SpecwoodError(f"llama_decode failed with code {rc} on a batch of {n} tokens")

    def output_logits(self, rows: int) -> torch.Tensor:
        """The last decode's output rows (batch order) as float32 [rows, vocab_size]."""
        ptr = self._lc.llama_get_logits(self._ctx)
        out = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy())
        if self.vocab_size < self.n_vocab:
            return out[:, : self.vocab_size].contiguous()
        if self.vocab_size > self.n_vocab:  # ids the tokenizer lacks are never predicted
            pad = torch.full((rows, self.vocab_size - self.n_vocab), float("-inf"))
            return torch.cat([out, pad], dim=1)
        return out

    def check_room(self, n: int) -> None:
        if self.n_past + n > self.n_ctx:
            raise ContextLengthError(f"{self.n_past} + {n} tokens do not fit the llama.cpp context of {self.n_ctx}")

    # --- the runner interface ---------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` to the committed sequence; logits after the last one, [vocab_size]."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise SpecwoodError("prefill needs at least one token")
        self._discard_tree()
        self.check_room(len(tokens))
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i:i + self.n_batch]
            last = i + len(chunk) == len(tokens)
            self.decode_batch(chunk, range(self.n_past, self.n_past + len(chunk)), [[0]] * len(chunk),
                         [last and k == len(chunk) - 1 for k in range(len(chunk))])
            self.n_past += len(chunk)
        return self.output_logits(1)[0]

    def decode_one(self, token: int) -> torch.Tensor:
        """One plain autoregressive step: append `token`, return the logits after it."""
        self._discard_tree()
        self.check_room(1)
        self.decode_batch([int(token)], [self.n_past], [[0]], [True])
        self.n_past += 1
        return self.output_logits(1)[0]

    def forward_tree(self, tree: Any, parents: Sequence[int] | None = None) -> torch.Tensor:
        """Logits after every node of a token tree rooted at position n_past, [n, vocab_size].

        `tree` is a TokenTree (or a token list with `parents`, parents[0] == -1, parents before
        children). The tree stays in the cache, uncommitted, until `commit` or `rollback`.
        """
        tokens = [int(t) for t in (tree.tokens if parents is None else tree)]
        parents = list(tree.parents if parents is None else parents)
        n = len(tokens)
        if n == 0 or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise SpecwoodError("a tree needs a root (parents[0] == -1) and every parent before its children")
        if n > self.n_batch:
            raise SpecwoodError(f"a tree of {n} nodes exceeds the llama.cpp batch of {self.n_batch}")
        self._discard_tree()
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        self.check_room(max(depth) + 1)
        has_child = set(parents[1:])
        leaves = [i for i in range(n) if i not in has_child]
        if len(leaves) > self.n_seq_max:
            raise SpecwoodError(f"a tree with {len(leaves)} leaves needs n_seq_max >= {len(leaves)} "
                                f"(this runner has {self.n_seq_max}); lower --budget")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for s, leaf in enumerate(leaves):
            node = leaf
            while node != -1:
                seqs[node].append(s)
                node = parents[node]
        for s in range(1, len(leaves)):  # every leaf sequence sees the committed prefix
            self.share_prefix(0, s)
        self._tree_seqs, self._tree_parents, self._tree_tokens = seqs, parents, tokens
        self.decode_batch(tokens, [self.n_past + d for d in depth], seqs, [True] * n)
        return self.output_logits(n)

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of the last tree's nodes `path` (root first, each the parent of the next) as
        the continuation of sequence 0; drop every other node. No token is decoded again."""
        if self._tree_seqs is None:
            raise SpecwoodError("commit() needs a forward_tree() first")
        path = [int(p) for p in path]
        n = len(self._tree_seqs)
        if (not path or path[0] != 0 or any(not 0 <= p < n for p in path)
                or any(self._tree_parents[b] != a for a, b in zip(path, path[1:]))):
            raise SpecwoodError(f"nodes {path} are not a root-to-node path of the last tree")
        if self.exact and path != list(range(len(path))):  # decode the path again in order: its cells
            # then sit in position order, as plain decoding leaves them (attention sums in cell order)
            tokens = [self._tree_tokens[p] for p in path]
            self.rollback(self.n_past)
            self.decode_batch(tokens, range(self.n_past, self.n_past + len(tokens)), [[0]] * len(tokens),
                              [False] * len(tokens))
            self.n_past += len(tokens)
            return
        # the sequence of some leaf below the last accepted node holds the whole path
        self.keep_path(self._tree_seqs[path[-1]][0], self.n_past + len(path))

    def share_prefix(self, src: int, dst: int, end: int = -1) -> None:
        """Add sequence `dst` to the cells of sequence `src` at positions < `end` (all if end < 0)."""
        self._lc.llama_memory_seq_cp(self._mem, src, dst, -1, end)

    def keep_path(self, seq: int, end: int) -> None:
        """Make sequence `seq`'s cells at positions < `end` the committed sequence 0 and drop every
        other cell (the rest of that branch, the other branches, the other sequence ids)."""
        mem, lc = self._mem, self._lc
        lc.llama_memory_seq_rm(mem, seq, end, -1)
        lc.llama_memory_seq_keep(mem, seq)
        if seq != 0:
            lc.llama_memory_seq_cp(mem, seq, 0, -1, -1)
            lc.llama_memory_seq_rm(mem, seq, -1, -1)
        self.n_past = end
        self._tree_seqs = None

    def rollback(self, n: int) -> None:
        """Truncate the committed sequence to its first `n` tokens (and drop an uncommitted tree)."""
        if not 0 <= n <= self.n_past:
            raise SpecwoodError(f"cannot roll back to {n} tokens: {self.n_past} are committed")
        self._lc.llama_memory_seq_keep(self._mem, 0)
        self._lc.llama_memory_seq_rm(self._mem, 0, n, -1)
        self.n_past = n
        self._tree_seqs = None

    def reset(self) -> None:
        """An empty cache."""
        self._lc.llama_memory_clear(self._mem, True)
        self.n_past = 0
        self._tree_seqs = None

    def _discard_tree(self) -> None:
        if self._tree_seqs is not None:
            self.rollback(self.n_past)

    def close(self) -> None:
        lc = self._lc
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        self._model = self.weights = None  # the weights are freed with their last context

    @property
    def loaded(self) -> _LoadedGGUF:
        """Its loaded file, which other contexts over the same weights share (while it is open)."""
        if self.weights is None:
            raise RuntimeError(f"{self.path}: this llama.cpp context is closed")
        return self.weights

    def __enter__(self) -> "LlamaCppModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


def greedy_decode(model: LlamaCppModel, prompt: Sequence[int], max_tokens: int,
                  eos: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding on the runner (the backend's own autoregressive reference)."""
    model.reset()
    logits = model.prefill(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = int(torch.argmax(logits))
        if tok in eos:
            break
        out.append(tok)
        if len(out) < max_tokens:
            logits = model.decode_one(tok)
    return out
