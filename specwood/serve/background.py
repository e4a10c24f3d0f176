"""A child process the server runs beside itself (the plan measured in the background): paused
while requests run, and ended with everything it started."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any


def pause_while_busy(proc: Any, scheduler: Any, period_s: float = 0.02) -> threading.Thread:
    """Keep `proc`'s process group stopped (SIGSTOP) while `scheduler` has requests, running
    (SIGCONT) while it is idle, until the process ends. On a small CPU a background measurement
    beside live requests spoils both: its timings see the server's decode steps (a wrong plan),
    and its threads steal the cores the requests' OpenMP threads wait on (BENCHMARKS.md §4c)."""

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
