"""`specwood serve` against clients that misbehave at the connection level (issue 43), as a real
process on 127.0.0.1 with its limits lowered: a dropped upload, half-sent requests, more open
connections than the cap, a body declared too large, and bursts of over-long prompts."""
from __future__ import annotations

import socket
import sys
import threading
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specwood.bench.soak import process_sample
from specwood.models.testing import make_tiny_tokenizer, tiny_hf_folder
from specwood.serve.prompt_limits import PromptLimit, longest_token
from specwood.serve.protocol import GenerationRequest, ProtocolError

from test_server import serve_command

READ_TIMEOUT_S = 4
MAX_CONNECTIONS = 12  # above the 8 clients of the prompt burst
MAX_CONTEXT = 32768  # long enough that prompts under the early refusal's bound are large
CLIENT_WAIT_S = 60  # how long a client waits for the server to answer or close: far past READ_TIMEOUT_S
RSS_BOUND_KB = 200 * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("connections")
    folder = tiny_hf_folder(root / "tiny", max_positions=MAX_CONTEXT)
    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(folder), "--draft", "none", "--dtype",
           "fp32", "--method", "ar", "--port", "0", "--max-batch", "2", "--max-context", str(MAX_CONTEXT),
           "--read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]
    with serve_command(cmd, root / "cache", start_timeout_s=180) as (url, lines, proc):  # a first kernel build
        yield url, lines, proc


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _raw(url: str, data: bytes) -> socket.socket:
    """A raw connection that has sent `data`."""
    s = socket.create_connection(_address(url), timeout=CLIENT_WAIT_S)
    s.sendall(data)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _dropped(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("specwood:request_uploads_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("no specwood:request_uploads_dropped_total in /metrics")


def test_a_dropped_upload_is_counted_and_logs_no_traceback(served):
    url, lines, proc = served
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        before = _dropped(http)
        for _ in range(3):  # headers and part of the body, then the client goes away
            s = _raw(url, _head("/v1/completions", 100_000) + b'{"prompt": "' + b"a" * 5000)
            time.sleep(0.2)  # the server is reading the body when the connection drops
            s.close()
        deadline = time.monotonic() + 30
        while _dropped(http) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _dropped(http) == before + 3
        assert http.get("/health").json()["status"] == "ok"
    log = "".join(lines)
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
    assert proc.poll() is None


def test_half_sent_requests_are_closed_within_the_read_timeout(served):
    """A body that stops gets 408 and its connection closed; headers that stop, or a connection
    that sends nothing, are closed. (Without the timeouts each waits forever: the client's own
    CLIENT_WAIT_S timeout then fails the test.)"""
    url, _, proc = served
    body = _raw(url, _head("/v1/completions", 1000) + b'{"prompt": "half')
    headers = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    nothing = _raw(url, b"")
    with ThreadPoolExecutor(3) as pool:  # the three waits overlap
        got = list(pool.map(_read_until_closed, (body, headers, nothing)))
    for s in (body, headers, nothing):
        s.close()
    assert got[0].startswith(b"HTTP/1.1 408 ") and b"read_timeout" in got[0], got[0][:300]
    assert got[1] == got[2] == b""
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        assert http.get("/health").json()["status"] == "ok"
    assert proc.poll() is None


def test_connections_beyond_the_cap_get_503(served):
    url, _, proc = served

    def open_idle(n: int) -> list[socket.socket]:
        """`n` connections that send nothing, once the server has accepted them (its descriptors)."""
        fds = process_sample(proc.pid)["fds"]
        conns = [socket.create_connection(_address(url)) for _ in range(n)]
        deadline = time.monotonic() + 30
        while process_sample(proc.pid)["fds"] < fds + n and time.monotonic() < deadline:
            time.sleep(0.01)
        return conns

    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        http.get("/health")  # its own connection, then idle ones up to the cap
        idle = open_idle(MAX_CONNECTIONS - 1)
        try:
            assert http.get("/health").status_code == 200  # MAX_CONNECTIONS open: all served
            idle += open_idle(1)
            r = http.get("/health")  # one more: refused
            assert r.status_code == 503, r.text
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server sees the closes
        assert http.get("/health").status_code == 200
    assert proc.poll() is None


def test_a_body_declared_too_large_gets_413_at_once(served):
    """50 MB declared, nothing sent: the 413 comes without waiting for the body, and the server
    closes the connection instead of reading it."""
    url, _, proc = served
    s = _raw(url, _head("/v1/completions", 50_000_000))
    try:
        got = _read_until_closed(s)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 413 ") and b"request_too_large" in got, got[:300]
    assert proc.poll() is None


def test_over_long_prompts_leave_memory_where_it_was(served):
    """A burst of prompts too long for the context, larger than the early refusal's bound (refused
    untokenized) and under it (tokenized, then refused): every one gets a 400, and the server's
    resident memory ends within 200 MB of where it was."""
    url, _, proc = served
    per = longest_token(make_tiny_tokenizer())
    bound = per * (MAX_CONTEXT - 1)
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
        idle = process_sample(proc.pid)["rss_kb"]

        def send(chars: int) -> httpx.Response:
            return http.post("/v1/completions", json={"prompt": "hello world " * (chars // 12), "max_tokens": 4})

        with ThreadPoolExecutor(8) as pool:
            over = list(pool.map(send, [3 * bound] * 8))
            under = list(pool.map(send, [bound - 1000] * 2))
        for r in over + under:
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert "characters" in over[0].json()["error"]["message"]  # refused before tokenizing
        assert "tokens but" in under[0].json()["error"]["message"]  # tokenized, then refused
        time.sleep(0.5)
        after = process_sample(proc.pid)["rss_kb"]
        print(f"RSS idle {idle // 1024} MiB, after the burst {after // 1024} MiB")
        assert after - idle < RSS_BOUND_KB, (idle, after)
        assert http.get("/health").json()["status"] == "ok"
    assert proc.poll() is None


# ---------------------------------------------------------------------------------------------
# the early refusal's bound, on tokenizers built here


def _tokenizer_with_a_long_token(length: int):
    """The tiny byte-level tokenizer with NFC and an added token of `length` characters, so the
    bound is tight: a prompt of k copies of that token is exactly k tokens."""
    from tokenizers import normalizers

    tok = make_tiny_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    long = "<|" + "x" * (length - 4) + "|>"
    tok.add_tokens([long], special_tokens=True)
    return tok, long


def test_the_early_refusal_never_refuses_a_prompt_that_fits():
    tok, long = _tokenizer_with_a_long_token(40)
    max_context = 64
    limit = PromptLimit(tok, max_context)
    assert limit.longest_token == 40
    composed = "e\u0301" * 2000  # NFC composes each pair into one character (é, 2 bytes)
    prompts = [long * k for k in (max_context - 2, max_context - 1, max_context, 3 * max_context)]
    decomposed = unicodedata.normalize("NFD", "\u1f82")  # 4 characters NFC makes one again
    prompts += ["a" * n for n in (max_context - 1, 40 * max_context)] + [composed, "é" * 3000, decomposed * 5000]
    refused = 0
    try:
        for prompt in prompts:
            n = len(tok.encode(prompt, add_special_tokens=True))
            try:
                limit.check(GenerationRequest(kind="completion", prompt=prompt))
            except ProtocolError as e:
                assert n >= max_context, (prompt[:20], n)  # refused: it could not have fit
                assert e.code == "context_length_exceeded"
                refused += 1
        assert refused >= 3
        with pytest.raises(ProtocolError):  # the tight case: max_context copies of the long token
            limit.check(GenerationRequest(kind="completion", prompt=long * max_context))
        limit.check(GenerationRequest(kind="completion", prompt=long * (max_context - 1)))  # fits: not refused
        # chat: only what every template keeps counts (stripped contents, no assistant turns)
        padded = [{"role": "user", "content": " " * 10_000 + "hi"}, {"role": "assistant", "content": "b" * 10_000}]
        limit.check(GenerationRequest(kind="chat", prompt=padded))
    finally:
        limit.close()


def test_a_tokenizer_that_drops_text_gets_no_early_refusal():
    from tokenizers import pre_tokenizers

    tok = make_tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace
    assert longest_token(tok) is None
    limit = PromptLimit(tok, 8)
    try:
        limit.check(GenerationRequest(kind="completion", prompt=" " * 100_000 + "x"))  # 1 token: not refused
    finally:
        limit.close()


def test_large_prompts_are_tokenized_on_one_thread_of_their_own():
    import asyncio

    limit = PromptLimit(make_tiny_tokenizer(), 1 << 20)
    names = []

    def encode(g):
        names.append(threading.current_thread().name)
        return [1]

    async def both():
        await limit.run(GenerationRequest(kind="completion", prompt="small"), encode)
        await limit.run(GenerationRequest(kind="completion", prompt="x" * 40_000), encode)

    try:
        asyncio.run(both())
    finally:
        limit.close()
    assert not names[0].startswith("specwood-tokenize-large") and names[1].startswith("specwood-tokenize-large")


@pytest.mark.parametrize("flag,value", [("--read-timeout", "0"), ("--read-timeout", "nan"), ("--max-connections", "0")])
def test_bad_connection_limits_fail_in_one_line(tmp_path, flag, value):
    import subprocess

    cmd = [sys.executable, "-m", "specwood.cli", "serve", "--target", str(tmp_path / "none"), "--port", "0",
           flag, value]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"specwood: error: {flag} must be"), p.stderr


def test_accepted_connections_send_without_waiting_for_acks():
    """Nagle's algorithm is off on every connection the server accepts (TCP_NODELAY), as asyncio
    serves the socket `specwood serve` binds (uvicorn's create_server on it): with it on, a JSON
    answer's body, written after its headers, waited for the client's delayed ACK of them -- 40 ms
    an answer (the fuzzing test spent 52 of its 83 s so)."""
    import asyncio

    from specwood.serve.app import bind_socket

    seen: list[int] = []

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind_socket("127.0.0.1", 0)
        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the handler closed it
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0, seen
