"""`specwood serve` under hostile and long use, as a real process on 127.0.0.1: schemathesis fuzzes
both generation endpoints from the server's own OpenAPI schema (positive and negative cases) and
must find no 5xx; a soak of mixed requests (streams, cancellations, bad input, full concurrency)
must give back memory, file descriptors, threads and cache rows. The 5,000-request soak is
benchmarks/soak.py (BENCHMARKS.md)."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import httpx
import pytest

from specwood.bench.soak import CLIENT_CLOSED, Soak
from specwood.models.testing import tiny_pair_folders

from test_server import serve_command

MAX_BATCH = 4
FUZZ_EXAMPLES = 200


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`specwood serve` on a tiny target and draft (dyspec by default), port 0."""
    root = tmp_path_factory.mktemp("reliability")
    target, draft = tiny_pair_folders(root)
    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(target), "--draft", str(draft),
           "--dtype", "fp32", "--method", "dyspec", "--port", "0", "--max-batch", str(MAX_BATCH),
           # the prefix cache keeps finished requests' K/V up to its budget by design: a small one
           # fills during the soak's warm-up, so growth after it is a leak, not the cache
           # (8M: the 4 rows of 1,281 slots take 5.2M of it, the entries the other 3M)
           "--kv-memory", "8M"]
    with serve_command(cmd, root / "cache") as (url, lines, proc):
        yield url, proc, root


def test_fuzzing_both_generation_endpoints_finds_no_server_error(served):
    url, proc, root = served
    report = root / "fuzz"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--include-method", "POST",
           "--checks", "not_a_server_error", "--mode", "all", "--phases", "coverage,fuzzing",
           "--max-examples", str(FUZZ_EXAMPLES), "--seed", "7", "--workers", "1", "--generation-database", "none",
           "--request-timeout", "60", "--no-color", "--report", "ndjson", "--report-dir", str(report)]
    # tests/schemathesis_hooks.py also sends each body with a string field turned hostile
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root, env=env)  # its caches go there
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    # from the run's own record: every answer per endpoint, and how many fuzzing cases each had
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    fuzzed: collections.Counter = collections.Counter()
    hostile: collections.Counter = collections.Counter()
    for line in next(report.glob("*.ndjson")).read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        rec = finished["recorder"]
        statuses[rec["label"]].update(i["response"]["status_code"] for i in rec["interactions"].values()
                                      if i.get("response"))
        if finished["phase"] == "fuzzing":
            fuzzed[rec["label"]] += len(rec["cases"])
        for case in rec["cases"].values():  # what the hooks sent
            sent = json.dumps(case.get("value", {}).get("body"))
            hostile["surrogate"] += "\\ud800" in sent or "\\udfff" in sent
            hostile["control text"] += "<|im_end|>" in sent
    labels = {"POST /v1/chat/completions", "POST /v1/completions"}
    assert set(fuzzed) == labels and min(fuzzed.values()) >= FUZZ_EXAMPLES, fuzzed
    assert hostile["surrogate"] and hostile["control text"], hostile
    for label in labels:  # accepted and refused cases both reached the server, and no 5xx
        seen = statuses[label]
        assert seen[200] > 0 and sum(n for s, n in seen.items() if 400 <= s < 500) > 0, (label, seen)
        assert not [s for s in seen if s >= 500], (label, seen)
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
    assert proc.poll() is None


def test_a_soak_gives_everything_back(served):
    """Mixed requests at full concurrency: no 5xx, every good request completes, and after a
    warm-up the server's memory grows < 5% while descriptors, threads and cache rows return."""
    url, proc, _ = served
    with Soak(url, proc.pid, concurrency=MAX_BATCH, seed=3) as soak:
        dropped = _uploads_dropped(soak.client)
        report = soak.run(1500, warmup=100)
        dropped = _uploads_dropped(soak.client) - dropped
    print("\n" + report.summary())
    assert report.server_errors == 0 and not report.failures, report.failures[:5]
    # every upload the client dropped was counted as one (the warm-up's too), and logged no
    # traceback (the fixture's end looks at the whole log)
    assert dropped >= report.kinds["drop"] == report.statuses[CLIENT_CLOSED] > 0, (dropped, report.summary())
    assert sum(report.statuses.values()) == report.requests and all(report.kinds.values())
    assert report.rss_growth < 0.05, report.summary()
    assert report.end["fds"] <= report.warm["fds"], report.summary()
    # the event loop's worker pool (parsing, tokenising) grows on demand up to its fixed size and
    # stays: bounded, where a leak would add threads with every request
    assert report.end["threads"] <= report.warm["threads"] + min(32, (os.cpu_count() or 1) + 4), report.summary()
    assert report.warm["free_rows"] == report.end["free_rows"] == MAX_BATCH
    assert proc.poll() is None


def _uploads_dropped(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("specwood:request_uploads_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("no specwood:request_uploads_dropped_total in /metrics")
