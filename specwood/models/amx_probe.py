"""The AMX probe, run by specwood.models.amx in a child process (`python -m specwood.models.amx_probe`):
it asks Linux for tile data, checks the tile kernel against the VNNI kernel bit for bit on every
type, and times both to find from how many rows the tiles pay. It prints its verdict as one line of
JSON; whatever kills it (a VM that faults on a tile instruction) kills only the child.

SPECWOOD_AMX_PROBE_FAULT (tests): `signal` dies of SIGILL at once, `mismatch` puts one output one
ulp off, so that the parent's handling of both is tested on any CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any, Callable

import torch

from specwood.models.amx import DEFAULT_MIN_ROWS, OPS, PROBE_ROWS, ProbeResult
from specwood.models.kquant_kernels import AMX_KERNEL, EMULATED_KERNEL, VNNI_KERNEL
from specwood.models.q6k import Q6Linear, Q6Weights
from specwood.models.q8_0 import Q8Linear, Q8Weights
from specwood.models.w4a8 import Q4Linear, Q4Weights, Q5Linear, Q5Weights

def random_packed(op: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Packed weights of `op`'s type with every code, scale code and minimum the format allows."""
    g = torch.Generator().manual_seed(seed)
    supers = -(-k // 256)

    def codes(top: int) -> torch.Tensor:
        return torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)

    def sixbit(per: int) -> torch.Tensor:
        return torch.randint(0, 64, (n, k // per), generator=g, dtype=torch.uint8)

    def half(shape: tuple[int, int], low: float = 0.0) -> torch.Tensor:
        return ((torch.rand(*shape, generator=g) - low) * 0.01).half()

    makers: dict[str, Callable[[], Any]] = {
        "q4_linear": lambda: Q4Linear(Q4Weights(codes(16), sixbit(32), sixbit(32), half((n, supers)),
                                                half((n, supers)))),
        "q5_linear": lambda: Q5Linear(Q5Weights(codes(32), sixbit(32), sixbit(32), half((n, supers)),
                                                half((n, supers)))),
        "q6_linear": lambda: Q6Linear(Q6Weights(codes(64), torch.randint(-128, 128, (n, k // 16), generator=g,
                                                                         dtype=torch.int8), half((n, supers)))),
        "q8_linear": lambda: Q8Linear(Q8Weights(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                                                half((n, k // 32), low=0.3))),
    }
    return makers[op]().packed


def first_difference(amx: Any, vnni: Any, rows: tuple[int, ...] = (1, 5, 16, 17, 40)) -> str | None:
    """Where the AMX kernel's result differs from the VNNI kernel's by one bit (None: nowhere),
    every type, fp32 and bf16 activations, whole and partial superblocks and row tiles; and 1024
    output channels at 17 rows, so that the blocks are shared out among the threads (at::parallel_for
    runs four blocks or fewer on the calling thread alone)."""
    for op in OPS:
        for k, n, counts in ((288, 64, rows), (512, 64, rows), (512, 1024, (17,))):
            packed = random_packed(op, n, k, seed=k)
            bias = torch.randn(n)
            for m in counts:
                for dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(m, k) * torch.rand(m, 1) * 5).to(dtype)
                    x[0, :32] = 0  # a group of zeros
                    if not torch.equal(getattr(amx, op)(x, packed, bias), getattr(vnni, op)(x, packed, bias)):
                        return f"{op}, {m} x {k} activations, {str(dtype).removeprefix('torch.')}"
    return None


def time_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def crossover(amx: Any, vnni: Any) -> tuple[int | None, dict[str, list[float]]]:
    """From how many rows AMX is at least as fast as VNNI on a target-sized Q4_K linear (8960 x
    1536, the default target's FFN) and stays so at every larger count timed."""
    packed, bias = random_packed("q4_linear", 8960, 1536), torch.empty(0)
    timings: dict[str, list[float]] = {}
    for m in PROBE_ROWS:
        x = torch.randn(m, 1536)
        timings[str(m)] = [time_ms(lambda: vnni.q4_linear(x, packed, bias)),
                           time_ms(lambda: amx.q4_linear(x, packed, bias))]
    best = None
    for m in reversed(PROBE_ROWS):
        vnni_ms, amx_ms = timings[str(m)]
        if amx_ms > vnni_ms:
            break
        best = m
    return best, timings


def probe(emulate: bool) -> ProbeResult:
    if os.environ.get("SPECWOOD_AMX_PROBE_FAULT") == "signal":
        os.kill(os.getpid(), signal.SIGILL)  # what a VM that faults on a tile instruction does to us
    kernel_spec = EMULATED_KERNEL if emulate else AMX_KERNEL
    amx, vnni = kernel_spec.load(), VNNI_KERNEL.load()
    if amx is None or vnni is None:
        return ProbeResult(False, str(kernel_spec.failure or VNNI_KERNEL.failure))
    refused = amx.request_tile_permission()
    if refused:
        return ProbeResult(False, f"Linux refused AMX tile data ({os.strerror(refused)})")
    if os.environ.get("SPECWOOD_AMX_PROBE_FAULT") == "mismatch":
        amx = _BiasedKernel(amx)
    wrong = first_difference(amx, vnni)
    if wrong:
        return ProbeResult(False, f"its result differs from the VNNI kernel's ({wrong})")
    if emulate:
        return ProbeResult(True, min_rows=DEFAULT_MIN_ROWS)
    min_rows, timings = crossover(amx, vnni)
    return ProbeResult(True, min_rows=min_rows, timings_ms=timings)


class _BiasedKernel:
    """A kernel one ulp off in one output (SPECWOOD_AMX_PROBE_FAULT=mismatch): what the probe must catch."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __getattr__(self, op: str) -> Callable[..., torch.Tensor]:
        def run(*args: Any) -> torch.Tensor:
            out = getattr(self.kernel, op)(*args)
            out.view(-1)[-1] = torch.nextafter(out.view(-1)[-1], torch.tensor(float("inf"), dtype=out.dtype))
            return out

        return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Probe the AMX k-quant kernel (run by specwood in a child process).")
    parser.add_argument("--emulate", action="store_true", help="probe the emulated build (tests)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(json.dumps(probe(args.emulate).__dict__), flush=True)


if __name__ == "__main__":
    main()
