"""One configuration of a scheduler and the KV cache its requests run on, validated once.

`SchedulerConfig` holds the batch, the queue, the cache rows, the memory budget and reuse; it is
built once -- from `specwood serve`'s flags (`serve.app.server_config`) or by a caller of the API --
and read as it is: `Engine.make_scheduler(config)` builds the executor for the engine's target and
the `Scheduler` over it, and nothing below re-checks or re-interprets a field.

`kv_memory` has one meaning everywhere: bytes the cache rows of the running requests and the
prefix cache hold together (rows start at `base_row_len` slots and grow with the longest request
up to what the budget holds; the prefix cache keeps what they leave when `reuse` is on). "auto" is
half the memory available when the scheduler is made; None keeps static rows of `row_len` slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import torch

from specwood.errors import SpecwoodError
from specwood.models.prefill import PREFILL_CHUNK

TREE_ROOM = 1025  # cache slots a row keeps for the largest tree (MAX_BUDGET drafted nodes + root)
BASE_ROW_LEN = 4096 + TREE_ROOM  # rows under a KV budget start at this length (or the budget's cap)
STATIC_ROW_LEN = 4096  # static rows without a row_len: the model's context and tree room, at most this
DEFAULT_SHARE = 0.5  # kv_memory="auto": this share of the memory available when the scheduler is made
AUTO: Final = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """A scheduler and its KV cache (see the module). Every field is checked here, once."""

    max_batch: int = 8  # requests decoded together: the rows of every cache pool
    max_queue: int = 64  # requests waiting for a row; past it, QueueFullError (a 503 in the server)
    request_timeout_s: float | None = None  # each request's deadline, queue included (None: none)
    # static rows: the slots of each (None: the model's context and tree room, at most STATIC_ROW_LEN);
    # under kv_memory: the most a row may grow to (None: the engine's context and tree room)
    row_len: int | None = None
    kv_memory: int | Literal["auto"] | None = None  # bytes for the rows and the prefix cache together
    reuse: bool = False  # finished requests' K/V kept for newcomers that share their prefix
    # with reuse on static rows: the prefix cache's bound (kv_memory bounds it otherwise)
    prefix_bytes: int | None = None
    growable: bool = False  # static rows an idle scheduler re-allocates for a longer request (Engine.generate's)
    tree_room: int = TREE_ROOM  # slots a row keeps beyond prompt + new tokens for a tree
    base_row_len: int = BASE_ROW_LEN  # under kv_memory: the rows' length when idle
    prefill_chunk_tokens: int = 64  # prompt tokens a newcomer advances per step while others decode
    # prompt tokens of all newcomers together in one step (vLLM's max_num_batched_tokens, llama.cpp's
    # --batch-size): bounds a step's activations; many short prompts beyond it wait a step
    prefill_step_tokens: int = PREFILL_CHUNK
    cuda_graphs: bool | None = None  # decode steps replay CUDA graphs (None: where the device has them)

    def __post_init__(self) -> None:
        for flag, value in (("--max-batch", self.max_batch), ("--max-queue", self.max_queue)):
            if not _is_int(value) or value < 1:
                raise SpecwoodError(f"{flag} must be >= 1, got {value}")
        t = self.request_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isinf(t)):
            raise SpecwoodError(f"--request-timeout must be > 0 seconds, got {t}")
        m = self.kv_memory
        if m is not None and m != AUTO and (not _is_int(m) or int(m) < 0):
            raise SpecwoodError(f"--kv-memory must be >= 0 bytes, got {m}")
        if self.prefix_bytes is not None:
            if m is not None:
                raise SpecwoodError("prefix_bytes bounds the prefix cache beside static rows; under kv_memory the "
                                    "prefix cache keeps what the rows leave (drop prefix_bytes)")
            if not _is_int(self.prefix_bytes) or self.prefix_bytes < 0:
                raise SpecwoodError(f"prefix_bytes must be >= 0, got {self.prefix_bytes}")
        if self.reuse and m is None and self.prefix_bytes is None:
            raise SpecwoodError("reuse on static rows needs prefix_bytes (the prefix cache's bound), or give kv_memory")
        if self.prefix_bytes is not None and not self.reuse:
            raise SpecwoodError("prefix_bytes is the prefix cache's bound: set reuse=True with it")
        if self.growable and m is not None:
            raise SpecwoodError("growable re-allocates static rows; under kv_memory rows grow by themselves")
        sizes: tuple[tuple[str, int | None, int], ...] = (
            ("row_len", self.row_len, 2), ("tree_room", self.tree_room, 0), ("base_row_len", self.base_row_len, 2),
            ("prefill_chunk_tokens", self.prefill_chunk_tokens, 1),
            ("prefill_step_tokens", self.prefill_step_tokens, 1))
        for name, size, least in sizes:
            if size is not None and (not _is_int(size) or size < least):
                raise SpecwoodError(f"{name} must be an integer >= {least}, got {size}")

    @property
    def budgeted(self) -> bool:
        """Whether rows grow within a memory budget (else they are static)."""
        return self.kv_memory is not None


def default_kv_memory(device: torch.device | str = "cpu") -> int:
    """DEFAULT_SHARE of the memory available now on `device` (the entries live beside the cache
    rows; 1 GiB where it cannot be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_SHARE)
    available = meminfo("MemAvailable")
    return int(available * DEFAULT_SHARE) if available is not None else 1 << 30


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
