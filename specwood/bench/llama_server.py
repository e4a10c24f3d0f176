"""llama.cpp's own `llama-server`, built from the llama.cpp sources vendored in the llama-cpp-python
sdist (the `llamacpp` extra), so a server comparison runs the same llama.cpp the extra installs.

    python -m specwood.bench.llama_server build [--version 0.3.36] [--jobs 2] [--force]
    python -m specwood.bench.llama_server path      # print the binary's path (build it if missing)

The sdist is fetched with pip (``pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION``: PyPI or pip's own cache, nothing else), its ``vendor/llama.cpp`` is
configured with cmake (this CPU's instruction sets named explicitly, AMX off: see
``specwood/bench/llama_cpu_flags.py``; ``-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release``, static
libraries, no web UI download, no OpenSSL, no tests or examples) and only the ``llama-server``
target is built. The binary lands in ``$SPECWOOD_CACHE/llama-server/VERSION/bin/llama-server``
(default ``~/.cache/specwood``) with ``build.json`` beside it (version, cmake flags, compiler, the
binary's ``--version``), and is reused from there; sources and build tree are deleted afterwards
(``--keep-build`` keeps them). ~10 minutes on 2 cores. Progress lines go to stderr, the full
build output to ``build.log``; a failure is one line (what is missing and how to install it).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TextIO

from specwood.bench import llama_cpu_flags
from specwood.errors import SpecwoodError
from specwood.models.registry import cache_dir

DIST = "llama-cpp-python"
TARGET = "llama-server"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",            # no downloads at run time (deprecated in newer llama.cpp, harmless)
    "-DBUILD_SHARED_LIBS=OFF",     # one self-contained binary, independent of the build tree
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",        # the web UI would need npm ...
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ... or a download from a Hugging Face bucket: neither (API only)
    "-DLLAMA_OPENSSL=OFF",         # loopback HTTP only
    "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",  # belt and braces: cmake fetches nothing
)
BUILD_TIMEOUT_S = 3 * 3600
PIP_TIMEOUT_S = 900

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"llama-server build: {msg}", file=sys.stderr, flush=True)


def installed_version() -> str | None:
    """The installed llama-cpp-python's version (the `llamacpp` extra), or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve_version(version: str | None) -> str:
    v = version or installed_version()
    if not v:
        raise SpecwoodError(f"{DIST} is not installed, so there is no version to build llama-server from; "
                            "install the extra (CMAKE_ARGS=\"$(python3 -m specwood.bench.llama_cpu_flags)\" "
                            "pip install -e '.[llamacpp]') "
                            "or pass --version X.Y.Z")
    if not re.fullmatch(r"[0-9A-Za-z.+!_-]+", v):
        raise SpecwoodError(f"not a version: {v!r}")
    return v


def install_dir(version: str) -> Path:
    return cache_dir() / "llama-server" / version


def binary_path(version: str) -> Path:
    return install_dir(version) / "bin" / TARGET


def _binary_version(binary: Path, timeout: float = 30.0) -> str | None:
    """`llama-server --version` (it prints to stderr), or None when it does not run."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = " ".join((r.stdout + "\n" + r.stderr).split())
    return (text or None) if r.returncode == 0 else None


def cached_binary(version: str | None = None) -> Path | None:
    """The built binary for `version` (default: the installed llama-cpp-python's) when it exists,
    carries a build.json and runs; else None."""
    try:
        v = resolve_version(version)
    except SpecwoodError:
        return None
    b = binary_path(v)
    if b.is_file() and os.access(b, os.X_OK) and (install_dir(v) / "build.json").is_file():
        return b if _binary_version(b) else None
    return None


def build_info(version: str) -> dict:
    p = install_dir(version) / "build.json"
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


# ------------------------------------------------------------------------------------------ checks
def _find_compiler() -> tuple[str | None, str | None]:
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    return (shutil.which(cxx) if cxx else None), (shutil.which(cc) if cc else None)


def check_tools() -> dict[str, str]:
    """cmake (>= 3.18), a C and a C++ compiler, and a build tool; one-line SpecwoodError otherwise."""
    cmake = shutil.which("cmake")
    if not cmake:
        raise SpecwoodError("cmake not found: install it (apt-get install -y cmake, or pip install cmake) "
                            "to build llama-server")
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecwoodError(f"{cmake} does not run ({e}); reinstall cmake (apt-get install -y cmake)") from None
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m or (int(m.group(1)), int(m.group(2))) < (3, 18):
        raise SpecwoodError(f"cmake {m.group(0) if m else '?'} is too old (llama.cpp needs >= 3.18): "
                            "pip install -U cmake")
    cxx, cc = _find_compiler()
    if not cxx or not cc:
        raise SpecwoodError("no C/C++ compiler found (cc/c++, gcc/g++ or clang/clang++): install one "
                            "(apt-get install -y build-essential) to build llama-server")
    ninja = shutil.which("ninja")
    make = shutil.which("make")
    if not ninja and not make:
        raise SpecwoodError("neither ninja nor make found: pip install ninja (or apt-get install -y make)")
    return {"cmake": cmake, "cmake_version": m.group(0), "cxx": cxx, "cc": cc,
            "generator": "Ninja" if ninja else "Unix Makefiles"}


# ------------------------------------------------------------------------------------------- build
@contextlib.contextmanager
def _lock(path: Path, log: Log) -> Iterator[None]:
    """One build per version at a time (a second caller waits, then reuses the result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another build holds {path}; waiting for it ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_sdist(version: str, dest: Path, log: Log, pip_cmd: Sequence[str] | None = None) -> Path:
    """The llama-cpp-python sdist (.tar.gz) from PyPI (or pip's cache) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz")) + sorted(dest.glob("llama-cpp-python-*.tar.gz"))
    if found:
        return found[0]
    cmd = list(pip_cmd or [sys.executable, "-m", "pip"]) + [
        "download", "--no-deps", "--no-binary", ":all:", f"{DIST}=={version}", "-d", str(dest),
        "--disable-pip-version-check", "--no-input"]
    log(f"fetching the {DIST} {version} sdist with pip (PyPI or pip's cache) ...")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SpecwoodError(f"pip download of {DIST}=={version} took over {PIP_TIMEOUT_S} s; check the "
                            "network to PyPI") from None
    found = sorted(dest.glob("*.tar.gz"))
    if r.returncode != 0 or not found:
        last = [ln for ln in (r.stderr or r.stdout or "").splitlines() if ln.strip()]
        raise SpecwoodError(f"pip could not download the {DIST}=={version} sdist: "
                            f"{last[-1].strip() if last else 'no output'}")
    return found[0]


def extract_llama_cpp(sdist: Path, dest: Path, log: Log) -> Path:
    """Extract only vendor/llama.cpp of the sdist into dest; returns the llama.cpp source root."""
    log(f"extracting vendor/llama.cpp from {sdist.name} ...")
    with tarfile.open(sdist, "r:gz") as tf:
        members = [m for m in tf.getmembers()
                   if "/vendor/llama.cpp/" in f"/{m.name}/" or m.name.rstrip("/").endswith("/vendor/llama.cpp")]
        if not members:
            raise SpecwoodError(f"{sdist.name} has no vendor/llama.cpp (not a llama-cpp-python sdist?)")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, members=members, **kwargs)  # type: ignore[arg-type]
    roots = sorted(dest.glob("*/vendor/llama.cpp"))
    if not roots or not (roots[0] / "CMakeLists.txt").is_file():
        raise SpecwoodError(f"{sdist.name}: vendor/llama.cpp has no CMakeLists.txt")
    if not any((roots[0] / d / "server").is_dir() for d in ("tools", "examples")):
        raise SpecwoodError(f"{sdist.name}: the vendored llama.cpp has no server sources (tools/server)")
    return roots[0]


_PROGRESS = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(cmd: Sequence[str], logf: TextIO, log: Log, what: str, timeout: float, env: dict[str, str]) -> None:
    """Run cmd with its output into logf; progress lines ([k/n] of ninja, [p%] of make) at most
    every 5% or 60 s on stderr; a one-line error with the last compiler/cmake message on failure."""
    logf.write(f"\n$ {' '.join(cmd)}\n")
    logf.flush()
    tail: list[str] = []
    last_pct, last_t = -100.0, 0.0
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            s = line.strip()
            if s:
                tail.append(s)
                del tail[:-40]
            m = _PROGRESS.match(s)
            if m:
                pct = 100.0 * int(m.group(1)) / max(1, int(m.group(2))) if m.group(1) else float(m.group(3))
                now = time.monotonic()
                if pct - last_pct >= 5 or now - last_t >= 60:
                    log(f"{what}: {pct:3.0f}% ({now - t0:.0f} s)")
                    last_pct, last_t = pct, now
            if time.monotonic() - t0 > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except BaseException:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        raise
    finally:
        logf.flush()
    if proc.returncode != 0:
        errs = [t for t in tail if re.search(r"error|Error|ERROR|not found|No such", t)]
        msg = (errs or tail or ["no output"])[-1]
        raise SpecwoodError(f"{what} failed (exit {proc.returncode}): {msg[:300]} (full log: {logf.name})")


def build(version: str | None = None, *, jobs: int = 2, force: bool = False, keep_build: bool = False,
          extra_cmake_flags: Sequence[str] = (), log: Log | None = _stderr) -> Path:
    """Build (or reuse) llama-server for `version` (default: the installed llama-cpp-python's);
    returns the binary's path. See the module docstring."""
    log = log or (lambda s: None)
    v = resolve_version(version)
    home = install_dir(v)
    with _lock(home.parent / f".{v}.lock", log):
        if not force and cached_binary(v):
            log(f"reusing {binary_path(v)}")
            return binary_path(v)
        tools = check_tools()
        work = home.parent / f".{v}.work"
        if work.exists():
            shutil.rmtree(work)
        (work / "sdist").mkdir(parents=True)
        log_path = work / "build.log"
        t0 = time.monotonic()
        ok = False
        try:
            sdist = download_sdist(v, work / "sdist", log)
            src = extract_llama_cpp(sdist, work / "src", log)
            bdir = work / "build"
            # as the README's CMAKE_ARGS for the extra: this CPU's sets by name (a native build
            # faults on AMX VMs); flags given with --cmake-flag come last and win
            flags = [*CMAKE_FLAGS, *llama_cpu_flags.cmake_flags(), *extra_cmake_flags]
            env = dict(os.environ)
            env.pop("CMAKE_ARGS", None)  # pip's convention, not cmake's: flags are given explicitly
            env.setdefault("CXX", tools["cxx"])
            env.setdefault("CC", tools["cc"])
            with open(log_path, "w", encoding="utf-8") as logf:
                log(f"configuring llama.cpp with cmake {tools['cmake_version']} ({tools['generator']}) ...")
                _run_logged([tools["cmake"], "-S", str(src), "-B", str(bdir), "-G", tools["generator"], *flags],
                            logf, log, "cmake configure", 1800, env)
                log(f"building target {TARGET} with {jobs} jobs (~10 minutes on 2 cores) ...")
                _run_logged([tools["cmake"], "--build", str(bdir), "--target", TARGET, "--config", "Release",
                             "-j", str(jobs)], logf, log, "build", BUILD_TIMEOUT_S, env)
            built = next((p for p in (bdir / "bin" / TARGET, bdir / TARGET) if p.is_file()), None)
            if built is None:
                found = sorted(bdir.rglob(TARGET))
                built = next((p for p in found if p.is_file() and os.access(p, os.X_OK)), None)
            if built is None:
                raise SpecwoodError(f"the build finished but produced no {TARGET} binary (log: {log_path})")
            staged = home.parent / f".{v}.staged"
            if staged.exists():
                shutil.rmtree(staged)
            (staged / "bin").mkdir(parents=True)
            shutil.copy2(built, staged / "bin" / TARGET)
            shutil.copy2(log_path, staged / "build.log")
            ver = _binary_version(staged / "bin" / TARGET)
            if not ver:
                raise SpecwoodError(f"the built {TARGET} does not run (`{TARGET} --version` failed); "
                                    f"log: {staged / 'build.log'}")
            info = {
                "llama_cpp_python": v,
                "sdist": sdist.name,
                "binary": str(binary_path(v)),
                "binary_version": ver,
                "cmake_flags": flags,
                "cmake": tools["cmake"], "cmake_version": tools["cmake_version"], "generator": tools["generator"],
                "cxx": env["CXX"], "cc": env["CC"], "jobs": jobs,
                "built_at": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
                "build_s": round(time.monotonic() - t0, 1),
            }
            (staged / "build.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            if home.exists():
                shutil.rmtree(home)
            staged.rename(home)
            ok = True
            log(f"built {binary_path(v)} in {info['build_s']:.0f} s ({ver})")
            return binary_path(v)
        finally:
            if ok and not keep_build:
                shutil.rmtree(work, ignore_errors=True)
            elif not ok:
                log(f"build directory kept for inspection: {work}")


def ensure(version: str | None = None, *, build_if_missing: bool = True, jobs: int = 2,
           log: Log | None = _stderr) -> Path:
    """The llama-server binary: the cached one, else built now (or a one-line error saying how)."""
    b = cached_binary(version)
    if b is not None:
        return b
    if not build_if_missing:
        v = version or installed_version() or "VERSION"
        raise SpecwoodError(f"no llama-server built for llama-cpp-python {v}; build it with "
                            f"`python -m specwood.bench.llama_server build` (~10 min)")
    return build(version, jobs=jobs, log=log)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specwood.bench.llama_server",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) llama-server")
    b.add_argument("--version", default=None, help="llama-cpp-python version (default: the installed one)")
    b.add_argument("--jobs", "-j", type=int, default=2)
    b.add_argument("--force", action="store_true", help="rebuild even when a binary is cached")
    b.add_argument("--keep-build", action="store_true", help="keep the sources and build tree")
    b.add_argument("--cmake-flag", action="append", default=[], help="extra cmake flag (repeatable)")
    p = sub.add_parser("path", help="print the binary's path (building it when missing, unless --no-build)")
    p.add_argument("--version", default=None)
    p.add_argument("--no-build", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            path = build(a.version, jobs=a.jobs, force=a.force, keep_build=a.keep_build,
                         extra_cmake_flags=a.cmake_flag)
        else:
            path = ensure(a.version, build_if_missing=not a.no_build)
    except SpecwoodError as e:
        print(f"llama-server build: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llama-server build: interrupted", file=sys.stderr)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
