"""Model-free drafting over HTTP (issue 41): `specwood serve` with ar, auto and suffix beside
llama-server plain and with its own n-gram speculation, on workloads where answers copy their
input or earlier answers.

    python benchmarks/suffix.py --out benchmarks/results/suffix/suffix_DATE \\
        [--workloads benchmarks/suffix_workloads.jsonl] [--methods ar,auto,suffix,auto-no-suffix] [--concurrency 1,8] \\
        [--max-tokens 256] [--llama-server BIN --llama-model GGUF] [--target T --draft D] [--limit N]

Categories (benchmarks/suffix_workloads.jsonl, written for this benchmark): code-edit (the answer
copies most of a function), refine (a first turn, not streamed, then a follow-up asking for the
whole answer again, changed: the follow-up is measured), repeated (unit tests and JSON extraction of one kind,
sent one after the other: their answers share scaffolding), open (chat, translation, fresh code:
nothing to copy; a cache that does not match must cost nothing).

Order (stated, because the global suffix tree fills from the answers given): for every server
configuration and concurrency c, a FRESH server (global tree empty, beyond one untimed generic
warm-up request), then pass 1 (cold) and pass 2 (warm: the same requests again) of the whole
workload, requests in file order, c closed-loop streaming clients. Multi-turn follow-ups are sent
after their first turn's answer, with it. llama-server modes: plain, and `--spec-type
ngram-simple` / `ngram-mod` where its --help lists them (checked, not assumed).

Reported per (server, mode or method, c, pass, category): mean per-request decode tok/s, AAT,
draft ms per step (specwood: draft_s / spec_steps) and, for auto, how often each source drafted
(none / model / suffix / both). results.json has every request; report.md the tables.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from specwood.bench.load_requests import _require_httpx, parse_concurrency, stream_request
from specwood.bench.server_process import ServerProcess, free_port, serve_command

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOADS = REPO / "benchmarks" / "suffix_workloads.jsonl"
PASSES = ("cold", "warm")


def log(msg: str) -> None:
    print(f"suffix: {msg}", file=sys.stderr, flush=True)


def load_items(path: Path, limit: int | None) -> list[dict[str, Any]]:
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit:  # keep every category: the first `limit` of each
        seen: dict[str, int] = defaultdict(int)
        items = [it for it in items if (seen.__setitem__(it["category"], seen[it["category"]] + 1)
                                        or seen[it["category"]] <= limit)]
    return items


def second_turn(item: dict[str, Any], answer: str) -> list[dict[str, str]]:
    """A refinement's second-turn messages: its first turn, the answer given, its follow-up."""
    return [*item["messages"], {"role": "assistant", "content": answer}, {"role": "user", "content": item["followup"]}]


def llama_spec_types(binary: Path) -> list[str]:
    """The n-gram speculation types this llama-server's --help lists."""
    try:
        text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [t for t in ("ngram-simple", "ngram-mod") if t in text]


async def run_pass(base: str, items: Sequence[dict[str, Any]], method: str | None, c: int, max_tokens: int,
                   timeout: float) -> list[dict[str, Any]]:
    """Every item once by c closed-loop clients (a follow-up turn after its first turn)."""
    httpx = _require_httpx()
    records: list[dict[str, Any]] = []
    todo = iter(items)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), trust_env=False,
                                 # a connection per request: llama-server closes kept-alive ones
                                 # after a few requests, and one sent on a closing one fails
                                 limits=httpx.Limits(max_connections=c + 2, max_keepalive_connections=0)) as client:
        async def one(item: dict[str, Any], messages: list[dict[str, str]], turn: int) -> dict[str, Any]:
            r = await stream_request(client, base, None, method, max_tokens, timeout, None, messages=messages)
            r.update(id=item["id"], category=item["category"], turn=turn)
            stats = r.get("specwood_stats") or {}
            steps = stats.get("spec_steps") or 0
            r["draft_ms_per_step"] = 1e3 * stats["draft_s"] / steps if steps and "draft_s" in stats else None
            r["auto_sources"] = stats.get("auto_sources")
            r["auto_admission_load"] = stats.get("auto_admission_load")
            records.append(r)
            log(f"{item['id']} turn {turn}: {r.get('completion_tokens')} tokens, "
                f"{r.get('decode_tokens_per_s') or 0:.1f} tok/s, AAT {r.get('mean_accepted_tokens')}"
                + (f", auto {stats['auto']} (admitted at load {stats.get('auto_admission_load')})"
                   if "auto" in stats else "")
                + (f" error {r['error']}" if r.get("error") else ""))
            return r

        async def first_turn(item: dict[str, Any], messages: list[dict[str, str]]) -> str | None:
            """A refine item's first turn, not streamed (its text is the follow-up's context; the
            follow-up is what is measured)."""
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            if method:
                body["method"] = method
            r = await client.post(base.rstrip("/") + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                records.append({"id": item["id"], "category": item["category"], "turn": 1,
                                "error": f"HTTP {r.status_code}: {r.text[:200]}"})
                return None
            return r.json()["choices"][0]["message"]["content"]

        async def worker() -> None:
            for item in todo:
                messages = list(item["messages"])
                if not item.get("followup"):
                    await one(item, messages, 1)
                    continue
                answer = await first_turn(item, messages)
                if answer is not None:
                    await one(item, second_turn(item, answer), 2)

        await asyncio.gather(*(worker() for _ in range(c)))
    return records


def measured(rec: dict[str, Any]) -> bool:
    """The records a category's figures come from: a refine item's follow-up only (the copy)."""
    return not rec.get("error") and (rec["category"] != "refine" or rec["turn"] == 2)


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if measured(r):
            groups[(r["server"], r["mode"], r["c"], r["pass"], r["category"])].append(r)

    def mean(xs: list[Any]) -> float | None:
        v = [float(x) for x in xs if isinstance(x, (int, float))]
        return round(sum(v) / len(v), 3) if v else None

    rows = []
    for (server, mode, c, pas, cat), rs in sorted(groups.items()):
        sources: dict[str, int] = defaultdict(int)
        for r in rs:
            for k, v in (r.get("auto_sources") or {}).items():
                sources[k] += v
        rows.append({"server": server, "mode": mode, "c": c, "pass": pas, "category": cat, "requests": len(rs),
                     "decode_tok_s": mean([r.get("decode_tokens_per_s") for r in rs]),
                     "aat": mean([r.get("mean_accepted_tokens") for r in rs]),
                     "draft_ms_per_step": mean([r.get("draft_ms_per_step") for r in rs]),
                     "auto_sources": dict(sources) or None})
    return rows


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = ["# Model-free drafting over HTTP (benchmarks/suffix.py)", "",
           f"{meta['when']}; workloads {meta['workloads']}; max_tokens {meta['max_tokens']}; "
           "greedy; a fresh server per configuration and c, pass cold then warm.", "",
           "| server | mode | c | pass | category | n | decode tok/s | AAT | draft ms/step | auto sources |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        f = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        src = ", ".join(f"{k} {v}" for k, v in (r["auto_sources"] or {}).items() if v) or "–"
        out.append(f"| {r['server']} | {r['mode']} | {r['c']} | {r['pass']} | {r['category']} | {r['requests']} | "
                   f"{f(r['decode_tok_s'])} | {f(r['aat'])} | {f(r['draft_ms_per_step'])} | {src} |")
    return "\n".join(out) + "\n"


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.items = load_items(Path(a.workloads), a.limit)
        self.levels = parse_concurrency(a.concurrency)
        self.records: list[dict[str, Any]] = []

    def passes(self, base: str, server: str, mode: str, method: str | None, c: int) -> None:
        for pas in PASSES:
            recs = asyncio.run(run_pass(base, self.items, method, c, self.a.max_tokens, self.a.request_timeout))
            for r in recs:
                r.update(server=server, mode=mode, c=c, **{"pass": pas})
            self.records += recs

    def warm_up(self, base: str, method: str | None) -> None:
        item = {"id": "warm-up", "category": "warm-up", "messages": [{"role": "user", "content": "Say hello."}]}
        asyncio.run(run_pass(base, [item], method, 1, 16, self.a.request_timeout))

    def specwood(self, label: str, c: int) -> None:
        """A server for `label`: a method name, or `auto-no-suffix` (auto as it was before suffix
        drafts: the draft model and one prompt-lookup chain, `--no-suffix`)."""
        method, extra = ("auto", ["--no-suffix"]) if label == "auto-no-suffix" else (label, [])
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = serve_command(port, max_batch=max(self.levels), max_context=self.a.ctx, target=self.a.target,
                            draft=self.a.draft) + ["--method", method, *extra] + list(self.a.specwood_arg)
        with ServerProcess(cmd, base, log_path=self.out / f"specwood-{label}-c{c}.log",
                           startup_timeout=self.a.startup_timeout, log=log):
            self.warm_up(base, method)
            self.passes(base, "specwood", label, method, c)

    def llama(self, mode: str, c: int) -> None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [self.a.llama_server, "-m", self.a.llama_model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(self.a.threads), "-tb", str(self.a.threads), "-c", str(self.a.ctx * c), "-np", str(c)]
        if mode != "plain":
            cmd += ["--spec-type", mode]
        with ServerProcess(cmd, base, log_path=self.out / f"llama-{mode}-c{c}.log",
                           startup_timeout=self.a.startup_timeout, log=log):
            self.warm_up(base, None)
            self.passes(base, "llama.cpp", mode, None, c)

    def run(self) -> None:
        t0 = time.time()
        modes = []
        if self.a.llama_server:
            modes = ["plain", *llama_spec_types(Path(self.a.llama_server))]
            log(f"llama-server modes: {modes}")
        for c in self.levels:
            for m in self.a.methods.split(","):
                self.specwood(m.strip(), c)
            for mode in modes:
                self.llama(mode, c)
        rows = summarize(self.records)
        meta = {"when": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)), "workloads": str(self.a.workloads),
                "max_tokens": self.a.max_tokens, "levels": self.levels, "llama_modes": modes,
                "wall_s": round(time.time() - t0, 1), "argv": sys.argv[1:]}
        (self.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "records": self.records},
                                                          indent=1, default=str))
        (self.out / "report.md").write_text(markdown(rows, meta))
        log(f"wrote {self.out / 'report.md'}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workloads", default=str(DEFAULT_WORKLOADS))
    p.add_argument("--methods", default="ar,auto,suffix")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="the first N items of each category")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--ctx", type=int, default=4096, help="context tokens per request slot")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (omit: specwood only)")
    p.add_argument("--llama-model", default=None, help="the target GGUF llama-server loads")
    p.add_argument("--specwood-arg", action="append", default=[], help="extra `specwood serve` argument")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    if a.llama_server and not a.llama_model:
        p.error("--llama-server needs --llama-model GGUF")
    Run(a).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
