"""The compiled-kernel cache: one folder per build keyed by source, flags, torch and Python
versions, where the caches point; a lock left by a killed build is removed, not waited on forever."""
from __future__ import annotations

import subprocess
import sys
import time

from specwood.models import kernels
from specwood.models.layer_ops import KERNEL


def test_each_build_has_its_own_folder(tmp_path, monkeypatch):
    base = KERNEL.build_dir()
    assert base.parent == kernels.build_directory() and base.name.startswith(KERNEL.name + "-")
    other_flags = kernels.CpuKernel(KERNEL.name, KERNEL.source.name, KERNEL.cflags + ["-DSPECWOOD_X"], KERNEL.required,
                                    KERNEL.use)
    assert other_flags.build_dir() != base
    monkeypatch.setattr(kernels, "torch_version", lambda: "0.0.1")
    assert KERNEL.build_dir() != base
    monkeypatch.undo()
    monkeypatch.delenv("SPECWOOD_KERNEL_DIR", raising=False)
    monkeypatch.setenv("SPECWOOD_CACHE", str(tmp_path))
    assert kernels.build_directory() == tmp_path / "kernels"


def test_a_stale_lock_is_removed_and_the_kernel_loads():
    """A lock from a killed build (its recorded builder is dead): the next start removes it with one
    line and loads the kernel instead of hanging in torch's wait."""
    from specwood.models import w4a8

    kernel = w4a8.KERNEL  # the k-quant kernel builds on every CPU we run on (AVX512-VNNI or AVX2)
    assert kernel.load() is not None, kernel.failure  # built (or loaded) here first
    build = kernel.build_dir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (build / "lock").write_text("")
    (build / "builder.pid").write_text(str(dead.pid))
    code = "from specwood.models.w4a8 import KERNEL; assert KERNEL.load() is not None, KERNEL.failure"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "removed a stale kernel build lock" in proc.stderr and not (build / "lock").exists()


def test_a_live_builders_lock_is_left_alone(tmp_path):
    (tmp_path / "lock").write_text("")
    (tmp_path / "builder.pid").write_text(str(subprocess.os.getpid()))
    assert not kernels.clear_stale_lock(tmp_path) and (tmp_path / "lock").exists()
    (tmp_path / "builder.pid").unlink()  # no record: only a lock older than STALE_LOCK_S is stale
    assert not kernels.clear_stale_lock(tmp_path)
    old = time.time() - kernels.STALE_LOCK_S - 5
    subprocess.os.utime(tmp_path / "lock", (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not (tmp_path / "lock").exists()


def test_without_a_compiler_generation_runs_on_torch_with_one_line(tmp_path, tiny_tokenizer):
    import os

    from specwood.models.testing import random_state_dict, random_tiny_config, save_hf_folder

    cfg = random_tiny_config("qwen2", vocab_size=264, max_position_embeddings=128)
    folder = save_hf_folder(tmp_path / "tiny", cfg, random_state_dict(cfg, seed=1))
    tiny_tokenizer.save_pretrained(folder)
    env = dict(os.environ, SPECWOOD_KERNEL_DIR=str(tmp_path / "kernels"), SPECWOOD_CACHE=str(tmp_path / "cache"),
               CXX="/bin/false")
    proc = subprocess.run([sys.executable, "-m", "specwood.cli", "generate", "hello", "--target", str(folder),
                           "--draft", "none", "--method", "ar", "--max-tokens", "4", "--raw"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "run on torch instead" in ln]
    assert "Traceback" not in proc.stderr
    if KERNEL.missing_flags():  # no AVX512: the kernel is never tried, so there is no failure to report
        assert said == []
    else:
        assert len(said) == 1 and "could not be built" in said[0]
