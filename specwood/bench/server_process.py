"""The server process of the loadtest: a free local port, the `specwood serve` command line, and
`ServerProcess`, which starts a server subprocess, waits until it answers GET /health and always
stops it (SIGTERM, then SIGKILL)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from specwood.bench.load_requests import Log, _require_httpx, _stderr
from specwood.errors import SpecwoodError


# ---------------------------------------------------------------------------------- server process
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_command(port: int, *, host: str = "127.0.0.1", max_batch: int, target: str | None = None,
                  draft: str | None = None, dtype: str | None = None, draft_dtype: str | None = None,
                  max_context: int | None = None, max_queue: int | None = None, python: str | None = None) -> list[str]:
    """`specwood serve ...` run with this interpreter (the same installation as the loadtest). No
    plan is measured in the background: it would compete with the requests being timed."""
    cmd = [python or sys.executable, "-m", "specwood.cli", "serve", "--host", host, "--port", str(port),
           "--max-batch", str(max_batch), "--no-plan-in-background"]
    for flag, v in (("--target", target), ("--draft", draft), ("--dtype", dtype), ("--draft-dtype", draft_dtype),
                    ("--max-context", max_context), ("--max-queue", max_queue)):
        if v is not None:
            cmd += [flag, str(v)]
    return cmd


class ServerProcess:
    """A server subprocess (its own process group) that is ready once GET /health answers 200.
    Use as a context manager: it is terminated (SIGTERM, then SIGKILL) on exit, errors and
    interrupts alike. Its output goes to `log_path` (and the last lines into error messages)."""

    def __init__(self, cmd: Sequence[str], base_url: str, *, log_path: str | os.PathLike[str] | None = None,
                 startup_timeout: float = 900.0, log: Log | None = _stderr, env: dict[str, str] | None = None) -> None:
        self.cmd = list(cmd)
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.log = log or (lambda s: None)
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=30)
        self.saw_listening = False
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"starting server: {shlex.join(self.cmd)}")
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                         start_new_session=True, env=self.env)
        except OSError as e:
            raise SpecwoodError(f"could not start the server ({self.cmd[0]}): {e}") from None
        self._reader = threading.Thread(target=self._read, name="specwood-loadtest-server-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        f = open(self.log_path, "w", encoding="utf-8") if self.log_path else None
        try:
            for line in self.proc.stdout:
                if f:
                    f.write(line)
                    f.flush()
                line = line.rstrip("\n")
                if line.strip():
                    self.tail.append(line)
                if "listening on http" in line:
                    self.saw_listening = True
        except (OSError, ValueError):
            pass
        finally:
            if f:
                f.close()

    def _last_line(self) -> str:
        lines = [ln for ln in self.tail if ln.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def wait_ready(self) -> None:
        httpx = _require_httpx()
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        where = f" (log: {self.log_path})" if self.log_path else ""
        while True:
            code = self.proc.poll()
            if code is not None:
                if self._reader:
                    self._reader.join(timeout=2)
                raise SpecwoodError(f"the server exited with code {code} before it was ready: "
                                    f"{self._last_line()}{where}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False)
                if r.status_code == 200:
                    self.log(f"server ready at {self.base_url}")
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SpecwoodError(f"the server was not ready within {self.startup_timeout:g} s "
                                    f"(GET {self.base_url}/health); last output: {self._last_line()}{where}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 15.0) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                p.wait(timeout=10)
        else:
            self._signal(signal.SIGKILL)  # stray children of an exited server, if any
        if self._reader:
            self._reader.join(timeout=5)
        if p.stdout:
            try:
                p.stdout.close()
            except OSError:
                pass

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        try:
            if hasattr(os, "killpg"):
                os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            else:  # pragma: no cover - not POSIX
                self.proc.terminate() if sig == signal.SIGTERM else self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass


__all__ = ["ServerProcess", "serve_command", "free_port"]
