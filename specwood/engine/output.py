"""Turning a stream of token ids into text: stop conditions, streaming, timing statistics.

Decoding loops (autoregressive, speculative, parallel, pipeline) only yield the tokens each
step produced; this object decides when to stop, what text to stream and what the stats are,
so every method stops at exactly the same token as plain decoding would.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specwood.constrain.logprobs import TokenLogprob


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length"
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked (specwood.constrain.logprobs)


class StopMatcher:
    """Where stop strings complete in a text that only grows, in time linear in the text: one
    Knuth-Morris-Pratt automaton per string, fed each new character once. `held` is the longest
    partial match at the end of the text, which streaming must hold back."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_prefix_function(s) for s in stops]
        self.state = [0] * len(stops)  # characters of each stop string matched at the text's end
        self.fed = 0  # characters of the text read so far

    def feed(self, text: str) -> int | None:
        """Read text[fed:]; the index where the first completed stop string starts (the one that
        completes first, the earliest starting of those), or None."""
        for pos in range(self.fed, len(text)):
            ch, done = text[pos], None
            for j, s in enumerate(self.stops):
                k, fail = self.state[j], self.fail[j]
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    start = pos + 1 - k
                    done = start if done is None else min(done, start)
                    k = fail[k - 1]
                self.state[j] = k
            if done is not None:
                self.fed = pos + 1
                return done
        self.fed = len(text)
        return None

    @property
    def held(self) -> int:
        return max(self.state, default=0)


def _prefix_function(s: str) -> list[int]:
    """KMP's failure function: pi[i] = the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + (s[i] == s[k])
    return pi


class OutputStream:
    """Accumulates generated tokens; applies EOS, stop strings and the token limit; streams text."""

    def __init__(self, tokenizer: Any, prompt_tokens: int, max_tokens: int, eos_ids: set[int],
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                 emit_limit: int | None = None):
        self.tokenizer = tokenizer
        self.emit_limit = emit_limit  # ids at or past it are not the tokenizer's (specwood.engine.vocab)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids
        self.stop = [s for s in (stop or []) if s]
        self._stops = StopMatcher(self.stop)
        self.on_text = on_text
        self.token_ids: list[int] = []
        # with logprobs requested: one entry per token id, pushed with it (read them in on_text to stream)
        self.logprobs: list[TokenLogprob] | None = None
        self._offered: list[TokenLogprob] = []
        self.text = ""
        # incremental detokenisation: text holds decode(ids[:read]); ids[prefix:read] is a short
        # window decoded again with each new token, so a token's text can depend on the previous
        # ones (byte-level BPE, sentencepiece spaces) without decoding the whole output each time
        self._prefix = self._read = 0
        self._cut = False
        self.emitted = 0  # characters of self.text already streamed
        self.finish_reason: str | None = None
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.step_times: list[tuple[float, int]] = []  # (time, tokens in that step)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def offer_logprobs(self, entries: list[TokenLogprob]) -> None:
        """The log-probabilities of the tokens the next `push_step` brings, in order."""
        if self.logprobs is None:
            self.logprobs = []
        self._offered = list(entries)

    def push_step(self, tokens: list[int]) -> bool:
        """Add the tokens one decoding step produced; True once generation should stop."""
        offered, self._offered = self._offered, []
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        taken = 0
        for i, t in enumerate(tokens):
            taken += 1
            if offered and self.logprobs is not None and int(t) not in self.eos_ids:  # aligned with token_ids
                self.logprobs.append(offered[i])  # (an EOS is not output); `offer` made the list
            if self._push(int(t)):
                break
        self.step_times.append((now, taken))
        self._stream()
        return self.finished

    def _push(self, token: int) -> bool:
        if token < 0 or (self.emit_limit is not None and token >= self.emit_limit):
            raise RuntimeError(f"a decoding step emitted token id {token}, which the tokenizer does not have "
                               f"(its ids are 0..{(self.emit_limit or 1) - 1}); a bug in the sampler or verifier")
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return True
        self.token_ids.append(token)
        self._detokenize()
        i = self._stops.feed(self.text) if self.stop else None
        if i is not None:
            self.text = self.text[:i]
            self._cut = True
            self.finish_reason = "stop"
            return True
        if len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def _detokenize(self, final: bool = False) -> None:
        """Append the text of the tokens since `_read`, unless it ends inside a UTF-8 sequence."""
        if self._read == len(self.token_ids):
            return  # nothing since the last text (the decodes below would be equal)
        decode = self.tokenizer.decode
        window = self.token_ids[self._prefix:]
        before = (decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
                  if self._read > self._prefix else "")
        now = decode(window, skip_special_tokens=True)
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.token_ids)

    def _stream(self) -> None:
        end = len(self.text)
        if not self.finished:
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its rest
                end = len(self.text.rstrip("\ufffd"))
            # hold back a tail that may grow into a stop string
            end = min(end, len(self.text) - self._stops.held)
        if end > self.emitted:  # (text never ends inside a UTF-8 sequence before the end)
            if self.on_text is not None:
                self.on_text(self.text[self.emitted:end])
            self.emitted = end

    def finish(self, method: str, extra: dict[str, Any] | None = None) -> GenerationResult:
        if self.finish_reason is None:
            self.finish_reason = "length"
        if not self._cut:  # flush an unfinished UTF-8 tail (a stop string's cut is final)
            self._detokenize(final=True)
        self._stream()
        t_end = time.perf_counter()
        n = len(self.token_ids)
        ttft = (self.t_first or t_end) - self.t_start
        decode_s = t_end - (self.t_first or t_end)
        # per-token latency of each decode step (a speculative step emits several tokens at once)
        per_token = []
        prev = self.t_first or t_end  # (set by the first step)
        for t, k in self.step_times[1:]:
            if k:
                per_token.append((t - prev) / k)
            prev = t
        stats: dict[str, Any] = {
            "method": method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": n,
            "ttft_s": round(ttft, 5),
            "prefill_tokens_per_s": round(self.prompt_tokens / ttft, 2) if ttft > 0 else None,
            # decode throughput: tokens after the first over the time after the first
            "tokens_per_s": round(sum(k for _, k in self.step_times[1:]) / decode_s, 3) if decode_s > 0 else None,
            "e2e_tokens_per_s": round(n / (t_end - self.t_start), 3) if t_end > self.t_start else None,
            "tbt_ms_p50": round(statistics.median(per_token) * 1e3, 3) if per_token else None,
            "total_s": round(t_end - self.t_start, 4),
            "finish_reason": self.finish_reason,
        }
        stats.update(extra or {})
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return GenerationResult(self.text, list(self.token_ids), self.finish_reason, stats, logprobs)
