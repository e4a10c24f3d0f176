"""Sampling parameters and the one logits -> probabilities transform.

`SamplingParams` is the one description of how a request samples: its fields' defaults are the
neutral values, `__post_init__` the one validation. The HTTP body (serve.protocol), the command line
(engine.args) and the Python API (`Engine.generate(prompt, params)`, or its sampling keywords through
`split_sampling`) each build one, and every executor reads it as it is. Autoregressive sampling and
every speculative verifier call `target_probs` so that the distribution SD preserves is exactly
the one plain decoding samples from.
"""
from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from specwood.errors import SamplingParamsError


SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes seeds below this
# A temperature below this samples as its limit, greedy (as vLLM does): logits / 1e-38 overflow
# float32 to inf and softmax to NaN, and long before that the softmax is one-hot up to rounding.
GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# fields only the sequential executor carries out (per-path processors, the output's reports):
# the other executors refuse a request that sets them
SHAPING = {"shaping": True}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; each default is the field's neutral value (off)."""

    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) means greedy (argmax)
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1.0 means off
    seed: int | None = None
    # ids at or past it are never chosen: a vocabulary padded past the tokenizer's (the engine sets it)
    emit_limit: int | None = None
    # per-path logits processors (specwood.constrain.processors), applied before temperature
    # (token id, added logit) pairs, OpenAI's range; a {token id: bias} mapping is taken (sorted pairs)
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=SHAPING)
    presence_penalty: float = field(default=0.0, metadata=SHAPING)  # over the generated tokens (OpenAI/vLLM)
    frequency_penalty: float = field(default=0.0, metadata=SHAPING)  # over the generated tokens, times their count
    # over prompt + generated tokens (HF/vLLM); 1.0 means off
    repetition_penalty: float = field(default=1.0, metadata=SHAPING)
    # after temperature: drop tokens below min_p * the top probability
    min_p: float = field(default=0.0, metadata=SHAPING)
    # an llguidance grammar (LLMatcher.grammar_from_json_schema / _lark)
    grammar: str | None = field(default=None, metadata=SHAPING)
    # a JSON schema (a dict) the output must match: the engine compiles it to `grammar` for its tokenizer
    json_schema: Mapping[str, Any] | None = field(default=None, hash=False, metadata=SHAPING)
    # None: off; k: the chosen token's logprob and its k best alternatives
    logprobs: int | None = field(default=None, metadata=SHAPING)

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or t > 100:
            raise SamplingParamsError(f"temperature must be in [0, 100] (0 = greedy), got {t}")
        if not isinstance(k, int) or k < 0:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 = off), got {k}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT):
            raise SamplingParamsError(f"seed must be an integer in [0, 2**64), got {self.seed}")  # torch's range
        if self.emit_limit is not None and (not isinstance(self.emit_limit, int) or self.emit_limit < 1):
            raise SamplingParamsError(f"emit_limit must be a positive integer, got {self.emit_limit}")
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        elif not isinstance(self.logit_bias, tuple):
            raise SamplingParamsError("logit_bias must map token ids to numbers in [-100, 100]")
        self._check_processors()

    def _check_processors(self) -> None:
        for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
            v = getattr(self, name)
            if not _is_number(v) or not lo <= v <= hi:
                raise SamplingParamsError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= 100:
            raise SamplingParamsError(f"repetition_penalty must be a number in (0, 100] (1 = off), got {rp!r}")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0
                    or not _is_number(pair[1]) or not -100 <= pair[1] <= 100):
                raise SamplingParamsError(
                    f"logit_bias maps token ids (integers >= 0) to numbers in [-100, 100], got {pair!r}")
        if self.json_schema is not None:
            if self.grammar is not None:
                raise SamplingParamsError("pass grammar or json_schema, not both")
            if not isinstance(self.json_schema, Mapping):
                raise SamplingParamsError("json_schema must be a JSON schema object (a dict)")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise SamplingParamsError("grammar must be a non-empty llguidance grammar string")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise SamplingParamsError(f"logprobs (top_logprobs) must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {lp!r}")

    @property
    def processed(self) -> bool:
        """Whether any per-path logits processor is on (specwood.constrain.processors)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def shaping(self) -> list[str]:
        """The names of the set fields that only the sequential executor carries out."""
        return [name for name, neutral in _SHAPING_NEUTRAL.items() if getattr(self, name) != neutral]

    def unshaped(self) -> SamplingParams:
        """These parameters without the fields that only the sequential executor carries out."""
        return dataclasses.replace(self, **_SHAPING_NEUTRAL)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# the shaping fields and their neutral values (read per request: dataclasses.fields costs ~15 us a call)
_SHAPING_NEUTRAL: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                                    if f.metadata.get("shaping")}


def split_sampling(params: SamplingParams | None, options: Mapping[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
    """(the request's SamplingParams, the other options): `params`, or the one the keyword
    arguments named after its fields make (`generate(prompt, temperature=0.7)`), never both."""
    named = {k: v for k, v in options.items() if k in FIELDS}
    rest = {k: v for k, v in options.items() if k not in FIELDS}
    if not named:
        return params if params is not None else SamplingParams(), rest
    if params is not None:
        raise SamplingParamsError(f"pass the sampling parameters as params or as keywords, not both "
                                  f"(got params and {', '.join(named)})")
    return SamplingParams(**named), rest


def params_from_flags(args: Any, **more: Any) -> SamplingParams:
    """The command line's sampling flags (--temperature, --top-p, --top-k, --seed:
    engine.args.add_sampling_args) and `more` fields as one SamplingParams."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, **more)


def _bias_pairs(bias: Mapping[Any, Any]) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or numeric strings, as JSON gives them) -> sorted pairs."""
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}") from None
        pairs.append((token, value))
    return tuple(sorted(pairs))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 probabilities over the vocabulary after temperature, top-k and top-p.

    Greedy params give a one-hot distribution on the argmax, so verifiers can treat greedy
    decoding as the temperature -> 0 limit of sampling.
    """
    logits = without_padding(logits, params)
    if params.greedy:
        return _one_hot_argmax(logits)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # x / 1 is x
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0:  # after temperature, as vLLM and HF's MinPLogitsWarper; renormalised below
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    # a row that overflowed (huge logits over a small temperature: inf - inf) or held NaN logits
    # has no distribution to sample: its limit is the argmax
    if not bool(torch.isfinite(probs).all()):
        broken = ~torch.isfinite(probs).all(-1)
        probs = torch.where(broken.unsqueeze(-1), _one_hot_argmax(logits), probs)
    return probs


def law_key(params: SamplingParams) -> tuple:
    """What `target_probs` reads of `params`: rows whose keys are equal share one call."""
    return (params.greedy, params.temperature, params.top_k, params.top_p, params.min_p, params.emit_limit)


def without_padding(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 logits with -inf at the padding ids past `params.emit_limit` (never the caller's tensor
    when it masks)."""
    logits = logits.float()
    if params.emit_limit is not None and params.emit_limit < logits.shape[-1]:
        logits = logits.clone()  # .float() of fp32 logits is the caller's tensor
        logits[..., params.emit_limit:] = float("-inf")
    return logits


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy distribution; a NaN logit never wins (torch.argmax would pick it)."""
    best = logits.nan_to_num(nan=float("-inf")).argmax(-1)
    return torch.nn.functional.one_hot(best, logits.shape[-1]).float()


def _top_p(probs: torch.Tensor, top_p: float, candidates: int = 1024) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always).

    A full sort of a 150k vocabulary costs ~20 ms on a CPU; the nucleus almost always lies inside
    the top 1024, so sort those and fall back to the full sort only when it does not.
    """
    k = min(candidates, probs.shape[-1])
    vals, idx = probs.topk(k, dim=-1)
    if k < probs.shape[-1] and bool((vals.sum(-1) < top_p).any()):
        vals, idx = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p
    out = torch.zeros_like(probs).scatter(-1, idx, vals * keep)
    return out / out.sum(-1, keepdim=True)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of the non-negative (not necessarily normalised) `probs` [..., V].

    Inverse CDF in float64: exact, and far cheaper than torch.multinomial on a 150k vocabulary.
    """
    rows = probs.numel() // max(probs.shape[-1], 1)
    return draw_token(probs, torch.rand(rows, dtype=torch.float64, generator=generator, device=probs.device))


# below this many probabilities a draw on the CPU runs in Python floats: a dozen torch calls on a
# few rows cost ~50 us, the same arithmetic on Python floats ~10 (a small vocabulary); the CPU's
# float64 cumsum adds in order, so both give the same index
_PYTHON_DRAW_MAX = 1024


def _draws_on_floats(probs: torch.Tensor) -> bool:
    return probs.numel() <= _PYTHON_DRAW_MAX and probs.device.type == "cpu"  # (a GPU's cumsum adds in another order)


def sample_index(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """`sample_token` of one distribution [V], as an int: the same uniform from `generator`, the
    same draw (a drafted node's token, drawn a few times per request, without a tensor for it)."""
    if probs.dim() != 1:
        raise ValueError(f"sample_index draws from one distribution [V], got shape {tuple(probs.shape)}")
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
    if _draws_on_floats(probs):
        return _draw_floats(probs.tolist(), u.item())
    return int(draw_token(probs, u))


def draw_token(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample_token` on given uniforms: `u` holds one float64 in [0, 1) per row of `probs`
    (a batch of rows whose draws come from different generators)."""
    if _draws_on_floats(probs):
        return _draw_token_floats(probs, u)
    flat = probs.reshape(-1, probs.shape[-1]).double()
    cdf = flat.cumsum(-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # a caller's bug, never a token
        raise RuntimeError("sampling from a distribution that is empty or not finite (an all-zero or NaN row)")
    u = u.reshape(-1, 1).to(torch.float64) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=flat.shape[-1] - 1)
    stray = flat.gather(1, idx).squeeze(1) <= 0  # u rounded onto the very end of the cdf
    for r in stray.nonzero().flatten().tolist():
        idx[r, 0] = int(flat[r].nonzero()[-1])
    return idx.reshape(probs.shape[:-1])


def _draw_token_floats(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`draw_token` on Python floats (`_draw_floats` a row)."""
    rows = probs.reshape(-1, probs.shape[-1]).tolist()
    tokens = [_draw_floats(row, draw) for row, draw in zip(rows, u.reshape(-1).tolist())]
    return torch.tensor(tokens, dtype=torch.long, device=probs.device).reshape(probs.shape[:-1])


def _draw_floats(row: list[float], draw: float) -> int:
    """`draw_token`'s index for one row, bit for bit: the same float64 running sum (a cumsum adds in
    order), the same scaled uniform, the same right-hand search and the same stray fix-up."""
    cdf = list(accumulate(row))
    total = cdf[-1] if cdf else 0.0
    if not (math.isfinite(total) and total > 0):
        raise RuntimeError("sampling from a distribution that is empty or not finite (an all-zero or NaN row)")
    index = min(bisect_right(cdf, draw * total), len(row) - 1)
    if row[index] <= 0:  # u rounded onto the very end of the cdf
        index = max(i for i, p in enumerate(row) if p != 0)
    return index


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The autoregressive choice: argmax when greedy, else a draw from `target_probs`."""
    if params.greedy:
        return allowed(logits, params).argmax(-1)
    return sample_token(target_probs(logits, params), generator)


def allowed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits of the ids that may be chosen (a view without the padding ids past
    `params.emit_limit`): greedy choices take their argmax, the same op everywhere."""
    limit = params.emit_limit
    return logits if limit is None or limit >= logits.shape[-1] else logits[..., :limit]
