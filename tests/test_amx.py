"""The AMX path of the k-quant linears (specwood.models.amx, kernels/kquants_amx.cpp).

Everywhere: the kernel built over the C++ model of the tile unit gives the VNNI kernel's bits for
every type, row count and thread count, and every method stays token-identical to `ar` with it on;
the probe runs in a real child process and its failures (a fault, a wrong result) leave this
process on VNNI with one line; the probe's record and the kernel builds are keyed by the CPU.
Where the CPU has AMX (amx_tile, amx_int8), the real kernel goes through the same checks.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_every_method_matches_ar
from test_kquant_types import every_type_copy

from specwood.engine.api import Engine
from specwood.models import amx, amx_probe, kernels
from specwood.models.kernels import cpu_flags
from specwood.models.w4a8 import q4_unavailable_reason

# the tile path (and its emulation) is built beside the AVX512-VNNI kernel: an AVX2 machine has neither
pytestmark = pytest.mark.skipif(bool(amx.VNNI_KERNEL.missing_flags()) or q4_unavailable_reason() is not None,
                                reason=str(q4_unavailable_reason() or "the AMX path builds on AVX512-VNNI, which "
                                                                      "this CPU lacks"))
HAS_AMX = all(f in cpu_flags() for f in amx.AMX_FLAGS)
NO_AMX = "this CPU has no AMX (amx_tile, amx_int8 missing from /proc/cpuinfo): the real tile kernel cannot run here"


@pytest.fixture(scope="module")
def emulated():
    kernel = amx.EMULATED_KERNEL.load()
    assert kernel is not None, amx.EMULATED_KERNEL.failure
    assert kernel.emulated
    return kernel


@pytest.fixture(scope="module")
def vnni():
    return amx.VNNI_KERNEL.load()


@pytest.mark.parametrize("threads", [1, 2])
def test_emulated_tiles_give_the_vnni_kernels_bits(emulated, vnni, threads):
    """Every type, fp32 and bf16, whole and partial superblocks, 1 to 40 rows (whole and partial
    row tiles of 16): bit-identical; and the check itself catches a result one ulp off."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert amx_probe.first_difference(emulated, vnni, rows=tuple(range(1, 41))) is None
        assert (amx_probe.first_difference(amx_probe._BiasedKernel(emulated), vnni, rows=(3,))
                == "q4_linear, 3 x 288 activations, float32")
    finally:
        torch.set_num_threads(old)


def test_a_rows_result_does_not_depend_on_the_others_on_tiles(emulated):
    packed, bias = amx_probe.random_packed("q6_linear", 96, 512, seed=3), torch.randn(96)
    x = torch.randn(37, 512) * torch.rand(37, 1) * 10
    batch = emulated.q6_linear(x, packed, bias)
    assert torch.equal(torch.cat([emulated.q6_linear(x[i:i + 1], packed, bias) for i in range(37)]), batch)
    assert torch.equal(emulated.q6_linear(x[5:22], packed, bias), batch[5:22])


def test_every_method_matches_ar_with_linears_of_two_rows_and_more_on_tiles(tiny_pair, tiny_tokenizer, emulated,
                                                                            monkeypatch):
    """Trees, batches and prefill on the tile kernel, ar's one-row steps on VNNI: same tokens."""
    monkeypatch.setattr(amx, "_chosen", (amx.TilePath(emulated, 2, "emulated AMX tiles"),))
    target = every_type_copy(tiny_pair.target)
    assert all(lin.tiles is not None and lin.tiles.kernel is emulated for lin in target.modules()
               if hasattr(lin, "packed"))
    engine = Engine(target, tiny_tokenizer, draft=every_type_copy(tiny_pair.draft))
    assert_every_method_matches_ar(engine)


def test_the_probe_passes_the_emulated_kernel_in_a_child_process(monkeypatch):
    monkeypatch.setenv("SPECWOOD_AMX", "emulate")  # the child's own linears must not probe again
    result = amx.run_probe(emulate=True, timeout_s=240)
    assert result.ok and result.min_rows == amx.DEFAULT_MIN_ROWS, result.why


@pytest.mark.parametrize("fault, why", [("signal", "the child died of SIGILL on a tile instruction"),
                                        ("mismatch", "its result differs from the VNNI kernel's "
                                                     "(q4_linear, 1 x 288 activations")])
def test_a_failing_probe_leaves_vnni_with_one_line(monkeypatch, fault, why):
    """A VM that faults on a tile instruction, or a kernel that gives other bits: the child dies or
    says so, this process goes on with VNNI and one line naming why."""
    monkeypatch.setenv("SPECWOOD_AMX_PROBE_FAULT", fault)
    path, notice = amx.choose_tile_path("emulate")
    assert path is None
    assert notice.startswith("k-quant linears: AVX512-VNNI (the AMX probe failed: ") and "\n" not in notice
    assert why in notice


def test_settings_and_cpus_without_amx(monkeypatch):
    path, notice = amx.choose_tile_path("off")
    assert path is None and notice == "k-quant linears: AVX512-VNNI (AMX turned off by SPECWOOD_AMX=off)"
    path, notice = amx.choose_tile_path("fast")
    assert path is None and "SPECWOOD_AMX='fast' is not one of auto, off, emulate" in notice
    if not HAS_AMX:  # nothing changes and nothing is said
        assert amx.choose_tile_path("auto") == (None, None)


def test_the_probe_runs_once_per_cpu_and_its_record_is_read(monkeypatch):
    """The verdict is kept beside the build under a key of the CPU, OS release and build; a record
    is what later processes go by (here a recorded refusal), and another CPU has another key."""
    record = amx.EMULATED_KERNEL.build_dir() / f"probe-{amx.probe_cache_key(amx.EMULATED_KERNEL)}.json"
    record.unlink(missing_ok=True)
    try:
        path, notice = amx.choose_tile_path("emulate")
        assert path is not None and path.min_rows == amx.DEFAULT_MIN_ROWS
        assert notice == "k-quant linears: emulated AMX tiles (a test build, slow) from 4 rows, AVX512-VNNI below"
        assert json.loads(record.read_text())["ok"] is True
        record.write_text(json.dumps({"ok": False, "why": "recorded on this machine"}))
        assert amx.choose_tile_path("emulate") == (None, "k-quant linears: AVX512-VNNI (the AMX probe failed: "
                                                         "recorded on this machine)")
        monkeypatch.setenv("SPECWOOD_AMX_MIN_ROWS", "9")
        record.unlink()
        assert amx.choose_tile_path("emulate")[0].min_rows == 9
    finally:
        record.unlink(missing_ok=True)
    key = amx.probe_cache_key(amx.EMULATED_KERNEL)
    monkeypatch.setattr(kernels, "cpu_identity", lambda: "another CPU|avx512f")
    monkeypatch.setattr(amx, "cpu_identity", lambda: "another CPU|avx512f")
    assert amx.probe_cache_key(amx.EMULATED_KERNEL) != key


def test_a_kernel_built_for_another_cpu_is_rebuilt_not_run(monkeypatch):
    here = amx.AMX_KERNEL.build_dir()
    monkeypatch.setattr(kernels, "cpu_identity", lambda: "Intel(R) Xeon(R) Platinum 8480+|amx_int8 amx_tile avx512f")
    assert amx.AMX_KERNEL.build_dir() != here and amx.VNNI_KERNEL.build_dir().name != here.name


@pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)
def test_the_real_tile_kernel_passes_its_probe_and_keeps_every_method_lossless(tiny_pair, tiny_tokenizer, monkeypatch):
    result = amx.run_probe(emulate=False)
    assert result.ok, result.why
    kernel = amx.AMX_KERNEL.load()
    assert kernel.request_tile_permission() == 0
    assert amx_probe.first_difference(kernel, amx.VNNI_KERNEL.load(), rows=tuple(range(1, 41))) is None
    monkeypatch.setattr(amx, "_chosen", (amx.TilePath(kernel, 2, "AMX int8 tiles"),))
    engine = Engine(every_type_copy(tiny_pair.target), tiny_tokenizer, draft=every_type_copy(tiny_pair.draft))
    assert_every_method_matches_ar(engine)


def test_the_planner_keys_and_times_the_tile_path_apart(tiny_pair, tiny_tokenizer, emulated, monkeypatch):
    """A plan timed with the tile path is another plan (its T_v curve is another shape): its key
    says so, and the starter plan times wider trees on it."""
    from specwood.planner.starter import AMX_X_CAP, AMX_XS, TORCH_X_CAP, TORCH_XS, starter_grid
    from specwood.planner.store import plan_key_for

    monkeypatch.setattr(amx, "_chosen", (None,))
    engine = Engine(every_type_copy(tiny_pair.target), tiny_tokenizer)
    assert starter_grid() == (TORCH_XS, TORCH_X_CAP) and plan_key_for(engine, "auto").dtype == "fp32+q4"
    monkeypatch.setattr(amx, "_chosen", (amx.TilePath(emulated, 2, "emulated AMX tiles"),))
    assert starter_grid() == (AMX_XS, AMX_X_CAP) and max(AMX_XS) >= 64
    assert plan_key_for(engine, "auto").dtype == "fp32+q4+amx"
