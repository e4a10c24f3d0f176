"""A plan measured while the server worked is not kept (issue 43 item 8): the background planner
knows when the server paused it and takes a spoilt timing again, a plan whose fits fail the sanity
checks is not stored for a server, and the server says so in one line. A plan measured while other
processes kept the machine busy is never stored, and a stored plan from another CPU or build is
not used (issue 58, bad input): one line says so each time."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_planner import KEY, synthetic_plan

from specwood.planner.decision import ParallelProfile
from specwood.planner.store import ROOFLINE_MAX_ERROR, plan_key_for, plan_path, plan_problems


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path / "cache"))


def duo(comm_s: float, tokens_per_s: float = 20.0) -> ParallelProfile:
    """DuoDecoding measured at 2 tokens per iteration: an iteration of 100 ms at 20 tok/s."""
    return ParallelProfile(gamma=3.0, t_draft_token_s=0.01, target_slowdown=1.2, verify_tokens=2.0,
                           tokens_per_iteration=2.0, comm_s=comm_s, tokens_per_s=tokens_per_s, context=64)


# ------------------------------------------------------------------------------------- sanity checks
def test_a_sane_plan_passes():
    plan = synthetic_plan(KEY)
    plan.parallel = duo(comm_s=-0.02)  # overlapping a little better than max() assumes is allowed
    assert plan_problems(plan.refresh()) == []
    assert plan_problems(plan, ar_step_s=0.012, ar_context=64) == []  # the plan's own 10 ms step: near


def test_negative_duodecoding_comm_time_is_rejected():
    plan = synthetic_plan(KEY)
    plan.parallel = duo(comm_s=-2.027)  # what the plan measured under load stored
    (problem,) = plan_problems(plan.refresh())
    assert "communication time -2027.0 ms per iteration of 100.0 ms" in problem


def test_negative_and_non_finite_times_are_rejected():
    plan = synthetic_plan(KEY)
    plan.verify_times[64][2] = -0.004
    plan.draft_times[64][4] = float("nan")
    problems = plan_problems(plan)
    assert any(p.startswith("T_v not a positive time (ctx 64 x 2") for p in problems)
    assert any(p.startswith("T_d not a positive time (ctx 64 x 4") for p in problems)


def test_a_roofline_fit_with_a_large_error_is_rejected():
    plan = synthetic_plan(KEY, contexts=(64,))
    # steps paused half-way at x = 2 and 6 (3x as long): a noisy curve no roofline follows
    plan.verify_times[64] = {1: 0.01, 2: 0.03, 4: 0.01, 6: 0.035, 8: 0.012, 16: 0.02, 32: 0.02}
    plan.refresh()
    assert plan.rooflines[64].rel_error > ROOFLINE_MAX_ERROR
    (problem,) = plan_problems(plan)
    assert problem.startswith("roofline ctx 64: relative error") and "over 20%" in problem


def test_plain_decoding_far_from_the_servers_is_rejected():
    plan = synthetic_plan(KEY)  # 10 ms a plain step at ctx 64: 100 tok/s
    (problem,) = plan_problems(plan, ar_step_s=1 / 1000, ar_context=64)
    assert problem == "plain decoding at ctx 64: 100.00 tok/s in the plan, 1000.00 tok/s measured by the server"
    assert plan_problems(plan, ar_step_s=0.1, ar_context=64)  # 10x slower than the server: also off


def plan_args(*extra: str) -> argparse.Namespace:
    from specwood.planner.cli import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", "--quick", "--contexts", "64,4096", "--no-plots", *extra])


def test_a_plan_for_the_server_that_fails_is_not_stored(tiny_model_factory, tiny_tokenizer, monkeypatch, capsys):
    """`specwood plan` as the server starts it (with its own plain step): a plan whose fits fail
    ends in one line and leaves no file, so `auto` keeps its starter plan; the same plan asked for
    by hand is stored with a warning."""
    import specwood.engine.api as engine_api
    import specwood.engine.args  # noqa: F401 - imported before the patch: it binds the real `load` (the CLI's)
    from specwood.errors import SpecwoodError

    tiny_engine = engine_api.Engine(tiny_model_factory(), tiny_tokenizer, target_name="tiny")

    def bad_plan(engine, method, **kw):
        plan = synthetic_plan(plan_key_for(engine, method))
        plan.parallel = duo(comm_s=-2.0)
        return plan.refresh()

    monkeypatch.setattr(engine_api, "load", lambda *a, **k: tiny_engine)
    monkeypatch.setattr("specwood.planner.build.build_plan", bad_plan)
    args = plan_args("--server-step-s", "0.0101", "--server-step-ctx", "64")
    with pytest.raises(SpecwoodError) as e:
        args.func(args)
    assert "\n" not in str(e.value) and str(e.value).startswith("the measured plan is not stored: DuoDecoding")
    key = bad_plan(tiny_engine, "dyspec").key
    assert not plan_path(key).exists()
    capsys.readouterr()
    args = plan_args()  # by hand
    assert args.func(args) == 0
    assert "[plan] warning: DuoDecoding: communication time" in capsys.readouterr().err
    assert plan_path(key).exists()


def test_the_server_says_in_one_line_that_its_background_plan_was_not_stored(tmp_path, capsys):
    from specwood.serve.background import Background, pause_while_busy

    class Idle:  # a server without requests: the child runs unpaused
        idle = True

    line = "specwood: error: the measured plan is not stored: roofline ctx 128: relative error 21.6% over 20%"
    child = Background([sys.executable, "-c", f"import sys; print('measuring\\r50%'); print({line!r}); sys.exit(2)"],
                       tmp_path / "plan.log", "background plan (auto keeps its starter plan)")
    pause_while_busy(child, Idle()).join(30)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specwood: background plan (auto keeps its starter plan): the measured plan is not stored: "
                   f"roofline ctx 128: relative error 21.6% over 20% (log: {tmp_path / 'plan.log'})"]


# ------------------------------------------------------------------- the machine and its load
def test_a_plan_from_another_cpu_or_build_is_discarded_in_one_line(capsys):
    from specwood.planner.machine import machine_record
    from specwood.planner.store import load_plan, save_plan

    plan = synthetic_plan(KEY)  # measured here, in this process
    here = machine_record()
    assert plan.machine == here and here["cpu"] and here["kernels"]
    save_plan(plan)
    assert load_plan(KEY) is not None and capsys.readouterr().err == ""
    isa = here["isa"].split()
    changes = [({"cpu": "Other CPU 9000"}, "it was measured on another CPU ('Other CPU 9000', this one is"),
               ({"kernels": "0123456789ab torch 0.0 specwood 0.0"}, "it was measured with other kernels (0123456789ab"),
               (None, "it does not say which CPU and kernels it was measured with")]  # a plan from before
    if isa:  # a VM that shows the same CPU model without one of its instruction sets
        shown = "avx512f" if "avx512f" in isa else isa[-1]
        changes.append(({"isa": " ".join(f for f in isa if f != shown)},
                        f"it was measured on a CPU with other instruction sets ({shown} added here)"))
    for change, said in changes:
        plan.machine = {**here, **change} if change else {}
        save_plan(plan)
        assert load_plan(KEY) is None
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"[plan] the stored plan {plan_path(KEY)} is discarded: {said}")
        assert load_plan(KEY) is None and capsys.readouterr().err == ""  # once a process (a server asks often)
    plan.source, plan.machine = "analytic", {}  # a device model: measured nowhere
    save_plan(plan)
    assert load_plan(KEY) is not None


def test_the_kernel_digest_covers_the_modules_that_choose_kernels():
    """A plan timed before a kernel choice changed (e.g. fp32 linears moved to oneDNN in linears.py)
    is re-measured: the digest `machine_record` stores covers the C++ sources and those modules."""
    import specwood.models.kernels as kernels_pkg
    import specwood.models.linears as linears
    from specwood.planner.machine import kernel_sources

    sources = kernel_sources()
    assert all(p.is_file() for p in sources)
    assert Path(linears.__file__).resolve() in sources
    cpp = {p.name for p in Path(kernels_pkg.__file__).parent.iterdir() if p.suffix in (".cpp", ".h")}
    assert cpp and cpp <= {p.name for p in sources}


def test_a_plan_measured_beside_busy_processes_is_not_stored(monkeypatch, capsys):
    """Real processes spin on the cores while LoadWatch samples the others' CPU use: the plan is
    not stored and one line says why; the same samples under a higher limit are stored."""
    from specwood.planner.machine import BUSY_CORES_ENV, LoadWatch, others_cores
    from specwood.planner.store import save_if_quiet

    if others_cores(0.05) is None:
        pytest.skip("no /proc/stat here to read the others' CPU use from")
    monkeypatch.setenv(BUSY_CORES_ENV, "0.5")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(min(4, os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # started
        watch = LoadWatch()
        plan = synthetic_plan(KEY)
        plan.load = watch.finish()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert min(plan.load["start"], plan.load["end"]) > 0.5, plan.load
    assert save_if_quiet(plan) is None and not plan_path(KEY).exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"[plan] the measured plan is not stored: other processes kept {plan.load['start']:.2f} "
                           f"at its start and {plan.load['end']:.2f} at its end of the {os.cpu_count()} cores busy")
    monkeypatch.setenv(BUSY_CORES_ENV, "inf")
    assert save_if_quiet(plan) == plan_path(KEY) and capsys.readouterr().err == ""


def test_specwood_plan_on_a_busy_machine_stores_nothing(tiny_model_factory, tiny_tokenizer, monkeypatch, capsys):
    """`specwood plan` whose measurement saw a busy machine: for the server, an error in one line
    (it keeps its starter plan); by hand, one line and no file."""
    import specwood.engine.api as engine_api
    from specwood.errors import SpecwoodError
    from specwood.planner.machine import BUSY_CORES_ENV

    tiny_engine = engine_api.Engine(tiny_model_factory(), tiny_tokenizer, target_name="tiny")

    def busy_plan(engine, method, **kw):
        plan = synthetic_plan(plan_key_for(engine, method))
        plan.load = {"start": 1.6, "end": 0.2}  # others' cores (LoadWatch, tested above)
        return plan

    monkeypatch.setenv(BUSY_CORES_ENV, "0.5")
    monkeypatch.setattr(engine_api, "load", lambda *a, **k: tiny_engine)
    monkeypatch.setattr("specwood.planner.build.build_plan", busy_plan)
    key = busy_plan(tiny_engine, "dyspec").key
    args = plan_args("--server-step-s", "0.0101", "--server-step-ctx", "64")
    with pytest.raises(SpecwoodError) as e:
        args.func(args)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "the measured plan is not stored: other processes kept 1.60 at its start of the")
    capsys.readouterr()
    args = plan_args()  # by hand
    assert args.func(args) == 0 and not plan_path(key).exists()
    said = [ln for ln in capsys.readouterr().err.splitlines() if "not stored" in ln or "saved" in ln]
    assert len(said) == 1 and said[0].startswith("[plan] the measured plan is not stored: other processes kept 1.60")


# ------------------------------------------------------------------------------------------- pauses
PROFILER_CHILD = r"""
import json, sys, time
import torch
from specwood.models.testing import random_state_dict, random_tiny_config
from specwood.models.transformer import build_model
from specwood.planner.pauses import PAUSES
from specwood.planner.profiler import measure_verify_times

torch.set_num_threads(1)
cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=512)
model = build_model(cfg, random_state_dict(cfg), torch.float32, layer_kernels=False)  # no kernel to load
print("ready", flush=True)
deadline = time.monotonic() + 240
tables = []
while time.monotonic() < deadline:  # until a pause spoilt a round and it was taken again
    tables.append(measure_verify_times(model, (1, 2, 4, 8), (64,), repeats=3, refine=False, progress=False))
    if PAUSES.retaken >= 1:
        break
print(json.dumps({"pauses": PAUSES.count, "retaken": PAUSES.retaken, "grace_s": PAUSES.grace_s,
                  "tables": len(tables)}), flush=True)
"""


def test_a_timing_the_server_paused_is_taken_again(tmp_path, tiny_model_factory, tiny_tokenizer):
    """The real profiler in a background child, paused by the server's own mechanism
    (pause_while_busy) while a real scheduler decodes requests: the child sees the pauses and
    takes the rounds they spoilt again, with the server's grace."""
    from specwood.engine.api import Engine
    from specwood.engine.scheduler import TREE_ROOM, SchedulerConfig
    from specwood.serve.background import PAUSE_POLL_S, Background, pause_while_busy

    engine = Engine(tiny_model_factory(max_positions=512), tiny_tokenizer)
    scheduler = engine.make_scheduler(SchedulerConfig(max_batch=1, row_len=512 + TREE_ROOM))
    scheduler.start()
    log = tmp_path / "child.log"
    child = Background([sys.executable, "-c", PROFILER_CHILD], log, "profiler")
    watch = pause_while_busy(child, scheduler)
    try:
        deadline = time.monotonic() + 120
        while "ready" not in log.read_text() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        submitted = 0
        while child.poll() is None and time.monotonic() < deadline:  # requests of ~0.1-1 s, gaps between them
            request = engine.new_request([3, 4, 5], max_tokens=120, method="ar", scheduler=scheduler)
            scheduler.submit(request)
            submitted += 1
            while not scheduler.idle:
                time.sleep(0.01)
            time.sleep(0.15)
        child.wait(60)
    finally:
        if child.poll() is None:
            from specwood.serve.background import end_process_group

            end_process_group(child)
        scheduler.stop()
    watch.join(10)
    out = log.read_text().strip().splitlines()
    assert child.returncode == 0, out[-5:]
    result = json.loads(out[-1])
    assert submitted >= 1 and result["pauses"] >= 1 and result["retaken"] >= 1
    assert result["grace_s"] == pytest.approx(2 * PAUSE_POLL_S)
