"""A child process the server runs beside itself (the plan measured in the background): paused
while requests run, and ended with everything it started."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specwood.planner.pauses import GRACE_ENV

PAUSE_POLL_S = 0.02  # how often the server looks whether it has requests


class Background(subprocess.Popen[bytes]):
    """A child process the server pauses while busy (`pause_while_busy`), in its own process group,
    its output going to `log`. It knows it is paused (specwood.planner.pauses): the server's work
    may run beside it for up to two polls before the stop lands, which is its grace."""

    def __init__(self, cmd: list[str], log: Path, what: str, preexec_fn: Callable[[], None] | None = None) -> None:
        self.log, self.what = log, what
        env = {**os.environ, GRACE_ENV: str(2 * PAUSE_POLL_S)}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            super().__init__(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             preexec_fn=preexec_fn, start_new_session=True)

    def failure(self) -> str | None:
        """Why it failed, in one line (its last error line), or None if it succeeded, still runs or
        was ended by a signal (the server's own shutdown)."""
        code = self.poll()
        if code is None or code <= 0:
            return None
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").replace("\r", "\n").splitlines()]
        except OSError:
            lines = []
        errors = [ln for ln in lines if "error:" in ln] or [ln for ln in lines if ln] or [f"exit code {code}"]
        return errors[-1].split("error:", 1)[-1].strip()


def pause_while_busy(proc: Any, scheduler: Any, period_s: float = PAUSE_POLL_S) -> threading.Thread:
    """Keep `proc`'s process group stopped (SIGSTOP) while `scheduler` has requests, running
    (SIGCONT) while it is idle, until the process ends. On a small CPU a background measurement
    beside live requests spoils both: its timings see the server's decode steps (a wrong plan),
    and its threads steal the cores the requests' OpenMP threads wait on (BENCHMARKS.md §4c).
    When a Background child fails (a plan that failed its sanity checks is not stored), one line
    says so."""

    def watch() -> None:
        stopped = False
        try:
            while proc.poll() is None:
                busy = not scheduler.idle
                if busy != stopped:
                    os.killpg(proc.pid, signal.SIGSTOP if busy else signal.SIGCONT)
                    stopped = busy
                time.sleep(period_s)
        except (ProcessLookupError, PermissionError):
            pass  # it ended between the poll and the signal
        if isinstance(proc, Background):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            reason = proc.failure()
            if reason:
                print(f"specwood: {proc.what}: {reason} (log: {proc.log})", file=sys.stderr, flush=True)

    thread = threading.Thread(target=watch, name="specwood-pause-background", daemon=True)
    thread.start()
    return thread


def end_process_group(proc: Any, timeout_s: float = 5.0) -> None:
    """Terminate a child started with start_new_session (and whatever it started): continue it
    first, since a stopped process does not act on SIGTERM; SIGKILL if it lingers."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout_s)
