"""torch.distributed plumbing of the pipeline executor: process group set-up, the per-step
messages, and liveness (a dead or failed rank ends every other rank with one line naming it).

Messages, all int64 except hidden states:
  header    broadcast from rank 0: [cmd, step, joins, lanes, nodes]; a step (CMD_STEP) goes on with
            the joining requests (an object broadcast of [(lane, Job)], if joins), the lane table
            [lanes, 5] (lane, leaves, kind, position, n; kind 0 = a tree level, 1 = a verified
            chain, 2 = a whole tree) and the nodes entering stage 1, [3, nodes] (node ids, parent
            ids, tokens), every lane's n in table order
  verdicts  broadcast from the last rank: [lanes, 5] of (step, kind, token, node, position)
  transfer  rank i -> i+1 every step: [step, n, checksum of row keys], then hidden [n, dim]
Every receiver checks the step and what it expected, so ranks that disagree fail loudly.

Liveness: every rank bumps a counter in the rendezvous store (the launcher's file store, or
torchrun's) every HEARTBEAT_S; a watcher thread that sees another rank's counter stand still for
STALE_S, or a failure note (`fail/<rank>`) in the store, prints one line and exits the process.
A collective that fails because a peer vanished asks the watcher which rank it was.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


HEARTBEAT_S = 0.5
STALE_S = 10.0  # a rank silent this long is dead (or hung): well inside the 30 s the others get
KEY = "specpipe/"
CMD_NOOP, CMD_STEP, CMD_EXIT = 0, 1, 4

_report_lock = threading.Lock()


def die(line: str, code: int = 1) -> None:
    """Print one line (once per process) and leave at once: gloo's threads must not hold us."""
    if _report_lock.acquire(blocking=False):
        print(f"specwood: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    time.sleep(3600)  # another thread is already reporting and exiting


class Monitor(threading.Thread):
    """Heartbeats through the store and a watch on every other rank's."""

    def __init__(self, store: Any, rank: int, world: int):
        super().__init__(daemon=True, name="specpipe-monitor")
        self.store, self.rank, self.world = store, rank, world
        self.closing = False
        self.verdict: str | None = None  # which rank is gone, once known

    def run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        while not self.closing:
            try:
                self.store.add(f"{KEY}hb/{self.rank}", 1)
                now = time.monotonic()
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    note = self._note(r)
                    if note is not None:
                        self._found(f"pipeline rank {r} failed: {note}")
                        return
                    count = self.store.add(f"{KEY}hb/{r}", 0)
                    last = seen.get(r)
                    if last is None or last[0] != count:
                        seen[r] = (count, now)
                    elif now - last[1] > STALE_S and not self._exited(r):
                        self._found(f"pipeline rank {r} is gone (no heartbeat for {STALE_S:.0f} s)")
                        return
            except Exception as e:  # noqa: BLE001 - the store's host (launcher or torchrun) is gone
                if not self.closing:
                    self._found(f"lost the pipeline's rendezvous store ({type(e).__name__}); "
                                "its host or rank 0 is gone")
                return
            time.sleep(HEARTBEAT_S)

    def _note(self, r: int) -> str | None:
        if not self.store.check([f"{KEY}fail/{r}"]):
            return None
        note: bytes = self.store.get(f"{KEY}fail/{r}")
        return note.decode(errors="replace")

    def _exited(self, r: int) -> bool:
        return bool(self.store.check([f"{KEY}exit/{r}"]))

    def _found(self, what: str) -> None:
        self.verdict = what
        if not self.closing:
            die(f"pipeline rank {self.rank}: {what}")

    def post_failure(self, message: str) -> None:
        try:
            self.store.set(f"{KEY}fail/{self.rank}", message)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self.closing = True
        try:
            self.store.set(f"{KEY}exit/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def wait_for_culprit(self, timeout: float = STALE_S + 3) -> str:
        """After a failed collective: the watcher's finding (it exits the process itself)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.verdict is None:
            time.sleep(0.1)
        return self.verdict or "a peer rank vanished"


def init_group(rank: int, world: int, backend: str, store: Any | None, timeout_s: float) -> Any:
    """Join the process group: on `store` (the launcher's) or env:// (torchrun); returns the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timeout)
        return store
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return dist.distributed_c10d._get_default_store()


class Comm:
    """The messages of one rank; `dev` is where communicated tensors live (cuda for NCCL)."""

    def __init__(self, rank: int, world: int, dev: torch.device, dim: int, dtype: torch.dtype):
        self.rank, self.world, self.last = rank, world, world - 1
        self.dev, self.dim, self.dtype = dev, dim, dtype

    def _long(self, values: list[int] | list[list[int]] | None, n: int) -> torch.Tensor:
        if values is None:
            return torch.zeros(n, dtype=torch.long, device=self.dev)
        return torch.tensor(values, dtype=torch.long, device=self.dev)

    def header(self, values: list[int] | None = None) -> list[int]:
        t = self._long(values, 5)
        dist.broadcast(t, 0)
        return t.tolist()

    def longs(self, values: list[list[int]] | None, rows: int, cols: int, root: int = 0) -> list[list[int]]:
        """A [rows, cols] int64 table broadcast from `root` (the others pass None)."""
        t = self._long(values, rows * cols).reshape(rows, cols)
        dist.broadcast(t, root)
        return t.tolist()

    def obj(self, value: Any = None) -> Any:
        box = [value]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def transfer(self, step: int, send_ids: list[int], send_x: torch.Tensor | None,
                 expect_ids: list[int]) -> torch.Tensor | None:
        """Hidden states of the surviving nodes to the next stage; those of the previous one in.
        The ids are any keys naming the rows (request and node), checked on arrival."""
        pending = []
        if self.rank < self.last:
            pending.append(dist.isend(self._long([step, len(send_ids), checksum(send_ids)], 3), self.rank + 1))
            if send_ids:
                if send_x is None:
                    raise RuntimeError(f"protocol: rank {self.rank} has node ids to send but no hidden states")
                pending.append(dist.isend(send_x.to(self.dev, self.dtype).contiguous(), self.rank + 1))
        got = None
        if self.rank > 0:
            hdr = self._long(None, 3)
            dist.recv(hdr, self.rank - 1)
            want = [step, len(expect_ids), checksum(expect_ids)]
            if hdr.tolist() != want:
                raise RuntimeError(f"protocol: malformed transfer from rank {self.rank - 1}: header {hdr.tolist()}, "
                                   f"expected {want}")
            if expect_ids:
                got = torch.empty(len(expect_ids), self.dim, dtype=self.dtype, device=self.dev)
                dist.recv(got, self.rank - 1)
        for p in pending:
            if p is not None:
                p.wait()
        return got

    def gather(self, value: Any) -> list[Any] | None:
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(value, out, dst=0)
        return out


def checksum(ids: list[int]) -> int:
    return sum((i + 1) * (x + 1) for i, x in enumerate(ids)) % (1 << 61)


def is_comm_error(e: BaseException) -> bool:
    """A failure of a collective or point-to-point op (a peer died, a timeout), not our own bug."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, getattr(dist, "DistError", ())) or any(s in text for s in (
        "Connection closed", "Connection reset", "Broken pipe", "Gloo", "gloo", "NCCL", "Timed out", "timed out",
        "Socket", "peer"))
