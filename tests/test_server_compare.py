"""The llama-server build helper and benchmarks/server_compare.py's bookkeeping, without building
or starting anything (the end-to-end run needs the built llama-server and minutes of CPU)."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from specwood.bench import llama_server as LS
from specwood.bench.workload import load_workload
from specwood.errors import SpecwoodError

REPO = Path(__file__).resolve().parents[1]


def _compare_module():
    spec = importlib.util.spec_from_file_location("server_compare", REPO / "benchmarks" / "server_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_heldout_prompts_cover_every_builtin_category_twice():
    held = load_workload(REPO / "benchmarks" / "heldout_prompts.jsonl")
    builtin = load_workload("builtin")
    assert sorted(held.categories) == sorted(builtin.categories)
    assert all(sum(p.category == c for p in held.prompts) == 2 for c in held.categories)
    own = {p.id for p in builtin.prompts}
    assert not own & {p.id for p in held.prompts}


def test_install_dir_follows_specwood_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path))
    assert LS.binary_path("1.2.3") == tmp_path / "llama-server" / "1.2.3" / "bin" / "llama-server"
    assert LS.cached_binary("1.2.3") is None


def test_missing_cmake_is_one_line_with_the_fix(monkeypatch):
    monkeypatch.setattr(LS.shutil, "which", lambda name: None)
    with pytest.raises(SpecwoodError) as e:
        LS.check_tools()
    msg = str(e.value)
    assert "cmake" in msg and "apt-get install -y cmake" in msg and "pip install cmake" in msg and "\n" not in msg


def test_bad_version_is_refused():
    with pytest.raises(SpecwoodError):
        LS.resolve_version("1.0; rm -rf /")


def test_extract_takes_only_vendored_llama_cpp(tmp_path):
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    files = {"llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt": b"project(x)\n",
             "llama_cpp_python-9.9.9/vendor/llama.cpp/tools/server/main.cpp": b"int main(){}\n",
             "llama_cpp_python-9.9.9/llama_cpp/__init__.py": b"__version__ = '9.9.9'\n"}
    with tarfile.open(sdist, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    root = LS.extract_llama_cpp(sdist, tmp_path / "src", lambda s: None)
    assert (root / "tools" / "server" / "main.cpp").is_file()
    assert not (tmp_path / "src" / "llama_cpp_python-9.9.9" / "llama_cpp").exists()


def test_llama_command_slots_context_and_speculation(tmp_path):
    sc = _compare_module()
    cmd = sc.llama_command(Path("/b/llama-server"), 1234, Path("/m/t.gguf"), threads=2, ctx=4096, slots=4)
    assert cmd[cmd.index("-c") + 1] == str(4 * 4096) and cmd[cmd.index("-np") + 1] == "4"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "-md" not in cmd
    spec = sc.llama_command(Path("/b/llama-server"), 1234, Path("/m/t.gguf"), threads=2, ctx=4096, slots=1,
                            draft=Path("/m/d.gguf"))
    assert spec[spec.index("-md") + 1] == "/m/d.gguf" and spec[spec.index("--spec-type") + 1] == "draft-simple"


def test_plan_state_and_spec_lengths_from_logs(tmp_path):
    sc = _compare_module()
    log = tmp_path / "s.log"
    log.write_text("[plan] no measured plan for 'dyspec' on this device yet: starting from T_v and T_d timed now\n")
    assert sc._plan_state(log)["plan"] == "starter"
    log.write_text("specwood: listening on http://127.0.0.1:1 (model m, method auto, max batch 8)\n")
    assert sc._plan_state(log)["plan"] == "measured"
    log.write_text("specwood: listening on http://127.0.0.1:1 (model m, method ar, max batch 8)\n")
    assert sc._plan_state(log)["plan"].startswith("unknown")
    log.write_text("x draft acceptance = 0.5 (1 accepted / 2 generated), mean len =  2.00\n"
                   "y draft acceptance = 0.9 (9 accepted / 10 generated), mean len =  3.50\n")
    assert sc._spec_mean_lens(log) == [2.0, 3.5] and sc._spec_mean_lens(log, skip=1) == [3.5]


def test_summary_ratios_and_report():
    sc = _compare_module()
    recs, rows = [], []
    speeds = {("llama.cpp", "plain"): 20.0, ("specwood", "ar"): 19.0, ("specwood", "auto"): 26.0}
    for (server, method), v in speeds.items():
        for c in (1, 4):
            for cat in ("code", "chat"):
                recs.append({"server": server, "method": method, "concurrency": c, "round": 0, "id": cat,
                             "category": cat, "error": None, "completion_tokens": 32, "ttft_s": 0.5,
                             "decode_tokens_per_s": v * (1.2 if cat == "code" else 0.8), "prompt_tokens": 40})
            rows.append({"server": server, "method": method, "concurrency": c, "round": 0, "errors": 0,
                         "requests": 2, "decode_tokens_per_s": v * c, "tokens_per_s": v * c, "ttft_s_p50": 0.5,
                         "other_cpu_cores": 0.6 if method == "auto" and c == 4 else 0.0, "steal_cores": 0.0})
    s = sc.summarize(recs, rows, [1, 4], ["ar", "auto"], ["llama.cpp", "specwood"])
    assert s["c1_ratios"]["all"]["ar/llama.cpp"] == pytest.approx(0.95)
    assert s["c1_ratios"]["code"]["auto/ar"] == pytest.approx(26 / 19)
    assert s["goals"]["ar"]["met_overall"] and s["goals"]["auto"]["met_overall"]
    assert s["aggregate"][1]["auto/llama.cpp"] == pytest.approx(1.3)
    result = sc._jsonable({"meta": {"command": "x", "auto_plan": {"plan": "starter", "line": None}},
                           "summary": s, "levels": rows, "requests": recs})
    md = sc.markdown(result)
    assert "0.95x" in md and "without a measured plan" in md and "other processes used the CPU" in md
    json.dumps(result)



def test_paired_ratios_compare_each_prompt_within_its_round():
    """--paired: a ratio per prompt and round, pooled as a geometric mean; a drift that slows
    every series alike in round 2 cancels, where the ratio of pooled means would carry a
    series' share of slow and fast rounds."""
    sc = _compare_module()
    recs = []
    for rnd, speed in ((0, 1.0), (1, 0.8)):  # the machine 20% slower in round 2
        for pid, cat, auto_gain in (("p1", "code", 1.5), ("p2", "translation", 0.9)):
            for server, method, v in (("llama.cpp", "plain", 30.0), ("specwood", "ar", 36.0),
                                      ("specwood", "auto", 36.0 * auto_gain)):
                recs.append({"server": server, "method": method, "concurrency": 1, "round": rnd, "id": pid,
                             "category": cat, "error": None, "decode_tokens_per_s": v * speed,
                             "prompt_tokens": 100, "completion_tokens": 64, "ttft_s": 0.3})
    s = sc.summarize(recs, [], [1], ["ar", "auto"], ["llama.cpp", "specwood"])
    pr = s["paired_ratios"]
    assert pr["translation"]["auto/ar"]["geomean"] == pytest.approx(0.9)
    assert pr["translation"]["auto/ar"]["n"] == 2
    assert pr["all"]["auto/ar"]["geomean"] == pytest.approx((1.5 * 0.9) ** 0.5)
    assert pr["all"]["auto/ar"]["lowest"] == pytest.approx(0.9)
    assert pr["code"]["ar/llama.cpp"]["geomean"] == pytest.approx(1.2)
    md = sc.markdown(sc._jsonable({"meta": {"command": "x", "paired": True}, "summary": s, "levels": [],
                                   "requests": recs}))
    assert "## paired at c=1" in md and "| translation | 2 | 1.20x | 1.20x |" in md

# ------------------------------------------------------------------- llama.cpp's build flags (issue 39, item 0)
def test_llama_cpu_flags_name_the_sets_and_keep_amx_off() -> None:
    from specwood.bench.llama_cpu_flags import cmake_flags, cpu_flags
    xeon = ("processor : 0\nflags : fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl "
            "avx512_vnni avx512_bf16 avx512vbmi amx_tile amx_int8 amx_bf16\n")
    f = cmake_flags(cpu_flags(xeon), machine="x86_64")
    assert "-DGGML_NATIVE=OFF" in f and "-DGGML_NATIVE=ON" not in f
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
            "-DGGML_AVX512_VBMI=ON"} <= set(f)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(f)
    assert not any("AMX" in x and x.endswith("=ON") for x in f)
    # an AVX2-only CPU with AVX-VNNI: no AVX512 flags
    f2 = cmake_flags(cpu_flags("flags : avx avx2 fma f16c avx_vnni\n"), machine="x86_64")
    assert "-DGGML_AVX_VNNI=ON" in f2 and not any("AVX512" in x for x in f2)
    assert cmake_flags(set(), machine="aarch64") == ["-DGGML_NATIVE=OFF"]


def test_llama_server_build_uses_the_named_flags() -> None:
    # the README, CI and the server build all name the sets; none builds natively
    root = Path(__file__).resolve().parents[1]
    for f in ("README.md", ".ci/run"):
        text = (root / f).read_text(encoding="utf-8")
        assert "GGML_NATIVE=ON" not in text and "llama_cpu_flags.py" in text
    assert not any("NATIVE" in x for x in LS.CMAKE_FLAGS)
    out = subprocess.run([sys.executable, str(root / "specwood/bench/llama_cpu_flags.py")],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert "-DGGML_NATIVE=OFF" in out and "-DGGML_AMX_INT8=OFF" in out
