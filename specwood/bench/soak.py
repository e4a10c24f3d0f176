"""A soak test of `specwood serve`: many mixed requests, then is everything given back?

The requests are a seeded mix of non-streamed chat and completion requests, streams, streams the
client drops after their first chunk (a cancellation mid-stream), uploads the client drops halfway
through the body, and bad requests (malformed JSON, out-of-range parameters, a seed past 2^64, deep
nesting, a wrong content type), sent by up to
`concurrency` clients at once. Read from the server's process (/proc) after a warm-up and at the
end, both while it is idle: resident memory, open file descriptors and threads; from /health: free
cache rows. Every good request must complete (200, a finish reason, [DONE] for a stream), every bad
one must get a 4xx, and none may get a 5xx. A dropped upload gets no answer (recorded as 499,
nginx's "client closed request").

Used by tests/test_server_reliability.py (a short run) and benchmarks/soak.py (5,000 requests).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import random
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx

KINDS = ("chat", "completion", "stream", "cancel", "bad", "drop")
WEIGHTS = (3, 3, 3, 2, 2, 1)
CLIENT_CLOSED = 499  # the status recorded for an upload the client dropped (nothing comes back)
WORDS = ("def", "return", "the", "server", "token", "tree", "print(", "x = 1", "hello", "for i in range(3):")


def process_sample(pid: int) -> dict[str, int]:
    """Resident memory (kB), open file descriptors and threads of process `pid` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def _bad_request(rng: random.Random) -> tuple[bytes, str]:
    """A request body the server must refuse with a 4xx, and its content type."""
    choice = rng.randrange(8)
    if choice == 0:
        return b'{"prompt": "x", "max_tokens": ', "application/json"  # truncated JSON
    if choice == 1:
        return json.dumps({"prompt": "x", "temperature": -1}).encode(), "application/json"
    if choice == 2:
        return json.dumps({"prompt": "x", "seed": 2 ** 64}).encode(), "application/json"
    if choice == 3:
        return b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "application/json"  # deep nesting
    if choice == 4:
        return json.dumps({"prompt": "x", "method": "no-such-method"}).encode(), "application/json"
    if choice == 5:
        return json.dumps({"prompt": "x", "stop": ["s"] * 17}).encode(), "application/json"
    if choice == 6:
        return b"prompt=x", "application/x-www-form-urlencoded"
    return json.dumps({"messages": []}).encode(), "application/json"


@dataclasses.dataclass
class SoakReport:
    requests: int
    kinds: dict[str, int]
    statuses: dict[int, int]
    failures: list[str]
    seconds: float
    warm: dict[str, Any]  # process_sample's figures and the free cache rows (None: the executor has none)
    end: dict[str, Any]

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def rss_growth(self) -> float:
        return self.end["rss_kb"] / self.warm["rss_kb"] - 1

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in self.kinds.items())
        return (f"{self.requests} requests ({kinds}) in {self.seconds:.0f} s; 5xx: {self.server_errors}; "
                f"failed: {len(self.failures)}; after warm-up -> end: RSS {self.warm['rss_kb'] / 1024:.1f} -> "
                f"{self.end['rss_kb'] / 1024:.1f} MiB ({100 * self.rss_growth:+.2f}%), fds {self.warm['fds']} -> "
                f"{self.end['fds']}, threads {self.warm['threads']} -> {self.end['threads']}, free cache rows "
                f"{self.warm['free_rows']} -> {self.end['free_rows']}")


class Soak:
    """Drives the server at `url` (process `pid`) with the mix above."""

    def __init__(self, url: str, pid: int, *, concurrency: int = 4, max_tokens: int = 24, seed: int = 0,
                 headers: dict[str, str] | None = None, timeout_s: float = 120):
        self.url, self.pid, self.concurrency, self.max_tokens = url, pid, concurrency, max_tokens
        self.headers, self.timeout_s = dict(headers or {}), timeout_s
        self.rng = random.Random(seed)
        self.client = self._new_client()

    def _new_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=self.timeout_s, trust_env=False, headers=self.headers,
                            limits=httpx.Limits(max_connections=self.concurrency + 2))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "Soak":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    def _good_body(self, rng: random.Random, chat: bool, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": rng.randint(1, self.max_tokens), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt(rng)}]
        else:
            body["prompt"] = self._prompt(rng)
        if rng.random() < 0.5:
            body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]), seed=rng.randrange(2 ** 32))
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(WORDS)]
        return body

    def one(self, kind: str, seed: int) -> tuple[int, str | None]:
        """Send one request of `kind`; (HTTP status, what went wrong or None); 0 when the
        connection itself failed."""
        try:
            return self._send(kind, random.Random(seed))
        except httpx.HTTPError as e:
            return 0, f"{kind}: {type(e).__name__}: {e}"

    def _send(self, kind: str, rng: random.Random) -> tuple[int, str | None]:
        if kind == "drop":
            return self._drop_upload(rng)
        if kind == "bad":
            body, ctype = _bad_request(rng)
            r = self.client.post("/v1/completions", content=body, headers={"content-type": ctype})
            return r.status_code, None if 400 <= r.status_code < 500 else f"bad request got {r.status_code}"
        chat = kind == "chat" or (kind != "completion" and rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if kind in ("chat", "completion"):
            r = self.client.post(path, json=self._good_body(rng, chat, False))
            ok = r.status_code == 200 and r.json()["choices"][0].get("finish_reason") in ("stop", "length")
            return r.status_code, None if ok else f"{kind}: {r.status_code} {r.text[:200]}"
        with self.client.stream("POST", path, json=self._good_body(rng, chat, True)) as r:
            if r.status_code != 200:
                return r.status_code, f"{kind}: {r.status_code} {r.read()[:200]!r}"
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if kind == "cancel":
                    return 200, None  # leaving the block closes the connection mid-stream
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        finished = any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
        return 200, None if events and events[-1] == "[DONE]" and finished else f"stream ended early: {events[-2:]}"

    def _drop_upload(self, rng: random.Random) -> tuple[int, str | None]:
        """A good request whose client goes away after half of its body: the server must take it
        for a cancelled request and go on."""
        chat = rng.random() < 0.5
        body = json.dumps(self._good_body(rng, chat, False)).encode()
        host, port = httpx.URL(self.url).host, httpx.URL(self.url).port
        shown = f"[{host}]" if ":" in host else host
        head = [f"POST /v1/{'chat/' if chat else ''}completions HTTP/1.1", f"Host: {shown}:{port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s) as s:
                s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body[:len(body) // 2])
        except OSError as e:
            return 0, f"drop: {type(e).__name__}: {e}"
        return CLIENT_CLOSED, None

    def health(self) -> dict[str, Any]:
        return self.client.get("/health").json()

    def idle_sample(self, timeout_s: float = 60) -> dict[str, Any]:
        """Once nothing runs or waits (cancellations land within a step), the process's figures."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not become idle: {h}")
            time.sleep(0.05)
        # no connection of ours stays open (the pool keeps a varying number alive): the server's
        # descriptors are then its own alone
        self.client.close()
        self.client = self._new_client()
        time.sleep(0.5)  # closed connections and finished to_thread calls settle
        return {**process_sample(self.pid), "free_rows": h.get("free_rows")}

    def run(self, n_requests: int, warmup: int = 100,
            progress: Callable[[int, int], None] | None = None) -> SoakReport:
        plan = [(self.rng.choices(KINDS, WEIGHTS)[0], self.rng.randrange(2 ** 32)) for _ in range(warmup + n_requests)]
        with ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(lambda job: self.one(*job), plan[:warmup]))
            warm = self.idle_sample()
            t0 = time.monotonic()
            statuses: collections.Counter[int] = collections.Counter()
            failures: list[str] = []
            for i, (status, failure) in enumerate(pool.map(lambda job: self.one(*job), plan[warmup:])):
                statuses[status] += 1
                if failure:
                    failures.append(failure)
                if progress is not None and (i + 1) % 100 == 0:
                    progress(i + 1, n_requests)
            seconds = time.monotonic() - t0
        end = self.idle_sample()
        kinds = collections.Counter(k for k, _ in plan[warmup:])
        return SoakReport(n_requests, {k: kinds[k] for k in KINDS}, dict(statuses), failures, seconds, warm, end)


def print_progress(done: int, total: int) -> None:
    print(f"soak: {done}/{total} requests", file=sys.stderr, flush=True)
