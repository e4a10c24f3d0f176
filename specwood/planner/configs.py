"""The fastest runtime configuration of a model pair on this machine (`specwood plan --choose-config`).

A configuration is the target's backend and weight mode and the draft's (RuntimeConfig). Each
candidate is loaded in turn; T_v(x) is timed on its target and T_d(x) on its draft at a short and
a long context, AAT(x) is the pair's measured curve (or the default one), and P_eff picks for each
context the better of plain decoding and the best tree. The candidate with the highest predicted
decode rate, averaged over the contexts, is stored; `--backend auto` loads it from then on. Each
candidate's timed plan is stored too where no measured plan of that configuration exists, so
`--method auto` starts from this machine's timings in the configuration it runs.

AAT is not re-measured per configuration: int8 weights or llama.cpp's Q4_K change the target's
logits only to rounding, and the draft's too, so acceptance moves far less than step times do.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specwood.engine.backends import RuntimeConfig, llama_cpp_available, register_measured_config
from specwood.errors import SpecwoodError
from specwood.planner.store import DEFAULT_METHOD, device_id, keyed_filename, load_plan, plans_dir, save_if_quiet

CONFIG_XS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
CONFIG_CONTEXTS: tuple[int, ...] = (128, 512)


@dataclass
class ConfigScore:
    """One candidate's timings, summed up: predicted decode tokens/s per context, plain and best."""

    config: RuntimeConfig
    ar_tok_s: dict[int, float] = field(default_factory=dict)
    best_tok_s: dict[int, float] = field(default_factory=dict)
    choice: dict[int, str] = field(default_factory=dict)  # "ar" or "dyspec x12"
    seconds: float = 0.0  # loading and timing it
    error: str = ""  # why it could not be measured

    @property
    def score(self) -> float:
        """Mean predicted decode rate over the contexts (tokens/s); 0 if not measured."""
        return sum(self.best_tok_s.values()) / len(self.best_tok_s) if self.best_tok_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "ar_tok_s": self.ar_tok_s, "best_tok_s": self.best_tok_s,
                "choice": self.choice, "seconds": self.seconds, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConfigScore":
        def table(t: dict[str, Any]) -> dict[int, Any]:
            return {int(k): v for k, v in t.items()}
        return cls(RuntimeConfig(**d["config"]), table(d["ar_tok_s"]), table(d["best_tok_s"]), table(d["choice"]),
                   float(d.get("seconds", 0.0)), str(d.get("error", "")))


@dataclass
class ConfigChoice:
    device: str
    target: str
    draft: str
    method: str
    scores: list[ConfigScore]
    created: str = ""

    @property
    def best(self) -> ConfigScore:
        measured = [s for s in self.scores if s.best_tok_s]
        if not measured:
            raise SpecwoodError("no configuration could be measured")
        return max(measured, key=lambda s: s.score)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "target": self.target, "draft": self.draft, "method": self.method,
                "created": self.created, "chosen": asdict(self.best.config),
                "scores": [s.to_dict() for s in self.scores]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConfigChoice":
        return cls(str(d["device"]), str(d["target"]), str(d["draft"]), str(d["method"]),
                   [ConfigScore.from_dict(s) for s in d["scores"]], str(d.get("created", "")))


def choice_path(device: str, target: str, draft: str | None) -> Path:
    return plans_dir() / "configs" / keyed_filename(f"{Path(target).name}-{Path(str(draft)).name}",
                                                    [device, target, str(draft)])


def candidate_configs(target: str, draft: str | None, device: str = "cpu") -> list[RuntimeConfig]:
    """The configurations worth timing for this pair here: torch in bf16, int8 and (where our
    AVX512-VNNI kernel runs) q4 on the CPU, the q4 target also with a q4 draft, and, for GGUF
    models with llama-cpp-python installed, llama.cpp for the draft and for both."""
    from specwood.engine.backends import _is_gguf

    if not str(device).startswith("cpu"):
        return [RuntimeConfig()]
    from specwood.models.w4a8 import q4_available

    modes = ["auto", "int8"] + (["q4"] if q4_available() else [])
    out = [RuntimeConfig(dtype=mode) for mode in modes]
    if "q4" in modes and draft is not None:  # a q4 draft: one copy of its weights, and flat over a tree's rows
        out.append(RuntimeConfig(dtype="q4", draft_dtype="q4-lite"))
    if llama_cpp_available():
        if draft is not None and _is_gguf(draft):
            out += [RuntimeConfig(dtype=mode, draft_backend="llama.cpp") for mode in modes]
        if _is_gguf(target):
            out.append(RuntimeConfig(backend="llama.cpp",
                                     draft_backend="llama.cpp" if draft is not None and _is_gguf(draft) else "torch"))
    return out


def time_config(config: RuntimeConfig, target: str, draft: str | None, method: str = DEFAULT_METHOD, *,
                contexts: Sequence[int] = CONFIG_CONTEXTS, xs: Sequence[int] = CONFIG_XS, repeats: int = 3,
                device: str = "cpu", max_context: int | None = None, save: bool = True) -> ConfigScore:
    """Load one configuration, time T_v and T_d, and predict its decode rate per context."""
    from specwood.engine.api import load
    from specwood.planner.starter import runner_verify_times, timed_plan
    from specwood.planner.build import measure_draft_prefill, measure_draft_rows
    from specwood.planner.machine import LoadWatch
    from specwood.planner.profiler import measure_draft_times, measure_verify_times

    t0 = time.perf_counter()
    score = ConfigScore(config)
    engine = load(target, draft if draft is not None else "none", dtype=config.dtype,
                           draft_dtype=config.draft_dtype, device=device, backend=config.backend,
                           draft_backend=config.draft_backend, max_context=max_context, progress=False)
    try:
        watch = LoadWatch()  # others' CPU use while measuring
        fit = [c for c in contexts if c + max(xs) + 64 < engine.max_context] or [engine.max_context // 2]
        if config.backend == "llama.cpp":
            tv = runner_verify_times(engine, xs, fit, repeats)
        else:
            tv = measure_verify_times(engine.target, xs, fit, repeats, refine=False, progress=False)
        if engine.draft_model is None:
            td = {c: {x: 0.0 for x in xs} for c in fit}
            prefill = None
        else:
            td = measure_draft_times(engine, [method], xs=xs, contexts=fit, repeats=repeats, progress=False)[method]
            prefill = 0.0 if config.draft_backend == "llama.cpp" else measure_draft_prefill(engine)
        plan = timed_plan(engine, method, tv, td, draft_prefill_s=prefill, draft_row_times=measure_draft_rows(engine),
                          note=f"timed by `specwood plan --choose-config` ({config.label()})")
        for c in plan.choices:
            score.ar_tok_s[c.context] = c.p_ar
            sd = c.method != "ar"
            score.best_tok_s[c.context] = c.p_eff if sd else c.p_ar
            score.choice[c.context] = f"{method} x{c.x}" if sd else "ar"
        plan.load = watch.finish()
        if save:
            stored = load_plan(plan.key)
            if stored is None or stored.mode == "timed":  # never replace a calibrated plan
                save_if_quiet(plan)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        del engine
        gc.collect()
    score.seconds = time.perf_counter() - t0
    return score


def choose_config(target: str | None = None, draft: str | None = "auto", method: str = DEFAULT_METHOD, *,
                  device: str = "cpu", candidates: Sequence[RuntimeConfig] | None = None,
                  contexts: Sequence[int] = CONFIG_CONTEXTS, repeats: int = 3, max_context: int | None = None,
                  progress: bool = True, save: bool = True) -> ConfigChoice:
    """Time every candidate configuration (a minute or so each) and store the fastest."""
    from specwood.models.registry import DEFAULT_TARGET, default_draft_for

    target = str(target or DEFAULT_TARGET)
    if isinstance(draft, str) and draft.strip().lower() == "none":
        draft = None
    if draft == "auto":
        draft = default_draft_for(target)
    cands = list(candidates) if candidates is not None else candidate_configs(target, draft, device)
    scores = []
    for i, config in enumerate(cands, 1):
        if progress:
            print(f"[plan] configuration {i}/{len(cands)}: {config.label()}", file=sys.stderr, flush=True)
        try:
            score = time_config(config, target, draft, method, contexts=contexts, repeats=repeats, device=device,
                                max_context=max_context, save=save)
        except SpecwoodError as e:  # e.g. int8 kernels missing: the others still count
            score = ConfigScore(config, error=str(e))
        if progress:
            print(f"[plan]   {format_score(score)}", file=sys.stderr, flush=True)
        scores.append(score)
    choice = ConfigChoice(device_id(device), target, str(draft), method, scores,
                          created=time.strftime("%Y-%m-%d %H:%M:%S"))
    choice.best  # noqa: B018 - raises if nothing could be measured
    if save:
        path = choice_path(choice.device, target, draft)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice.to_dict(), indent=1))
        if progress:
            print(f"[plan] saved {path}", file=sys.stderr)
    return choice


def load_config_choice(target: str, draft: str | None, device: str = "cpu") -> ConfigChoice | None:
    path = choice_path(device_id(device), target, draft)
    try:
        return ConfigChoice.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured_config(target: str, draft: str | None, device: str) -> tuple[RuntimeConfig, str] | None:
    """The stored choice for `--backend auto` (registered with the engine's backends)."""
    choice = load_config_choice(target, draft, device)
    if choice is None:
        return None
    try:
        best = choice.best
    except SpecwoodError:
        return None
    return best.config, f"measured fastest here by `specwood plan --choose-config` on {choice.created}"


def format_score(s: ConfigScore) -> str:
    if s.error:
        return f"{s.config.label()}: not measured ({s.error})"
    per_ctx = ", ".join(f"ctx {c}: ar {s.ar_tok_s[c]:.1f}, best {s.best_tok_s[c]:.1f} tok/s ({s.choice[c]})"
                        for c in sorted(s.best_tok_s))
    return f"{s.config.label()}: {s.score:.1f} tok/s predicted [{per_ctx}] in {s.seconds:.0f} s"


def format_choice(choice: ConfigChoice) -> str:
    ctxs = sorted({c for s in choice.scores for c in s.best_tok_s})
    head = "| configuration | " + " | ".join(f"ar @{c}" for c in ctxs) + " | " + \
        " | ".join(f"best @{c}" for c in ctxs) + " | predicted tok/s |"
    lines = [f"configurations for {choice.target} + {choice.draft} on {choice.device} ({choice.method}, "
             "predicted decode tok/s from timed T_v/T_d and the pair's AAT):", head,
             "|---|" + "---:|" * (2 * len(ctxs) + 1)]
    best = choice.best
    for s in choice.scores:
        if s.error:
            lines.append(f"| {s.config.label()} | not measured: {s.error} |")
            continue
        mark = " **(chosen)**" if s is best else ""
        lines.append(f"| {s.config.label()}{mark} | " + " | ".join(f"{s.ar_tok_s[c]:.1f}" for c in ctxs) + " | "
                     + " | ".join(f"{s.best_tok_s[c]:.1f} ({s.choice[c]})" for c in ctxs) + f" | {s.score:.1f} |")
    lines.append(f"`--backend auto` now loads: {best.config.label()}")
    return "\n".join(lines)


register_measured_config(measured_config)
