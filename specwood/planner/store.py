"""The persisted plan: its key, per-bucket choices and measurements (PlanKey, BucketChoice, Plan),
and its storage as JSON under `<cache>/plans/`, keyed by (device, target, draft, dtype, method).
The plan keeps the measurements and fits behind each choice.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from specwood.engine.protocols import EngineLike
from specwood.errors import SpecwoodError
from specwood.planner.decision import (MAX_X, Decision, ParallelProfile, batch_share, decide, interpolate, monotone,
                                       nearest_context, p_eff)
from specwood.planner.fits import AATFit, RooflineFit, fit_roofline
from specwood.planner.machine import busy, machine_change, machine_record
from specwood.planner.prior_tree import PriorScores
from specwood.planner.profiler import TimeTable

SCHEMA_VERSION = 2  # 2: AAT(x) per context bucket, dense small-x timings
DEFAULT_METHOD = "dyspec"
# Speculation in a shared step must beat plain decoding by this fraction: the batch model's parts
# (AAT of 2-3 token trees, T_v at the batch's mixed contexts, batched drafting) each erred by 5-10%
# at c = 8, always in speculation's favour, and a loaded server must not be made slower (§4g).
BATCH_MARGIN = 0.15


class PlanWarning(UserWarning):
    """A stored plan could not be used (missing fields, older schema, other key, corrupt JSON)."""


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
        return keyed_filename(f"{self.method}-{Path(self.target).name}-{Path(self.draft).name}-{self.dtype}",
                              self.to_dict())


def keyed_filename(readable: str, key: Any) -> str:
    """A JSON file name: `readable` made filesystem-safe, plus a digest of everything in `key`."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
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
    executor: str = "sequential"  # "parallel": DuoDecoding beats both sequential SD and AR here
    p_parallel: float = 0.0  # modelled parallel-SD tokens/s (0: not measured)

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
    # prompt tokens -> seconds per token of the draft's prefill, where timed at several lengths
    draft_prefill_by_length: dict[int, float] = field(default_factory=dict)
    draft_row_times: dict[int, float] = field(default_factory=dict)  # n rows -> one draft forward (s)
    source: str = "measured"  # or "analytic" (a device model, no hardware)
    mode: str = "quick"  # "quick" or "full" measurement, "analytic", "timed" (T_v/T_d only, AAT borrowed)
    prior: PriorScores | None = None
    observed: dict[int, dict[str, float]] = field(default_factory=dict)  # calibration step stats per x
    parallel: ParallelProfile | None = None  # DuoDecoding measured here (None: not measured)
    notes: list[str] = field(default_factory=list)
    created: str = ""
    # where it was measured (machine.machine_record: a plan made in this process is this machine's)
    # and others' CPU use (cores) at the start and end of measuring (machine.LoadWatch)
    machine: dict[str, str] = field(default_factory=lambda: dict(machine_record()))
    load: dict[str, float] = field(default_factory=dict)
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

    def step_costs(self, ctx: int, batch: int = 1, draft_scale: float = 1.0, riding: int = 0
                   ) -> tuple[Callable[[float], float], Callable[[float], float]]:
        """Per-request T_v(x) and T_d(x) at context ctx when `batch` requests share each step
        (with `riding` prefill tokens in its forward); `draft_scale` corrects batched drafting
        by what it was measured to cost (DraftCostTracker)."""
        rows = (lambda v: interpolate(self.draft_row_times, v)) if len(self.draft_row_times) >= 2 else None
        t_v, t_d = batch_share(lambda v: self.t_v(ctx, v), lambda v: self.t_d(ctx, v), batch, rows, riding)
        if draft_scale == 1.0:
            return t_v, t_d
        return t_v, (lambda v: draft_scale * t_d(v))

    def decide(self, ctx: int, aat: Callable[[float], float] | None = None, batch: int = 1,
               draft_scale: float = 1.0, riding: int = 0, free: int = 0) -> Decision:
        """The decision at context ctx, with the plan's AAT(x) for it or the given curve, for a
        step shared by `batch` requests and `riding` prefill tokens (there speculation must win
        by BATCH_MARGIN), after `free` tokens of a forced run (`decide`)."""
        t_v, t_d = self.step_costs(ctx, batch, draft_scale, riding)
        return decide(t_v, t_d, aat or self.aat_for(ctx), self.candidate_xs(ctx),
                      margin=BATCH_MARGIN if batch > 1 or riding else 0.0, free=free)

    def refresh(self) -> "Plan":
        """Recompute the fits and per-bucket choices from the stored measurements."""
        self._smooth.clear()
        self.rooflines = {c: fit_roofline(list(row), list(row.values())) for c, row in self.verify_times.items()
                          if len(row) >= 2}
        self.choices = []
        for c in self.contexts:
            d = self.decide(c)
            method = "ar" if d.method == "ar" else self.key.method
            choice = BucketChoice(c, method, d.x, d.speedup, d.p_eff, d.p_ar, d.x_best_sd)
            if self.parallel is not None:  # DuoDecoding vs the better of sequential SD and AR
                choice.p_parallel = self.parallel.p_parallel(functools.partial(self.t_v, c))
                if choice.p_parallel > max(d.p_ar, d.p_eff if d.method == "sd" else 0.0):
                    choice.executor = "parallel"
            self.choices.append(choice)
        return self

    def executor_for(self, context_len: int) -> str:
        """"parallel" where the plan measured DuoDecoding faster than sequential SD and AR."""
        return self.choice_for(context_len).executor

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

    def speculation_pays(self, prompt_len: int, max_tokens: int, load: int = 1, draft_scale: float = 1.0) -> bool:
        """End to end, not just per decoded token: speculating first costs the draft's own
        prefill of the prompt, which only the decode steps can earn back. True if the time the
        chosen tree saves over `max_tokens` tokens exceeds that prefill (unknown cost: True).

        `load` requests share the decode steps (itself included): the saving is then the batch
        decision's, whose per-token machine time shrinks as the batch fills the hardware, while
        the draft's prefill costs the same machine time as ever -- so a loaded server stops
        paying for drafts it cannot earn back (vLLM's speculation-under-load complaint)."""
        choice = self.choice_for(prompt_len)
        d: BucketChoice | Decision = choice
        if load > 1 and d.method != "ar" and d.p_eff > 0:
            d = self.decide(choice.context, batch=load, draft_scale=draft_scale)
        return self.prefill_is_earned(d, max_tokens, prompt_len)

    def prefill_is_earned(self, d: BucketChoice | Decision, tokens: int, context_len: int) -> bool:
        """Whether decoding `tokens` tokens at d's speculative rate instead of its plain one saves
        more than the draft's prefill of `context_len` tokens costs (unknown cost: True)."""
        if d.method == "ar" or d.p_eff <= 0:
            return False
        if not self.draft_prefill_s:
            return True
        return tokens * (1.0 / d.p_ar - 1.0 / d.p_eff) > self.draft_prefill_seconds(context_len)

    def draft_prefill_seconds(self, tokens: int) -> float:
        """The draft's prefill of a `tokens`-token prompt: `draft_prefill_s` a token, grown with
        the length as the timings at several lengths grow (each token's attention reads the ones
        before it: linear between and past them, never below the shortest's); flat where one was timed."""
        per_token, timed = float(self.draft_prefill_s or 0.0), self.draft_prefill_by_length
        if len(timed) >= 2:
            shortest = timed[min(timed)]
            per_token *= max(interpolate(timed, tokens), shortest) / max(shortest, 1e-12)
        return tokens * per_token

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
            "draft_prefill_by_length": {str(k): v for k, v in self.draft_prefill_by_length.items()},
            "draft_row_times": {str(k): v for k, v in self.draft_row_times.items()},
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
            "parallel": asdict(self.parallel) if self.parallel is not None else None,
            "notes": list(self.notes),
            "machine": dict(self.machine),
            "load": dict(self.load),
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
            draft_prefill_by_length={int(k): float(v) for k, v in (d.get("draft_prefill_by_length") or {}).items()},
            draft_row_times={int(k): float(v) for k, v in (d.get("draft_row_times") or {}).items()},
            source=str(d.get("source", "measured")),
            mode=str(d.get("mode", "quick")),
            prior=PriorScores.from_dict(d["prior"]) if d.get("prior") else None,
            observed={int(k): dict(v) for k, v in (d.get("observed") or {}).items()},
            parallel=ParallelProfile(**d["parallel"]) if d.get("parallel") else None,
            notes=list(d.get("notes") or []),
            created=str(d.get("created", "")),
            machine={str(k): str(v) for k, v in (d.get("machine") or {}).items()},
            load={str(k): float(v) for k, v in (d.get("load") or {}).items()},
            schema=int(d["schema"]),
        )


def _table_out(t: TimeTable) -> dict[str, dict[str, float]]:
    return {str(c): {str(x): float(v) for x, v in row.items()} for c, row in t.items()}


def _table_in(t: dict[str, Any]) -> TimeTable:
    return {int(c): {int(x): float(v) for x, v in row.items()} for c, row in t.items()}


# ---------------------------------------------------------------------------------------------
# sanity: a plan measured while something else ran is not kept

# A quiet CPU's quick plan fits its rooflines within 10-13% (BENCHMARKS.md §3a); one measured
# beside a stream of requests had 21.6% (issue 43).
ROOFLINE_MAX_ERROR = 0.20
# plain decoding in the plan against the same step timed by the server: a shared VM's quiet
# rounds vary up to ~1.7x (§3a); the plan measured under load was 11.6x off
AR_STEP_FACTOR = 2.0
# DuoDecoding's comm (what the overlapped compute leaves unexplained) may be negative where the two
# sides overlap better than max() assumes, but not by more than half the measured iteration
COMM_FLOOR = -0.5


def plan_problems(plan: Plan, ar_step_s: float | None = None, ar_context: int = 128) -> list[str]:
    """Why a measured plan is not to be trusted (empty: it is): times that are not positive and
    finite, a roofline fit whose relative error exceeds ROOFLINE_MAX_ERROR, a DuoDecoding profile
    whose comm time is more negative than COMM_FLOOR iterations, and, given `ar_step_s` (one plain
    decoding step at `ar_context` tokens timed by the caller), a plan whose own plain step there is
    more than AR_STEP_FACTOR times off it."""
    import math

    def bad(v: float | None, zero_ok: bool = False) -> bool:
        return v is None or not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok)

    out = []
    for what, table, zero_ok in (("T_v", plan.verify_times, False), ("T_d", plan.draft_times, True)):
        wrong = [f"ctx {c} x {x}: {v:.4g} s" for c, row in table.items() for x, v in row.items()
                 if bad(v, zero_ok or x == 1 and what == "T_d")]
        if wrong:
            out.append(f"{what} not a positive time ({', '.join(wrong[:3])})")
    if any(bad(v) for v in plan.draft_row_times.values()) or (plan.draft_prefill_s is not None
                                                             and bad(plan.draft_prefill_s)):
        out.append("a draft timing is not a positive time")
    for c, fit in sorted(plan.rooflines.items()):
        if not fit.rel_error <= ROOFLINE_MAX_ERROR:
            out.append(f"roofline ctx {c}: relative error {fit.rel_error:.1%} over {ROOFLINE_MAX_ERROR:.0%}")
    pp = plan.parallel
    if pp is not None:
        if any(bad(v) for v in (pp.t_draft_token_s, pp.target_slowdown, pp.tokens_per_s, pp.tokens_per_iteration)):
            out.append("DuoDecoding: a time or rate that is not positive")
        else:
            iteration_s = pp.tokens_per_iteration / pp.tokens_per_s
            if not pp.comm_s >= COMM_FLOOR * iteration_s:
                out.append(f"DuoDecoding: communication time {pp.comm_s * 1e3:.1f} ms per iteration of "
                           f"{iteration_s * 1e3:.1f} ms")
    if ar_step_s is not None and ar_step_s > 0 and plan.verify_times:
        planned = plan.t_v(ar_context, 1)
        if not 1 / AR_STEP_FACTOR <= planned / ar_step_s <= AR_STEP_FACTOR:
            out.append(f"plain decoding at ctx {ar_context}: {1 / planned:.2f} tok/s in the plan, "
                       f"{1 / ar_step_s:.2f} tok/s measured by the server")
    return out


# ---------------------------------------------------------------------------------------------
# persistence


def plans_dir() -> Path:
    from specwood.models.registry import cache_dir

    return cache_dir() / "plans"


def plan_path(key: PlanKey) -> Path:
    return plans_dir() / key.filename()


def write_json_atomically(path: Path, data: Any, **dumps_options: Any) -> None:
    """Write `data` as JSON so that a crash never leaves half a file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, **dumps_options))
    os.replace(tmp, path)


def save_plan(plan: Plan, path: Path | None = None) -> Path:
    """Write atomically (a crash never leaves half a plan under the final name)."""
    path = Path(path) if path is not None else plan_path(plan.key)
    write_json_atomically(path, plan.to_dict(), indent=1, allow_nan=False)
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
    change = machine_change(plan.machine) if plan.source == "measured" else None
    if change is not None:  # its timings are another machine's or build's
        _tell_once(f"[plan] the stored plan {path} is discarded: {change}; re-planning "
                   "(`specwood plan --force` measures it here)")
        return None
    return plan


_told: set[str] = set()


def _tell_once(line: str) -> None:
    """One line on stderr, once per process (a server reads the store again and again)."""
    if line not in _told:
        _told.add(line)
        print(line, file=sys.stderr)


def save_if_quiet(plan: Plan, path: Path | None = None) -> Path | None:
    """`save_plan`, unless the plan was measured while other processes kept the machine busy
    (Plan.load): then one line says so and nothing is stored."""
    why = busy(plan.load)
    if why is not None:
        print(f"[plan] the measured plan is not stored: {why}; run `specwood plan` again when the machine "
              "is quiet", file=sys.stderr)
        return None
    return save_plan(plan, path)


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
# the key of this engine's plan


def local_device_id(engine: EngineLike) -> str:
    """What the timings depend on: the accelerator or CPU model and the thread count."""
    return device_id(engine.device)


def device_id(dev: Any) -> str:
    """local_device_id for a torch.device (or its name), before any engine is loaded."""
    import torch

    dev = torch.device(dev)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    from specwood.models.kernels import cpu_model

    return f"cpu:{cpu_model() or 'cpu'}/{torch.get_num_threads()}t"


_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}


def plan_key_for(engine: EngineLike, method: str = DEFAULT_METHOD, device: str | None = None) -> PlanKey:
    return PlanKey(device=device or local_device_id(engine), target=str(engine.target_name or "target"),
                   draft=str(engine.draft_name or "none"), dtype=weight_mode_name(engine), method=method)


def weight_mode_name(engine: EngineLike) -> str:
    """The dtype part of a plan key: the activation dtype, plus the weight mode where the target's
    linears are quantised (an int8 target times differently from a bf16 one) and the draft's
    weight mode (int4 and bf16 drafts have different T_d)."""
    from specwood.models.amx import decided_tile_path

    name = _DTYPE_NAMES.get(str(engine.dtype), str(engine.dtype))
    target_mode = getattr(engine.target, "weight_mode", None)
    if target_mode in ("int8", "int4", "q4", "q4-lite", "llama.cpp"):  # llama.cpp: another backend, other T_v
        name = f"{name}+{target_mode}"
    if target_mode in ("q4", "q4-lite") and decided_tile_path() is not None:
        name = f"{name}+amx"  # its linears' T_v(x) is another curve (flat to many rows)
    draft = getattr(engine, "draft_model", None)
    draft_mode = getattr(draft, "weight_mode", None) if draft is not None else None
    if draft_mode in ("int8", "int4", "q4", "q4-lite", "llama.cpp"):
        name = f"{name}/draft-{draft_mode}"
    return name
