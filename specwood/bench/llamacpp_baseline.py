"""The `llama.cpp` baseline: llama.cpp's own plain decoding of the target's GGUF file.

llama-cpp-python's `Llama.generate` (its eval + sampler chain, greedy at temperature 0) on the very
file the engine loaded, with as many threads as torch uses, fed the token ids specwood's chat
template produces. Timing goes through the engine's own OutputStream (start after tokenising,
first token = TTFT, tokens/s over the tokens after the first, incremental detokenisation per
token), so the numbers mean what they mean for every engine method.
"""
from __future__ import annotations

import time
from typing import Any

from specwood.engine.output import OutputStream
from specwood.engine.protocols import EngineLike
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.models.llamacpp import default_threads, gguf_path, import_llama_cpp

LLAMACPP_METHODS = ("llama.cpp",)
MAX_CTX = 8192  # KV cache size: the bench's prompts + new tokens fit easily; the model's 32k would cost ~1 GB


class LlamaCppBaseline:
    """Loads the engine's target GGUF into llama.cpp once and times plain generations on it."""

    def __init__(self, engine: EngineLike, n_threads: int | None = None) -> None:
        lc = import_llama_cpp()
        name = getattr(engine, "target_name", None)
        if not name:
            raise SpecwoodError("method 'llama.cpp' needs the engine's target file (load it with specwood.load)")
        self.engine = engine
        self.path = gguf_path(name)
        self.n_threads = n_threads or default_threads()
        self.n_ctx = min(int(getattr(engine, "max_context", None) or MAX_CTX), MAX_CTX)
        try:
            self.llm = lc.Llama(str(self.path), n_ctx=self.n_ctx, n_threads=self.n_threads,
                                n_threads_batch=self.n_threads, n_gpu_layers=0, verbose=False)
        except ValueError as e:  # llama-cpp-python's way of saying the file did not load
            raise SpecwoodError(f"{self.path}: llama.cpp cannot load it ({e})") from None
        self.version = getattr(lc, "__version__", None)

    def settings(self) -> dict[str, Any]:
        """What run.json records about this baseline."""
        return {"llama_cpp_python": self.version, "gguf": str(self.path), "n_threads": self.n_threads,
                "n_ctx": self.n_ctx, "decoding": "Llama.generate (llama.cpp sampler chain), no prompt cache"}

    def _without_padding(self) -> Any:
        """A logits processor that never lets llama.cpp choose the ids past the tokenizer's
        (`engine.emit_limit`), as our sampler and the HF baseline do, so `= ar` compares like with
        like; None when the vocabulary has no padding."""
        limit = getattr(self.engine, "emit_limit", None)
        if limit is None:
            return None

        def mask(_ids: Any, scores: Any) -> Any:
            scores[limit:] = -float("inf")
            return scores

        return import_llama_cpp().LogitsProcessorList([mask])

    def generate(self, method: str, content: Any, raw: bool, max_tokens: int,
                 sampling: dict[str, Any]) -> dict[str, Any]:
        if method not in LLAMACPP_METHODS:
            raise SpecwoodError(f"unknown llama.cpp method '{method}'")
        t_call = time.perf_counter()
        ids = list(self.engine.encode(content, raw=raw))
        if len(ids) >= self.n_ctx:
            raise ContextLengthError(f"prompt has {len(ids)} tokens but the llama.cpp context holds {self.n_ctx}")
        max_tokens = min(max_tokens, self.n_ctx - len(ids))  # the engine's context rule
        temperature = float(sampling.get("temperature") or 0.0)
        if sampling.get("seed") is not None:
            self.llm.set_seed(int(sampling["seed"]))
        out = OutputStream(self.engine.tokenizer, len(ids), max_tokens, set(self.engine.eos_token_ids))
        self.llm.reset()  # n_tokens = 0: the whole prompt is evaluated again, as the engine does
        gen = self.llm.generate(ids, temp=temperature, top_k=int(sampling.get("top_k") or 0),
                                top_p=float(sampling.get("top_p") or 1.0), min_p=0.0, typical_p=1.0,
                                repeat_penalty=1.0, reset=True, logits_processor=self._without_padding())
        try:
            for token in gen:
                if out.push_step([int(token)]):
                    break
        finally:
            gen.close()
        res = out.finish(method)
        s = res.stats
        return {
            "token_ids": list(res.token_ids),
            "text": res.text,
            "prompt_tokens": len(ids),
            "wall_s": time.perf_counter() - t_call,
            "ttft_s": s.get("ttft_s"),
            "tokens_per_s": s.get("tokens_per_s"),
            "tbt_ms_p50": s.get("tbt_ms_p50"),
            "mean_accepted_tokens": None,
            "acceptance_rate": None,
        }
