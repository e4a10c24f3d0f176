"""The Python API: `specwood.load(...)` returns an Engine whose `generate` runs any method."""
from __future__ import annotations

import copy
import functools
import os
import sys
from dataclasses import replace
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from specwood.engine.chat import encode_chat
from specwood.engine.config import SchedulerConfig
from specwood.engine.executor import executor_name
from specwood.engine.executors import plugin_for
from specwood.engine.output import GenerationResult, OutputStream
from specwood.engine.protocols import Prompt, is_token_ids
from specwood.engine.request import Request
from specwood.engine.runner import RunnerExecutor
from specwood.engine.vocab import emit_limit
from specwood.engine.scheduler import Scheduler
from specwood.engine.sequential import SequentialExecutor
from specwood.errors import ContextLengthError, SamplingParamsError, SpecwoodError
from specwood.heap import release_freed_memory
from specwood.models.config import ModelConfig
from specwood.models.linears import int4_available
from specwood.models.transformer import Transformer, build_model, usable_exact, weights_taken_as_stored
from specwood.sampling import SamplingParams, split_sampling

if TYPE_CHECKING:
    from specwood.constrain.processors import Processors
    from specwood.methods import DrafterFactory

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


def eos_token_ids(tok: Any, config: ModelConfig) -> set[int]:
    """The ids that end a generation: the model's, the tokenizer's and the end-of-turn tokens of
    the chat templates we run, within the model's vocabulary."""
    ids = set(config.eos_token_ids)
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return {i for i in ids if i < config.vocab_size}


def encode_prompt(tok: Any, prompt: str | list[dict[str, Any]], raw: bool = False,
                  tools: list[dict[str, Any]] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids for a prompt: chat messages (or a user string) through the chat template, their
    contents as plain text (specwood.engine.chat), or raw text, whose special tokens' text parses.
    `tools` (OpenAI tool definitions) go to the template, which shows them to the model;
    `template_kwargs` are the template's own variables (Qwen3's `enable_thinking`)."""
    if isinstance(prompt, str) and (raw or not getattr(tok, "chat_template", None)):
        return list(tok.encode(prompt, add_special_tokens=True))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise SpecwoodError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not getattr(tok, "chat_template", None):
        raise SpecwoodError("this model's tokenizer has no chat template; "
                            "pass a plain prompt with raw=True (--raw)")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    return encode_chat(tok, messages, **extra)  # contents as plain text: no forged turns


class Engine:
    """A loaded target (and optional draft) model plus tokenizer; `generate` runs one request."""

    def __init__(self, target: Transformer, tokenizer: Any, *, draft: Transformer | None = None,
                 target_name: str = "", draft_name: str | None = None, max_context: int | None = None,
                 head: Transformer | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.draft_model = draft
        self.draft_head = head  # a feature-level draft head (specwood.drafting.head), method "head"
        self.target_name = target_name
        self.draft_name = draft_name
        self.max_context = min(max_context or target.max_positions, target.max_positions)
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise SpecwoodError(
                f"draft vocabulary ({draft.config.vocab_size} tokens, {draft_name}) differs from the target's "
                f"({target.config.vocab_size} tokens, {target_name}); pick a draft from the same model family"
            )
        self.eos_token_ids = self._eos_ids()
        # ids past the tokenizer's (a padded vocabulary) are never sampled nor emitted
        self.emit_limit = emit_limit(tokenizer, target.config.vocab_size)
        self._scheduler: Scheduler | None = None

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
        return eos_token_ids(self.tokenizer, self.target.config)

    def encode(self, prompt: str | list[dict[str, Any]], raw: bool = False,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids for a prompt (encode_prompt with this engine's tokenizer)."""
        return encode_prompt(self.tokenizer, prompt, raw, tools, template_kwargs)

    # --- requests -------------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The target's runtime: 'torch' or 'llama.cpp' (specwood.engine.backends)."""
        return getattr(self.target, "backend", "torch")

    @property
    def draft_backend(self) -> str | None:
        return getattr(self.draft_model, "backend", "torch") if self.draft_model is not None else None

    @property
    def scheduler(self) -> Scheduler:
        """The engine's own scheduler for `generate`: one cache row, grown while idle as needed."""
        if self._scheduler is None:
            self._scheduler = self.make_scheduler(SchedulerConfig(max_batch=1, row_len=256, growable=True))
        return self._scheduler

    def make_scheduler(self, config: SchedulerConfig = SchedulerConfig(),
                       drafts: tuple[Any, ...] | None = None) -> Scheduler:
        """A scheduler for this engine's target, as `config` says (specwood.engine.config):
        continuous batching on torch; on a runner-backed target (llama.cpp: one KV sequence)
        requests take turns, whatever `config.max_batch` says (and nothing is reused across
        requests). Under `config.kv_memory` rows grow up to the engine's context (and tree room)
        unless `config.row_len` says less. `drafts`: the draft models whose cache pools are made
        now (default: the engine's draft model and draft head; others get theirs on first use)."""
        runner = getattr(self.target, "runner", None)
        if runner is not None:
            return Scheduler(RunnerExecutor(runner), replace(config, max_batch=1))
        if drafts is None:
            drafts = tuple(m for m in (self.draft_model, self.draft_head) if m is not None)
        if config.budgeted and config.row_len is None:
            config = replace(config, row_len=int(self.max_context) + config.tree_room)
        return Scheduler(SequentialExecutor(self.target, config, drafts), config)

    def prepare(self, method: str, options: dict[str, Any] | None = None) -> "DrafterFactory":
        """Validate a method and its options once (`auto` loads its plan here)."""
        from specwood.methods import prepare_method

        return prepare_method(self, method, options)

    def new_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        max_tokens: int = 128,
        stop: list[str] | str | None = None,
        method: str = "ar",
        raw: bool = False,
        on_text: Callable[[str], None] | None = None,
        scheduler: Scheduler | None = None,
        prepared: "DrafterFactory | None" = None,
        on_finish: Callable[[Request], None] | None = None,
        request_id: str | None = None,
        cache_scope: str | None = "",
        **options: Any,
    ) -> Request:
        """A request ready to `submit` to `scheduler` (default: the engine's own). Raises a
        SpecwoodError for bad input (sampling parameters, lengths, methods and their options).

        `params`: how it samples (specwood.sampling.SamplingParams: temperature, top-k/p, seed, and
        the constraints and shaping of specwood.constrain, docs/structured.md: a grammar or a JSON
        schema, logit_bias, the presence/frequency/repetition penalties and min_p, as OpenAI/vLLM
        define them, logprobs); instead of `params` its fields may come as keyword arguments. The
        other `options` are the method's.

        `cache_scope`: requests reuse each other's work (K/V of a shared prefix, suffix drafts
        from earlier answers) only within one scope ("" by default: all share); None shares
        nothing with any other request. The server gives each tenant and `cache_salt` its own."""
        scheduler = scheduler or self.scheduler
        params, method_options = split_sampling(params, options)
        params = self.params_for_model(params)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise SpecwoodError(f"max_tokens must be a positive integer, got {max_tokens}")
        if is_token_ids(prompt):
            prompt_ids = prompt
            V = self.target.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < V for t in prompt_ids):
                raise SpecwoodError(f"prompt token ids must be integers in [0, {V})")
        else:
            prompt_ids = self.encode(prompt, raw)
        if not prompt_ids:
            raise SpecwoodError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_context}; shorten the prompt"
            )
        max_tokens = min(max_tokens, self.max_context - len(prompt_ids))
        scheduler.ensure_room(scheduler.room_for(len(prompt_ids), max_tokens))
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not all(isinstance(s, str) for s in stop):
            raise SpecwoodError("stop must be a string or a list of strings")
        factory = prepared if prepared is not None else self.prepare(method, method_options)
        load = scheduler.admission_load if isinstance(scheduler, Scheduler) else 1  # an executor alone: 1
        drafter = factory(scheduler.draft_source, len(prompt_ids), max_tokens, load, cache_scope)
        if drafter.shape is not None and params.seed is not None and not params.greedy:
            drafter.shape.repeatable()  # the same seed, the same trees: no choice by measured time (auto)
        out = OutputStream(self.tokenizer, len(prompt_ids), max_tokens, self.eos_token_ids, stop, on_text,
                           emit_limit=self.emit_limit)
        return Request(prompt_ids, max_tokens, params, drafter, out, method=method, device=self.device,
                       extra_stats=drafter.extra_stats, on_finish=on_finish, request_id=request_id,
                       processors=self.processors_for(params, prompt_ids, cache_scope), cache_scope=cache_scope)

    # --- constraints and shaping (specwood.constrain) -------------------------------------------

    def params_for_model(self, params: SamplingParams) -> SamplingParams:
        """`params` as this model samples them: its emit limit, the logit biases' ids checked
        against its vocabulary, a JSON schema compiled to a grammar (limits and one-line errors)."""
        V = self.target.config.vocab_size
        bad = next((token for token, _ in params.logit_bias if token >= V), None)
        if bad is not None:
            raise SamplingParamsError(f"logit_bias token id {bad} is outside the vocabulary [0, {V})")
        if params.json_schema is None:
            if params.emit_limit == self.emit_limit:
                return params  # already this model's
            # the model's own emit limit on validated parameters: a replace would re-validate every field
            # (~20 us a request)
            params = copy.copy(params)
            object.__setattr__(params, "emit_limit", self.emit_limit)
            return params
        from specwood.constrain.grammars import json_schema_grammar

        grammar = json_schema_grammar(dict(params.json_schema))  # (a grammar beside it is refused: SamplingParams)
        return replace(params, emit_limit=self.emit_limit, grammar=grammar, json_schema=None)

    def prepare_grammars(self) -> None:
        """Build llguidance's view of the tokenizer now (~1 s of Python on a 150k vocabulary,
        holding the GIL): a server does it at start, not inside its first grammar request. A
        tokenizer it cannot read is left alone (a grammar request then gets the error)."""
        from specwood.constrain.matcher import ll_tokenizer
        from specwood.errors import GrammarError

        try:
            ll_tokenizer(self.tokenizer, self.target.config.vocab_size, self.eos_token_ids)
        except GrammarError:
            pass

    def processors_for(self, params: SamplingParams, prompt_ids: list[int],
                       cache_scope: str | None = "") -> Processors | None:
        """The request's per-path logits processors, None when it has none (it then pays nothing).
        A grammar is compiled for this tokenizer here (once per cache scope: `grammar_matcher`): a
        bad one fails the request before it runs."""
        if not params.processed:
            return None
        from specwood.constrain.matcher import grammar_matcher, ll_tokenizer
        from specwood.constrain.processors import Processors

        V = self.target.config.vocab_size
        matcher = None
        if params.grammar is not None:
            matcher = grammar_matcher(ll_tokenizer(self.tokenizer, V, self.eos_token_ids), params.grammar, cache_scope)
        return Processors(params, prompt_ids, V, matcher, self.eos_token_ids)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        max_tokens: int = 128,
        stop: list[str] | str | None = None,
        method: str = "ar",
        raw: bool = False,
        on_text: Callable[[str], None] | None = None,
        executor: Any = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate a completion with `method` ("ar" or a speculative method): a batch of one on
        the same step the server batches. Lossless: every method emits exactly what "ar" emits
        under greedy decoding, and samples the same distribution.

        `params`: a SamplingParams (greedy by default), or its fields as keyword arguments
        (`temperature=0.7, seed=1`); the other `options` are the method's (see new_request).

        executor="parallel" (or a ParallelExecutor) runs DuoDecoding instead: method "duo" with
        the draft model in a worker process (options draft_device, draft_threads; see
        specwood.engine.parallel). executor=None lets the method choose: "auto" runs on the
        parallel executor where the stored plan measured it fastest, everything else sequentially.
        executor="pipeline" (or a PipelineExecutor) splits the target over pipeline stages (options
        stages, width, topk, threads; specwood.engine.specpipe.launch): method "specpipe" (or auto),
        "pp" (or ar), "specinfer" (or a tree shape name, with budget/depth). The constraints and
        shaping (`SamplingParams.shaping`) run on the sequential executor only."""
        params, method_options = split_sampling(params, options)
        shaped = params.shaping()
        if executor is None and shaped:
            executor = "sequential"  # where the processors run (auto's plan may pick another)
        if executor is None:
            executor, prompt = self._executor_for(method, prompt, raw, method_options)
            if executor == "parallel":
                method_options = {}  # auto's own options do not apply to duo
        name = executor_name(executor)
        if name == "sequential":
            request = self.new_request(prompt, params, max_tokens=max_tokens, stop=stop, method=method, raw=raw,
                                       on_text=on_text, **method_options)
            return self.run(request)
        if shaped:
            raise SpecwoodError(f"{', '.join(shaped)} run on the sequential executor, not '{name}'; drop executor=")
        from specwood.engine.backends import check_backends

        check_backends(self.backend, self.draft_backend or "torch", executor=name)
        generate = plugin_for(name).generate
        if generate is None:
            raise SpecwoodError(f"executor '{name}' does not run Engine.generate")
        return generate(self, executor, prompt, params, max_tokens=max_tokens, stop=stop, method=method, raw=raw,
                        on_text=on_text, **method_options)

    def _executor_for(self, method: str, prompt: Any, raw: bool, options: dict[str, Any]) -> tuple[str, Any]:
        """The executor a method picks for this prompt (sequential unless it chooses: auto follows
        the plan), and the prompt: as token ids once the choice needed its length, so that
        new_request does not encode it a second time."""
        from specwood.methods import get_method

        choose = get_method(method).choose_executor if self.draft_model is not None else None
        if choose is None:
            return "sequential", prompt
        ids = prompt if is_token_ids(prompt) else self.encode(prompt, raw)
        return choose(self, options, len(ids)), ids

    def run(self, request: Request) -> GenerationResult:
        """Submit a request to the engine's own scheduler and step until it is done."""
        self.scheduler.submit(request)
        self.scheduler.run_until_done([request])
        return request.outcome()


def _is_token_ids(prompt: Any) -> bool:
    """A prompt given as token ids (a list of ints; an empty list counts, and is refused later)."""
    return isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))


def check_q4(device: str) -> None:
    """The q4 weight mode's kernel runs here (CPU, AVX512-VNNI or AVX2, built), else one line saying what to use."""
    if not str(device).startswith("cpu"):
        raise SpecwoodError(f"the q4 weight mode runs on the CPU; with --device {device} use --dtype bf16")
    from specwood.models.w4a8 import require_q4

    require_q4()


def gguf_is_q4k(name_or_path: str | os.PathLike[str]) -> bool:
    """True for a GGUF model (a registry name or a file) whose layers' matmul weights are mostly Q4_K,
    or all in types the q4 mode runs as stored (llama.cpp's Q4_K_M of a small model such as Gemma 3
    270M keeps most of them in Q5_0 and Q8_0: on the kernels as stored, not decoded to bf16)."""
    from gguf.constants import GGMLQuantizationType as Q

    from specwood.models.gguf_file import canonical_name, read_gguf_header
    from specwood.models.canonical import layer_index
    from specwood.models.registry import resolve_model

    path = resolve_model(name_or_path)
    if path.is_dir():
        return False
    types = [info.ggml_type for gname, info in read_gguf_header(path).tensors.items()
             if (c := canonical_name(gname)) and c.endswith(".weight") and layer_index(c) is not None
             and len(info.shape) == 2]
    as_stored = {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0}  # gguf_kquants.kquant_weights
    return bool(types) and (2 * sum(t == Q.Q4_K for t in types) > len(types) or all(t in as_stored for t in types))


def row_exact_attention_here() -> bool:
    """Whether the layers' kernel (row-exact attention: a row's bits never depend on the other rows
    or the key count) can run on this CPU; without it attention runs on torch's SDPA, which is not."""
    from specwood.models.layer_ops import KERNEL as LAYER_KERNEL

    return not LAYER_KERNEL.missing_flags()


def q4_runs_here(device: str) -> bool:
    """Whether "auto" may pick the q4 weight mode: a CPU with the kernel's instructions, where the
    kernel builds (compiled here on first use). A failed build says so in one line; the caller
    keeps the older defaults (a float target, an int4 draft)."""
    from specwood.models.w4a8 import KERNEL

    if not str(device).startswith("cpu") or KERNEL.missing_flags():
        return False
    if KERNEL.load() is None:
        print(f"[load] {KERNEL.failure}; running without the q4 weight mode", file=sys.stderr)
        return False
    return True


def exact_q4_weights(path: Path, q4: bool, lite: bool = False) -> Mapping[str, Any] | None:
    """For the q4 weight modes: the GGUF's own quantised values the mode runs as stored
    (gguf_kquants.kquant_weights; with `lite` the Q4_K ones only; None for other sources and modes)."""
    if not q4 or path.is_dir():
        return None
    from specwood.models.gguf_kquants import kquant_weights

    return usable_exact(kquant_weights(path, q4k_only=lite), lite)


def left_in_file(exact: Mapping[str, Any] | None, lite: bool) -> Callable[[Any], set[str]] | None:
    """For load_checkpoint's `skip`: the weights a q4 build runs from `exact` are never decoded to floats
    (a 1.5B target's would be 6 GB in fp32, the default mode's load peak on an AVX2 CPU)."""
    if not exact:
        return None
    return lambda config: weights_taken_as_stored(config, exact, lite)


def weights_in_floats_note(path: Path, model: Any) -> str:
    """One line naming the weights the q4 mode keeps in floats, with their file types."""
    names = model.weights_in_floats
    types: dict[str, str] = {}
    if not path.is_dir():
        from gguf.constants import GGMLQuantizationType

        from specwood.models.gguf_file import canonical_name, read_gguf_header

        types = {c: GGMLQuantizationType(i.ggml_type).name
                 for g, i in read_gguf_header(path).tensors.items() if (c := canonical_name(g)) is not None}
    listed = ", ".join(f"{n} ({types.get(n, 'float')})" for n in names[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return (f"q4: no kernel for the type or shape of {listed}{more}; kept in "
            f"{str(model.dtype).removeprefix('torch.')} (dequantised from the file)")


def load(
    target: str | os.PathLike[str] | None = None,
    draft: str | os.PathLike[str] | None = "auto",
    *,
    dtype: str | torch.dtype = "auto",
    draft_dtype: str = "auto",
    device: str = "cpu",
    max_context: int | None = None,
    progress: bool = True,
    backend: str = "torch",
    draft_backend: str = "torch",
    head: str | os.PathLike[str] | None = None,
) -> Engine:
    """Load a target model (a registry name, a .gguf file or a Hugging Face folder) and a draft.

    draft="auto" picks the registry's default draft for a registry target (none otherwise);
    draft=None (or "none") loads no draft. On a CPU with AVX512-VNNI dtype="auto" is "q4" for a GGUF
    of Q4_K weights (the file's Q4_K and Q6_K weights as stored, the rest in bf16) and
    draft_dtype="auto" is "q4-lite" (every weight in 4 bits; q4_runs_here); otherwise dtype="auto"
    is bf16 where it is fast, else fp32, and draft_dtype="auto" runs the draft with int4 weights on
    CPUs (bf16 activations; drafting never affects the output, only the speed) and in the target's
    dtype elsewhere; "int4", "int8", "q4", "q4-lite", "bf16", "fp32" force one. dtype="int8" (and draft_dtype="int8")
    is W8A8: int8 weights and per-token int8 activations in the linears of the layers and the
    vocabulary head (see Int8Linear), activations in the "auto" dtype elsewhere; lossy against the
    float model, but every method stays token-identical to "ar" in that mode.

    backend / draft_backend: "torch" (default), "llama.cpp" (llama-cpp-python runs the GGUF file
    as it is, on the CPU; a llama.cpp target decodes one request at a time) or "auto" (llama.cpp
    for a GGUF model when llama-cpp-python is installed, else torch); see specwood.engine.backends.
    backend="auto" after `specwood plan --choose-config` loads the configuration measured fastest
    on this machine for the pair: both backends and, where dtype/draft_dtype are "auto", both
    weight modes.

    head: a feature-level draft head for method "head" (specwood.drafting.head): a file made by
    `specwood train-drafter` or an EAGLE-1/2 folder, for a torch target; it runs on the target's kernels.
    "auto" loads the head that ships with the package for a registry target, if there is one.
    """
    from specwood.engine.backends import LlamaCppDraft, LlamaCppTarget, RuntimeConfig, check_backends, resolve_runtime
    from specwood.models.loader import load_checkpoint, load_tokenizer
    from specwood.models.registry import DEFAULT_TARGET, default_draft_for, resolve_model

    device = check_device(device)
    if max_context is not None and max_context < 2:
        raise SpecwoodError(f"max_context (--max-context) must be >= 2 tokens, got {max_context}")
    target = str(target or DEFAULT_TARGET)
    if isinstance(draft, str) and draft.strip().lower() == "none":  # as on the command line
        draft = None
    if draft == "auto":
        draft = default_draft_for(target)
    runtime, note = resolve_runtime(RuntimeConfig(str(backend), str(dtype), str(draft_backend), str(draft_dtype)),
                                    target, draft, device)
    if note and progress:
        print(f"[load] {note}", file=sys.stderr)
    backend, draft_backend = runtime.backend, runtime.draft_backend
    if note:  # a measured choice sets the weight modes too
        dtype, draft_dtype = runtime.dtype, runtime.draft_dtype
    check_backends(backend, draft_backend, dtype=dtype, draft_dtype=draft_dtype, device=device)
    # "auto" is q4 where the kernel runs: for a target of Q4_K weights (the GGUF's own weights times
    # int8 activations, as llama.cpp computes them: 2.7x bf16's decode rate and a third of its
    # memory, BENCHMARKS §7m-§7o), and q4-lite for any draft (its precision changes speed, never
    # output; 4 bits are faster than int4 at every tree size, §7n)
    q4_target = dtype == "auto" and backend == "torch" and gguf_is_q4k(target)
    q4_draft = draft_dtype == "auto" and draft is not None and draft_backend == "torch"
    if (q4_target or q4_draft) and q4_runs_here(device):
        # a q4 target by default only where attention is row-exact too (layer_ops.cpp: AVX512 or AVX2);
        # on torch's attention a tree's node can round apart from a one-token step, so speculation
        # would not be token-identical to ar there (BENCHMARKS §25): --dtype q4 asks for it anyway
        q4_target = q4_target and row_exact_attention_here()
        dtype, draft_dtype = ("q4" if q4_target else dtype), ("q4-lite" if q4_draft else draft_dtype)
    if {"q4", "q4-lite"} & {dtype, draft_dtype}:  # before minutes of loading
        check_q4(device)
    if draft is not None:  # a draft of another vocabulary: one line now, not minutes of loading first
        from specwood.models.vocab_match import check_same_vocabulary

        check_same_vocabulary(resolve_model(target), resolve_model(str(draft)), str(target), str(draft))
    if device == "cpu" and "torch" in (backend, draft_backend):  # compiled while the model files are read
        from specwood.models.layer_ops import KERNEL as LAYER_KERNEL

        LAYER_KERNEL.build_in_background()
    int8, q4, q4_lite = dtype == "int8", dtype == "q4", dtype == "q4-lite"
    torch_dtype = resolve_dtype("auto" if int8 or q4 or q4_lite else dtype, device)
    if backend == "llama.cpp":
        model: Any = LlamaCppTarget(target, max_context)
        positions = model.max_positions
    else:
        exact = exact_q4_weights(resolve_model(target), q4 or q4_lite, q4_lite)
        cfg, sd, path = load_checkpoint(target, dtype=torch_dtype, skip=left_in_file(exact, q4_lite), lazy=q4_lite)
        positions = min(max_context, cfg.max_position_embeddings) if max_context else cfg.max_position_embeddings
        # the int8 head too: a step's vocabulary matmul in 7.6 instead of 13.7 ms (one row; BENCHMARKS §7f)
        model = build_model(cfg, sd, torch_dtype, device, max_positions=positions, int8=int8, int8_head=int8,
                            q4=q4, q4_lite=q4_lite, q4_exact=exact, consume=True)
        del sd, exact
        if model.weights_in_floats and progress:
            print(f"[load] {weights_in_floats_note(path, model)}", file=sys.stderr)
    release_freed_memory()  # the target's decoded copies: the draft's load peaks on top of what is left
    tokenizer = load_tokenizer(target)
    draft_model: Any = None
    if draft is not None and draft_backend == "llama.cpp":
        draft_model = LlamaCppDraft(str(draft), max_context or positions)
    elif draft is not None:
        int4 = draft_dtype == "int4" or (draft_dtype == "auto" and device == "cpu" and int4_available())
        dint8, dq4, dq4_lite = draft_dtype == "int8", draft_dtype == "q4", draft_dtype == "q4-lite"
        ddtype = (torch.bfloat16 if int4 else torch_dtype if draft_dtype in ("auto", "int8", "q4", "q4-lite")
                  else resolve_dtype(draft_dtype, device))
        dexact = exact_q4_weights(resolve_model(str(draft)), dq4 or dq4_lite, dq4_lite)
        # q4-lite decodes each weight as the build takes it and requantises each layer as it arrives
        dcfg, dsd, _ = load_checkpoint(str(draft), dtype=ddtype, skip=left_in_file(dexact, dq4_lite), lazy=dq4_lite)
        # a draft's precision changes speed, never output
        draft_model = build_model(dcfg, dsd, ddtype, device, max_positions=positions, int4=int4, int8=dint8,
                                  int8_head=dint8, q4=dq4, q4_lite=dq4_lite, q4_exact=dexact,
                                  q4_embeddings=dq4_lite, consume=True)
        del dsd, dexact
    draft_head = None
    if isinstance(head, str) and head.strip().lower() in ("auto", "none"):
        from specwood.drafting.head_files import shipped_head

        head = shipped_head(target) if head.strip().lower() == "auto" and backend == "torch" else None
    if head is not None:
        if backend != "torch":
            raise SpecwoodError("a draft head reads the target's features: it needs --backend torch for the target")
        from specwood.drafting.head_files import load_head

        draft_head = load_head(head, model)
    release_freed_memory()
    return Engine(model, tokenizer, draft=draft_model, target_name=target,
                  draft_name=str(draft) if draft is not None else None, max_context=max_context, head=draft_head)
