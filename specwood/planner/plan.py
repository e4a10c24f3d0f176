"""Effective performance, the SD-vs-AR decision, and the persisted plan (seed paper 000, Eq. 7-8).

    P_eff(x) = AAT(x) / (T_v(x) + T_d(x)),    P_AR = P(1) = 1 / T_v(1)

Per context bucket: if max_x P_eff(x) < P_AR, decode autoregressively; otherwise verify trees of
x* = argmax_x P_eff(x) tokens (x* - 1 drafted nodes, the shape's `budget`). The plan keeps the
measurements and fits behind each choice and is stored as JSON under `<cache>/plans/`, keyed by
(device, target, draft, dtype, method).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from specwood.errors import SpecwoodError
from specwood.planner.fits import DEFAULT_AAT, AATFit, RooflineFit, fit_aat, fit_roofline
from specwood.planner.prior_tree import PriorScores
from specwood.planner.profiler import TimeTable

if TYPE_CHECKING:
    from specwood.planner.devices import DeviceModel

SCHEMA_VERSION = 2  # 2: AAT(x) per context bucket, dense small-x timings
DEFAULT_METHOD = "dyspec"
MAX_X = 1025  # the engine's largest tree (MAX_BUDGET drafted nodes + root)

# Calibration prompts for AAT(x) and the prior-score search. Deliberately *not* the benchmark
# workload (specwood/bench/data/builtin.jsonl), so plans are not tuned on what we report.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    # Interleaved by kind (code, chat, translation, math, extraction, summary, ...) so that the first
    # n prompts any caller takes stay a mix: acceptance differs a lot between kinds of text.
    "Write a Python function `chunked(seq, n)` that yields consecutive lists of length n from any "
    "iterable, the last one possibly shorter. Include a docstring and two doctests.",
    "Explain in four sentences why a hash map has average O(1) lookups but O(n) in the worst case.",
    "Translate into Italian:\n\n\"The library will be closed on Monday for maintenance. Books due that "
    "day can be returned on Tuesday without a fine, and the online catalogue stays available.\"",
    "A recipe for four people uses 300 g of flour, 2 eggs and 250 ml of milk. How much of each is "
    "needed for ten people? Show the calculation.",
    "Extract the contact details as JSON with the keys `name`, `email`, `phone` and `city`. Output "
    "only the JSON.\n\n\"For questions about the workshop, write to Olivia Brandt "
    "(olivia.brandt@example.org) or call +49 30 1234567; she works from our Berlin office.\"",
    "Summarise in two sentences:\n\nThe town library reopened last week after an eight-month "
    "renovation. The building now has a children's wing, twenty study rooms that can be booked "
    "online and a café on the ground floor. Opening hours were extended to 9 pm on weekdays, and "
    "the book collection grew by 12,000 titles, many of them in languages spoken by recent arrivals.",
    "Convert this loop to a list comprehension and explain the change:\n\nsquares = []\n"
    "for i in range(20):\n    if i % 3 == 0:\n        squares.append(i * i)",
    "I want to start running but I have never done sport. Suggest a simple plan for the first four "
    "weeks, with rest days, and tell me how to avoid getting injured.",
    "Translate into Spanish:\n\n\"Your order has shipped and should arrive within three to five "
    "working days. You can follow the parcel with the tracking link below.\"",
    "A savings account pays 3% interest per year, compounded yearly. What is a deposit of 1,000 "
    "euros worth after four years? Show the balance after each year.",
    "List every date in this text with what happens on it, as a JSON array of objects with `date` "
    "(YYYY-MM-DD) and `event`:\n\n\"The conference opens on 2 June 2025 with registration; "
    "workshops run on 3 June, and the closing keynote is on the morning of 4 June.\"",
    "Summarise this product update for a customer newsletter in three bullet points:\n\nVersion 5 "
    "of the app adds offline mode, so notes can be edited without a connection and sync later. "
    "Search is now about twice as fast, and shared folders finally show who changed what. Support "
    "for Android 8 ends in March.",
    "List five practical tips for writing clear git commit messages, one line each.",
    "Write a C function `int is_palindrome(const char *s)` that ignores case and non-letters. "
    "Add a short main() that tests three strings.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder and "
    "prints the ten largest, then explain each part of the pipeline.",
    "Implement binary search over a sorted Python list that returns the leftmost index of the "
    "target or -1, and state its loop invariant.",
)


# Long calibration text for the context buckets: raw windows of stdlib source and of the bundled
# language reference, again not what the built-in workload's long prompts use (textwrap, shlex,
# LICENSE and the "with"/"exceptions"/"assert" topics).
CALIBRATION_MODULES: tuple[str, ...] = ("heapq", "bisect", "fractions", "calendar", "glob", "queue")
CALIBRATION_TOPICS: tuple[str, ...] = ("for", "try", "import", "class", "lambda", "numbers", "if", "while")


def calibration_texts() -> list[str]:
    """Code and prose (alternating) for calibration windows; whatever this Python install has."""
    from specwood.bench.workload import _module_file

    code = []
    for module in CALIBRATION_MODULES:
        path = _module_file(module)
        if path is not None:
            code.append(path.read_text(encoding="utf-8", errors="replace"))
    prose = []
    try:
        from pydoc_data.topics import topics  # type: ignore[import-not-found]

        text = "\n\n".join(topics[k] for k in CALIBRATION_TOPICS if k in topics)
        half = len(text) // 2  # two different prose windows
        prose = [text[:half], text[half:]] if half > 20000 else [text]
    except Exception:  # minimal installs lack pydoc_data
        pass
    mixed = [t for pair in itertools.zip_longest(code, prose) for t in pair if t]
    return mixed or list(CALIBRATION_PROMPTS)


def calibration_set(engine: Any, ctx: int, n_windows: int, n_chat: int = 0, raw: bool = False) -> list[list[int]]:
    """Calibration prompts for the context bucket `ctx`: `n_chat` short chat prompts (through the
    chat template, as users send them) plus `n_windows` raw windows of exactly `ctx` tokens of
    code and prose (a long document being continued)."""
    out = encode_prompts(engine, CALIBRATION_PROMPTS[:n_chat], raw) if n_chat else []
    windows: list[list[int]] = []
    for text in calibration_texts() if n_windows > 0 else ():
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= ctx + 1:
            windows.append(ids[:ctx])
        if len(windows) == n_windows:
            break
    return out + windows


class PlanWarning(UserWarning):
    """A stored plan could not be used (missing fields, older schema, other key, corrupt JSON)."""


# ---------------------------------------------------------------------------------------------
# the decision rule


@dataclass
class Decision:
    method: str  # "ar" or "sd"
    x: int  # verification length to use (1 for AR)
    speedup: float  # max P_eff / P_AR (below 1 when AR wins)
    p_eff: float  # best SD effective performance, tokens/s
    p_ar: float  # 1 / T_v(1), tokens/s
    x_best_sd: int  # argmax of P_eff even when AR wins


def p_eff(x: int, t_v: Callable[[int], float], t_d: Callable[[int], float], aat: Callable[[int], float]) -> float:
    """Eq. 7: effective tokens per second when verifying x tokens per target forward."""
    return float(aat(x)) / (float(t_v(x)) + float(t_d(x)))


def decide(t_v: Callable[[int], float], t_d: Callable[[int], float], aat: Callable[[int], float],
           xs: Sequence[int]) -> Decision:
    """Eq. 8: SD only if some x >= 2 beats autoregressive decoding; then its argmax (the smallest
    x among equal maxima, which costs the least drafting)."""
    p_ar = 1.0 / float(t_v(1))
    cands = sorted({int(x) for x in xs if int(x) >= 2})
    if not cands:
        return Decision("ar", 1, 0.0, 0.0, p_ar, 1)
    values = np.array([p_eff(x, t_v, t_d, aat) for x in cands])
    i = int(np.argmax(values))
    best = float(values[i])
    if best < p_ar:
        return Decision("ar", 1, best / p_ar, best, p_ar, cands[i])
    return Decision("sd", cands[i], best / p_ar, best, p_ar, cands[i])


def interpolate(row: dict[int, float], x: float) -> float:
    """Piecewise-linear T(x) through measured points; linear extrapolation past either end."""
    xs = sorted(row)
    if len(xs) == 1:
        return float(row[xs[0]])
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v >= x)
        lo = xs[xs.index(hi) - 1]
        if hi == x:
            return float(row[hi])
    slope = (row[hi] - row[lo]) / (hi - lo)
    return max(0.0, float(row[lo] + slope * (x - lo)))


def monotone(row: dict[int, float]) -> dict[int, float]:
    """The non-decreasing least-squares fit to T(x) (pool adjacent violators): a forward over
    more tokens never takes less time, so a dip is timing noise and must not attract argmax."""
    xs = sorted(row)
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([row[x], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(xs, values))


def nearest_context(contexts: Sequence[int], ctx: float) -> int:
    """The bucket closest to ctx on a log scale (contexts grow geometrically)."""
    return min(contexts, key=lambda c: (abs(math.log(max(c, 1)) - math.log(max(ctx, 1))), c))


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class PlanKey:
    device: str
    target: str
    draft: str
    dtype: str
    method: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanKey":
        return cls(**{k: str(d[k]) for k in ("device", "target", "draft", "dtype", "method")})

    def filename(self) -> str:
        digest = hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
        readable = f"{self.method}-{Path(self.target).name}-{Path(self.draft).name}-{self.dtype}"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", readable)[:120] + f"-{digest}.json"


@dataclass
class BucketChoice:
    context: int
    method: str  # "ar" or the plan's method
    x: int  # verification length (tree tokens incl. root); 1 for AR
    speedup: float
    p_eff: float
    p_ar: float
    x_best_sd: int

    @property
    def budget(self) -> int:
        """Drafted nodes per tree: what `budget=` means for the shapes."""
        return max(0, self.x - 1)


@dataclass
class Plan:
    key: PlanKey
    contexts: list[int]
    verify_times: TimeTable  # ctx -> x -> T_v seconds
    draft_times: TimeTable  # ctx -> x -> T_d seconds (may hold fewer contexts than verify_times)
    aat: AATFit  # over every bucket's calibration (display, analytic reuse, buckets without their own)
    aat_points: dict[int, float] = field(default_factory=dict)  # measured AAT at x (all buckets)
    aat_by_context: dict[int, AATFit] = field(default_factory=dict)  # AAT(x) per context bucket
    aat_points_by_context: dict[int, dict[int, float]] = field(default_factory=dict)
    rooflines: dict[int, RooflineFit] = field(default_factory=dict)
    choices: list[BucketChoice] = field(default_factory=list)
    x_cap: int = MAX_X  # largest x the method can build (e.g. the prior's maximal tree + 1)
    draft_prefill_s: float | None = None  # the draft's prefill, seconds per prompt token
    source: str = "measured"  # or "analytic" (a device model, no hardware)
    mode: str = "quick"  # "quick" or "full" measurement, "analytic"
    prior: PriorScores | None = None
    observed: dict[int, dict[str, float]] = field(default_factory=dict)  # calibration step stats per x
    notes: list[str] = field(default_factory=list)
    created: str = ""
    schema: int = SCHEMA_VERSION
    _smooth: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)

    # --- evaluation ---------------------------------------------------------------------------

    def _row(self, which: str, table: TimeTable, ctx: int) -> dict[int, float]:
        """The measured row of the nearest bucket, made monotone in x (cached)."""
        c = nearest_context(list(table), ctx)
        if (which, c) not in self._smooth:
            self._smooth[(which, c)] = monotone(table[c])
        return self._smooth[(which, c)]

    def t_v(self, ctx: int, x: float) -> float:
        return interpolate(self._row("v", self.verify_times, ctx), x)

    def t_d(self, ctx: int, x: float) -> float:
        if x <= 1 or not self.draft_times:
            return 0.0
        return interpolate(self._row("d", self.draft_times, ctx), x)

    def aat_for(self, ctx: int) -> AATFit:
        """AAT(x) of the nearest calibrated bucket (the pooled curve if none has its own)."""
        if not self.aat_by_context:
            return self.aat
        return self.aat_by_context[nearest_context(list(self.aat_by_context), ctx)]

    def candidate_xs(self, ctx: int) -> list[int]:
        row = self.verify_times[nearest_context(list(self.verify_times), ctx)]
        return list(range(1, min(max(row), self.x_cap, MAX_X) + 1))

    def p_eff_curve(self, ctx: int) -> tuple[list[int], list[float]]:
        xs = [x for x in self.candidate_xs(ctx) if x >= 2]
        aat = self.aat_for(ctx)
        return xs, [p_eff(x, lambda v: self.t_v(ctx, v), lambda v: self.t_d(ctx, v), aat) for x in xs]

    def decide(self, ctx: int, aat: Callable[[float], float] | None = None) -> Decision:
        """The decision at context ctx, with the plan's AAT(x) for it or the given curve."""
        return decide(lambda v: self.t_v(ctx, v), lambda v: self.t_d(ctx, v), aat or self.aat_for(ctx),
                      self.candidate_xs(ctx))

    def refresh(self) -> "Plan":
        """Recompute the fits and per-bucket choices from the stored measurements."""
        self._smooth.clear()
        self.rooflines = {c: fit_roofline(list(row), list(row.values())) for c, row in self.verify_times.items()
                          if len(row) >= 2}
        self.choices = []
        for c in self.contexts:
            d = self.decide(c)
            method = "ar" if d.method == "ar" else self.key.method
            self.choices.append(BucketChoice(c, method, d.x, d.speedup, d.p_eff, d.p_ar, d.x_best_sd))
        return self

    def choose(self, context_len: int) -> tuple[str, int]:
        """(method, x) for a request whose context holds `context_len` tokens: the choice of the
        nearest bucket (log scale). x is the verification length; use budget = x - 1."""
        c = self.choice_for(context_len)
        return c.method, c.x

    def choice_for(self, context_len: int) -> BucketChoice:
        """The stored choice of the bucket nearest `context_len` (log scale)."""
        if not self.choices:
            raise SpecwoodError("this plan has no per-context choices (call refresh())")
        by_ctx = {c.context: c for c in self.choices}
        return by_ctx[nearest_context(list(by_ctx), context_len)]

    def speculation_pays(self, prompt_len: int, max_tokens: int) -> bool:
        """End to end, not just per decoded token: speculating first costs the draft's own
        prefill of the prompt, which only the decode steps can earn back. True if the time the
        chosen tree saves over `max_tokens` tokens exceeds that prefill (unknown cost: True)."""
        d = self.choice_for(prompt_len)
        if d.method == "ar" or d.p_eff <= 0:
            return False
        if not self.draft_prefill_s:
            return True
        saving = max_tokens * (1.0 / d.p_ar - 1.0 / d.p_eff)
        return saving > prompt_len * self.draft_prefill_s

    # --- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "key": self.key.to_dict(),
            "created": self.created,
            "source": self.source,
            "mode": self.mode,
            "contexts": list(self.contexts),
            "x_cap": self.x_cap,
            "draft_prefill_s": self.draft_prefill_s,
            "verify_times": _table_out(self.verify_times),
            "draft_times": _table_out(self.draft_times),
            "aat": self.aat.to_dict(),
            "aat_points": {str(k): v for k, v in self.aat_points.items()},
            "aat_by_context": {str(c): f.to_dict() for c, f in self.aat_by_context.items()},
            "aat_points_by_context": {str(c): {str(x): v for x, v in pts.items()}
                                      for c, pts in self.aat_points_by_context.items()},
            "rooflines": {str(c): f.to_dict() for c, f in self.rooflines.items()},
            "choices": [asdict(c) for c in self.choices],
            "prior": self.prior.to_dict() if self.prior is not None else None,
            "observed": {str(k): v for k, v in self.observed.items()},
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        return cls(
            key=PlanKey.from_dict(d["key"]),
            contexts=[int(c) for c in d["contexts"]],
            verify_times=_table_in(d["verify_times"]),
            draft_times=_table_in(d.get("draft_times") or {}),
            aat=AATFit.from_dict(d["aat"]),
            aat_points={int(k): float(v) for k, v in (d.get("aat_points") or {}).items()},
            aat_by_context={int(c): AATFit.from_dict(f) for c, f in (d.get("aat_by_context") or {}).items()},
            aat_points_by_context={int(c): {int(x): float(v) for x, v in pts.items()}
                                   for c, pts in (d.get("aat_points_by_context") or {}).items()},
            rooflines={int(c): RooflineFit.from_dict(f) for c, f in (d.get("rooflines") or {}).items()},
            choices=[BucketChoice(**c) for c in d.get("choices") or []],
            x_cap=int(d.get("x_cap", MAX_X)),
            draft_prefill_s=None if d.get("draft_prefill_s") is None else float(d["draft_prefill_s"]),
            source=str(d.get("source", "measured")),
            mode=str(d.get("mode", "quick")),
            prior=PriorScores.from_dict(d["prior"]) if d.get("prior") else None,
            observed={int(k): dict(v) for k, v in (d.get("observed") or {}).items()},
            notes=list(d.get("notes") or []),
            created=str(d.get("created", "")),
            schema=int(d["schema"]),
        )


def _table_out(t: TimeTable) -> dict[str, dict[str, float]]:
    return {str(c): {str(x): float(v) for x, v in row.items()} for c, row in t.items()}


def _table_in(t: dict[str, Any]) -> TimeTable:
    return {int(c): {int(x): float(v) for x, v in row.items()} for c, row in t.items()}


# ---------------------------------------------------------------------------------------------
# persistence


def plans_dir() -> Path:
    from specwood.models.registry import cache_dir

    return cache_dir() / "plans"


def plan_path(key: PlanKey) -> Path:
    return plans_dir() / key.filename()


def save_plan(plan: Plan, path: Path | None = None) -> Path:
    """Write atomically (a crash never leaves half a plan under the final name)."""
    path = Path(path) if path is not None else plan_path(plan.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan.to_dict(), indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def load_plan(key: PlanKey, path: Path | None = None) -> Plan | None:
    """The stored plan for `key`, or None: missing (silently), or stale/corrupt (with a
    PlanWarning saying why). Never raises for a bad file; the caller re-plans."""
    path = Path(path) if path is not None else plan_path(key)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        warnings.warn(f"plan {path} is unreadable or corrupt ({e}); re-planning", PlanWarning, stacklevel=2)
        return None
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        warnings.warn(f"plan {path} has schema {schema!r}, this specwood writes {SCHEMA_VERSION}; it is stale, "
                      "re-planning", PlanWarning, stacklevel=2)
        return None
    try:
        plan = Plan.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        warnings.warn(f"plan {path} is corrupt (bad field: {e!r}); re-planning", PlanWarning, stacklevel=2)
        return None
    if plan.key != key:
        warnings.warn(f"plan {path} belongs to {plan.key}, not {key}; it is stale, re-planning",
                      PlanWarning, stacklevel=2)
        return None
    if not plan.choices:
        warnings.warn(f"plan {path} has no decisions; re-planning", PlanWarning, stacklevel=2)
        return None
    return plan


def list_plans() -> list[Plan]:
    """Every readable current-schema plan in the cache (stale files are skipped quietly)."""
    out = []
    for p in sorted(plans_dir().glob("*.json")):
        try:
            data = json.loads(p.read_text())
            if data.get("schema") == SCHEMA_VERSION:
                out.append(Plan.from_dict(data))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


# ---------------------------------------------------------------------------------------------
# building a plan on the engine's own device


def local_device_id(engine: Any) -> str:
    """What the timings depend on: the accelerator or CPU model and the thread count."""
    import torch

    dev = engine.device
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}/{torch.get_num_threads()}t"


_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}


def plan_key_for(engine: Any, method: str = DEFAULT_METHOD, device: str | None = None) -> PlanKey:
    return PlanKey(device=device or local_device_id(engine), target=str(engine.target_name or "target"),
                   draft=str(engine.draft_name or "none"), dtype=_DTYPE_NAMES.get(str(engine.dtype), str(engine.dtype)),
                   method=method)


def encode_prompts(engine: Any, prompts: Sequence[str], raw: bool = False) -> list[list[int]]:
    """Token ids through the chat template (or raw text); long prompts keep their last
    half-context tokens."""
    limit = max(8, engine.max_context // 2)
    return [engine.encode(p, raw=raw)[-limit:] for p in prompts]


def method_factory(engine: Any, method: str, prior: PriorScores | None = None) -> Callable[[int], tuple[Any, Any]]:
    """budget -> (source, shape) for a method name, or for "prior" from the prior scores. The
    source is created once and shared (its cache is reused across builds)."""
    from specwood.planner.profiler import method_components
    from specwood.planner.prior_tree import prior_shape

    state: dict[str, Any] = {}

    def make(budget: int) -> tuple[Any, Any]:
        if method == "prior":
            if prior is None:
                raise SpecwoodError("method 'prior' needs prior scores (run `specwood plan --method prior`)")
            src, shape = method_components(engine, lambda b: prior_shape(prior.best_layout(b)), budget)
        else:
            src, shape = method_components(engine, method, budget)
        state.setdefault("source", src)
        return state["source"], shape

    return make


def measure_aat(engine: Any, make: Callable[[int], tuple[Any, Any]], xs: Sequence[int],
                prompts_ids: Sequence[Sequence[int]], max_tokens: int,
                progress: bool = True, label: str = "") -> dict[int, dict[str, float]]:
    """AAT(x) on the calibration prompts for each verification length x (budget x - 1), plus the
    per-step draft and verify seconds seen while decoding."""
    from specwood.planner.profiler import _progress, run_speculative

    out: dict[int, dict[str, float]] = {}
    with _progress(len(xs), f"calibrating AAT(x) {label}".strip(), progress) as bar:
        for x in xs:
            source, shape = make(int(x) - 1)
            stats = run_speculative(engine, source, shape, prompts_ids, max_tokens)
            s = stats.as_dict()
            steps = max(stats.steps, 1)
            out[int(x)] = {"aat": float(s["mean_accepted_tokens"]), "steps": float(stats.steps),
                           "draft_s": stats.draft_s / steps, "verify_s": stats.verify_s / steps,
                           "mean_tree_nodes": float(s["mean_tree_nodes"])}
            bar.set_postfix(x=x, aat=f"{out[int(x)]['aat']:.2f}")
            bar.update(1)
    return out


def measure_draft_prefill(engine: Any, n_tokens: int = 512, repeats: int = 2) -> float | None:
    """Seconds per prompt token of the draft model's prefill (None without a draft model)."""
    from specwood.drafting.model_source import ModelDraftSource

    if engine.draft_model is None:
        return None
    n = max(8, min(n_tokens, engine.max_context // 2))
    ids = calibration_set(engine, n, 1) or encode_prompts(engine, CALIBRATION_PROMPTS[:1])
    source = ModelDraftSource(engine.draft_model)
    with torch.inference_mode():
        source.start(ids[0][:16])  # allocate the cache, warm the kernels
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            source.start(ids[0])
            best = min(best, time.perf_counter() - t0)
    return best / len(ids[0])


def build_plan(
    engine: Any,
    method: str = DEFAULT_METHOD,
    quick: bool = True,
    calibration_prompts: Sequence[str] | None = None,
    *,
    contexts: Sequence[int] | None = None,
    xs: Sequence[int] | None = None,
    aat_xs: Sequence[int] | None = None,
    max_tokens: int | None = None,
    repeats: int | None = None,
    device_id: str | None = None,
    prior_nodes: int | None = None,
    prior_levels: int | None = None,
    raw_prompts: bool = False,
    progress: bool = True,
) -> Plan:
    """Profile T_v and T_d, calibrate AAT(x), fit, and decide per context bucket.

    x is the verification length everywhere (tree tokens including the root); AAT(x) is measured
    by decoding with budget = x - 1 drafted nodes. With method "prior" the prior-score search
    runs first (maximal tree of `prior_nodes` over `prior_levels` levels) and AAT(x) is measured
    with its top-(x - 1) trees. quick: fewer x points, contexts, prompts and tokens.
    raw_prompts: feed the calibration prompts as plain text instead of through the chat template.
    """
    from specwood.planner import profiler as prof
    from specwood.planner.prior_tree import collect_prior_scores

    if method in ("ar", "auto"):
        raise SpecwoodError(f"cannot plan method '{method}': give the speculative method to tune (e.g. dyspec)")
    xs = sorted(set(xs or (prof.QUICK_XS if quick else prof.DEFAULT_XS)) | {1})
    wanted = list(contexts or (prof.QUICK_CONTEXTS if quick else prof.DEFAULT_CONTEXTS))
    fit_ctx = [c for c in wanted if c + max(xs) + 1 < engine.max_context]
    if not fit_ctx:  # a small model: one bucket that fits
        fit_ctx = [max(1, engine.max_context - max(xs) - 2)]
    max_tokens = max_tokens or (32 if quick else 64)
    repeats = repeats or (5 if quick else 7)
    if calibration_prompts is not None:  # explicit prompts: one set for every bucket
        given = encode_prompts(engine, calibration_prompts, raw_prompts)
        sets = {c: given for c in fit_ctx}
        what = f"{len(given)} given prompts"
    else:  # the first bucket also gets short chat prompts: what most requests look like
        n = 2 if quick else 4
        sets = {c: calibration_set(engine, c, n, n if i == 0 else 0) for i, c in enumerate(fit_ctx)}
        sets = {c: ids for c, ids in sets.items() if ids} or {fit_ctx[0]: encode_prompts(engine, CALIBRATION_PROMPTS)}
        what = f"{n} chat prompts + {n} raw code/prose windows of the bucket's length (first bucket), {n} windows (others)"
    prompts_ids = sets[min(sets)]
    notes = [f"x = verification length (tree tokens incl. root); budget = x - 1 drafted nodes",
             f"AAT(x) measured per context bucket on {what}, {max_tokens} tokens each (greedy)"]

    prior = None
    x_cap = MAX_X
    if method == "prior":
        n_nodes = prior_nodes or (32 if quick else 64)
        levels = prior_levels or (6 if quick else 8)
        if progress:
            print(f"[plan] prior-score search: maximal tree of {n_nodes} nodes over {levels} levels", file=sys.stderr)
        prior = collect_prior_scores(engine, prompts_ids, max_tokens, n_nodes, levels)
        x_cap = n_nodes + 1
    make = method_factory(engine, method, prior)
    xs = [x for x in xs if x <= x_cap] or [1, 2]

    t_v = prof.measure_verify_times(engine.target, xs, fit_ctx, repeats, quick, progress=progress)
    t_v = {c: r for c, r in t_v.items() if r} or t_v
    default_aat = (2, 4, 8, 16, 32) if quick else (2, 3, 4, 6, 8, 12, 16, 24, 32)
    aat_xs = sorted({int(x) for x in (aat_xs or default_aat) if 2 <= int(x) <= min(max(xs), x_cap)})
    by_ctx: dict[int, AATFit] = {}
    t_d: dict[int, dict[int, float]] = {}
    points_by_ctx: dict[int, dict[int, float]] = {}
    observed: dict[int, dict[str, float]] = {}  # pooled over buckets, weighted by steps
    for c, ids in sorted(sets.items()):
        seen = measure_aat(engine, make, aat_xs, ids, max_tokens, progress, label=f"ctx {c}") if aat_xs else {}
        points_by_ctx[c] = {x: o["aat"] for x, o in seen.items()}
        few = [x for x, o in seen.items() if o["steps"] < 8]
        if few:
            notes.append(f"ctx {c}: AAT at x = {few} rests on fewer than 8 decoding steps (the model stopped early)")
        if len(points_by_ctx[c]) >= 2:
            by_ctx[c] = fit_aat(list(points_by_ctx[c]), list(points_by_ctx[c].values()))
        for x, o in seen.items():
            acc = observed.setdefault(x, {k: 0.0 for k in o})
            for k, v in o.items():
                acc[k] += v * o["steps"] if k != "steps" else v
        if len(seen) >= 2:  # T_d(x) as drafted while decoding real text (see below)
            t_d[c] = {1: 0.0, **{x: o["draft_s"] for x, o in seen.items()}}
    for o in observed.values():
        for k in o:
            if k != "steps":
                o[k] /= max(o["steps"], 1.0)
    # T_d(x) comes from the calibration runs: how many draft forwards a heap or threshold shape
    # spends depends on how sure the draft is, i.e. on the text, so a synthetic context misleads.
    # Buckets without calibration fall back to profiling the shape on the calibration tokens.
    if t_d:
        notes.append("T_d(x) = mean drafting seconds per step while calibrating AAT(x) (per bucket)")
    else:
        shape_spec = {method: (lambda b: make(b)[1])} if method == "prior" else [method]
        t_d = prof.measure_draft_times(engine, shape_spec, xs, fit_ctx[:1], max(2, repeats // 2),
                                       seed_ids=[t for ids in prompts_ids for t in ids], progress=progress)[method]
        notes.append(f"T_d(x) profiled at context {fit_ctx[0]} on the calibration tokens and reused for every bucket")
    points = {x: o["aat"] for x, o in observed.items()}
    if len(points) >= 2:
        aat = fit_aat(list(points), list(points.values()))
    else:
        aat = DEFAULT_AAT
        notes.append("too few AAT points: using the default AAT curve")

    draft_prefill = measure_draft_prefill(engine, max(fit_ctx))
    plan = Plan(key=PlanKey(device_id or local_device_id(engine), str(engine.target_name or "target"),
                            str(engine.draft_name or "none"),
                            _DTYPE_NAMES.get(str(engine.dtype), str(engine.dtype)), method),
                contexts=sorted(t_v), verify_times=t_v, draft_times=t_d, aat=aat, aat_points=points,
                aat_by_context=by_ctx, aat_points_by_context=points_by_ctx, x_cap=x_cap,
                draft_prefill_s=draft_prefill, source="measured", mode="quick" if quick else "full", prior=prior, observed=observed, notes=notes,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return plan.refresh()


def get_plan(engine: Any, method: str = DEFAULT_METHOD, *, build_if_missing: bool = False, quick: bool = True,
             progress: bool = True) -> Plan | None:
    """The stored plan for this engine and method; with build_if_missing, plan now (and save)
    when there is none or it is stale."""
    key = plan_key_for(engine, method)
    plan = load_plan(key)
    if plan is None and build_if_missing:
        if progress:
            print(f"[plan] no usable plan for {key}; profiling now ({'quick' if quick else 'full'} mode)",
                  file=sys.stderr)
        plan = build_plan(engine, method, quick=quick, progress=progress)
        save_plan(plan)
    return plan


# ---------------------------------------------------------------------------------------------
# what the engine calls: --method auto and --method prior


class AcceptanceTracker:
    """How much better (or worse) than the plan's AAT(x) the draft does in this request.

    AAT depends on the text as much as on the hardware: a code continuation accepts far deeper
    than an open-ended chat answer, and P_eff(x) is flat enough near its maximum that the
    calibration curve alone can pick a tree half the best size. We keep exponentially decayed
    sums of accepted drafted tokens (observed) and of what the plan's curve predicted for the
    trees used, and scale the curve's drafted part by their ratio r:
        AAT_req(x) = 1 + min(x - 1, r * (AAT(x) - 1)).
    Both sums start from `prior_steps` steps of agreement, so a request starts on the plan. On
    plain (AR) steps nothing is observed and r relaxes towards 1, so a request that fell back
    to AR tries speculation again after a few tokens instead of staying stuck.
    """

    def __init__(self, decay: float = 0.75, prior_steps: float = 2.0, unit: float = 2.0):
        self.decay = decay
        self.unit = unit  # one step's worth of evidence, in accepted drafted tokens
        self.observed = self.predicted = prior_steps * unit

    @property
    def ratio(self) -> float:
        return min(4.0, max(0.05, self.observed / self.predicted))

    def record(self, predicted_aat: float, emitted: int) -> None:
        """A speculative step the plan expected to emit `predicted_aat` tokens emitted `emitted`
        (accepted + bonus)."""
        self.observed = self.decay * self.observed + max(0, emitted - 1)
        self.predicted = self.decay * self.predicted + max(predicted_aat - 1.0, 1e-3)

    def relax(self) -> None:
        """A plain step: no evidence, drift back towards the plan."""
        self.observed = self.decay * self.observed + (1 - self.decay) * self.unit
        self.predicted = self.decay * self.predicted + (1 - self.decay) * self.unit

    def scale(self, aat: Callable[[float], float]) -> Callable[[float], float]:
        """The curve corrected for this request."""
        r = self.ratio
        return lambda x: 1.0 if x <= 1 else 1.0 + min(x - 1.0, r * (float(aat(x)) - 1.0))


class PlannedShape:
    """A tree shape that follows a plan as the context grows and as acceptance is observed.

    At each step it takes the plan's measured T_v(x) and T_d(x) at the current context length,
    the plan's AAT(x) for that context corrected for this request (AcceptanceTracker), and
    drafts the argmax x of P_eff (budget x - 1) -- or returns a bare root (a plain
    autoregressive step through the same loop) where AR wins. With `adapt=False` it uses the
    plan's per-bucket choices as stored.
    """

    def __init__(self, plan: Plan, make: Callable[[int], tuple[Any, Any]], adapt: bool = True):
        self.plan = plan
        self.name = f"auto:{plan.key.method}"
        self.adapt = adapt
        self._make = make
        self._shapes: dict[int, Any] = {}
        self.tracker = AcceptanceTracker()
        self._last: tuple[int, int] | None = None  # (context length, x) of the previous step

    def choose_x(self, context_len: int) -> int:
        if not self.adapt:
            method, x = self.plan.choose(context_len)
            return 1 if method == "ar" else x
        d = self.plan.decide(context_len, self.tracker.scale(self.plan.aat_for(context_len)))
        return 1 if d.method == "ar" else d.x

    def shape_for(self, context_len: int) -> Any | None:
        x = self.choose_x(context_len)
        if x <= 1:
            return None
        if x not in self._shapes:
            self._shapes[x] = self._make(x - 1)[1]
        return self._shapes[x]

    def observe(self, context_len: int) -> None:
        """Credit the previous step with the tokens the context grew by since it was drafted."""
        if self._last is None:
            return
        last_len, x = self._last
        grew = context_len - last_len
        if not 1 <= grew <= max(x, 1):  # a new request on a reused shape
            self.tracker = AcceptanceTracker()
        elif x <= 1:
            self.tracker.relax()
        else:
            self.tracker.record(float(self.plan.aat_for(last_len)(x)), grew)

    def build(self, context: list[int], root: int, source: Any, params: Any, generator: Any):
        from specwood.tree.token_tree import TokenTree

        self.observe(len(context))
        shape = self.shape_for(len(context))
        tree = (TokenTree.with_root(root, "selected" if params.greedy else "sampled") if shape is None
                else shape.build(context, root, source, params, generator))
        self._last = (len(context), len(tree))
        return tree


def auto_components(engine: Any, options: dict[str, Any] | None = None, *, build_if_missing: bool = True,
                    progress: bool = True, prompt_len: int | None = None,
                    max_tokens: int | None = None) -> tuple[Any, Any] | None:
    """For `generate(method="auto")`: (source, PlannedShape) following the plan for this
    engine, or None when the plan says autoregressive at every context (use method "ar").

    options: {"shape": base method} (default dyspec); tree-size options are ignored (the plan
    picks the budget). Without a stored plan a quick one is built and saved first.
    """
    from specwood.drafting.shapes import needs_model

    options = dict(options or {})
    base = str(options.pop("shape", None) or DEFAULT_METHOD)
    adapt = bool(options.pop("adapt", True))
    if engine.draft_model is None and (base == "prior" or (base != "early-exit" and needs_model(base))):
        if progress:
            print(f"[plan] method auto: no draft model loaded, so '{base}' cannot draft; decoding "
                  "autoregressively (load a draft, or use --method pld)", file=sys.stderr)
        return None
    plan = get_plan(engine, base, build_if_missing=build_if_missing, progress=progress)
    if plan is None:
        raise SpecwoodError(f"no plan for method '{base}' on this device; run `specwood plan --method {base}`")
    if all(c.method == "ar" for c in plan.choices):
        return None
    if prompt_len and max_tokens:
        if plan.draft_prefill_s is None and plan.source == "measured":  # a plan from before this field
            plan.draft_prefill_s = measure_draft_prefill(engine)
            save_plan(plan)
        if not plan.speculation_pays(prompt_len, max_tokens):
            if progress:
                print(f"[plan] method auto: decoding autoregressively -- for a {prompt_len}-token prompt and "
                      f"{max_tokens} new tokens the draft's prefill would cost more than speculation saves",
                      file=sys.stderr)
            return None
    make = method_factory(engine, base, plan.prior)
    first_sd = next(c for c in plan.choices if c.method != "ar")
    source, _ = make(first_sd.budget)
    return source, PlannedShape(plan, make, adapt=adapt)


def prior_components(engine: Any, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """For `generate(method="prior", budget=n)`: (draft source, LayoutShape) of the best n-node
    tree from the stored prior scores (plan key method "prior"). Without stored scores a warning
    is given and an analytic prior (rank-only acceptance model) is used. Without a budget the
    plan's choice at the shortest context is used (16 nodes when there is no plan)."""
    from specwood.drafting.model_source import ModelDraftSource
    from specwood.planner.prior_tree import PriorScores, analytic_scores, maximal_layout, prior_shape

    if engine.draft_model is None:
        raise SpecwoodError("method 'prior' needs a draft model; pass --draft NAME|PATH")
    options = dict(options or {})
    plan = load_plan(plan_key_for(engine, "prior"))
    if plan is not None and plan.prior is not None:
        prior = plan.prior
    else:
        warnings.warn("no prior-score plan for this engine; using an analytic prior "
                      "(run `specwood plan --method prior` to measure one)", PlanWarning, stacklevel=2)
        layout = maximal_layout(64, 8)
        prior = PriorScores(layout, analytic_scores(layout), measured=False)
    budget = options.get("budget")
    if budget is None:
        sd = [c for c in plan.choices if c.method != "ar"] if plan is not None else []
        budget = sd[0].budget if sd else 16
    return ModelDraftSource(engine.draft_model), prior_shape(prior.best_layout(int(budget)))


# ---------------------------------------------------------------------------------------------
# plans for hardware we do not have


WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "auto": 2.0, "fp32": 4.0, "int8": 1.0, "int4": 0.5}


def stored_aat(target: str, draft: str, method: str) -> tuple[AATFit, str] | None:
    """The AAT fit of the newest measured local plan for this target/draft/method, if any."""
    found = [p for p in list_plans() if p.source == "measured" and p.key.target == target
             and p.key.draft == draft and p.key.method == method and p.aat.n_points >= 2]
    if not found:
        return None
    newest = max(found, key=lambda p: p.created)
    return newest.aat, f"AAT from the measured plan of {newest.key.device} ({newest.created})"


def build_analytic_plan(device: "str | DeviceModel", target: str, draft: str | None = None, *, method: str = DEFAULT_METHOD,
                        dtype: str = "bf16", contexts: Sequence[int] = (128, 512, 2048), aat: AATFit | None = None,
                        x_max: int = 128) -> Plan:
    """Predict a plan from a device model and model shapes only (no weights, no hardware).

    draft None: the default for the target (same-family small model, else a one-layer draft);
    "none": no draft cost (e.g. pld). AAT: `aat`, else one measured with a stored local plan of
    the same target/draft/method, else DEFAULT_AAT.
    """
    from specwood.planner.devices import DeviceModel, default_draft_name, get_device, resolve_config

    model = device if isinstance(device, DeviceModel) else get_device(device, dtype)
    tcfg = resolve_config(target)
    draft_name = default_draft_name(target) if draft in (None, "auto") else draft
    dcfg = None if draft_name == "none" else resolve_config(draft_name, tcfg)
    notes = [f"analytic: {model.name} ({model.note}); peak {model.peak_flops / 1e12:.2f} TFLOP/s, "
             f"{model.mem_bw / 1e9:.0f} GB/s; compute/bandwidth ridge ~{model.ridge_tokens:.0f} tokens",
             f"target {tcfg.name or target} ({tcfg.n_params / 1e9:.2f} B params), draft "
             f"{(dcfg.name if dcfg else 'none')} ({(dcfg.n_params / 1e9 if dcfg else 0):.3f} B params)",
             "x = verification length (tree tokens incl. root); budget = x - 1 drafted nodes"]
    if aat is None:
        found = stored_aat(target, draft_name, method)
        if found is not None:
            aat, why = found
            notes.append(why)
        else:
            aat = DEFAULT_AAT
            notes.append(f"assumed AAT(x) = {aat.A} + {aat.B} ln(x - {aat.C}) (default typical curve)")
    else:
        notes.append(f"given AAT(x) = {aat.A:.3g} + {aat.B:.3g} ln(x - {aat.C:.3g})")
    from specwood.planner.devices import analytic_tables

    weight_bytes = WEIGHT_BYTES.get(dtype, 2.0)
    tv, td = analytic_tables(model, tcfg, dcfg, method, contexts, x_max, weight_bytes)
    plan = Plan(key=PlanKey(f"model:{model.name}", target, draft_name, dtype, method), contexts=list(contexts),
                verify_times=tv, draft_times=td, aat=aat, source="analytic", mode="analytic", notes=notes,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return plan.refresh()
