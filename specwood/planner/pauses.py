"""Timings that a pause spoilt, found and taken again.

The server measures its plan in a background process that it stops (SIGSTOP) while requests run
and continues (SIGCONT) when it is idle again (specwood.serve.background). A stop cannot be seen
from inside, but the continue can: a SIGCONT handler counts them. A measurement during which the
count moved was stopped half-way (its wall time holds the pause) and is taken again. The server
notices its own work only at its next poll, so it may already be computing beside us for up to
`grace_s` before the stop lands: after each measurement we wait that long, and a stop within it
spoils the measurement too. Outside a server (grace 0) nothing waits; a Ctrl-Z / fg still counts.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

GRACE_ENV = "SPECWOOD_PAUSE_GRACE_S"  # set by the server for the process it pauses


class PauseCounter:
    """How often this process was continued after a stop (`count`), and how many measurements
    were taken again because of it (`retaken`)."""

    def __init__(self) -> None:
        self.count = 0
        self.retaken = 0
        self.installed = False

    def _on_continue(self, signum: int, frame: object) -> None:
        self.count += 1

    def install(self) -> None:
        """Count SIGCONTs from now on (signal handlers can only be set from the main thread;
        elsewhere pauses go unseen, as before)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGCONT, self._on_continue)
        self.installed = True

    @property
    def grace_s(self) -> float:
        try:
            return max(0.0, float(os.environ.get(GRACE_ENV, "0") or 0))
        except ValueError:
            return 0.0


PAUSES = PauseCounter()


def undisturbed(measure: Callable[[], T]) -> T:
    """`measure()`, taken again until no pause overlapped it (nor the grace after it)."""
    PAUSES.install()
    while True:
        before = PAUSES.count
        result = measure()
        if PAUSES.grace_s:
            time.sleep(PAUSES.grace_s)  # a stop for work that began during the measurement lands by now
        if PAUSES.count == before:
            return result
        PAUSES.retaken += 1
