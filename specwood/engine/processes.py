"""Small helpers shared by the executors that run model work in child processes (the DuoDecoding
draft worker, the SpecPipe stage ranks)."""
from __future__ import annotations

import signal


def describe_exit(code: int | None) -> str:
    """How a child process ended, for a one-line error: 'exited with code 1', 'was killed by
    SIGKILL', or 'stopped answering' while it still runs."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
