"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""
from __future__ import annotations

from typing import Any

import specwood
from specwood.planner.build import get_plan


def engine_and_plan(method: str) -> tuple[Any, Any]:
    """The default pair and its stored plan for `method`, or exit saying how to make one."""
    engine = specwood.load()
    plan = get_plan(engine, method)
    if plan is None:
        raise SystemExit(f"no stored plan; run `specwood plan --method {method}` first")
    return engine, plan
