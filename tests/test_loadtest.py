"""Tests for `specwood loadtest`: the timing maths, and the real HTTP measuring core against a small
real server (FastAPI + uvicorn on 127.0.0.1, a free port) that streams OpenAI-style SSE chunks with
known delays, usage and specwood_stats; the server subprocess handling; the CLI; and, when the
specwood server exists, an end-to-end run against it on the tiny engine."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from specwood.bench import load_inprocess, load_report, load_requests, load_stats, server_process
from specwood.bench import loadtest as lt
from specwood.bench.workload import Prompt, Workload
from specwood.errors import SpecwoodError

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

# A fake OpenAI-compatible server. Per request: TTFT_S before the first content chunk, then one
# chunk every STEP_S; method "ar" streams one token per chunk, "spec" three (AAT 3); "slow" waits
# 5 s before anything (so does a prompt ending in 9); "bad" is rejected with a 400; "broken" sends an
# error event mid-stream;
# "cut" stops after the first chunk; "empty" finishes at once with zero tokens; "multiline" spreads
# each event over several data lines.
# The prompt's last character, a digit, sets how many tokens it generates (N_BY_DIGIT).
# Used in-process (exec) and as a script for the subprocess tests.
FAKE_SERVER = r'''
import asyncio, json, sys, time
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse, PlainTextResponse

TTFT_S = 0.05
STEP_S = 0.02
N_BY_DIGIT = {"1": 7, "2": 10, "3": 4}
TOKENS_PER_CHUNK = {"ar": 1, "spec": 3}


def make_app():
    app = FastAPI()
    seen = []
    app.state.seen = seen

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("fake_requests_total %d\n" % len(seen))

    async def handle(req: Request, chat: bool):
        body = await req.json()
        seen.append(body)
        method = body.get("method", "ar")
        if method == "bad":
            return JSONResponse({"error": {"message": "unknown method 'bad'", "type": "invalid_request_error"}},
                                status_code=400)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        n = min(N_BY_DIGIT.get(text[-1:], 5), int(body.get("max_tokens", 16)))
        k = TOKENS_PER_CHUNK.get(method, 1)

        continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))

        def chunk(content, finish=None, cum=None):
            extra = {"usage": {"prompt_tokens": 1, "completion_tokens": cum}} if continuous and cum is not None else {}
            if chat:
                choice = {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": content, "finish_reason": finish}
                obj = "text_completion"
            event = {"id": "x", "object": obj, "model": "fake-model", "choices": [choice], **extra}
            if method == "multiline":  # legal SSE: one event over several data lines, joined by newlines
                return "".join("data: " + ln + "\n" for ln in json.dumps(event, indent=1).splitlines()) + "\n"
            return "data: " + json.dumps(event) + "\n\n"

        if method == "empty":  # an immediate end of sequence: no content, zero tokens, not an error
            n = 0

        async def gen():
            yield ": keep-alive comment\n\n"
            if method == "slow" or text.endswith("9"):
                await asyncio.sleep(5)
            if chat:  # a role-only first chunk, as OpenAI sends: not content, not the first token
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(TTFT_S)
            if n:
                yield chunk("tok ", cum=1)
            if method == "cut":  # the connection ends without [DONE], usage or finish_reason
                return
            sent = 1 if n else 0
            while sent < n:
                if method == "broken":
                    yield "data: " + json.dumps({"error": {"message": "engine failure"}}) + "\n\n"
                    return
                await asyncio.sleep(STEP_S)
                m = min(k, n - sent)
                sent += m
                yield chunk("tok " * m, cum=sent)
            yield chunk("", "length")
            if (body.get("stream_options") or {}).get("include_usage"):
                stats = {"new_tokens": n, "tokens_per_s": 1.0 / STEP_S * k, "ttft_s": TTFT_S}
                if method == "spec":
                    stats["mean_accepted_tokens"] = 3.0
                    stats["auto"] = "dyspec"  # as specwood's auto reports its choice
                usage = {"prompt_tokens": len(text), "completion_tokens": n, "total_tokens": len(text) + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage, "specwood_stats": stats}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, True)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, False)

    return app


if __name__ == "__main__":
    import uvicorn
    port = int(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
    if mode == "exit":
        print("fatal: no model here", flush=True)
        sys.exit(3)
    if mode == "hang":  # never listens
        print("loading forever", flush=True)
        time.sleep(600)
    print("listening on http://127.0.0.1:%d" % port, flush=True)
    uvicorn.run(make_app(), host="127.0.0.1", port=port, log_level="warning")
'''

_fake: dict[str, Any] = {}
exec(compile(FAKE_SERVER, "fake_server", "exec"), _fake)
TTFT_S, STEP_S = _fake["TTFT_S"], _fake["STEP_S"]


class ThreadServer:
    """Runs an ASGI app with uvicorn in a thread on 127.0.0.1:<free port>."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        self.port = server_process.free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "test server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_server():
    app = _fake["make_app"]()
    with ThreadServer(app) as s:
        s.app = app
        yield s


@pytest.fixture()
def one_torch_thread() -> Any:
    """Tiny models are much slower with 2 threads on a shared 2-core box (spin-waiting)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts() -> list[Prompt]:
    """4 prompts in 2 categories; last digit = generated tokens (1: 7, 2: 10, 3: 4)."""
    return [Prompt("a1", "alpha", messages=({"role": "user", "content": "first 1"},)),
            Prompt("a2", "alpha", messages=({"role": "user", "content": "second 2"},)),
            Prompt("b1", "beta", prompt="raw prompt 3"),
            Prompt("b2", "beta", messages=({"role": "user", "content": "fourth 1"},))]


# --------------------------------------------------------------------------------------- pure maths
def test_percentile_matches_linear_interpolation() -> None:
    assert load_stats.percentile([], 50) is None
    assert load_stats.percentile([3.0], 99) == 3.0
    assert load_stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert load_stats.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert load_stats.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)


def test_chunk_token_counts() -> None:
    assert load_stats.chunk_token_counts([4, 4, 4], 3) == ([1, 1, 1], "one-per-chunk")
    assert load_stats.chunk_token_counts([4, 4], None) == ([1, 1], "one-per-chunk")
    # several tokens per chunk: the first (prefill) chunk holds one, the rest split by text share
    assert load_stats.chunk_token_counts([4, 12, 12, 4], 8) == ([1, 3, 3, 1], "estimated")
    counts, mode = load_stats.chunk_token_counts([5, 1, 1, 50], 20)
    assert (sum(counts) == 20 and counts[0] == 1 and min(counts) >= 1 and counts[3] == max(counts)
            and mode == "estimated")
    # fewer tokens than chunks: some carry none, the total is kept
    counts, _ = load_stats.chunk_token_counts([1, 1, 1, 1], 2)
    assert sum(counts) == 2
    # exact per-chunk counts win
    assert load_stats.chunk_token_counts([4, 8], 3, exact=[1, 2]) == ([1, 2], "exact")


def test_per_token_latencies_and_level_summary() -> None:
    assert load_stats.per_token_latencies([0.1, 0.3, 0.4], [1, 2, 1]) == pytest.approx([0.1, 0.1, 0.1])
    # 0-token chunk folds in
    assert load_stats.per_token_latencies([0.1, 0.2, 0.4], [1, 0, 2]) == pytest.approx([0.15, 0.15])
    recs = [
        {"completion_tokens": 3, "ttft_s": 0.1, "latency_s": 0.4, "chunk_s": [0.1, 0.3, 0.4], "chunk_tokens": [1, 1, 1],
         "mean_accepted_tokens": 2.0},
        {"completion_tokens": 5, "ttft_s": 0.3, "latency_s": 0.7, "chunk_s": [0.3, 0.5, 0.7], "chunk_tokens": [1, 2, 2],
         "mean_accepted_tokens": 4.0},
        {"completion_tokens": 0, "error": "HTTP 500"},
    ]
    s = load_stats.summarize_level(recs, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, 1)
    assert s["completion_tokens"] == 8 and s["decode_tokens"] == 6
    assert s["decode_tokens_per_s"] == pytest.approx(3.0) and s["tokens_per_s"] == pytest.approx(4.0)
    assert s["ttft_s_p50"] == pytest.approx(0.2)
    # per-token latencies: 200, 100 ms (request 1) and 100, 100, 100, 100 ms (request 2)
    assert s["tbt_ms_p50"] == pytest.approx(100.0) and s["tbt_ms_p99"] == pytest.approx(195.0)
    assert s["itl_ms_p50"] == pytest.approx(200.0)
    assert s["mean_accepted_tokens"] == pytest.approx(3.0)


def test_speedups() -> None:
    rows = [{"method": m, "concurrency": c, "decode_tokens_per_s": v, "tokens_per_s": v + 1}
            for m, c, v in [("ar", 1, 10.0), ("ar", 4, 30.0), ("spec", 1, 20.0), ("spec", 4, 45.0)]]
    load_stats.add_speedups(rows)
    idx = {(r["method"], r["concurrency"]): r for r in rows}
    assert idx[("ar", 4)]["scaling"] == pytest.approx(3.0)
    assert idx[("spec", 4)]["scaling"] == pytest.approx(2.25)
    assert idx[("spec", 1)]["speedup_vs_ar"] == pytest.approx(2.0)
    assert idx[("spec", 4)]["speedup_vs_ar"] == pytest.approx(1.5)
    assert idx[("spec", 4)]["e2e_speedup_vs_ar"] == pytest.approx(46 / 31)
    assert idx[("ar", 1)]["speedup_vs_ar"] == pytest.approx(1.0)


def test_request_plan_is_interleaved_and_bounded() -> None:
    ps = prompts()
    assert [p.id for p in load_requests.interleave(ps)] == ["a1", "b1", "a2", "b2"]
    assert [p.id for p in load_requests.plan_requests(ps, [1, 2])] == ["a1", "b1", "a2", "b2"]
    assert [p.id for p in load_requests.plan_requests(ps, [1, 4])] == ["a1", "b1", "a2", "b2"] * 2
    assert len(load_requests.plan_requests(ps, [8], n_requests=3)) == 3
    assert load_requests.parse_concurrency("4, 1,2,2") == [1, 2, 4]
    for bad in ("0", "a", ""):
        with pytest.raises(SpecwoodError):
            load_requests.parse_concurrency(bad)
    with pytest.raises(SpecwoodError, match="over the limit"):
        lt.LoadTest("http://127.0.0.1:1", ps, ["ar", "x"], [1, 2, 4], max_total_requests=10)
    cmd = server_process.serve_command(8123, max_batch=8, draft="none", dtype="fp32")
    assert cmd[1:] == ["-m", "specwood.cli", "serve", "--host", "127.0.0.1", "--port", "8123", "--max-batch", "8",
                       "--no-plan-in-background", "--draft", "none", "--dtype", "fp32"]
    cmd = server_process.serve_command(8123, max_batch=8, dtype="q4", draft_dtype="q4")
    assert cmd[-4:] == ["--dtype", "q4", "--draft-dtype", "q4"]


# ------------------------------------------------------------------------ real HTTP, fake server
def test_loadtest_against_fake_server(fake_server, tmp_path: Path) -> None:
    wl = Workload(prompts=prompts(), source="test.jsonl")
    fake_server.app.state.seen.clear()
    logs: list[str] = []
    result = lt.run_loadtest(fake_server.url, wl, ["ar", "spec"], [1, 2], tmp_path, max_tokens=16,
                             request_timeout=10, log=logs.append, run_info={"command": "specwood loadtest --test"})
    rows = {(r["method"], r["concurrency"]): r for r in result["levels"]}
    assert set(rows) == {("ar", 1), ("ar", 2), ("spec", 1), ("spec", 2)}
    reqs = result["requests"]
    assert len(reqs) == 16 and not any(r.get("error") for r in reqs)
    # the request bodies: greedy, streaming with usage, the method field, chat vs raw endpoint, the model id
    seen = [b for b in fake_server.app.state.seen if b.get("method") in ("ar", "spec")]
    assert all(b["temperature"] == 0 and b["stream"]
               and b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               and b["model"] == "fake-model" for b in seen)
    assert len(seen) == 2 + 16 and sum("prompt" in b for b in seen) == 4  # raw b1 once per level and method
    expected_tokens = {"a1": 7, "a2": 10, "b1": 4, "b2": 7}
    for r in reqs:
        assert r["completion_tokens"] == expected_tokens[r["id"]]
        assert sum(r["chunk_tokens"]) == r["completion_tokens"]
        assert TTFT_S <= r["ttft_s"] < TTFT_S + 0.5  # the role-only chunk does not count
        assert r["tokens_per_chunk"] == "exact"  # continuous usage: cumulative counts in every chunk
        if r["method"] == "ar":
            assert set(r["chunk_tokens"]) == {1} and r.get("mean_accepted_tokens") is None
        else:
            assert r["mean_accepted_tokens"] == 3.0 and r["chunk_tokens"][:2] == [1, 3]
    for c in (1, 2):
        ar, spec = rows[("ar", c)], rows[("spec", c)]
        assert ar["requests"] == spec["requests"] == 4 and ar["errors"] == 0
        assert ar["completion_tokens"] == spec["completion_tokens"] == 28
        # ar: one token per STEP_S; spec: three per STEP_S
        assert STEP_S * 1e3 <= ar["tbt_ms_p50"] < STEP_S * 1e3 + 25
        # three tokens a chunk: a third of ar's gap, overheads included (a bound relative to ar's,
        # not to the clock: a busy machine's late wake-ups lengthen both alike)
        assert STEP_S * 1e3 / 3 <= spec["tbt_ms_p50"] < ar["tbt_ms_p50"] / 2
        assert spec["itl_ms_p50"] >= STEP_S * 1e3
        assert spec["mean_accepted_tokens"] == pytest.approx(3.0) and ar["mean_accepted_tokens"] is None
        assert ar["decode_tokens_per_s"] == pytest.approx(24 / ar["wall_s"])
        assert ar["tokens_per_s"] == pytest.approx(28 / ar["wall_s"])
        # the ratio of the two levels' decode rates; not a timing threshold: one scheduler stall on a
        # busy machine is as long as a whole fake level (~0.4 s), the per-token checks above see the pacing
        assert spec["speedup_vs_ar"] == pytest.approx(spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"])
    # c=1: the requests run back to back: wall >= sum of their ideal times
    ideal = sum(TTFT_S + (n - 1) * STEP_S for n in expected_tokens.values())
    assert ideal <= rows[("ar", 1)]["wall_s"] < ideal + 2.0
    # two clients at a time really overlap, one client never does (interval checks, not a throughput
    # threshold that one stall of a busy machine can break); scaling is the ratio of the two levels
    def overlaps(c: int) -> int:
        spans = sorted((r["start_s"], r["start_s"] + r["latency_s"]) for r in reqs if r["method"] == "ar"
                       and r["concurrency"] == c)
        return sum(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    assert overlaps(1) == 0 and overlaps(2) >= 2
    assert rows[("ar", 2)]["scaling"] == pytest.approx(rows[("ar", 2)]["decode_tokens_per_s"]
                                                       / rows[("ar", 1)]["decode_tokens_per_s"])
    assert rows[("ar", 1)]["scaling"] == pytest.approx(1.0)
    # outputs
    files = {p.name for p in tmp_path.iterdir()}
    assert {"results.json", "report.md", load_report.PLOT_NAME} <= files
    assert (tmp_path / load_report.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["completed"] is True and saved["meta"]["command"] == "specwood loadtest --test"
    assert saved["meta"]["server"]["model"] == "fake-model" and saved["meta"]["requests_per_level"] == 4
    assert len(saved["levels"]) == 4 and len(saved["requests"]) == 16
    md = (tmp_path / "report.md").read_text()
    for m, c in rows:
        assert f"| {m} | {c} | 4 | 0 |" in md
    assert "specwood loadtest --test" in md and "machine:" in md and "date:" in md and load_report.PLOT_NAME in md
    assert "speedup vs ar" in md and "auto chose" in md and "| dyspec x4 |" in md
    assert rows[("spec", 1)]["auto_decisions"] == {"dyspec": 4} and rows[("ar", 1)]["auto_decisions"] is None
    assert any("warm-up [spec]" in s for s in logs) and any("[ar c=2] done" in s for s in logs)


def test_stream_edge_cases_and_failed_requests(fake_server, tmp_path: Path) -> None:
    import asyncio

    import httpx

    async def one(method: str, timeout: float) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:
            return await load_requests.stream_request(client, fake_server.url, prompts()[0], method, 8, timeout)

    assert asyncio.run(one("bad", 5))["error"] == "HTTP 400: unknown method 'bad'"
    assert "engine failure" in asyncio.run(one("broken", 5))["error"]
    r = asyncio.run(one("slow", 0.3))
    assert r["error"].startswith("timeout")
    assert asyncio.run(one("cut", 5))["error"].startswith("the stream ended early")
    r = asyncio.run(one("multiline", 5))
    assert r["error"] is None and r["completion_tokens"] == 7 and r["chunks"] == 7 and r["tokens_per_chunk"] == "exact"
    r = asyncio.run(one("empty", 5))
    assert r["error"] is None and r["completion_tokens"] == 0 and r["ttft_s"] is None
    # a method the server rejects fails at its warm-up, before anything is measured
    with pytest.raises(SpecwoodError, match="warm-up request for method 'bad' failed: HTTP 400"):
        lt.run_loadtest(fake_server.url, prompts(), ["ar", "bad"], [1], tmp_path / "w", log=None)
    # without warm-up: errors are counted per level and listed in the report
    res = lt.run_loadtest(fake_server.url, prompts()[:2], ["ar", "broken"], [1], tmp_path / "x", warmup=False,
                          log=None)
    rows = {r["method"]: r for r in res["levels"]}
    assert rows["broken"]["errors"] == 2 and rows["broken"]["decode_tokens_per_s"] is None
    assert rows["ar"]["errors"] == 0 and rows["ar"]["completion_tokens"] == 17
    md = (tmp_path / "x" / "report.md").read_text()
    assert "## errors" in md and "engine failure" in md


def test_cli_with_url(fake_server, tmp_path: Path, capsys) -> None:
    from specwood.cli import main

    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(p.to_dict()) for p in prompts()) + "\n")
    out = tmp_path / "out"
    rc = main(["loadtest", "--url", fake_server.url, "--methods", "ar,spec", "--concurrency", "2,1",
               "--workload", str(wl), "--max-tokens", "8", "--out", str(out), "--no-progress",
               "--no-continuous-usage"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "# specwood loadtest" in cap.out and "| spec | 2 | 4 | 0 |" in cap.out
    assert "specwood loadtest: [spec c=2] done" in cap.err
    saved = json.loads((out / "results.json").read_text())
    assert ([(r["method"], r["concurrency"]) for r in saved["levels"]]
            == [("ar", 1), ("ar", 2), ("spec", 1), ("spec", 2)])
    assert saved["meta"]["server"]["spawned"] is False
    assert all(r["completion_tokens"] <= 8 for r in saved["requests"])
    # without per-chunk usage the spec method's tokens per chunk are estimated from the text (exactly, here)
    spec = [r for r in saved["requests"] if r["method"] == "spec"]
    assert {r["tokens_per_chunk"] for r in spec} == {"estimated"} and all(r["chunk_tokens"][:2] == [1, 3] for r in spec)
    assert "estimated" in cap.out


@pytest.mark.parametrize("argv, needle", [
    (["--concurrency", "0"], "--concurrency levels must be >= 1"),
    (["--concurrency", "1,x"], "comma-separated integers"),
    (["--methods", "ar,hf"], "specwood bench"),
    (["--methods", "ar,nonsense"], "unknown method 'nonsense'"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--url", "localhost:8000"], "http://"),
    (["--url", "http://127.0.0.1:1", "--max-batch", "4"], "--max-batch"),
    (["--url", "http://127.0.0.1:1", "--target", "x"], "--target"),
    (["--inprocess", "--concurrency", "2,4"], "c=1"),
    (["--workload", "/nonexistent.jsonl"], "not found"),
])
def test_cli_errors_are_one_line(argv: list[str], needle: str, capsys, tmp_path: Path) -> None:
    from specwood.cli import main

    rc = main(["loadtest", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("specwood: error:")]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------- server process
@pytest.fixture()
def fake_script(tmp_path: Path) -> Path:
    p = tmp_path / "fake_server.py"
    p.write_text(FAKE_SERVER)
    return p


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_server_failures_are_one_line_errors(fake_script: Path) -> None:
    port = server_process.free_port()
    srv = server_process.ServerProcess([sys.executable, str(fake_script), str(port), "exit"],
                                       f"http://127.0.0.1:{port}", startup_timeout=30, log=None)
    with pytest.raises(SpecwoodError, match=r"exited with code 3 before it was ready: fatal: no model here"):
        with srv:
            pass
    srv = server_process.ServerProcess([sys.executable, str(fake_script), str(port), "hang"],
                                       f"http://127.0.0.1:{port}", startup_timeout=1.0, log=None)
    with pytest.raises(SpecwoodError, match="not ready within 1 s.*loading forever"):
        with srv:
            pass
    assert srv.proc.poll() is not None  # killed, not left behind


def test_cli_spawns_and_stops_the_server(fake_script: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """The CLI's own spawn path, with the fake server standing in for `specwood serve`."""
    from specwood.cli import main

    ports: list[int] = []

    def fake_serve(port: int, **kw: Any) -> list[str]:
        ports.append(port)
        assert kw["max_batch"] == 2 and kw["draft"] == "none"
        return [sys.executable, str(fake_script), str(port)]

    monkeypatch.setattr(server_process, "serve_command", fake_serve)
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(p.to_dict()) for p in prompts()[:2]) + "\n")
    out = tmp_path / "out"
    rc = main(["loadtest", "--methods", "ar", "--concurrency", "1,2", "--workload", str(wl), "--max-tokens", "4",
               "--draft", "none", "--out", str(out), "--server-timeout", "30"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "server ready at" in err and not _port_open(ports[0])
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["server"]["spawned"] is True and len(saved["levels"]) == 2
    assert "listening on" in (out / "server.log").read_text()


WRAPPER = """
import sys
from specwood.bench import server_process
server_process.serve_command = lambda port, **kw: [sys.executable, {script!r}, str(port)]
from specwood.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_stops_the_spawned_server(fake_script: Path, tmp_path: Path) -> None:
    """A loadtest killed mid-level (SIGTERM) stops its server, writes partial results, exits 130."""
    import re
    import signal

    wrapper = tmp_path / "run.py"
    wrapper.write_text(WRAPPER.format(script=str(fake_script)))
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "q", "prompt": "quick 3"}) + "\n"
                  + json.dumps({"id": "h", "prompt": "hang 9"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(wrapper), "loadtest", "--methods", "ar", "--concurrency", "1",
                             "--workload", str(wl), "--no-warmup", "--out", str(out),
                             "--max-tokens", "4"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port = None
    try:
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # type: ignore[union-attr]
            m = re.search(r"fake_server.py (\d+)", line)
            if m:
                port = int(m.group(1))
            if "[ar c=1] 1/2 q" in line:  # the next request hangs
                break
            assert time.monotonic() < deadline
        assert port is not None and _port_open(port)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert "interrupted; partial results" in rest and not _port_open(port)
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["completed"] is False and [r["id"] for r in saved["requests"]] == ["q"]


def test_cli_inprocess(fake_server, tmp_path: Path, tiny_tokenizer, one_torch_thread, capsys) -> None:
    """--inprocess loads the engine in the loadtest's process (here a tiny HF folder) and adds the
    server-overhead comparison; the HTTP side is the fake server."""
    from specwood.cli import main
    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=128)
    folder = save_hf_folder(tmp_path / "tiny", cfg, random_state_dict(cfg, seed=1))
    tiny_tokenizer.save_pretrained(folder)
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "r1", "prompt": "hello 1"}) + "\n")
    out = tmp_path / "out"
    rc = main(["loadtest", "--url", fake_server.url, "--methods", "ar", "--concurrency", "1", "--workload", str(wl),
               "--max-tokens", "6", "--out", str(out), "--inprocess", "--target", str(folder), "--draft", "none",
               "--dtype", "fp32", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    saved = json.loads((out / "results.json").read_text())
    comp = saved["inprocess_comparison"]
    assert [c["method"] for c in comp] == ["ar"] and comp[0]["http_decode_tokens_per_s"] > 0
    assert saved["inprocess"][0]["requests"] == 2 and len(saved["inprocess_requests"]) == 2
    assert "## server overhead" in (out / "report.md").read_text()


def test_inprocess_rows_and_comparison(tiny_engine, one_torch_thread) -> None:
    # raw prompts: the tiny random model ends chat turns at once
    reqs = load_requests.plan_requests([Prompt("r1", "a", prompt="hello world"),
                                        Prompt("r2", "b", prompt="raw prompt 3")], [1])
    rows = load_inprocess.run_inprocess(tiny_engine, reqs, ["ar", "chain"], 8, log=None)
    assert [r["method"] for r in rows] == ["ar", "chain"]
    for r in rows:
        assert r["ok"] == 2 and r["completion_tokens"] == 16 and r["decode_tokens_per_s"] > 0
        assert all(sum(x["chunk_tokens"]) == x["completion_tokens"] for x in r["records"])
    assert rows[1]["mean_accepted_tokens"] is not None
    http = [{"method": "ar", "concurrency": 1, "decode_tokens_per_s": rows[0]["decode_tokens_per_s"] / 2,
             "tokens_per_s": 1.0}]
    comp = load_inprocess.inprocess_comparison(http, rows)
    assert comp[0]["decode_ratio"] == pytest.approx(0.5) and comp[0]["overhead_pct"] == pytest.approx(50.0)
    assert comp[1]["http_decode_tokens_per_s"] is None and comp[1]["decode_ratio"] is None


# ------------------------------------------------------------------ the real specwood server
def test_end_to_end_against_specwood_server(tiny_engine, one_torch_thread, tmp_path: Path) -> None:
    """The loadtest core against the real server app on the tiny engine: 2 methods x c = 1, 2."""
    try:
        from specwood.serve.app import create_app
    except ImportError as e:
        pytest.skip(f"specwood.serve.app.create_app is not available yet ({e})")
    from specwood.engine.scheduler import SchedulerConfig

    scheduler = tiny_engine.make_scheduler(SchedulerConfig(max_batch=2), drafts=())
    scheduler.start()
    try:
        app = create_app(tiny_engine, scheduler)
        with ThreadServer(app, lifespan="on") as srv:
            # raw prompts: the tiny random model ends chat turns at once
            ps = [Prompt("r1", "a", prompt="hello world"), Prompt("r2", "b", prompt="def f(x):"),
                  Prompt("r3", "a", prompt="raw prompt 3")]
            res = lt.run_loadtest(srv.url, ps, ["ar", "chain"], [1, 2], tmp_path, max_tokens=8, request_timeout=120,
                                  warmup_timeout=120, log=None)
    finally:
        scheduler.stop()
    rows = {(r["method"], r["concurrency"]): r for r in res["levels"]}
    assert set(rows) == {("ar", 1), ("ar", 2), ("chain", 1), ("chain", 2)}
    for r in rows.values():
        assert r["requests"] == 4 and r["errors"] == 0 and r["completion_tokens"] > 0, r
        assert r["decode_tokens_per_s"] > 0 and r["ttft_s_p50"] > 0
    assert rows[("chain", 1)]["mean_accepted_tokens"] is not None  # specwood_stats reached the client
    md = (tmp_path / "report.md").read_text()
    for m, c in rows:
        assert f"| {m} | {c} | 4 | 0 |" in md
    assert (tmp_path / load_report.PLOT_NAME).exists()
