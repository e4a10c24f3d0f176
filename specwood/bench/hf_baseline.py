"""Hugging Face `generate` baselines on the SAME weights as the specwood engine.

- ``hf``: plain ``model.generate`` (greedy, or sampling with the same parameters).
- ``hf-assisted``: assisted generation with ``assistant_model=`` the engine's draft.
- ``hf-pld``: prompt-lookup decoding (``prompt_lookup_num_tokens=10``).

The transformers models are built from the engine's canonical config + state dict via
``specwood.models.hf_export.to_hf_model`` so both sides run identical weights, on identical
token ids (specwood's chat template), with the same max_new_tokens and EOS ids.
transformers is optional: asking for an HF method without it is a one-line SpecwoodError.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from specwood.engine.protocols import EngineLike
from specwood.errors import ContextLengthError, SpecwoodError
from specwood.sampling import GREEDY_BELOW

HF_METHODS = ("hf", "hf-assisted", "hf-pld")
PLD_TOKENS = 10

try:  # the streamer base class is needed at import time for the subclass below
    from transformers.generation.streamers import BaseStreamer as _BaseStreamer

    HAVE_TRANSFORMERS = True
except Exception:  # pragma: no cover - depends on the environment
    _BaseStreamer = object
    HAVE_TRANSFORMERS = False


class TimingStreamer(_BaseStreamer):
    """Records when each chunk of new tokens arrives. `generate` first puts the prompt, then every
    step's new tokens (one, or several per assisted step)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seen_prompt = False
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(now)
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass

    def ttft_s(self) -> float | None:
        return self.times[0] - self.t0 if self.times else None

    def tbt_ms_p50(self) -> float | None:
        """Median over decode steps after the first of (step gap / tokens in the step): the same
        per-token latency the engine reports (an assisted step emitting k tokens after g ms -> g/k)."""
        gaps = [(self.times[i] - self.times[i - 1]) * 1000.0 / self.sizes[i]
                for i in range(1, len(self.times)) if self.sizes[i]]
        return statistics.median(gaps) if gaps else None


def require_transformers() -> None:
    if not HAVE_TRANSFORMERS:
        raise SpecwoodError("methods hf, hf-assisted and hf-pld need Hugging Face transformers: "
                            "pip install transformers")


def torch_dtype_of(engine: EngineLike) -> Any:
    """The engine's compute dtype as a torch.dtype (engine.dtype if it says, else its weights')."""
    import torch

    d = getattr(engine, "dtype", None)
    if isinstance(d, torch.dtype):
        return d
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if isinstance(d, str) and d.lower() in names:
        return names[d.lower()]
    target = engine.target
    for p in (target.parameters() if isinstance(target, torch.nn.Module) else ()):
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class HFBaseline:
    """Lazily builds the transformers twins of the engine's target (and draft) and times generate."""

    def __init__(self, engine: EngineLike, methods: Sequence[str]) -> None:
        require_transformers()
        try:
            from specwood.models.hf_export import to_hf_model
        except ImportError as e:
            raise SpecwoodError(f"HF baselines need specwood.models.hf_export ({e})") from None
        self.engine = engine
        self.dtype = torch_dtype_of(engine)
        self.device = getattr(engine, "device", "cpu")
        self.eos: list[int] = sorted(int(t) for t in (getattr(engine, "eos_token_ids", None) or []))
        self.model = self._build(to_hf_model, engine.target_config, engine.target)
        self.assistant = None
        if "hf-assisted" in methods:
            draft = getattr(engine, "draft_model", None)
            if draft is None:
                raise SpecwoodError("method 'hf-assisted' needs a draft model: pass --draft")
            self.assistant = self._build(to_hf_model, engine.draft_config, draft)

    def _build(self, to_hf_model: Any, config: Any, model: Any) -> Any:
        from transformers import GenerationConfig

        # a quantised target (the default q4 mode, int8, ...) exports its exact dequantised weights
        hf = to_hf_model(config, model.canonical_state_dict(self.dtype), self.dtype)
        hf.eval()
        try:
            hf.to(self.device)
        except Exception:  # an engine device string transformers does not understand: stay where built
            pass
        # our own explicit generation config: checkpoint defaults (top_k=50, repetition penalty, ...)
        # must not leak into the comparison
        hf.generation_config = GenerationConfig(eos_token_id=self.eos or None,
                                                pad_token_id=self.eos[0] if self.eos else None)
        return hf

    def _vocab_size(self) -> int | None:
        config = getattr(getattr(self, "engine", None), "target_config", None)
        return getattr(config, "vocab_size", None)

    def generation_config(self, method: str, max_tokens: int, sampling: dict[str, Any]) -> Any:
        from transformers import GenerationConfig

        temperature = float(sampling.get("temperature") or 0.0)
        kw: dict[str, Any] = dict(max_new_tokens=max_tokens, eos_token_id=self.eos or None,
                                  pad_token_id=self.eos[0] if self.eos else None, num_beams=1,
                                  repetition_penalty=1.0)
        # the engine never emits the padding ids past its tokenizer's (specwood.engine.vocab): nor does HF
        limit, vocab = getattr(getattr(self, "engine", None), "emit_limit", None), self._vocab_size()
        if limit is not None and vocab is not None and limit < vocab:
            kw["suppress_tokens"] = list(range(limit, vocab))
        if temperature >= GREEDY_BELOW:
            kw.update(do_sample=True, temperature=temperature, top_p=float(sampling.get("top_p") or 1.0),
                      top_k=int(sampling.get("top_k") or 0))
        else:
            kw.update(do_sample=False, top_k=None, top_p=None, temperature=None)
        if method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = PLD_TOKENS
        return GenerationConfig(**kw)

    def generate(self, method: str, content: Any, raw: bool, max_tokens: int,
                 sampling: dict[str, Any]) -> dict[str, Any]:
        """One timed generation, measured like the engine measures itself (see OutputStream):
        TTFT from the start of decoding (after tokenising), tokens/s over the tokens after the
        first; wall_s covers the whole call (tokenising + generate + detokenising)."""
        import torch

        if method not in HF_METHODS:
            raise SpecwoodError(f"unknown HF method '{method}' (use one of {', '.join(HF_METHODS)})")
        t_call = time.perf_counter()
        ids = list(self.engine.encode(content, raw=raw))
        # the same context rule as engine.generate, so both sides generate the same number of tokens
        max_ctx = getattr(self.engine, "max_context", None) or getattr(self.engine.target_config,
                                                                      "max_position_embeddings", None)
        if max_ctx:
            if len(ids) >= max_ctx:
                raise ContextLengthError(f"prompt has {len(ids)} tokens but the context holds {max_ctx}")
            max_tokens = min(max_tokens, max_ctx - len(ids))
        gen_cfg = self.generation_config(method, max_tokens, sampling)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        extra: dict[str, Any] = {"assistant_model": self.assistant} if method == "hf-assisted" else {}
        seed = sampling.get("seed")
        if seed is not None:
            torch.manual_seed(int(seed))
        streamer = TimingStreamer()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=gen_cfg, streamer=streamer, **extra)
        new = [int(t) for t in out[0, len(ids):].tolist()]
        # the engine stops AT an EOS and does not return it: do the same
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[:i]
                break
        text = decode(self.engine, new)
        t_end = time.perf_counter()
        steps = len(streamer.sizes)
        # tokens of the steps after the first, EOS included: what the engine's OutputStream counts
        after_first = sum(streamer.sizes[1:])
        t_first = streamer.times[0] if steps else None
        return {
            "token_ids": new,
            "text": text,
            "prompt_tokens": len(ids),
            "wall_s": t_end - t_call,
            "ttft_s": streamer.ttft_s(),
            # undefined (None), not 0, when every token came with the first step
            "tokens_per_s": (after_first / (t_end - t_first)
                             if after_first and t_first is not None and t_end > t_first else None),
            "tbt_ms_p50": streamer.tbt_ms_p50(),
            # assisted/PLD: tokens emitted per target step (accepted drafts + the target's own token)
            "mean_accepted_tokens": (sum(streamer.sizes) / steps) if method != "hf" and steps else None,
            "acceptance_rate": None,
        }


def decode(engine: EngineLike, ids: Sequence[int]) -> str:
    """Text of generated ids the way the engine would show it (special tokens dropped)."""
    dec = getattr(engine, "decode", None)
    if callable(dec):
        return dec(list(ids))
    tok = engine.tokenizer
    try:
        return tok.decode(list(ids), skip_special_tokens=True)
    except TypeError:  # a tokenizer without that keyword
        return tok.decode(list(ids))
