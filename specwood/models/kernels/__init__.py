"""Our C++ CPU kernels: compiled on first use with torch's cpp_extension and cached on disk.

Each kernel is one source file here; `CpuKernel` builds it once per process (thread-safe) and
remembers why it could not (no AVX512 on this CPU, no compiler), so callers can fall back or
print one line instead of a traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")


def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ("" where there is none or no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name)), "")


def cpu_flags() -> set[str]:
    return set(_cpuinfo_field("flags").split())


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("" where it does not)."""
    return _cpuinfo_field("model name")


def cpu_identity() -> str:
    """The CPU a build is for: its model name and instruction-set flags. Kernels compiled for one
    CPU's instructions are keyed by it, so a kernel cache copied to another machine is rebuilt
    there, never executed."""
    return f"{cpu_model()}|{' '.join(sorted(cpu_flags()))}"


def build_directory() -> Path:
    """Where compiled kernels live: $SPECWOOD_KERNEL_DIR, else $SPECWOOD_CACHE/kernels, else
    ~/.cache/specwood/kernels (one folder per kernel build, `CpuKernel.build_dir`)."""
    if os.environ.get("SPECWOOD_KERNEL_DIR"):
        return Path(os.environ["SPECWOOD_KERNEL_DIR"])
    cache = os.environ.get("SPECWOOD_CACHE")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache" / "specwood") / "kernels"


STALE_LOCK_S = 60.0  # a build lock this old with no live builder on record is left over from a killed build


def clear_stale_lock(build: Path) -> bool:
    """Remove torch's build lock in `build` when its builder is gone: the pid we record while
    building is dead, or there is no record and the lock is older than STALE_LOCK_S. A killed
    build leaves the lock behind, and torch's loader then waits for it forever. True if removed."""
    lock, owner = build / "lock", build / "builder.pid"
    if not lock.exists():
        return False
    try:
        pid: int | None = int(owner.read_text())
    except (OSError, ValueError):
        pid = None
    try:
        stale = not _alive(pid) if pid is not None else time.time() - lock.stat().st_mtime > STALE_LOCK_S
    except OSError:
        return False
    if stale:
        lock.unlink(missing_ok=True)
        print(f"[load] removed a stale kernel build lock in {build} (a build was killed)", file=sys.stderr)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def local_headers(source: Path) -> list[Path]:
    """The headers of this folder that `source` includes, and those they include, each once."""
    found: list[Path] = []
    todo = [source]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), re.MULTILINE):
            path = source.parent / name
            if path not in found:
                found.append(path)
                todo.append(path)
    return found


def build_for_this_cpu(preferred: "CpuKernel", fallback: "CpuKernel") -> "CpuKernel":
    """`preferred` (e.g. an AVX512 build) where this CPU has every flag it needs, else `fallback` (e.g.
    the same source's AVX2 build), whose missing flags, on a CPU with neither, are the least it needs."""
    return fallback if preferred.missing_flags() else preferred


class CpuKernel:
    """One extension module: `source` (a file in this folder) built as `name` with `cflags`,
    on CPUs with every flag in `required` (as /proc/cpuinfo names them)."""

    def __init__(self, name: str, source: str, cflags: list[str], required: tuple[str, ...], use: str):
        self.name, self.source, self.cflags, self.required = name, Path(__file__).with_name(source), cflags, required
        self.use = use  # what the kernel is for, in the one-line failure message
        self._lock = threading.Lock()
        self._module: Any = None
        self.failure: str | None = None

    def build_dir(self) -> Path:
        """This build's own folder, keyed by the source and the headers of this folder it includes,
        the compiler flags, torch's and Python's versions and the CPU: a changed source or another
        torch never loads (or waits on) an old build, and a build copied from another CPU is not
        executed."""
        headers = b"".join(path.read_bytes() for path in local_headers(self.source))
        key = hashlib.sha256(self.source.read_bytes() + headers + json.dumps(
            [self.cflags, torch_version(), list(sys.version_info[:2]), cpu_identity()]).encode()).hexdigest()[:12]
        return build_directory() / f"{self.name}-{key}"

    def missing_flags(self) -> list[str]:
        """The required CPU flags this machine lacks (none: the kernel can run here, if it builds)."""
        return [f for f in self.required if f not in cpu_flags()]

    def build_in_background(self) -> None:
        """Start building (if not built yet) while the caller does other work, e.g. reads model
        files: a fresh machine's first run pays max(build, load) instead of their sum. A later
        `load` waits for that build. Not a daemon thread: a process that ends early (a bad model
        path) waits for the compiler instead of leaving torch's build lock behind, which would
        make every later build wait forever."""
        if self._module is None and self.failure is None:
            threading.Thread(target=self.load, name=f"build {self.name}").start()

    def load(self) -> Any:
        """The module, or None (then `failure` says why)."""
        with self._lock:
            if self._module is not None or self.failure is not None:
                return self._module
            missing = self.missing_flags()
            if missing:
                self.failure = f"{self.use} needs an x86 CPU with {', '.join(missing)}"
                return None
            try:
                from torch.utils.cpp_extension import load

                build = self.build_dir()
                build.mkdir(parents=True, exist_ok=True)
                clear_stale_lock(build)
                if not any(build.glob(f"{self.name}*.so")):
                    print(f"[load] compiling {self.source.name} (once, about a minute)", file=sys.stderr)
                owner = build / "builder.pid"
                owner.write_text(str(os.getpid()))  # lets a later process see that a lock is stale
                try:
                    self._module = load(name=self.name, sources=[str(self.source)], build_directory=str(build),
                                        extra_cflags=self.cflags, verbose=False)
                finally:
                    owner.unlink(missing_ok=True)
            except Exception as e:  # no compiler, no ninja, a failed build: one line, not a traceback
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.failure = f"{self.use}: the kernel could not be built ({first[:200]}); install a C++ compiler and ninja"
            return self._module
