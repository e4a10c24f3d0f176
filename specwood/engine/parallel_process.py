"""DuoDecoding's worker process as the executor sees it: the spawned draft process and its pipe
(`_Remote`: every call checks that the process is alive), or the worker's logic in this process
(`_Inline`, for tests); one clear `WorkerFailure` when it dies, hangs or fails.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from specwood.engine.parallel_worker import DraftWorker, _worker_main, build_draft
from specwood.engine.processes import ChildLost, NoAnswer, describe_exit, receive
from specwood.errors import SpecwoodError


class WorkerFailure(SpecwoodError):
    """The draft worker died, hung or failed; the executor restarts it for the next request."""


class _Remote:
    """The draft process and its pipe; every call checks that the process is alive."""

    def __init__(self, spec: dict[str, Any], start_timeout: float):
        import torch.multiprocessing as tmp  # registers the tensor reducers (shared memory)

        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="specwood-draft")
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn)
        try:
            self.send(("load", spec))
            self.info = self.expect("ready", start_timeout, "starting")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def death(self) -> str:
        return describe_exit(self.proc.exitcode)

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self.proc.join(0.5)
            raise WorkerFailure(f"the draft worker (pid {self.pid}) {self.death()}") from None

    def recv(self, timeout: float) -> tuple[Any, ...]:
        try:
            msg: tuple[Any, ...] = receive(self.conn, timeout, self.proc.is_alive)
            return msg
        except ChildLost:
            self.proc.join(0.5)
            raise WorkerFailure(f"the draft worker (pid {self.pid}) {self.death()}") from None
        except NoAnswer:
            self.kill()
            raise WorkerFailure(f"the draft worker (pid {self.pid}) did not answer within {timeout:.0f}s "
                                "and was stopped") from None

    def ready(self) -> bool:
        """Whether a reply is waiting (a dead worker counts as ready: recv then raises)."""
        try:
            return self.conn.poll(0) or not self.proc.is_alive()
        except (EOFError, OSError):
            return True

    def expect(self, kind: str, timeout: float, what: str) -> Any:
        reply = self.recv(timeout)
        if reply[0] == "error":
            raise WorkerFailure(f"draft worker failed while {what}: {reply[1].strip().splitlines()[0]}")
        if reply[0] != kind:
            raise WorkerFailure(f"draft worker answered {reply[0]!r} while {what}")
        return reply[1] if len(reply) == 2 else reply[1:]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        self._finalizer()


class _Inline:
    """The worker's logic in this process, answering each message at once (no parallelism): for
    debugging and for tests that inspect the worker's state."""

    class _Alive:
        pid = None

        @staticmethod
        def is_alive() -> bool:
            return True

    def __init__(self, spec: dict[str, Any]):
        self.worker = DraftWorker(build_draft(spec))
        self.proc = self._Alive()
        self.pid = None
        self.info = {"pid": None, "device": spec["device"], "threads": torch.get_num_threads(), "cores": None,
                     "vocab_size": spec["config"].vocab_size}
        self._replies: list[tuple[Any, ...]] = []
        self._last = time.perf_counter()
        self.lag = 0

    def send(self, msg: tuple[Any, ...]) -> None:
        idle = time.perf_counter() - self._last
        try:
            self._replies.append(self.worker.handle(msg, idle))
        except Exception as e:  # noqa: BLE001
            self._replies.append(("error", f"{type(e).__name__}: {e}"))
        self._last = time.perf_counter()

    def death(self) -> str:
        return "runs in this process"

    def ready(self) -> bool:
        """Replies are computed at once; `lag` > 0 makes the next `lag` polls say "not yet" (to
        exercise the catch-up steps deterministically)."""
        if self.lag > 0:
            self.lag -= 1
            return False
        return bool(self._replies)

    def expect(self, kind: str, timeout: float, what: str) -> Any:
        reply = self._replies.pop(0)
        if reply[0] == "error":
            raise WorkerFailure(f"draft worker failed while {what}: {reply[1]}")
        return reply[1] if len(reply) == 2 else reply[1:]

    def close(self) -> None:
        self._replies = []


def _shutdown(proc: Any, conn: Any) -> None:
    try:
        if proc.is_alive():
            try:
                conn.send(("stop",))
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    finally:
        conn.close()
