"""Small helpers shared by everything that runs work in child processes (the DuoDecoding draft
worker, the SpecPipe stage ranks, the server's background planner)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable


def exit_with_parent(parent: int | None = None) -> None:
    """Linux: this process gets SIGKILL when its parent dies (also while it is stopped), so no
    child outlives a killed server; if the parent (`parent`, when known) is already gone, exit now."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # it died before the prctl
        os._exit(1)


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


class ChildLost(Exception):
    """The pipe to a child broke or the child is gone (`receive`)."""


class NoAnswer(Exception):
    """A child did not answer within the time it was given (`receive`)."""


def receive(conn: Any, timeout: float, alive: Callable[[], bool]) -> Any:
    """The child's next message on `conn`, polling so that a dead child (`alive()` false) or a
    broken pipe raises ChildLost at once instead of blocking for ever; NoAnswer after `timeout`
    seconds. A message sent just before the child exited is still delivered."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if conn.poll(0.05):
                return conn.recv()
        except (EOFError, OSError):
            raise ChildLost() from None
        if not alive():
            try:
                if conn.poll(0):
                    return conn.recv()
            except (EOFError, OSError):
                pass
            raise ChildLost()
        if time.monotonic() > deadline:
            raise NoAnswer()
