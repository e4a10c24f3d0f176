"""An in-process stand-in for the pipeline's torch.distributed messages: M threads, one per rank,
each running the real `PipelineRank` loop, exchanging through shared slots and queues. The
multi-process tests run the same loop over gloo; this one makes per-step state checks cheap."""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from specwood.engine.specpipe.ranks import PipelineRank
from specwood.engine.specpipe.jobs import stage_ranges
from specwood.models.transformer import build_model


class Board:
    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slot: Any = None
        self.links = [queue.Queue() for _ in range(world)]  # links[i]: rank i-1 -> i
        self.gathered: list[Any] = [None] * world


class LocalComm:
    def __init__(self, board: Board, rank: int):
        self.board, self.rank, self.world, self.last = board, rank, board.world, board.world - 1

    def _bcast(self, value: Any, root: int) -> Any:
        b = self.board
        if self.rank == root:
            b.slot = value
        b.barrier.wait()
        out = b.slot
        b.barrier.wait()
        return out

    def header(self, values: list[int] | None = None) -> list[int]:
        return list(self._bcast(values, 0))

    def longs(self, values: Any, rows: int, cols: int, root: int = 0) -> list[list[int]]:
        out = self._bcast(values, root)
        assert len(out) == rows and all(len(v) == cols for v in out), (self.rank, rows, cols, out)
        return [list(v) for v in out]

    def obj(self, value: Any = None) -> Any:
        return self._bcast(value, 0)

    def transfer(self, step: int, send_ids: list[int], send_x: torch.Tensor | None,
                 expect_ids: list[int]) -> torch.Tensor | None:
        if self.rank < self.last:
            self.board.links[self.rank + 1].put((step, list(send_ids), None if send_x is None else send_x.clone()))
        if self.rank == 0:
            return None
        got_step, ids, x = self.board.links[self.rank].get(timeout=60)
        assert (got_step, ids) == (step, list(expect_ids)), (self.rank, step, got_step, ids, expect_ids)
        return x

    def gather(self, value: Any) -> list[Any] | None:
        self.board.gathered[self.rank] = value
        self.board.barrier.wait()
        out = list(self.board.gathered) if self.rank == 0 else None
        self.board.barrier.wait()
        return out


def split_target(target: Any, stages: int) -> list[Any]:
    ranges = stage_ranges(target.config, stages)
    sd = target.canonical_state_dict()
    return [build_model(target.config, sd, target.dtype, layers=r, max_positions=target.max_positions) for r in ranges]


def run_local(target: Any, draft: Any, tokenizer: Any, eos_ids: set[int], jobs: list[Any], stages: int,
              on_step: Any = None, concurrent: int = 1, max_lanes: int = 8) -> tuple[list[Any], list[PipelineRank]]:
    """Run `jobs` (Job, stop) on an in-process pipeline, `concurrent` at a time (SpecPipe-DB: a
    group's requests share every step); results and the ranks."""
    board = Board(stages)
    parts = split_target(target, stages)
    ranks = [PipelineRank(LocalComm(board, r), parts[r], draft=draft if r == 0 else None,
                          tokenizer=tokenizer if r == 0 else None, eos_ids=eos_ids if r == 0 else None,
                          on_step=on_step, max_lanes=max_lanes) for r in range(stages)]
    results: list[Any] = []
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            with torch.inference_mode():
                if r == 0:
                    for i in range(0, len(jobs), concurrent):
                        results.extend(ranks[0].generate_many(jobs[i:i + concurrent]))
                    ranks[0].comm.header([4, 0, 0, 0, 0])
                else:
                    ranks[r].follow()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results, ranks
