"""`specwood bench --fidelity`: how close each weight mode's logits are to the model in the file.

The yardstick (DESIGN.md, "Weight fidelity") is the file's own weights dequantised exactly and
computed in fp32 (`load(..., dtype="fp32")`). Every weight mode, and llama.cpp's own logits, are
teacher-forced over the same token ids of two texts that ship with Python (not written by us):

- code: the first N tokens of the standard library's ``json/decoder.py``;
- prose: the first N tokens of the licence text ``LICENSE.txt`` in the standard library's folder,
  or, where an installation does not ship it, the Zen of Python (the ``this`` module, decoded).

Per (mode, text) we report the perplexity of the text, the mean KL(reference || mode) over
positions and the top-1 agreement with the reference's argmax. Position i's logits predict token
i + 1, so N tokens give N - 1 positions for all three figures.

Outputs in ``--out``: ``fidelity.json`` (every figure, machine, date, command line, git state,
text sources, token counts), ``fidelity.md`` (one table) and ``fidelity.png`` (KL per mode per text).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import hashlib
import inspect
import io
import json
import math
import shlex
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specwood.errors import SpecwoodError

REFERENCE = "fp32"  # the file's weights dequantised exactly, computed in fp32
LLAMA_CPP = "llama.cpp"  # not a weight mode: llama-cpp-python's logits of the GGUF file as it is
DEFAULT_MODES = ("fp32", "q4", "int8", "bf16", LLAMA_CPP)
DEFAULT_TOKENS = 512
TEXT_NAMES = ("code", "prose")
METRIC_BLOCK = 64  # positions per float64 block: 64 x 151,936 x 8 bytes = 78 MB per temporary
LLAMA_CPP_THREADS = 2


# ------------------------------------------------------------------------------------------- texts
@dataclass
class Text:
    """One text the modes are measured on, with where it came from (for the json)."""

    name: str  # "code" or "prose"
    source: str  # what it is, in words
    path: str
    text: str

    def describe(self) -> dict[str, Any]:
        data = self.text.encode("utf-8")
        return {"source": self.source, "path": self.path, "chars": len(self.text),
                "sha256": hashlib.sha256(data).hexdigest()}


def code_text() -> Text:
    """json/decoder.py of this Python's standard library: ordinary, well-commented Python source."""
    import json.decoder

    path = inspect.getsourcefile(json.decoder)
    if path is None or not Path(path).is_file():
        raise SpecwoodError("the code text (json/decoder.py of the standard library) is missing from this Python "
                            "installation; install a Python that ships its standard library sources")
    return Text("code", "json/decoder.py of the Python standard library (inspect.getsourcefile(json.decoder))",
                path, Path(path).read_text(encoding="utf-8"))


def prose_text() -> Text:
    """LICENSE.txt in the standard library's folder if this installation ships it (python.org and
    pyenv builds do; Debian's python moves it elsewhere), else the Zen of Python: a fixed rule, so
    the same installation always measures the same text."""
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if lic.is_file():
        return Text("prose", "LICENSE.txt of the Python installation (sysconfig.get_paths()['stdlib'])",
                    str(lic), lic.read_text(encoding="utf-8"))
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    zen = codecs.decode(this.s, "rot13")
    if not zen.strip():
        raise SpecwoodError(f"no prose text: {lic} is missing and the `this` module holds no text")
    return Text("prose", f"the Zen of Python (the `this` module, rot13-decoded; {lic} is missing)",
                str(inspect.getsourcefile(this)), zen)


def stdlib_texts() -> list[Text]:
    return [code_text(), prose_text()]


def first_tokens(tokenizer: Any, text: str, n: int) -> tuple[list[int], int]:
    """The first n token ids of the raw text (no chat template, no BOS or other added token) and
    the text's whole length in tokens."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < 2:
        raise SpecwoodError("a fidelity text needs at least 2 tokens")
    return ids[:n], len(ids)


# ----------------------------------------------------------------------------------------- metrics
def fidelity_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, tokens: Sequence[int],
                     block: int = METRIC_BLOCK) -> dict[str, float | int]:
    """Teacher-forced figures of `logits` against `ref_logits` (both [n, V], row i after tokens
    [0, i], n = len(tokens)); rows 0..n-2 predict tokens 1..n-1, the last row predicts nothing.

    kl: mean over positions of KL(ref || mode) in nats; kl_first: position 0's (after one token,
    no context: outlier activations there can dominate the mean of per-row-quantised modes);
    kl_max, kl_max_position: the largest and where (position i = the logits after tokens [0, i]); top1: the
    share of positions where the argmaxes agree; ppl: exp(mean negative log-likelihood of the
    text's next tokens) under `logits`. Float64 log-softmax, in blocks of rows to bound memory."""
    n = len(tokens) - 1
    if n < 1:
        raise SpecwoodError("fidelity metrics need at least 2 tokens")
    if ref_logits.shape != logits.shape or ref_logits.dim() != 2 or ref_logits.shape[0] != len(tokens):
        raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(ref_logits.shape)} must both be "
                         f"[{len(tokens)}, V]")
    nxt = torch.as_tensor(list(tokens[1:]), dtype=torch.long)
    kl_sum = kl_max = nll_sum = kl_first = 0.0
    agree = kl_max_at = 0
    for s in range(0, n, block):
        e = min(s + block, n)
        ref = torch.log_softmax(ref_logits[s:e].double(), dim=-1)
        mod = torch.log_softmax(logits[s:e].double(), dim=-1)
        p = ref.exp()
        # 0 * log 0 = 0: a token the reference rules out (-inf logit) adds nothing
        kl = torch.where(p > 0, p * (ref - mod), torch.zeros((), dtype=torch.float64)).sum(dim=-1)
        kl_sum += float(kl.sum())
        if s == 0:
            kl_first = float(kl[0])
        if float(kl.max()) > kl_max:  # where the worst position is says whether it is the context-free start
            kl_max, kl_max_at = float(kl.max()), s + int(kl.argmax())
        agree += int((ref_logits[s:e].argmax(dim=-1) == logits[s:e].argmax(dim=-1)).sum())
        nll_sum -= float(mod.gather(1, nxt[s:e, None]).sum())
    return {"kl": kl_sum / n, "kl_first": kl_first, "kl_max": kl_max, "kl_max_position": kl_max_at,
            "top1": agree / n, "ppl": math.exp(nll_sum / n), "nll": nll_sum / n, "positions": n}


# ------------------------------------------------------------------------------------------ logits
def teacher_forced_logits(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Every position's logits [n, V] (fp32) of one forward over `tokens`, run as the engine runs
    a prompt's prefill (`prefill_input` rows through `forward_rows`, PREFILL_CHUNK tokens at a
    time into a KV cache) but asking for every token's logits instead of the last one's."""
    from specwood.models.batch import forward_rows
    from specwood.models.prefill import PREFILL_CHUNK, prefill_input

    ids = list(tokens)
    cache = model.new_cache(len(ids))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(ids))
            row = prefill_input(0, ids, start, end)
            row.outputs = torch.arange(end - start)
            out.append(forward_rows(model, cache, [row])[0].float())
            cache.lengths[0] = end
    return torch.cat(out)


def _release_memory() -> None:
    """After the caller dropped a model: give its memory back before the next one loads (the fp32
    target alone is ~7 GB)."""
    from specwood.heap import release_freed_memory

    gc.collect()
    release_freed_memory()


def llama_cpp_logits(target: str, token_lists: Sequence[Sequence[int]], vocab_size: int,
                     threads: int = LLAMA_CPP_THREADS, on_text: Callable[[str, float], None] | None = None
                     ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """llama.cpp's own logits (llama-cpp-python, the GGUF file as it is) for every position of each
    token list: [n, V] each. Raises SpecwoodError (one line) without the extra or for a non-GGUF
    target. Columns past the torch model's vocabulary are dropped and missing ones filled with
    the row's minimum (neither happens for the default model; noted in the info if it does)."""
    import numpy as np

    from specwood.models.llamacpp import gguf_path, import_llama_cpp

    lc = import_llama_cpp()
    path = gguf_path(target)
    t0 = time.perf_counter()
    llm = lc.Llama(model_path=str(path), logits_all=True, n_ctx=max(len(t) for t in token_lists),
                   n_threads=threads, n_threads_batch=threads, verbose=False)
    info: dict[str, Any] = {"backend": LLAMA_CPP, "llama_cpp_python": getattr(lc, "__version__", None),
                            "gguf": str(path), "n_vocab": int(llm.n_vocab()), "threads": threads,
                            "load_s": time.perf_counter() - t0}
    out = []
    try:
        for ids in token_lists:
            t1 = time.perf_counter()
            llm.reset()
            llm.eval(list(ids))
            scores = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
            if on_text is not None:
                on_text(f"{len(ids)} tokens", time.perf_counter() - t1)
            if scores.shape[1] != vocab_size:
                info["vocab_note"] = f"llama.cpp gives {scores.shape[1]} logits per row, the model {vocab_size}"
                if scores.shape[1] > vocab_size:
                    scores = scores[:, :vocab_size]
                else:
                    pad = scores.min(dim=1, keepdim=True).values.expand(-1, vocab_size - scores.shape[1])
                    scores = torch.cat([scores, pad], dim=1)
            out.append(scores)
    finally:
        if hasattr(llm, "close"):
            llm.close()
        del llm
    return out, info


def load_mode(target: str, mode: str, device: str, max_context: int) -> tuple[Any, dict[str, Any]]:
    """The target loaded in weight mode `mode` through the public API: the mode string goes to
    `load`'s dtype as it is, so the loader itself names an unknown mode (one line)."""
    from specwood.engine.api import load

    t0 = time.perf_counter()
    engine = load(target, None, dtype=mode, device=device, max_context=max_context, progress=False)
    return engine, {"backend": engine.backend, "weight_mode": getattr(engine.target, "weight_mode", mode),
                    "activation_dtype": str(engine.dtype).replace("torch.", ""), "load_s": time.perf_counter() - t0}


def torch_mode_logits(target: str, mode: str, token_lists: Sequence[Sequence[int]], device: str,
                      on_text: Callable[[str, float], None] | None = None
                      ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Load the target in `mode`, teacher-force each token list, free the model."""
    engine, info = load_mode(target, mode, device, max(len(t) for t in token_lists))
    out = _forward_all(engine.target, token_lists, on_text)
    del engine
    _release_memory()
    return out, info


def _forward_all(model: Any, token_lists: Sequence[Sequence[int]],
                 on_text: Callable[[str, float], None] | None) -> list[torch.Tensor]:
    out = []
    for ids in token_lists:
        t0 = time.perf_counter()
        out.append(teacher_forced_logits(model, ids))
        if on_text is not None:
            on_text(f"{len(ids)} tokens", time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------------ runner
def parse_modes(modes: str | Sequence[str]) -> list[str]:
    """'fp32,q4,llama.cpp' -> unique names in order (validated by the loader, not here)."""
    items = modes.split(",") if isinstance(modes, str) else list(modes)
    out = list(dict.fromkeys(m.strip() for m in items if m.strip()))
    if not out:
        raise SpecwoodError("--fidelity-modes is empty (e.g. fp32,q4,int8,bf16,llama.cpp)")
    return out


def git_state() -> dict[str, Any]:
    """HEAD and the uncommitted changes under specwood/models (the kernels may be mid-change)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=root)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.rstrip("\n") if r.returncode == 0 else None

    return {"head": git("rev-parse", "HEAD"),
            "status_short_specwood_models": git("status", "--short", "specwood/models")}


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


def run_fidelity(target: str | None, modes: str | Sequence[str] = DEFAULT_MODES, n_tokens: int = DEFAULT_TOKENS,
                 out_dir: str | Path | None = None, *, device: str = "cpu", progress: bool = True,
                 texts: Sequence[Text] | None = None, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure every mode against the fp32 reference on the texts; write the outputs to `out_dir`
    (when given) and return the result (what fidelity.json holds).

    The reference runs first and its logits are the only ones kept; then each mode is loaded,
    measured and freed in turn. A mode the loader refuses becomes a row with its one-line error
    (the others still run); llama.cpp without llama-cpp-python becomes a skipped row."""
    from specwood.bench.harness import machine_info
    from specwood.models.registry import DEFAULT_TARGET

    if n_tokens < 2:
        raise SpecwoodError(f"--fidelity-tokens must be >= 2 (got {n_tokens})")
    mode_list = parse_modes(modes)
    target = str(target or DEFAULT_TARGET)
    texts = list(texts) if texts is not None else stdlib_texts()
    started = time.perf_counter()
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")  # when it started
    git_at_start = git_state()  # the code that runs is the code at the start (another edit may land mid-run)

    # the reference: loaded first, its tokenizer gives the one list of ids every row uses
    _say(f"reference {REFERENCE}: loading {target} ...", progress)
    engine, ref_info = load_mode(target, REFERENCE, device, n_tokens)
    token_lists, text_info = [], {}
    for t in texts:
        ids, total = first_tokens(engine.tokenizer, t.text, n_tokens)
        token_lists.append(ids)
        text_info[t.name] = {**t.describe(), "file_tokens": total, "tokens": len(ids), "positions": len(ids) - 1}
    vocab_size = engine.target.config.vocab_size
    ref_times: list[float] = []
    ref_logits = _forward_all(engine.target, token_lists, on_text=lambda what, s: ref_times.append(s))
    del engine
    _release_memory()
    _say(f"reference {REFERENCE}: load {ref_info['load_s']:.1f}s, "
         + ", ".join(f"{t.name} {len(ids)} tokens {s:.1f}s" for t, ids, s in zip(texts, token_lists, ref_times)),
         progress)

    def row_from(mode: str, info: dict[str, Any], logits: list[torch.Tensor], times: list[float]) -> dict[str, Any]:
        figures = {}
        for t, ids, ref, lg, s in zip(texts, token_lists, ref_logits, logits, times):
            figures[t.name] = {**fidelity_metrics(ref, lg, ids), "forward_s": s}
        return {"mode": mode, **info, "texts": figures}

    rows: list[dict[str, Any]] = [row_from(REFERENCE, {**ref_info, "reference": True}, ref_logits, ref_times)]
    for mode in mode_list:
        if mode == REFERENCE:
            continue  # the reference row above is this mode
        t0 = time.perf_counter()
        _say(f"{mode}: loading ...", progress)
        times: list[float] = []
        try:
            if mode == LLAMA_CPP:
                logits, info = llama_cpp_logits(target, token_lists, vocab_size,
                                                on_text=lambda what, s: times.append(s))
            else:
                logits, info = torch_mode_logits(target, mode, token_lists, device,
                                                 on_text=lambda what, s: times.append(s))
        except SpecwoodError as e:
            if mode == LLAMA_CPP:  # an optional extra (or a target llama.cpp cannot read): no figures
                rows.append({"mode": mode, "backend": LLAMA_CPP, "skipped": str(e)})
                _say(f"{mode}: skipped: {e}", True)
            else:  # the loader's own one line (an unknown mode, q4 on a CPU without its kernel, ...)
                rows.append({"mode": mode, "error": str(e)})
                _say(f"{mode}: error: {e}", True)
            continue
        except Exception as e:  # noqa: BLE001 - one broken mode must not discard the others' minutes of work
            rows.append({"mode": mode, "error": f"{type(e).__name__}: {e}"})
            _say(f"{mode}: error: {type(e).__name__}: {e}", True)
            _release_memory()
            continue
        rows.append(row_from(mode, info, logits, times))
        del logits
        _release_memory()
        r = rows[-1]["texts"]
        _say(f"{mode}: {time.perf_counter() - t0:.1f}s; "
             + ", ".join(f"{n}: KL {r[n]['kl']:.4f}, top-1 {r[n]['top1']:.3f}, ppl {r[n]['ppl']:.3f}" for n in r),
             progress)

    result = {
        "kind": "fidelity",
        "date": date,
        **(run_info or {}),
        "target": target,
        "device": device,
        "reference": REFERENCE,
        "modes": mode_list,
        "tokens_requested": n_tokens,
        "texts": text_info,
        "metrics": {"kl": "mean over positions of KL(reference || mode), nats, float64 log-softmax of fp32 logits",
                    "kl_first": "KL at position 0 (one token of context)",
                    "kl_max": "largest per-position KL (at kl_max_position)",
                    "top1": "share of positions where argmax agrees with the reference's",
                    "ppl": "exp(mean NLL of the text's next token) under the mode",
                    "positions": "tokens - 1: position i's logits predict token i + 1"},
        "git": git_at_start,
        "specwood_path": str(Path(__file__).resolve().parents[1]),
        "machine": machine_info(),
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    git_at_end = git_state()
    if git_at_end != git_at_start:  # the modes loaded at different times may have run different code
        result["git_end"] = git_at_end
        result.setdefault("notes", []).append("the git state changed during the run (see git and git_end)")
        _say("note: the git state changed during the run; fidelity.json records both", True)
    if out_dir is not None:
        write_outputs(Path(out_dir), result)
    return result


# ----------------------------------------------------------------------------------------- outputs
def _num(x: float) -> str:
    """KL and perplexity span many decades (a random tiny model's ppl is ~1e17): 5 decimals where
    that shows 3+ digits, else 4 significant digits in exponent form."""
    if x == 0:
        return "0"
    return f"{x:.5f}" if 1e-3 <= abs(x) < 1e4 else f"{x:.3e}"


def markdown_table(result: dict[str, Any]) -> str:
    """| mode | code: KL | code: top-1 | code: ppl | prose: KL | ... |, then notes for rows without figures."""
    names = list(result["texts"])
    head = ["mode"] + [f"{n}: {m}" for n in names for m in ("KL", "top-1", "ppl")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    notes = []
    for r in result["rows"]:
        label = r["mode"] + (" (reference)" if r.get("reference") else "")
        if "texts" not in r:
            lines.append("| " + " | ".join([label] + ["—"] * (len(head) - 1)) + " |")
            what = "skipped" if "skipped" in r else "error"
            notes.append(f"- {r['mode']}: {what}: {r[what]}")
            continue
        cells = [label]
        for n in names:
            f = r["texts"][n]
            cells += [_num(f["kl"]), f"{f['top1']:.4f}", _num(f["ppl"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def markdown_report(result: dict[str, Any]) -> str:
    git = result.get("git") or {}
    status = git.get("status_short_specwood_models")
    out = [f"# Weight fidelity: {result['target']}", "",
           f"- reference: the file's weights dequantised exactly, fp32 (`dtype={REFERENCE}`)",
           f"- date: {result['date']}"]
    if result.get("command"):
        out.append(f"- command: `{result['command']}`")
    out.append(f"- machine: {(result.get('machine') or {}).get('summary')}")
    shown = "; ".join(f"`{line.strip()}`" for line in status.splitlines()) if status else "unknown"
    out.append(f"- git HEAD: {git.get('head')}; `git status --short specwood/models`: "
               + ("clean" if status == "" else shown))
    for name, t in result["texts"].items():
        out.append(f"- {name}: {t['source']}: first {t['tokens']} of {t['file_tokens']} tokens "
                   f"({t['positions']} positions), sha256 {t['sha256'][:12]}")
    out += [f"- note: {n}" for n in result.get("notes", [])]
    out += ["", "KL = mean KL(reference ‖ mode) in nats over positions; top-1 = agreement with the reference's "
            "argmax; ppl = perplexity of the text under the mode.", "", markdown_table(result)]
    if result.get("plot"):
        out += ["![KL per mode](fidelity.png)", ""]
    return "\n".join(out)


def plot_kl(result: dict[str, Any], path: Path) -> Path:
    """Grouped bars, log scale: KL per mode (the reference's is 0 and is left out) per text."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(result["texts"])
    rows = [r for r in result["rows"] if "texts" in r and not r.get("reference")]
    fig = Figure(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(rows))]
        ys = [r["texts"][n]["kl"] for r in rows]
        bars = ax.bar(xs, [max(y, 1e-12) for y in ys], width=width, label=n)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["mode"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("mean KL(fp32 reference ‖ mode), nats")
    ax.set_title(f"Weight fidelity vs the fp32 reference, {result['target']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_outputs(out_dir: Path, result: dict[str, Any]) -> str:
    """fidelity.json, fidelity.png (when matplotlib is there and some mode has figures), fidelity.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = ["fidelity.json", "fidelity.md"]
    if any("texts" in r and not r.get("reference") for r in result["rows"]):
        try:
            plot_kl(result, out_dir / "fidelity.png")
            outputs.append("fidelity.png")
            result["plot"] = "fidelity.png"
        except ImportError:
            result.setdefault("notes", []).append("plot skipped: matplotlib is not installed (pip install matplotlib)")
    result["outputs"] = outputs
    (out_dir / "fidelity.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    md = markdown_report(result)
    (out_dir / "fidelity.md").write_text(md, encoding="utf-8")
    return md


# --------------------------------------------------------------------------------------------- CLI
def run_fidelity_cli(args: Any) -> int:
    """`specwood bench --fidelity`: 0 on success, 1 if some mode failed, 2 on a usage/model error,
    130 on Ctrl-C. The table goes to stdout, progress to stderr."""
    try:
        modes = parse_modes(args.fidelity_modes)
        if args.fidelity_tokens < 2:
            raise SpecwoodError(f"--fidelity-tokens must be >= 2 (got {args.fidelity_tokens})")
        argv = ["specwood", *sys.argv[1:]]
        result = run_fidelity(args.target, modes, args.fidelity_tokens, args.out, device=args.device,
                              progress=not getattr(args, "no_progress", False),
                              run_info={"command": shlex.join(argv), "argv": argv})
    except SpecwoodError as e:
        print(f"specwood bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwood bench: interrupted", file=sys.stderr)
        return 130
    print(markdown_table(result), end="")
    print(f"specwood bench: fidelity results in {args.out} ({result['elapsed_s']:.0f}s)", file=sys.stderr)
    return 1 if any("error" in r for r in result["rows"]) else 0
