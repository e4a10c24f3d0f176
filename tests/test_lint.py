"""The linter and the type checker, configured in pyproject.toml ([tool.ruff], [tool.mypy]; see
docs/testing.md "Linters"), find nothing: ruff over the package, the tests and the benchmarks,
mypy over the package (the engine's seams with --strict's flags)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed; it comes with the test extra: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing() -> None:
    p = _run("ruff", "check", "--no-cache", "specwood", "tests", "benchmarks", timeout=300)
    assert p.returncode == 0, f"ruff check found problems:\n{p.stdout}{p.stderr}"


def test_mypy_finds_nothing() -> None:
    # the files and flags come from pyproject.toml; the cache (.mypy_cache, ignored by git) makes
    # a second run take seconds instead of a minute
    p = _run("mypy", timeout=900)
    assert p.returncode == 0, f"mypy found problems:\n{p.stdout}{p.stderr}"
    assert "Success: no issues found" in p.stdout, p.stdout
