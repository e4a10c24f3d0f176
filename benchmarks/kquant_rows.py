"""The k-quant linears' time by row count, this checkout's kernel against another revision's, built
the same way for this CPU (AVX512-VNNI where it has it, else AVX2): what each extra verified row
costs. Three views, each alternating the two builds:

  - one linear of the default target's FFN shape (8960 x 1536 Q4_K, 1536 x 8960 Q6_K, and Q5_K),
    its weights in cache: the kernel's arithmetic;
  - 24 such Q4_K linears one after the other (191 MB, beyond any cache): weights streamed as a decode
    step streams them;
  - with --model, T_v(x) of the default target (its k-quant linears switched between the builds).

--peak also times the chip's int8 multiply-add rate (vpmaddubsw on AVX2, vpdpbusd on AVX512-VNNI;
independent chains, every thread): the floor of any int8 kernel's per-row cost here.

    python benchmarks/kquant_rows.py --against dd77d68 [--rows 1,2,3,4,6,8,16] [--model] [--peak]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from specwood.models.amx_probe import random_packed, time_ms
from specwood.models.kquant_kernels import kquant_kernel

KERNELS = Path(__file__).resolve().parents[1] / "specwood" / "models" / "kernels"
SHAPES = {"q4_linear": (8960, 1536), "q6_linear": (1536, 8960), "q5_linear": (8960, 1536)}


def build_at(revision: str, work: Path) -> Any:
    """This CPU's build of the kernel source (and its headers) as they were at `revision`."""
    from torch.utils.cpp_extension import load

    spec = kquant_kernel()
    folder = work / revision
    folder.mkdir(parents=True, exist_ok=True)
    for path in [spec.source, *KERNELS.glob("*.h")]:
        rel = path.relative_to(KERNELS.parents[2])
        shown = subprocess.run(["git", "show", f"{revision}:{rel}"], cwd=KERNELS, capture_output=True)
        if shown.returncode == 0:
            (folder / path.name).write_bytes(shown.stdout)
    return load(name=f"kquants_at_{revision}", sources=[str(folder / spec.source.name)], build_directory=str(folder),
                extra_cflags=spec.cflags, verbose=False)


def alternate(builds: dict[str, Any], run: Callable[[Any], Any], rounds: int, repeats: int) -> dict[str, float]:
    """The best time of `run(build)` per build, the builds alternated round by round (drift hits both)."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    for r in range(rounds):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            times[name].append(time_ms(lambda: run(builds[name]), repeats))
    return {name: min(t) for name, t in times.items()}


def linears(builds: dict[str, Any], rows: list[int]) -> None:
    print("one linear, weights in cache (best ms):")
    for op, (n, k) in SHAPES.items():
        packed, bias = random_packed(op, n, k), torch.empty(0)
        cells: dict[str, list[str]] = {name: [] for name in builds}
        for m in rows:
            x = torch.randn(m, k)
            outs = [getattr(b, op)(x, packed, bias) for b in builds.values()]
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{op}: the builds differ at {m} rows"
            for name, ms in alternate(builds, lambda b: getattr(b, op)(x, packed, bias), 6, 5).items():
                cells[name].append(f"{m}: {ms:.3f}")
        for name, c in cells.items():
            print(f"  {op} {n}x{k} {name:>10s}  " + "  ".join(c))


def streamed(builds: dict[str, Any], rows: list[int]) -> None:
    packs = [random_packed("q4_linear", 8960, 1536, seed=i) for i in range(24)]
    print(f"24 Q4_K linears in a row, {sum(p.numel() for p in packs) / 1e6:.0f} MB of weights (best ms):")
    bias = torch.empty(0)
    for m in rows:
        x = torch.randn(m, 1536)
        res = alternate(builds, lambda b: [b.q4_linear(x, p, bias) for p in packs], 6, 2)
        print(f"  {m:2d} rows  " + "  ".join(f"{name} {ms:.1f}" for name, ms in res.items()))


def model_tv(builds: dict[str, Any], rows: list[int]) -> None:
    import specwood
    from specwood.models.w4a8 import KQuantLinear
    from specwood.planner.profiler import measure_verify_times

    engine = specwood.load(draft=None)
    mods = [m for m in engine.target.modules() if isinstance(m, KQuantLinear)]
    tv: dict[str, list[dict[int, float]]] = {name: [] for name in builds}
    for r in range(8):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            for m in mods:
                m.kernel = builds[name]
            tv[name].append(measure_verify_times(engine.target, rows, [256], repeats=5, refine=False,
                                                 progress=False)[256])
    print("the default target's T_v(x) at context 256, median of 8 alternated rounds (ms):")
    for name, runs in tv.items():
        print(f"  {name:>10s}  " + "  ".join(f"{x}: {statistics.median(t[x] for t in runs) * 1000:.1f}" for x in rows))


PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <chrono>
#include <vector>
// int8 multiply-adds a second: 8 independent accumulators per thread, every thread busy
double int8_peak(int64_t iterations) {
  const int threads = at::get_num_threads();
  std::vector<int> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef __AVX512VNNI__
      __m512i a[8], s[8]; const __m512i x = _mm512_set1_epi8(3);
      for (int j = 0; j < 8; ++j) { a[j] = _mm512_set1_epi8(j + 1); s[j] = _mm512_setzero_si512(); }
      for (int64_t i = 0; i < iterations; ++i) {
        for (int j = 0; j < 8; ++j) s[j] = _mm512_dpbusd_epi32(s[j], a[j], x);
        asm volatile("" : "+v"(a[0]), "+v"(a[1]));
      }
      int acc = 0; for (int j = 0; j < 8; ++j) acc += _mm512_reduce_add_epi32(s[j]);
#else
      __m256i a[8], s[8]; const __m256i x = _mm256_set1_epi8(3);
      for (int j = 0; j < 8; ++j) { a[j] = _mm256_set1_epi8(j + 1); s[j] = _mm256_setzero_si256(); }
      for (int64_t i = 0; i < iterations; ++i) {
        for (int j = 0; j < 8; ++j) s[j] = _mm256_add_epi16(s[j], _mm256_maddubs_epi16(a[j], x));
        asm volatile("" : "+x"(a[0]), "+x"(a[1]));
      }
      int acc = 0; for (int j = 0; j < 8; ++j) acc += _mm256_extract_epi16(s[j], 0);
#endif
      sink[t] = acc;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#ifdef __AVX512VNNI__
  const double per_op = 64;
#else
  const double per_op = 32;
#endif
  return sink[0] == 12345 ? 0.0 : iterations * 8 * per_op * threads / seconds;
}
"""


def int8_peak_rate() -> float:
    """The chip's int8 multiply-adds a second, every thread busy (best of 3 runs)."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline("int8_peak", cpp_sources=[PEAK_SOURCE], functions=["int8_peak"],
                         extra_cflags=kquant_kernel().cflags, verbose=False)
    return max(module.int8_peak(50_000_000) for _ in range(3))


def peak() -> None:
    rate = int8_peak_rate()
    print(f"int8 multiply-add peak ({torch.get_num_threads()} threads, {kquant_kernel().name}): "
          f"{rate / 1e9:.0f} GMAC/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="a git revision whose kernel source to compare with")
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--model", action="store_true", help="also T_v(x) of the default target with each build")
    ap.add_argument("--peak", action="store_true", help="also the chip's int8 multiply-add rate")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    spec = kquant_kernel()
    current = spec.load()
    if current is None:
        raise SystemExit(f"specwood: {spec.failure}")
    with tempfile.TemporaryDirectory(prefix="kquant-rows-") as work:
        builds = {"this": current, a.against: build_at(a.against, Path(work))}
        print(f"{spec.name}, {torch.get_num_threads()} threads")
        linears(builds, rows)
        streamed(builds, rows)
        if a.model:
            model_tv(builds, [r for r in rows if r <= 8])
        if a.peak:
            peak()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
