"""`run_bench`: run every method on every prompt in one process and write the results.

Outputs in ``out_dir``: ``results.json`` (one record per prompt x method), ``run.json`` (command,
machine, versions, models, settings), ``report.md`` and PNG plots (see ``report.py``).

Fairness rules: all methods run on the same prompts, in the same process, interleaved per prompt
(prompt 1: ar, m2, ...; prompt 2: ...) so slow drifts of the machine (thermals, neighbours) hit
every method alike; each method gets one untimed warm-up generation first; and every method's
tokens/s is measured the same way, by this harness, around the whole generate call.
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from specwood.engine.executors import build_executor
from specwood.engine.protocols import EngineLike
from specwood.methods import options_for, split_backend, split_executor
from specwood.bench import report as _report
from specwood.bench.hf_baseline import HF_METHODS, HFBaseline
from specwood.bench.llamacpp_baseline import LLAMACPP_METHODS, LlamaCppBaseline
from specwood.bench.workload import Prompt, Workload, load_workload
from specwood.errors import SamplingParamsError, SpecwoodError

AR = "ar"
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
WARMUP_TOKENS = 16
METHOD_OPTION_KEYS = ("budget", "depth", "topk", "threshold")


# --------------------------------------------------------------------------------------- arguments
def parse_methods(methods: str | Iterable[str]) -> list[str]:
    """'ar,hf' or ['ar', 'hf'] -> unique names in order."""
    items = methods.split(",") if isinstance(methods, str) else list(methods)
    out = list(dict.fromkeys(m.strip() for m in items if m and m.strip()))
    if not out:
        raise SpecwoodError("no methods given (e.g. --methods ar,hf)")
    return out


def normalise_sampling(sampling: dict[str, Any] | None) -> dict[str, Any]:
    s: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    s.update({k: v for k, v in (sampling or {}).items() if v is not None})
    unknown = set(s) - {"temperature", "top_p", "top_k", "seed"}
    if unknown:
        raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    if s["temperature"] < 0:
        raise SamplingParamsError(f"temperature must be >= 0 (got {s['temperature']})")
    if not 0 < s["top_p"] <= 1:
        raise SamplingParamsError(f"top-p must be in (0, 1] (got {s['top_p']})")
    if s["top_k"] < 0:
        raise SamplingParamsError(f"top-k must be >= 0, 0 = off (got {s['top_k']})")
    return s


# ---------------------------------------------------------------------------------------- metadata
def _cpu_model() -> str:
    from specwood.models.kernels import cpu_model

    model = cpu_model()
    if model:
        return model
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except Exception:
            pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    # the flags that decide whether bf16 / int8 matmuls are fast on this CPU
    from specwood.models.kernels import cpu_flags

    have = cpu_flags()
    return [w for w in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if w in have]


def machine_info() -> dict[str, Any]:
    import torch

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cpu_flags": _cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        info["transformers"] = None
    info["summary"] = (f"{info['cpu_model']}, {usable} usable cores, {info['torch_threads']} torch threads, "
                       f"torch {info['torch']}" + (f", GPU {info['gpu']}" if info["gpu"] else ""))
    return info


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                           cwd=Path(__file__).resolve().parent)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except Exception:
        return None


def _model_label(engine: EngineLike, which: str) -> str | None:
    for attr in (f"{which}_name", f"{which}_path"):
        v = getattr(engine, attr, None)
        if v:
            return str(v)
    cfg = getattr(engine, f"{which}_config", None)
    return (getattr(cfg, "name", None) or getattr(cfg, "arch", None)) if cfg is not None else None


def _dtype_name(d: Any) -> str | None:
    if d is None:
        return None
    name = str(d).replace("torch.", "")
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(name, name)


def run_metadata(engine: EngineLike, workload: Workload, methods: Sequence[str], sampling: dict[str, Any],
                 method_options: dict[str, Any], max_tokens: int, run_info: dict[str, Any] | None) -> dict[str, Any]:
    info = dict(run_info or {})
    argv = info.pop("argv", None) or sys.argv
    cats = workload.categories
    meta: dict[str, Any] = {
        "command": info.pop("command", None) or shlex.join(["specwood" if i == 0 else a for i, a in enumerate(argv)]),
        "argv": list(argv),
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "specwood_commit": _git_commit(),
        "target": info.pop("target", None) or _model_label(engine, "target"),
        "draft": info.pop("draft", None) or _model_label(engine, "draft"),
        "dtype": info.pop("dtype", None) or _dtype_name(getattr(engine, "dtype", None)),
        "device": info.pop("device", None) or str(getattr(engine, "device", "") or "") or None,
        "eos_token_ids": sorted(int(t) for t in (getattr(engine, "eos_token_ids", None) or [])),
        "methods": list(methods),
        "max_tokens": max_tokens,
        "sampling": sampling,
        "method_options": method_options,
        "warmup": {"messages": WARMUP_MESSAGES, "max_tokens": min(WARMUP_TOKENS, max_tokens)},
        "workload": {
            "source": workload.source,
            "n_prompts": len(workload.prompts),
            "categories": {c: sum(p.category == c for p in workload.prompts) for c in cats},
            "notes": list(workload.notes),
            "summary": f"{workload.source}: {len(workload.prompts)} prompts in {len(cats)} categories",
        },
        "timing": ("tokens_per_s: decode throughput, tokens after the first / time after the first token; "
                   "e2e_tokens_per_s: new tokens / wall time of the whole generate call (harness clock); "
                   "ttft_s: start of decoding (after tokenising) to the first token"),
    }
    hf_settings = {"hf": "model.generate, same generation parameters and EOS ids",
                   "hf-pld": {"prompt_lookup_num_tokens": 10},
                   "hf-assisted": "assistant_model = the draft; transformers defaults (num_assistant_tokens=20, "
                                  "constant schedule, assistant_confidence_threshold=0.4)"}
    if any(m in HF_METHODS for m in methods):
        meta["hf"] = {m: hf_settings[m] for m in methods if m in hf_settings}
    meta.update(info)  # anything else the caller wants recorded
    return meta


# ------------------------------------------------------------------------------------------ running
def _stat(stats: Any, key: str) -> Any:
    if isinstance(stats, dict):
        return stats.get(key)
    return getattr(stats, key, None)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item"):  # numpy / torch scalars
        try:
            return x.item()
        except Exception:
            pass
    return str(x)


class _Runner:
    """Runs one (prompt, method) generation and returns a record."""

    def __init__(self, engine: EngineLike, methods: Sequence[str], sampling: dict[str, Any],
                 method_options: dict[str, Any], max_tokens: int,
                 executor_options: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.sampling = sampling
        self.method_options = method_options
        self.max_tokens = max_tokens
        self.executor_options = executor_options or {}
        # one executor per name, started by its first row ('m@parallel': one draft worker for all)
        self.executors: dict[str, Any] = {}
        hf_methods = [m for m in methods if m in HF_METHODS]
        self.hf = HFBaseline(engine, hf_methods) if hf_methods else None
        self.llamacpp = LlamaCppBaseline(engine) if any(m in LLAMACPP_METHODS for m in methods) else None
        self.engines: dict[str, Any] = {}  # 'NAME@BACKEND' rows: the same models on that backend

    def engine_for(self, backend: str | None) -> Any:
        """The engine of a 'NAME@BACKEND' row: target and draft on BACKEND (loaded once, at warm-up)."""
        e = self.engine
        if backend is None or (e.backend == backend and (e.draft_backend or backend) == backend):
            return e
        if backend not in self.engines:
            from specwood.engine.api import load
            from specwood.engine.backends import DEFAULT_LLAMACPP_CTX

            ctx = min(e.max_context, DEFAULT_LLAMACPP_CTX) if backend == "llama.cpp" else e.max_context
            self.engines[backend] = load(e.target_name, e.draft_name, backend=backend, draft_backend=backend,
                                                  max_context=ctx, progress=False)
        return self.engines[backend]

    def generate(self, method: str, content: Any, raw: bool, max_tokens: int) -> dict[str, Any]:
        if method in HF_METHODS:
            assert self.hf is not None
            return self.hf.generate(method, content, raw, max_tokens, self.sampling)
        if method in LLAMACPP_METHODS:
            assert self.llamacpp is not None
            return self.llamacpp.generate(method, content, raw, max_tokens, self.sampling)
        # each engine method gets the pass-through options it takes
        method, backend = split_backend(method)
        engine = self.engine_for(backend)
        name, executor = split_executor(method)
        opts = options_for(name, self.method_options)
        if executor is not None and executor not in self.executors:
            self.executors[executor] = build_executor(executor, self.engine, self.executor_options.get(executor, {}))
        built = self.executors.get(executor) if executor is not None else None
        t0 = time.perf_counter()
        res = engine.generate(content, max_tokens=max_tokens, method=name, raw=raw,
                                   temperature=self.sampling["temperature"], top_p=self.sampling["top_p"],
                                   top_k=self.sampling["top_k"], seed=self.sampling["seed"],
                                   executor=built or executor, **opts)
        wall = time.perf_counter() - t0
        stats = getattr(res, "stats", None) or {}
        return {
            "token_ids": [int(t) for t in res.token_ids],
            "text": res.text,
            "prompt_tokens": _stat(stats, "prompt_tokens"),
            "wall_s": wall,
            "ttft_s": _stat(stats, "ttft_s"),
            "tokens_per_s": _stat(stats, "tokens_per_s"),
            "tbt_ms_p50": _stat(stats, "tbt_ms_p50"),
            "mean_accepted_tokens": _stat(stats, "mean_accepted_tokens"),
            "acceptance_rate": _stat(stats, "acceptance_rate"),
            "engine_stats": _jsonable(dict(stats) if isinstance(stats, dict) else getattr(stats, "__dict__", {})),
        }

    def run(self, prompt: Prompt, method: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"id": prompt.id, "category": prompt.category, "method": method}
        gc.collect()  # outside the clock: a collection mid-generation would bias one method
        try:
            r = self.generate(method, prompt.content, prompt.raw, self.max_tokens)
        except SpecwoodError as e:  # e.g. a prompt too long for the context: record it, keep going
            rec.update(error=str(e), text="", token_ids=[], new_tokens=0, tokens_per_s=None)
            return rec
        n = len(r["token_ids"])
        wall = r["wall_s"]
        rec.update(
            text=r["text"],
            token_ids=r["token_ids"],
            new_tokens=n,
            prompt_tokens=r.get("prompt_tokens"),
            wall_s=wall,
            # decode throughput (tokens after the first / time after the first), the engine's definition
            tokens_per_s=r.get("tokens_per_s"),
            # end to end: all new tokens / the whole call, measured here the same way for every method
            e2e_tokens_per_s=n / wall if wall > 0 and n else None,
            ttft_s=r.get("ttft_s"),
            # prefill throughput: prompt tokens over the time to the first token
            prefill_tokens_per_s=(r["prompt_tokens"] / r["ttft_s"]
                                  if r.get("prompt_tokens") and r.get("ttft_s") else None),
            tbt_ms_p50=r.get("tbt_ms_p50"),
            mean_accepted_tokens=r.get("mean_accepted_tokens"),
            acceptance_rate=r.get("acceptance_rate"),
        )
        if "engine_stats" in r:
            rec["engine_stats"] = r["engine_stats"]
        return rec

    def close(self) -> None:
        for executor in self.executors.values():
            if executor is not None:
                executor.close()

    def warmup(self, method: str) -> None:
        """One short untimed generation: first-call allocations, kernel selection, lazy init.
        Errors here are configuration errors (unknown method, missing draft) and abort the bench."""
        chat = takes_chat(self.engine)
        content = WARMUP_MESSAGES if chat else "\n\n".join(m["content"] for m in WARMUP_MESSAGES)
        self.generate(method, content, not chat, min(WARMUP_TOKENS, self.max_tokens))


def takes_chat(engine: EngineLike) -> bool:
    """Whether chat messages can be encoded: False for a base model whose tokenizer has no chat
    template (its prompts then run as raw text)."""
    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer is None or bool(getattr(tokenizer, "chat_template", None))


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (prompt, method)'s record from its repeated runs: the run with the median decode rate
    (the lower one of an even count), so every field of the record comes from one real run, plus
    every run's rate and TTFT (`tokens_per_s_runs`, `ttft_s_runs`) and whether all runs produced
    the same tokens. A failed run is the record."""
    failed = next((r for r in runs if r.get("error")), None)
    if failed is not None or len(runs) == 1:
        return failed or runs[0]
    ordered = sorted(runs, key=lambda r: r.get("tokens_per_s") or 0.0)
    rec = dict(ordered[(len(ordered) - 1) // 2])
    rec["tokens_per_s_runs"] = [r.get("tokens_per_s") for r in runs]
    rec["ttft_s_runs"] = [r.get("ttft_s") for r in runs]
    rec["same_tokens_every_run"] = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    return rec


def _progress(total: int, enabled: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: run silently
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n: int = 1) -> None: ...
            def set_postfix_str(self, s: str) -> None: ...
            def write(self, s: str) -> None: print(s, file=sys.stderr)
            def close(self) -> None: ...
        return _Null()
    bar = tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, dynamic_ncols=True)

    def write(s: str) -> None:
        tqdm.write(s, file=sys.stderr)

    bar.write = write  # type: ignore[method-assign, assignment]  # this bar's own write, to stderr
    return bar


def _mark_agreement(records: list[dict[str, Any]], eos: Sequence[int]) -> None:
    """matches_ar on every non-ar record: greedy outputs must be token-identical to ar (lossless)."""
    methods = _report.ordered_unique(r["method"] for r in records)
    for r in records:
        base = _report.ar_for(r["method"], methods)  # 'NAME@BACKEND' rows: that backend's own ar
        ar = next((a for a in records if a["method"] == base and a["id"] == r["id"] and _report.ok(a)), None)
        if r["method"] != base and _report.ok(r) and ar is not None:
            r["matches_ar"] = (_report._strip_eos(r["token_ids"], eos) == _report._strip_eos(ar["token_ids"], eos))


def write_outputs(out_dir: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """results.json, run.json, PNGs, report.md; returns the markdown report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_jsonable(records), indent=1, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    plots: list[Path] = []
    if any(_report.ok(r) for r in records):
        try:
            plots = _report.make_plots(records, out_dir)
        except ImportError:
            meta.setdefault("workload", {}).setdefault("notes", []).append(
                "plots skipped: matplotlib is not installed (pip install matplotlib)")
    meta["outputs"] = ["results.json", "run.json", "report.md", *[p.name for p in plots]]
    (out_dir / "run.json").write_text(json.dumps(_jsonable(meta), indent=1, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
    md = _report.markdown_report(records, meta, plots=[str(p) for p in plots])
    (out_dir / "report.md").write_text(md, encoding="utf-8")
    return md


def run_bench(engine: EngineLike, workload: Workload | Sequence[Prompt] | str, methods: str | Sequence[str],
              out_dir: str | os.PathLike[str], sampling: dict[str, Any] | None = None,
              method_options: dict[str, Any] | None = None, max_tokens: int = 128, *,
              run_info: dict[str, Any] | None = None, warmup: bool = True, progress: bool = True,
              on_record: Callable[[dict[str, Any]], None] | None = None,
              executor_options: dict[str, Any] | None = None, repeats: int = 1) -> list[dict[str, Any]]:
    """Benchmark `methods` on `workload` with one loaded engine; write results into `out_dir`.

    sampling: temperature/top_p/top_k/seed (greedy by default). method_options: passed to every
    engine method except `ar` (budget, depth, topk, threshold, ...). A method named 'NAME@parallel'
    runs NAME on the DuoDecoding parallel executor and 'NAME@pipeline' on the pipeline executor
    (executor_options: {"parallel": ParallelExecutor options, "pipeline": PipelineExecutor
    options}), so rows of every executor come from the same run. run_info: extra metadata for
    run.json (command, target, draft, dtype, device...). repeats: run every (prompt, method) that
    many times, the methods in a rotated order each time, and keep the run with the median decode
    rate (`median_run`): one record per (prompt, method) either way. Returns those records.
    A generation that raises SpecwoodError is recorded with an `error` and the run goes on; an
    interrupt still writes what finished (run.json says completed: false) and re-raises.
    """
    methods = parse_methods(methods)
    sampling = normalise_sampling(sampling)
    method_options = {k: v for k, v in (method_options or {}).items() if v is not None}
    if max_tokens < 1:
        raise SamplingParamsError(f"max tokens must be >= 1 (got {max_tokens})")
    if repeats < 1:
        raise SpecwoodError(f"repeats must be >= 1 (got {repeats})")
    if isinstance(workload, str):
        workload = load_workload(workload)
    elif not isinstance(workload, Workload):
        workload = Workload(prompts=list(workload), source="(in memory)")
    if not workload.prompts:
        raise SpecwoodError("the workload has no prompts to run (check --categories / --limit)")
    # a base model: the chat prompts as raw text
    if not takes_chat(engine) and any(not p.raw for p in workload.prompts):
        workload = Workload(prompts=[p.as_raw() for p in workload.prompts], source=workload.source)
        if progress:
            print("[bench] the model has no chat template: chat prompts run as raw text (their contents)",
                  file=sys.stderr)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    meta = run_metadata(engine, workload, methods, sampling, method_options, max_tokens, run_info)
    meta["repeats"] = repeats
    runner = _Runner(engine, methods, sampling, method_options, max_tokens, executor_options)
    if runner.llamacpp is not None:
        meta["llama.cpp"] = runner.llamacpp.settings()
    meta["backend"] = getattr(engine, "backend", "torch")  # of rows without an @BACKEND suffix
    meta["draft_backend"] = getattr(engine, "draft_backend", None)
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    meta["completed"] = False
    bar = None
    try:
        bar = _progress(len(workload.prompts) * len(methods) * repeats, progress)
        if warmup:
            for m in methods:
                bar.set_postfix_str(f"warm-up [{m}]")
                runner.warmup(m)
        for prompt in workload.prompts:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for k in range(repeats):
                for m in methods[k % len(methods):] + methods[:k % len(methods)]:  # no method always first
                    if runs[m] and runs[m][-1].get("error"):  # the same input fails the same way again
                        bar.update(1)
                        continue
                    bar.set_postfix_str(f"{prompt.id} [{m}]" + (f" {k + 1}/{repeats}" if repeats > 1 else ""))
                    rec = runner.run(prompt, m)
                    if rec.get("error"):
                        bar.write(f"specwood bench: {prompt.id} [{m}] failed: {rec['error']}")
                    runs[m].append(rec)
                    bar.update(1)
            for m in methods:
                rec = median_run(runs[m])
                records.append(rec)
                if on_record:
                    on_record(rec)
        meta["completed"] = True
    finally:
        runner.close()
        if bar is not None:
            bar.close()
        meta["elapsed_s"] = round(time.perf_counter() - t_start, 3)
        meta["n_errors"] = sum(1 for r in records if r.get("error"))
        _mark_agreement(records, meta["eos_token_ids"])
        if records or meta["completed"]:
            write_outputs(out, records, meta)
    return records


__all__ = ["run_bench", "parse_methods", "normalise_sampling", "machine_info", "write_outputs",
           "METHOD_OPTION_KEYS"]
