"""The Python API: `specwood.load(...)` returns an Engine whose `generate` runs any method."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch

from specwood.engine.autoregressive import autoregressive_steps
from specwood.engine.output import GenerationResult, OutputStream
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.models.config import ModelConfig
from specwood.models.transformer import Transformer, build_model, int4_available
from specwood.sampling import SamplingParams

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
# tokens that end a turn in the chat templates of the families we run
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")


@functools.cache
def cpu_has_bf16() -> bool:
    """True on CPUs with native bf16 dot products (AVX512-BF16 or AMX), where bf16 is fast."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") or cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise SpecwoodError(f"unknown dtype '{dtype}' (use bf16 or fp32)")
    return DTYPES[dtype]


def check_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecwoodError(f"device '{device}' requested but CUDA is not available (use --device cpu)")
    try:
        torch.device(device)
    except RuntimeError:
        raise SpecwoodError(f"unknown device '{device}' (use cpu or cuda[:N])") from None
    return device


class Engine:
    """A loaded target (and optional draft) model plus tokenizer; `generate` runs one request."""

    def __init__(self, target: Transformer, tokenizer: Any, *, draft: Transformer | None = None,
                 target_name: str = "", draft_name: str | None = None, max_context: int | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.draft_model = draft
        self.target_name = target_name
        self.draft_name = draft_name
        self.max_context = min(max_context or target.max_positions, target.max_positions)
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise SpecwoodError(
                f"draft vocabulary ({draft.config.vocab_size} tokens, {draft_name}) differs from the target's "
                f"({target.config.vocab_size} tokens, {target_name}); pick a draft from the same model family"
            )
        self.eos_token_ids = self._eos_ids()

    @property
    def target_config(self) -> ModelConfig:
        return self.target.config

    @property
    def draft_config(self) -> ModelConfig | None:
        return self.draft_model.config if self.draft_model is not None else None

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def _eos_ids(self) -> set[int]:
        ids = set(self.target.config.eos_token_ids)
        tok = self.tokenizer
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        vocab = tok.get_vocab()
        ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
        return {i for i in ids if i < self.target.config.vocab_size}

    def encode(self, prompt: str | list[dict[str, str]], raw: bool = False) -> list[int]:
        """Token ids for a prompt: chat messages (or a user string) through the chat template, or raw text."""
        tok = self.tokenizer
        if isinstance(prompt, str) and (raw or not getattr(tok, "chat_template", None)):
            return list(tok.encode(prompt, add_special_tokens=True))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise SpecwoodError("messages must be a list of {'role': ..., 'content': ...} objects")
        if not getattr(tok, "chat_template", None):
            raise SpecwoodError("this model's tokenizer has no chat template; pass a plain prompt with raw=True (--raw)")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    def generate(
        self,
        prompt: str | list[dict[str, str]],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        method: str = "ar",
        raw: bool = False,
        on_text: Callable[[str], None] | None = None,
        **method_options: Any,
    ) -> GenerationResult:
        """Generate a completion with `method` ("ar" or a speculative method). Lossless: every method
        emits exactly what "ar" emits under greedy decoding, and samples the same distribution."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise SpecwoodError(f"max_tokens must be a positive integer, got {max_tokens}")
        prompt_ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else self.encode(prompt, raw)
        if not prompt_ids:
            raise SpecwoodError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_context}; shorten the prompt"
            )
        max_tokens = min(max_tokens, self.max_context - len(prompt_ids))
        stop = [stop] if isinstance(stop, str) else stop
        out = OutputStream(self.tokenizer, len(prompt_ids), max_tokens, self.eos_token_ids, stop, on_text)
        generator = params.generator(self.device) if not params.greedy else None
        steps, extra_stats = self._steps(method, prompt_ids, max_tokens, params, generator, method_options)
        with torch.inference_mode():
            for tokens in steps:
                if out.push_step(tokens):
                    break
        steps.close()
        return out.finish(method, extra_stats())

    def _steps(self, method: str, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
               generator: torch.Generator | None, options: dict[str, Any]):
        if method == "auto":  # the planner's choice for this hardware and context; may be plain decoding
            from specwood.planner import auto_components

            components = auto_components(self, options, prompt_len=len(prompt_ids), max_tokens=max_tokens)
            decided = "ar" if components is None else "sd"
            steps, stats = (self._steps("ar", prompt_ids, max_tokens, params, generator, {}) if components is None
                            else self._speculative_steps(components, prompt_ids, max_tokens, params, generator))
            return steps, lambda: {**stats(), "auto": decided}  # stats say what auto decided
        if method == "ar":
            if options:
                raise SpecwoodError(f"method 'ar' takes no options (got {', '.join(sorted(options))})")
            cache = self.target.new_cache(len(prompt_ids) + max_tokens + 1)
            return autoregressive_steps(self.target, cache, prompt_ids, params, generator), dict
        from specwood.engine.speculative import build_method  # imported late: heavier

        return self._speculative_steps(build_method(self, method, options), prompt_ids, max_tokens, params, generator)

    def _speculative_steps(self, components: tuple[Any, Any], prompt_ids: list[int], max_tokens: int,
                           params: SamplingParams, generator: torch.Generator | None):
        from specwood.engine.speculative import speculative_run

        source, shape = components
        return speculative_run(self.target, source, shape, prompt_ids, max_tokens, params, generator)

def load(
    target: str | os.PathLike[str] | None = None,
    draft: str | os.PathLike[str] | None = "auto",
    *,
    dtype: str | torch.dtype = "auto",
    draft_dtype: str = "auto",
    device: str = "cpu",
    max_context: int | None = None,
    progress: bool = True,
) -> Engine:
    """Load a target model (a registry name, a .gguf file or a Hugging Face folder) and a draft.

    draft="auto" picks the registry's default draft for a registry target (none otherwise);
    draft=None loads no draft. draft_dtype="auto" runs the draft with int4 weights on CPUs
    (bf16 activations; drafting never affects the output, only the speed) and in the target's
    dtype elsewhere; "int4", "bf16", "fp32" force one.
    """
    from specwood.models.loader import load_checkpoint, load_tokenizer
    from specwood.models.registry import DEFAULT_TARGET, default_draft_for

    device = check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    target = str(target or DEFAULT_TARGET)
    if draft == "auto":
        draft = default_draft_for(target)
    cfg, sd, path = load_checkpoint(target, dtype=torch_dtype)
    positions = min(max_context, cfg.max_position_embeddings) if max_context else cfg.max_position_embeddings
    model = build_model(cfg, sd, torch_dtype, device, max_positions=positions)
    del sd
    tokenizer = load_tokenizer(path)
    draft_model = None
    if draft is not None:
        int4 = draft_dtype == "int4" or (draft_dtype == "auto" and device == "cpu" and int4_available())
        ddtype = torch.bfloat16 if int4 else torch_dtype if draft_dtype == "auto" else resolve_dtype(draft_dtype, device)
        dcfg, dsd, _ = load_checkpoint(str(draft), dtype=ddtype)
        draft_model = build_model(dcfg, dsd, ddtype, device, max_positions=positions, int4=int4)
        del dsd
    return Engine(model, tokenizer, draft=draft_model, target_name=target,
                  draft_name=str(draft) if draft is not None else None, max_context=max_context)
