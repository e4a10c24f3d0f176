"""What a user sees over HTTP: `specwood serve` beside llama.cpp's own `llama-server`, same client,
same prompts (issue 29's goal: default pair, this CPU, `ar` >= 0.95x llama.cpp's plain decoding
tok/s and `auto` >= 1.2x, on held-out-style prompts of every category, over the server).

    python benchmarks/server_compare.py --out benchmarks/results/server/server_compare_DATE \\
        [--prompts benchmarks/heldout_prompts.jsonl] [--max-tokens 128] [--concurrency 1,4,8] \\
        [--methods ar,auto] [--llama-spec] [--rounds 1] [--paired] [--require-plan] [--limit N]

One server at a time, on 127.0.0.1 at a free port, always stopped afterwards (also on errors and
interrupts; SIGTERM too):
- `llama.cpp`: llama-server (built from the sources vendored in the installed llama-cpp-python
  sdist: `python -m specwood.bench.llama_server build`, done here when missing) on the default
  target GGUF, `-t T -tb T`, one server per concurrency level c with `-np c` and `-c CTX*c` (CTX
  tokens per slot, like specwood's rows), its default sampler chain at temperature 0 (greedy);
- `llama.cpp+draft` (with --llama-spec): the same with llama.cpp's own speculative decoding,
  drafting with the default draft GGUF (`-md DRAFT --spec-type draft-simple`: -md alone only loads
  the draft in this llama.cpp; its default draft settings otherwise, --spec-draft-n-max 3);
- `specwood serve` (`specwood.bench.server_process.serve_command`: --max-batch max(c), --max-context
  CTX, no background planning), each request picking its method with the body field "method" and
  a fresh "cache_salt" (a cache scope of its own: the methods and levels send the same prompts to
  one server, and without it `auto` copied `ar`'s answers from the suffix cache and reused its
  prefix K/V, BENCHMARKS §34).

Every server gets one untimed warm-up request (per method) first. Then, per concurrency level c,
the same request list (the prompts interleaved across categories, cycled to max(#prompts, 2c)
requests, as `specwood loadtest` does) is sent by c closed-loop streaming clients
(`load_requests.stream_request`: OpenAI chat/completions bodies with stream=true, stream_options
include_usage, temperature 0, max_tokens N; no "model" field, so the bodies are identical except
specwood's "method"). Every request has a timeout. Reported:
- c = the smallest level (1 by default): per-request decode tok/s ((completion tokens - 1) / (last
  chunk - first chunk), client clock), mean over requests, overall and per category, and TTFT;
- every level: aggregate decode tok/s (sum of tokens after each request's first / level wall time);
- ratios: ar / llama.cpp, auto / llama.cpp, auto / ar (and llama.cpp+draft / llama.cpp).
With --rounds R the whole sequence runs R times, alternating the order of the servers, and the
numbers are pooled (per-round ratios are listed too).

With --paired, every level runs with every server up at once (llama-server with -np c): each wave
of c requests goes to each server and method in turn, the order rotated per wave, and the report
adds per-prompt ratios at c = 1 (geometric mean over prompts and rounds, and the lowest); a
level's aggregate rate is its series' tokens over the walls of its own waves. On a shared host the machine's
speed drifts by up to a fifth over tens of seconds (BENCHMARKS §35: one process's plain step went
from 25 to 19.5 ms and back), so levels measured a minute apart compare the drift as much as the
servers; a pair measured seconds apart does not. An idle server's threads sleep.

The machine must be otherwise idle: llama.cpp's threads spin while waiting for each other, so one
busy neighbour on a 2-core CPU cuts its decode to a few tok/s. Each level measures the CPU used
by other processes meanwhile (/proc); a level above 0.25 cores is measured again (--retry-noisy,
default 2 more times; llama-server restarted, so no prompt cache carries over) and otherwise kept
and flagged in the report. --wait-idle S waits up to S seconds for quiet before each server start.
A full run (16 prompts, 128 tokens, c = 1,4,8, ar and auto) should take about 25 minutes on 2 cores
(estimated from the smoke runs; --llama-spec adds about 8), more when noisy levels are measured again.

`auto` follows the measured plan stored by `specwood plan`; without one the server runs it on
the starter plan. The report says which (from the server's own start-up log), and --require-plan
stops before measuring when there is none.

Writes results.json (every request record) and report.md into --out, plus one log per server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from specwood.bench import llama_server as LS
from specwood.bench.load_report import _jsonable, machine_summary
from specwood.bench.load_requests import (WARMUP_MESSAGES, _require_httpx, parse_concurrency, plan_requests,
                                          stream_request)
from specwood.bench.load_stats import summarize_level
from specwood.bench.server_process import ServerProcess, free_port, serve_command
from specwood.bench.workload import Prompt, load_workload
from specwood.errors import SpecwoodError

LLAMA = "llama.cpp"
LLAMA_SPEC = "llama.cpp+draft"
SPECWOOD = "specwood"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO / "benchmarks" / "heldout_prompts.jsonl"
WARMUP_TOKENS = 16
GOALS = {"ar": 0.95, "auto": 1.2}  # issue 29: x llama.cpp's plain decoding tok/s


def log(msg: str) -> None:
    print(f"server_compare: {msg}", file=sys.stderr, flush=True)


def _mean(xs: Sequence[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if not isinstance(x, (int, float)) else f"{x:{spec}}{suffix}"


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ------------------------------------------------------------------------------------------ client
async def _one_level(base: str, requests: Sequence[Any], method: str | None, c: int, max_tokens: int,
                     timeout: float, tag: str) -> tuple[list[dict[str, Any]], float]:
    """c closed-loop streaming clients over `requests`; (records in request order, wall time)."""
    httpx = _require_httpx()
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    records: list[dict[str, Any]] = []
    todo = iter(enumerate(requests))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0),
                                 trust_env=False) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            for i, p in todo:
                rec = await _send(client, base, p, method, max_tokens, timeout, i, t0)
                records.append(rec)
                _log_request(tag, rec, len(records), len(requests))

        await asyncio.gather(*(worker() for _ in range(min(c, len(requests)))))
        wall = time.perf_counter() - t0
    records.sort(key=lambda r: r["index"])
    return records, wall


async def _send(client: Any, base: str, p: Any, method: str | None, max_tokens: int, timeout: float, index: int,
                t0: float) -> dict[str, Any]:
    """One streaming request, recorded with its prompt's id, category and start (s after t0)."""
    t_start = time.perf_counter()
    # specwood's requests each in a cache scope of their own: the methods run the same prompts
    # on one server, and auto would otherwise copy ar's answer to its prompt
    salt = uuid.uuid4().hex if method else None
    r = await stream_request(client, base, p, method, max_tokens, timeout, None, continuous_usage=True,
                             cache_salt=salt)
    return {"index": index, "id": p.id, "category": p.category, "start_s": round(t_start - t0, 6), **r}


def _log_request(tag: str, rec: dict[str, Any], done: int, total: int) -> None:
    if rec.get("error"):
        log(f"{tag} {done}/{total} {rec['id']} failed: {rec['error']}")
    else:
        aat = rec.get("mean_accepted_tokens")
        log(f"{tag} {done}/{total} {rec['id']}: {rec['completion_tokens']} tokens, "
            f"TTFT {rec['ttft_s']:.2f} s, {_fmt(rec.get('decode_tokens_per_s'), '.1f')} tok/s"
            + (f", AAT {aat:.2f}" if isinstance(aat, (int, float)) else ""))


async def _paired_level(targets: Sequence[tuple[str, str | None, str]], requests: Sequence[Any], c: int,
                        max_tokens: int, timeout: float, rnd: int) -> tuple[list[dict[str, Any]], list[float]]:
    """The requests in waves of c, every wave sent to every (server, method, base URL) of `targets`
    in turn (c streams at once, the next series once all c finished), the order rotated from one
    wave to the next: each series sees the machine as the others did within seconds (its speed
    drifts by up to a fifth over minutes on a shared host, BENCHMARKS §35), so per-prompt ratios
    (c = 1) and aggregate rates (c > 1) compare like with like. (Records tagged with server and
    method, each target's summed wave walls.)"""
    httpx = _require_httpx()
    records: list[dict[str, Any]] = []
    walls = [0.0] * len(targets)
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0),
                                 trust_env=False) as client:
        t0 = time.perf_counter()
        indexed = list(enumerate(requests))
        waves = [indexed[w:w + c] for w in range(0, len(indexed), c)]
        for n, wave in enumerate(waves):
            k = (n + rnd) % len(targets)
            for t in [*range(k, len(targets)), *range(k)]:
                kind, method, base = targets[t]
                await _wait_idle(base)
                start = time.perf_counter()
                recs = await asyncio.gather(*(_send(client, base, p, method, max_tokens, timeout, i, t0)
                                              for i, p in wave))
                walls[t] += time.perf_counter() - start
                for rec in recs:
                    rec.update({"server": kind, "method": method or "plain"})
                    records.append(rec)
                    _log_request(f"[paired {kind}{' ' + method if method else ''} c={c}]", rec, rec["index"] + 1,
                                 len(requests))
    return records, walls


async def _wait_idle(base: str, limit_s: float = 60.0) -> None:
    """Before a level: until the server reports no running/waiting request (specwood's /health);
    servers without those fields: no wait."""
    httpx = _require_httpx()
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(base + "/health")
                h = r.json() if r.status_code == 200 else {}
            except Exception:
                return
            busy = [h.get(k) for k in ("running", "waiting")] if isinstance(h, dict) else []
            if not busy or not all(isinstance(b, int) for b in busy) or not any(busy):
                return
            await asyncio.sleep(0.2)


async def _get_json(base: str, path: str) -> Any:
    httpx = _require_httpx()
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            r = await client.get(base + path)
            return r.json() if r.status_code == 200 else None
    except Exception:
        return None


def as_raw(prompt: Prompt) -> Prompt:
    """The prompt's messages as one plain text (/v1/completions), for a model without a chat template."""
    if prompt.raw:
        return prompt
    text = "\n\n".join(m["content"] for m in prompt.messages or ())
    return dataclasses.replace(prompt, messages=None, prompt=text)


def warm_up(base: str, method: str | None, timeout: float, label: str, raw: bool = False) -> None:
    t0 = time.perf_counter()
    prompt = as_raw(Prompt("warm-up", "warm-up", messages=tuple(WARMUP_MESSAGES))) if raw else None

    async def go() -> dict[str, Any]:
        httpx = _require_httpx()
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), trust_env=False) as client:
            return await stream_request(client, base, prompt, method, WARMUP_TOKENS, timeout, None,
                                        messages=None if raw else WARMUP_MESSAGES, continuous_usage=True)

    r = asyncio.run(go())
    if r.get("error"):
        raise SpecwoodError(f"warm-up request to {label} failed: {r['error']}")
    log(f"warm-up [{label}] done in {time.perf_counter() - t0:.1f} s")


# -------------------------------------------------------------------------------- machine noise
class CpuMeter:
    """CPU time spent during a level by everything except the server under test and this client
    (from /proc: all busy time - the server process's - ours), in cores; and the VM's steal time.
    Another job on a 2-core machine shows up here, and such a level's numbers are not clean."""

    def __init__(self, pid: int | Sequence[int] | None) -> None:
        self.pids = [pid] if isinstance(pid, int) else [p for p in (pid or ()) if p]
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.t0 = time.monotonic()
        self.a = self._sample()

    def _sample(self) -> tuple[float, float, float, float] | None:
        try:
            f = [float(x) for x in open("/proc/stat").readline().split()[1:]]
            busy = f[0] + f[1] + f[2] + f[5] + f[6]  # user nice system irq softirq (guest is in user)
            steal = f[7] if len(f) > 7 else 0.0
            srv = 0.0
            for pid in self.pids:
                st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                srv += sum(float(x) for x in st[11:15])  # utime stime cutime cstime
            t = os.times()
            return busy, steal, srv, (t.user + t.system) * self.hz
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> dict[str, float | None]:
        b, wall = self._sample(), time.monotonic() - self.t0
        if self.a is None or b is None or wall <= 0:
            return {"other_cpu_cores": None, "steal_cores": None, "server_cpu_cores": None}
        d = [(y - x) / self.hz / wall for x, y in zip(self.a, b)]
        return {"other_cpu_cores": round(max(0.0, d[0] - d[2] - d[3]), 3), "steal_cores": round(d[1], 3),
                "server_cpu_cores": round(d[2], 3)}


NOISY_CORES = 0.25  # other processes' CPU during a level above this: flagged in the report


def machine_busy(window_s: float = 2.0) -> float | None:
    """Cores used by other processes over a short window (nothing of ours running)."""
    m = CpuMeter(None)
    time.sleep(window_s)
    return m.stop()["other_cpu_cores"]


def wait_for_quiet(max_wait_s: float) -> float | None:
    """Before a server starts: wait (at most max_wait_s) until other processes use under
    NOISY_CORES. llama.cpp's threads spin while they wait for each other, so on a 2-core machine
    one busy neighbour makes its decode collapse (to ~1 tok/s), far more than it slows specwood."""
    deadline = time.monotonic() + max_wait_s
    busy = machine_busy()
    while busy is not None and busy > NOISY_CORES and time.monotonic() < deadline:
        log(f"other processes use {busy:.2f} cores; waiting for a quiet machine "
            f"({deadline - time.monotonic():.0f} s left of --wait-idle)")
        time.sleep(10)
        busy = machine_busy()
    if busy is not None and busy > NOISY_CORES:
        log(f"WARNING: other processes use {busy:.2f} cores; measuring anyway (the levels will be flagged)")
    return busy


# ----------------------------------------------------------------------------------------- servers
def llama_command(binary: Path, port: int, target: Path, *, threads: int, ctx: int, slots: int,
                  draft: Path | None = None, extra: Sequence[str] = ()) -> list[str]:
    cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", str(ctx * slots), "-np", str(slots)]
    if draft is not None:
        # -md alone only loads the draft: --spec-type draft-simple turns llama.cpp's speculation on
        # (its default draft settings otherwise: --spec-draft-n-max 3, --spec-draft-p-min 0)
        cmd += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
    return cmd + list(extra)


def _spec_mean_lens(log_path: Path, skip: int = 0) -> list[float]:
    """llama-server's "draft acceptance = ... mean len = X" per finished request (tokens per target
    step, like specwood's AAT), after the first `skip` of them."""
    import re

    time.sleep(0.3)  # the server logs a request's timings right after its last chunk
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [float(m) for m in re.findall(r"draft acceptance = .*?mean len = *([0-9.]+)", text)][skip:]


def _plan_state(log_path: Path) -> dict[str, Any]:
    """What `specwood serve` said at start-up about auto's plan (its stderr, in the server log)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {"plan": "unknown", "line": None}
    for line in text.splitlines():
        if "method auto is unavailable" in line:
            return {"plan": "unavailable (auto falls back to ar)", "line": line.strip()}
        if "[plan] no measured plan" in line:
            return {"plan": "starter", "line": line.strip()}
        if "[plan] method auto on a" in line:
            return {"plan": "runner-timed", "line": line.strip()}
    listening = next((ln for ln in text.splitlines() if "listening on http" in ln), "")
    if listening and ", method auto," not in listening:  # auto was not prepared at start-up: no notice to read
        return {"plan": "unknown (the server's default method is not auto)", "line": listening.strip()}
    return {"plan": "measured", "line": None}


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        wl = load_workload(a.prompts, limit=a.limit, categories=a.categories.split(",") if a.categories else None)
        if a.raw:  # a base model without a chat template: the messages' text as one plain prompt
            wl = dataclasses.replace(wl, prompts=[as_raw(p) for p in wl.prompts])
        self.workload = wl
        self.levels = parse_concurrency(a.concurrency)
        self.requests = {c: plan_requests(wl.prompts, [c], None) for c in self.levels}
        self.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        self.records: list[dict[str, Any]] = []
        self.level_rows: list[dict[str, Any]] = []
        self.discarded: list[dict[str, Any]] = []  # noisy levels measured again
        self.servers: dict[str, Any] = {}
        self.plan: dict[str, Any] | None = None
        from specwood.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model

        self.target = resolve_model(a.target or DEFAULT_TARGET)  # a known name or a path
        # --draft none: specwood runs without a draft model (llama.cpp+draft then has none to use)
        no_draft = a.draft is not None and a.draft.lower() == "none"
        if no_draft and a.llama_spec:
            raise SystemExit("--llama-spec needs a draft model: drop it or give --draft")
        self.draft = None if no_draft else resolve_model(a.draft or DEFAULT_DRAFT)
        self.binary = Path(a.llama_server) if a.llama_server else LS.ensure(build_if_missing=not a.no_build, log=log)
        self.kinds = [LLAMA] + ([LLAMA_SPEC] if a.llama_spec else []) + ([SPECWOOD] if self.methods else [])
        if a.require_plan and SPECWOOD in self.kinds:  # fail fast: specwood first
            self.kinds = [SPECWOOD] + [k for k in self.kinds if k != SPECWOOD]

    # -- one level, recorded
    def _level(self, server: ServerProcess, base: str, kind: str, method: str | None, c: int, rnd: int,
               final: bool = True) -> bool:
        """Measure one level. A level during which other processes used the CPU is discarded
        (kept in `discarded`) and False returned, unless `final`: then it is kept, flagged."""
        label = kind if method is None else f"{kind} {method}"
        reqs = self.requests[c]
        asyncio.run(_wait_idle(base))
        log(f"[{label} c={c} round {rnd + 1}] {len(reqs)} requests, {c} clients ...")
        log_mark = len(_spec_mean_lens(server.log_path)) if kind == LLAMA_SPEC and server.log_path else 0
        meter = CpuMeter(server.proc.pid if server.proc else None)
        recs, wall = asyncio.run(_one_level(base, reqs, method, c, self.a.max_tokens, self.a.request_timeout,
                                            f"[{label} c={c}]"))
        cpu = meter.stop()
        if kind == LLAMA_SPEC and server.log_path:  # llama.cpp's own per-request acceptance, from its log
            lens = _spec_mean_lens(server.log_path, skip=log_mark)
            cpu["llama_spec_mean_len"] = _mean(lens)
        tag = {"server": kind, "method": method or "plain", "concurrency": c, "round": rnd}
        for r in recs:
            r.update(tag)
        row = {**tag, **summarize_level(recs, wall), **cpu}
        noisy = isinstance(cpu["other_cpu_cores"], (int, float)) and cpu["other_cpu_cores"] > NOISY_CORES
        log(f"[{label} c={c}] {_fmt(row['request_decode_tokens_per_s_mean'], '.2f')} tok/s per request, "
            f"{_fmt(row['decode_tokens_per_s'], '.2f')} aggregate decode tok/s, TTFT p50 "
            f"{_fmt(row['ttft_s_p50'], '.2f')} s, {row['errors']} errors, {wall:.1f} s"
            + (f"; WARNING: other processes used {cpu['other_cpu_cores']:.2f} cores meanwhile" if noisy else ""))
        if noisy and not final:
            log(f"[{label} c={c}] discarded (noisy); measuring it again")
            self.discarded.append({**row, "requests_records": recs})
            return False
        self.records += recs
        self.level_rows.append(row)
        return True

    def _llama(self, kind: str, rnd: int) -> None:
        for c in self.levels:
            for attempt in range(self.a.retry_noisy + 1):  # a fresh server each time: no prompt cache kept
                if self._llama_level(kind, c, rnd, attempt):
                    break

    def _llama_level(self, kind: str, c: int, rnd: int, attempt: int) -> bool:
        wait_for_quiet(self.a.wait_idle)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = llama_command(self.binary, port, self.target, threads=self.a.threads, ctx=self.a.ctx, slots=c,
                            draft=self.draft if kind == LLAMA_SPEC else None, extra=self.a.llama_arg)
        logp = self.out / f"{kind}-c{c}-r{rnd + 1}{f'-retry{attempt}' if attempt else ''}.log"
        with ServerProcess(cmd, base, log_path=logp, startup_timeout=self.a.startup_timeout, log=log) as srv:
            info = self.servers.setdefault(kind, {"commands": {}, "props": None})
            info["commands"][str(c)] = shlex.join(cmd)
            if info["props"] is None:
                props = asyncio.run(_get_json(base, "/props")) or {}
                info["props"] = {k: v for k, v in props.items() if k not in ("chat_template", "chat_template_tool_use")}
                info["models"] = asyncio.run(_get_json(base, "/v1/models"))
            warm_up(base, None, self.a.request_timeout, f"{kind} c={c}", self.a.raw)
            return self._level(srv, base, kind, None, c, rnd, final=attempt == self.a.retry_noisy)

    def _specwood_command(self, port: int) -> list[str]:
        cmd = serve_command(port, max_batch=max(self.levels), max_context=self.a.ctx, dtype=self.a.dtype,
                            draft_dtype=self.a.draft_dtype, target=self.a.target, draft=self.a.draft)
        return cmd + list(self.a.specwood_arg)

    def _specwood_started(self, srv: ServerProcess, base: str, logp: Path, cmd: Sequence[str]) -> None:
        """Read auto's plan from the start-up log (stop here under --require-plan without one)."""
        plan = _plan_state(logp)
        if self.plan is None:
            self.plan = plan
            log(f"specwood auto plan: {plan['plan']}" + (f" ({plan['line']})" if plan["line"] else ""))
        if "auto" in self.methods and plan["plan"] != "measured" and self.a.require_plan:
            raise SpecwoodError(f"specwood serve has no measured plan for auto ({plan['plan']}): run "
                                "`specwood plan` first (~6 min), or drop --require-plan")
        self.servers.setdefault(SPECWOOD, {"command": shlex.join(cmd),
                                           "models": asyncio.run(_get_json(base, "/v1/models"))})

    def _specwood(self, rnd: int) -> None:
        wait_for_quiet(self.a.wait_idle)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = self._specwood_command(port)
        logp = self.out / f"specwood-r{rnd + 1}.log"
        with ServerProcess(cmd, base, log_path=logp, startup_timeout=self.a.startup_timeout, log=log) as srv:
            self._specwood_started(srv, base, logp, cmd)
            for m in self.methods:
                warm_up(base, m, self.a.request_timeout, f"specwood {m}", self.a.raw)
            for c in self.levels:
                for m in self.methods:
                    for attempt in range(self.a.retry_noisy + 1):
                        if attempt:
                            wait_for_quiet(self.a.wait_idle)
                        if self._level(srv, base, SPECWOOD, m, c, rnd, final=attempt == self.a.retry_noisy):
                            break

    def run(self) -> None:
        for rnd in range(self.a.rounds):
            order = self.kinds if rnd % 2 == 0 else list(reversed(self.kinds))
            if self.a.paired:
                self._paired(order, rnd)
                continue
            for kind in order:
                if kind == SPECWOOD:
                    self._specwood(rnd)
                else:
                    self._llama(kind, rnd)

    def _paired(self, order: Sequence[str], rnd: int) -> None:
        """Every level with every server up at once (llama-server with -np c), each wave of c
        requests sent to each server and method in turn (_paired_level); an idle server's threads
        sleep, so only the one answering runs."""
        for c in self.levels:
            wait_for_quiet(self.a.wait_idle)
            targets: list[tuple[str, str | None, str]] = []
            pids: list[int] = []
            with contextlib.ExitStack() as stack:
                for kind in order:
                    port = free_port()
                    base = f"http://127.0.0.1:{port}"
                    if kind == SPECWOOD:
                        cmd = self._specwood_command(port)
                        logp = self.out / f"specwood-paired-c{c}-r{rnd + 1}.log"
                    else:
                        cmd = llama_command(self.binary, port, self.target, threads=self.a.threads, ctx=self.a.ctx,
                                            slots=c, draft=self.draft if kind == LLAMA_SPEC else None,
                                            extra=self.a.llama_arg)
                        logp = self.out / f"{kind}-paired-c{c}-r{rnd + 1}.log"
                    srv = stack.enter_context(ServerProcess(cmd, base, log_path=logp,
                                                            startup_timeout=self.a.startup_timeout, log=log))
                    pids += [srv.proc.pid] if srv.proc else []
                    if kind == SPECWOOD:
                        self._specwood_started(srv, base, logp, cmd)
                        for m in self.methods:
                            warm_up(base, m, self.a.request_timeout, f"specwood {m}", self.a.raw)
                            targets.append((kind, m, base))
                    else:
                        self.servers.setdefault(kind, {"commands": {}, "props": None})["commands"][f"{c} (paired)"] = \
                            shlex.join(cmd)
                        warm_up(base, None, self.a.request_timeout, f"{kind} c={c}", self.a.raw)
                        targets.append((kind, None, base))
                log(f"[paired c={c} round {rnd + 1}] {len(self.requests[c])} requests x {len(targets)} series ...")
                meter = CpuMeter(pids)
                recs, walls = asyncio.run(_paired_level(targets, self.requests[c], c, self.a.max_tokens,
                                                        self.a.request_timeout, rnd))
                cpu = meter.stop()
            if isinstance(cpu["other_cpu_cores"], (int, float)) and cpu["other_cpu_cores"] > NOISY_CORES:
                log(f"[paired c={c}] WARNING: other processes used {cpu['other_cpu_cores']:.2f} cores meanwhile "
                    "(flagged)")
            for (kind, method, _), wall in zip(targets, walls):
                tag = {"server": kind, "method": method or "plain", "concurrency": c, "round": rnd}
                mine = [r for r in recs if r["server"] == kind and r["method"] == tag["method"]]
                for r in mine:
                    r.update(tag)
                self.level_rows.append({**tag, **summarize_level(mine, wall), **cpu, "paired": True})
                self.records += mine


# ----------------------------------------------------------------------------------------- summary
def _series(rows_or_recs: Sequence[dict[str, Any]], server: str, method: str) -> list[dict[str, Any]]:
    return [r for r in rows_or_recs if r["server"] == server and r["method"] == method]


BUCKETS = ("prompt <1k", "prompt 1k-2k", "prompt 2k-4k", "prompt 4k-8k", "prompt 8k-16k", "prompt 16k+")


def context_buckets(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Each prompt's context bucket, by the prompt tokens a server reported for it (the first seen;
    the tokenizers agree to within a token or two)."""
    out: dict[str, str] = {}
    for r in records:
        n = r.get("prompt_tokens")
        if r["id"] in out or not isinstance(n, (int, float)):
            continue
        edges = (1024, 2048, 4096, 8192, 16384)
        out[r["id"]] = BUCKETS[sum(n >= e for e in edges)]
    return out


def summarize(records: Sequence[dict[str, Any]], level_rows: Sequence[dict[str, Any]], levels: Sequence[int],
              methods: Sequence[str], kinds: Sequence[str]) -> dict[str, Any]:
    series = [(k, "plain") for k in kinds if k != SPECWOOD] + [(SPECWOOD, m) for m in methods if SPECWOOD in kinds]
    c1 = min(levels)
    good = [r for r in records if not r.get("error") and r["concurrency"] == c1]
    cats = list(dict.fromkeys(r["category"] for r in records))
    bucket_of = context_buckets(good)
    buckets = [b for b in BUCKETS if b in bucket_of.values()]

    def cell(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"n": len(recs), "tok_s": _mean([r.get("decode_tokens_per_s") for r in recs]),
                "ttft_s": _mean([r.get("ttft_s") for r in recs]),
                "completion_tokens": _mean([r.get("completion_tokens") for r in recs]),
                "prompt_tokens": _mean([r.get("prompt_tokens") for r in recs]),
                "aat": _mean([r.get("mean_accepted_tokens") for r in recs]),
                "server_tok_s": _mean([r.get("server_tokens_per_s") for r in recs])}

    per_req: dict[str, dict[str, Any]] = {}
    for s, m in series:
        key = s if s != SPECWOOD else m
        mine = _series(good, s, m)
        per_req[key] = {"all": cell(mine), **{c: cell([r for r in mine if r["category"] == c]) for c in cats},
                        **{b: cell([r for r in mine if bucket_of.get(r["id"]) == b]) for b in buckets}}
    keys = list(per_req)

    def ratios(groups: Sequence[str]) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        for g in groups:
            v = {k: (per_req[k].get(g) or {}).get("tok_s") for k in keys}
            out[g] = {"ar/llama.cpp": _ratio(v.get("ar"), v.get(LLAMA)),
                      "auto/llama.cpp": _ratio(v.get("auto"), v.get(LLAMA)),
                      "auto/ar": _ratio(v.get("auto"), v.get("ar")),
                      "llama.cpp+draft/llama.cpp": _ratio(v.get(LLAMA_SPEC), v.get(LLAMA))}
        return out

    spec_rows = [r for r in level_rows if r["server"] == LLAMA_SPEC and r["concurrency"] == c1]
    if LLAMA_SPEC in per_req:  # llama.cpp's acceptance per level (from its log), not per category
        per_req[LLAMA_SPEC]["all"]["aat"] = _mean([r.get("llama_spec_mean_len") for r in spec_rows])
    c1_ratios = ratios(["all", *cats, *buckets])
    rounds = sorted({r["round"] for r in records})
    per_round = []
    for rnd in rounds:
        v = {}
        for s, m in series:
            v[s if s != SPECWOOD else m] = _mean([r.get("decode_tokens_per_s") for r in _series(good, s, m)
                                                    if r["round"] == rnd])
        per_round.append({"round": rnd + 1, "tok_s": v, "ar/llama.cpp": _ratio(v.get("ar"), v.get(LLAMA)),
                          "auto/llama.cpp": _ratio(v.get("auto"), v.get(LLAMA)),
                          "auto/ar": _ratio(v.get("auto"), v.get("ar"))})
    agg: list[dict[str, Any]] = []
    for c in levels:
        vals: dict[str, dict[str, Any]] = {}
        for s, m in series:
            rows = [r for r in _series(level_rows, s, m) if r["concurrency"] == c]
            vals[s if s != SPECWOOD else m] = {
                "decode_tok_s": _mean([r.get("decode_tokens_per_s") for r in rows]),
                "tok_s": _mean([r.get("tokens_per_s") for r in rows]),
                "ttft_s_p50": _mean([r.get("ttft_s_p50") for r in rows]),
                "tbt_ms_p50": _mean([r.get("tbt_ms_p50") for r in rows]),
                "errors": sum(int(r.get("errors") or 0) for r in rows),
                "requests": sum(int(r.get("requests") or 0) for r in rows)}
        d = {k: vals[k]["decode_tok_s"] for k in vals}
        agg.append({"concurrency": c, "servers": vals,
                    "ar/llama.cpp": _ratio(d.get("ar"), d.get(LLAMA)),
                    "auto/llama.cpp": _ratio(d.get("auto"), d.get(LLAMA)),
                    "auto/ar": _ratio(d.get("auto"), d.get("ar")),
                    "llama.cpp+draft/llama.cpp": _ratio(d.get(LLAMA_SPEC), d.get(LLAMA))})
    goals = {}
    for m, g in GOALS.items():
        key = f"{m}/llama.cpp"
        overall = c1_ratios["all"].get(key)
        by_cat = {c: c1_ratios[c].get(key) for c in cats}
        low = min((x for x in by_cat.values() if x is not None), default=None)
        goals[m] = {"target": g, "overall": overall, "lowest_category": low,
                    "lowest_category_name": min((c for c in cats if by_cat[c] is not None), key=lambda c: by_cat[c],
                                                default=None),
                    "met_overall": None if overall is None else overall >= g,
                    "met_every_category": None if low is None else low >= g}
    paired = paired_ratios(good, series, ["all", *cats, *buckets], bucket_of)
    return {"c1": c1, "categories": cats, "buckets": buckets, "per_request": per_req, "c1_ratios": c1_ratios,
            "per_round": per_round, "aggregate": agg, "goals": goals, "series": keys, "paired_ratios": paired}


PAIRS = (("ar", LLAMA), ("auto", LLAMA), ("auto", "ar"))


def paired_ratios(records: Sequence[dict[str, Any]], series: Sequence[tuple[str, str]], groups: Sequence[str],
                  bucket_of: dict[str, str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per group, for each pair (a, b): the geometric mean over prompts and rounds of a's decode
    tok/s over b's on the same prompt in the same round, and its lowest; what --paired measures
    (each pair within seconds of each other). n: the pairs counted."""
    speed: dict[tuple[str, str, int], float] = {}
    for r in records:
        key = r["server"] if r["server"] != SPECWOOD else r["method"]
        v = r.get("decode_tokens_per_s")
        if isinstance(v, (int, float)) and v > 0 and (r["server"], r["method"]) in series:
            speed[(key, r["id"], r["round"])] = float(v)
    cat_of = {r["id"]: r["category"] for r in records}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for g in groups:
        out[g] = {}
        for a, b in PAIRS:
            logs = [math.log(v / speed[(b, pid, rnd)]) for (k, pid, rnd), v in speed.items()
                    if k == a and (b, pid, rnd) in speed and g in ("all", cat_of.get(pid), bucket_of.get(pid))]
            out[g][f"{a}/{b}"] = {"n": len(logs), "geomean": math.exp(sum(logs) / len(logs)) if logs else None,
                                  "lowest": math.exp(min(logs)) if logs else None}
    return out


def markdown(result: dict[str, Any]) -> str:
    meta, s = result["meta"], result["summary"]
    keys = s["series"]
    out = ["# specwood serve vs llama.cpp llama-server (HTTP, same client, same prompts)", ""]
    for k, v in [("date", meta.get("date")), ("command", f"`{meta.get('command')}`"),
                 ("git", f"{meta.get('git_rev')}{' (dirty working tree)' if meta.get('git_dirty') else ''}"),
                 ("machine", (meta.get("machine") or {}).get("summary")),
                 ("prompts", meta.get("workload")), ("max tokens", meta.get("max_tokens")),
                 ("sampling", "greedy (temperature 0), streaming, no model field; specwood requests add \"method\""),
                 ("concurrency", ", ".join(map(str, meta.get("concurrency") or []))),
                 ("rounds", meta.get("rounds")),
                 ("llama-server", meta.get("llama_server", {}).get("binary_version")),
                 ("elapsed", _fmt(meta.get("elapsed_s"), ".0f", " s"))]:
        if v not in (None, "", "`None`"):
            out.append(f"- {k}: {v}")
    lv = result.get("levels") or []
    oth = [r["other_cpu_cores"] for r in lv if isinstance(r.get("other_cpu_cores"), (int, float))]
    stl = [r["steal_cores"] for r in lv if isinstance(r.get("steal_cores"), (int, float))]
    if oth:
        out.append(f"- machine noise: other processes' CPU during a level at most {max(oth):.2f} cores "
                   f"(flagged above {NOISY_CORES}); VM steal at most {max(stl) if stl else 0:.2f} cores")
    for name, info in (meta.get("servers") or {}).items():
        cmds = info.get("commands") or ({"all": info["command"]} if info.get("command") else {})
        for c, cmd in cmds.items():
            out.append(f"- {name} server{'' if c == 'all' else f' (c={c})'}: `{cmd}`")
    plan = meta.get("auto_plan") or {}
    if plan:
        out.append(f"- specwood auto plan: **{plan.get('plan')}**"
                   + (f" — `{plan['line']}`" if plan.get("line") else ""))
    if plan and plan.get("plan") != "measured":
        out += ["", "> **auto ran without a measured plan** (the server used the starter plan: an analytic model of "
                "this CPU, trees of at most 8 tokens). Run `specwood plan` (~6 min on 2 cores) before the run "
                "whose numbers count; `--require-plan` enforces it."]
    if meta.get("completed") is False:
        out += ["", "> **incomplete run**: " + str(meta.get("failure") or "interrupted")]
    noisy = [r for r in result.get("levels") or []
             if isinstance(r.get("other_cpu_cores"), (int, float)) and r["other_cpu_cores"] > NOISY_CORES]
    if noisy:
        out += ["", "> **other processes used the CPU during some levels** (not clean numbers; rerun on an idle "
                "machine): " + "; ".join(f"{r['server']} {r['method']} c={r['concurrency']} round {r['round'] + 1}: "
                                         f"{r['other_cpu_cores']:.2f} cores" for r in noisy)]

    c1 = s["c1"]
    out += ["", f"## per request at c={c1}: decode tok/s (mean over requests) and ratios", ""]
    head = ["category", "n", *[f"{k} tok/s" for k in keys]]
    rk = [r for r in ("ar/llama.cpp", "auto/llama.cpp", "auto/ar", "llama.cpp+draft/llama.cpp")
          if any(s["c1_ratios"][g].get(r) is not None for g in s["c1_ratios"])]
    head += rk
    if "auto" in keys:
        head.append("auto AAT")
    if LLAMA_SPEC in keys:
        head.append("llama.cpp+draft mean len")
    out += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for g in ["all", *s["categories"], *s.get("buckets", [])]:
        n = max((s["per_request"][k].get(g) or {}).get("n", 0) for k in keys) if keys else 0
        cells = ["**all**" if g == "all" else g, str(n)]
        cells += [_fmt((s["per_request"][k].get(g) or {}).get("tok_s"), ".2f") for k in keys]
        cells += [_fmt(s["c1_ratios"][g].get(r), ".2f", "x") for r in rk]
        if "auto" in keys:
            cells.append(_fmt((s["per_request"]["auto"].get(g) or {}).get("aat"), ".2f"))
        if LLAMA_SPEC in keys:
            cells.append(_fmt((s["per_request"][LLAMA_SPEC].get(g) or {}).get("aat"), ".2f"))
        out.append("| " + " | ".join(cells) + " |")

    pr = s.get("paired_ratios") or {}
    pk = [k for k in ("ar/llama.cpp", "auto/llama.cpp", "auto/ar") if (pr.get("all") or {}).get(k, {}).get("n")]
    if meta.get("paired") and pk:
        out += ["", f"## paired at c={c1}: per-prompt ratios (geometric mean over prompts and rounds; lowest)", "",
                "Each prompt went to every server and method within seconds (--paired): these ratios do not "
                "carry the machine's drift between levels.", "",
                "| category | pairs | " + " | ".join(f"{k} | lowest {k}" for k in pk) + " |",
                "|---|---:|" + "---:|" * (2 * len(pk))]
        for g in ["all", *s["categories"], *s.get("buckets", [])]:
            cells = ["**all**" if g == "all" else g, str(max(pr[g][k]["n"] for k in pk))]
            for k in pk:
                cells += [_fmt(pr[g][k]["geomean"], ".2f", "x"), _fmt(pr[g][k]["lowest"], ".2f", "x")]
            out.append("| " + " | ".join(cells) + " |")

    out += ["", f"## TTFT at c={c1} (s, mean over requests) and tokens", "",
            "| category | " + " | ".join(f"{k} TTFT" for k in keys) + " | "
            + " | ".join(f"{k} prompt/completion tokens" for k in keys) + " |",
            "|---|" + "---:|" * (2 * len(keys))]
    for g in ["all", *s["categories"], *s.get("buckets", [])]:
        cells = ["**all**" if g == "all" else g]
        cells += [_fmt((s["per_request"][k].get(g) or {}).get("ttft_s"), ".3f") for k in keys]
        cells += [f"{_fmt((s['per_request'][k].get(g) or {}).get('prompt_tokens'), '.0f')} / "
                  f"{_fmt((s['per_request'][k].get(g) or {}).get('completion_tokens'), '.1f')}" for k in keys]
        out.append("| " + " | ".join(cells) + " |")

    if len(s["per_round"]) > 1:
        out += ["", f"## per round (c={c1}, mean per-request tok/s)", "",
                "| round | " + " | ".join(keys) + " | ar/llama.cpp | auto/llama.cpp | auto/ar |",
                "|---:|" + "---:|" * (len(keys) + 3)]
        for r in s["per_round"]:
            out.append(f"| {r['round']} | " + " | ".join(_fmt(r["tok_s"].get(k), ".2f") for k in keys) + " | "
                       + " | ".join(_fmt(r[x], ".2f", "x") for x in ("ar/llama.cpp", "auto/llama.cpp", "auto/ar"))
                       + " |")

    out += ["", "## aggregate decode tok/s per concurrency level (all clients; TTFT p50 s)", "",
            "| c | " + " | ".join(keys) + " | ar/llama.cpp | auto/llama.cpp | auto/ar |",
            "|---:|" + "---:|" * (len(keys) + 3)]
    for row in s["aggregate"]:
        cells = [str(row["concurrency"])]
        for k in keys:
            v = row["servers"][k]
            err = f", {v['errors']} err" if v.get("errors") else ""
            cells.append(f"{_fmt(v['decode_tok_s'], '.2f')} (TTFT {_fmt(v['ttft_s_p50'], '.2f')}{err})")
        cells += [_fmt(row[x], ".2f", "x") for x in ("ar/llama.cpp", "auto/llama.cpp", "auto/ar")]
        out.append("| " + " | ".join(cells) + " |")

    if s["goals"]:
        out += ["", "## issue 29 goal (per-request tok/s at c=%d vs llama.cpp plain)" % c1, ""]
        if noisy:
            out += ["**unreliable: some levels were measured while other processes used the CPU (above)**", ""]
        for m, g in s["goals"].items():
            if g["overall"] is None:
                continue
            out.append(f"- `{m}` >= {g['target']}x: overall {_fmt(g['overall'], '.2f', 'x')} "
                       f"({'met' if g['met_overall'] else 'NOT met'}); lowest category "
                       f"{g['lowest_category_name']} {_fmt(g['lowest_category'], '.2f', 'x')} "
                       f"({'met' if g['met_every_category'] else 'NOT met'} in every category)")
    out += ["", "_Per-request decode tok/s: (completion tokens - 1) / (last content chunk - first content chunk), "
            "client clock; TTFT: request sent to the first content chunk. Aggregate: sum over a level's requests of "
            "(completion tokens - 1) / the level's wall time. llama-server runs once per level with -np c and c x "
            "the per-slot context; specwood serve once with --max-batch max(c). llama-server keeps its prompt cache "
            "(cache_prompt, its default), which can shorten its TTFT for prompts sharing a prefix (the chat "
            "template's system turn); decode tok/s is unaffected._"]
    if result.get("discarded_levels"):
        out += ["", f"_{len(result['discarded_levels'])} level(s) were measured again because other processes used "
                "the CPU meanwhile (the discarded attempts are in results.json, `discarded_levels`)._"]
    errs = [r for r in result.get("requests") or [] if r.get("error")]
    if errs:
        out += ["", "## errors", ""] + [f"- {r['server']} {r['method']} c={r['concurrency']} {r['id']}: {r['error']}"
                                        for r in errs[:40]]
    return "\n".join(out) + "\n"


def _llama_info(binary: Path) -> dict[str, Any]:
    """The binary's `--version` and, for the cached build, its build.json (flags, compiler, sdist)."""
    v = LS.installed_version()
    info = dict(LS.build_info(v)) if v and binary == LS.binary_path(v) else {}
    info["binary"] = str(binary)
    info["binary_version"] = info.get("binary_version") or LS._binary_version(binary)
    return info


def write(run: Run | None, a: argparse.Namespace, t0: float, completed: bool, failure: str | None) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    status = _git("status", "--porcelain", "--untracked-files=no")
    meta: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "machine": machine_summary(), "python": platform.python_version(),
        "git_rev": _git("rev-parse", "HEAD"), "git_dirty": bool(status),
        "completed": completed, "failure": failure, "elapsed_s": round(time.perf_counter() - t0, 1),
        "max_tokens": a.max_tokens, "rounds": a.rounds, "paired": a.paired, "threads": a.threads,
        "ctx_per_slot": a.ctx,
        "request_timeout_s": a.request_timeout,
    }
    if run is not None:
        try:
            from specwood.planner.store import plans_dir

            plans = sorted(p.name for p in plans_dir().glob("*.json")) if plans_dir().is_dir() else []
        except Exception:  # the planner is the lead's to change; this is only a listing
            plans = None
        meta.update({
            "concurrency": run.levels, "methods": run.methods, "servers_measured": run.kinds,
            "workload": f"{run.workload.source}: {len(run.workload.prompts)} prompts in "
                        f"{len(run.workload.categories)} categories ({', '.join(run.workload.categories)}); "
                        + ", ".join(f"c={c}: {len(v)} requests" for c, v in run.requests.items()),
            "prompt_ids": [p.id for p in run.workload.prompts],
            "target_gguf": str(run.target), "draft_gguf": str(run.draft),
            "llama_server": _llama_info(run.binary),
            "servers": run.servers, "auto_plan": run.plan, "stored_plans": plans,
        })
    result: dict[str, Any] = {"meta": meta}
    if run is not None:
        result["summary"] = summarize(run.records, run.level_rows, run.levels, run.methods, run.kinds)
        result["levels"] = run.level_rows
        result["requests"] = run.records
        result["discarded_levels"] = run.discarded
    (out / "results.json").write_text(json.dumps(_jsonable(result), indent=1, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
    if run is not None:
        md = markdown(_jsonable(result))
        (out / "report.md").write_text(md, encoding="utf-8")
        print(md)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (results.json, report.md, server logs)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                    help="JSONL workload(s), comma-separated, or 'builtin'; benchmarks/heldout_long.jsonl is the "
                         "long-context set (2k-14k-token prompts: summaries, completions, questions over a document)")
    ap.add_argument("--limit", type=int, default=None, help="at most N prompts, round-robin over categories")
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--methods", default="ar,auto", help="specwood methods ('' = no specwood server)")
    ap.add_argument("--llama-spec", action="store_true",
                    help="also measure llama-server's own speculative decoding with the default draft (-md)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, alternating the server order")
    ap.add_argument("--paired", action="store_true",
                    help="every server up at once: each wave of c requests to each server and method in turn "
                         "(ratios robust to the machine's drift)")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t/-tb (default: torch's thread count)")
    ap.add_argument("--ctx", type=int, default=4096, help="context per request slot (both servers)")
    ap.add_argument("--raw", action="store_true",
                    help="send each prompt's messages as one plain text to /v1/completions (a base model without "
                         "a chat template, such as gemma3-270m)")
    ap.add_argument("--target", default=None, help="target GGUF (default: the package's default target)")
    ap.add_argument("--draft", default=None, help="draft GGUF (default: the package's default draft)")
    ap.add_argument("--dtype", default=None, help="specwood serve --dtype (default: its own, auto)")
    ap.add_argument("--draft-dtype", default=None, help="specwood serve --draft-dtype")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: build/reuse the cached one)")
    ap.add_argument("--no-build", action="store_true", help="fail instead of building llama-server when missing")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--specwood-arg", action="append", default=[], help="extra specwood serve argument (repeatable)")
    ap.add_argument("--require-plan", action="store_true", help="stop when specwood's auto has no measured plan")
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="before each server start, wait up to S seconds for other processes to go quiet")
    ap.add_argument("--retry-noisy", type=int, default=2,
                    help="measure a level again (up to N times) when other processes used the CPU during it")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to come up")
    a = ap.parse_args(argv)
    if a.threads is None:
        import torch

        a.threads = torch.get_num_threads()
    if a.max_tokens < 1 or a.rounds < 1 or a.ctx < 64 or a.request_timeout <= 0 or a.retry_noisy < 0:
        ap.error("--max-tokens and --rounds must be >= 1, --ctx >= 64, --request-timeout > 0, --retry-noisy >= 0")

    def on_term(signum: int, frame: Any) -> None:  # let the servers' context managers stop them
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.perf_counter()
    run: Run | None = None
    completed, failure = False, None
    try:
        run = Run(a)
        run.run()
        completed = True
    except SpecwoodError as e:
        failure = str(e)
        log(f"error: {e}")
    except KeyboardInterrupt as e:
        failure = f"interrupted ({e})" if str(e) else "interrupted"
        log(failure)
    finally:
        write(run, a, t0, completed, failure)
        log(f"wrote {Path(a.out) / 'results.json'}" + (f" and {Path(a.out) / 'report.md'}" if run else ""))
    return 0 if completed else 2


if __name__ == "__main__":
    sys.exit(main())
