"""`--kv-memory`: how many bytes of K/V the server holds, the cache rows and the prefix cache together
(specwood.engine.config.SchedulerConfig.kv_memory).

A size is bytes, or a number with a binary suffix (K, M, G, T; "2G" = 2 GiB). Without the flag the
budget is half the memory available (on the cache's device) once the models are loaded; 0 keeps
that default budget and turns prefix reuse off (`serve.app.server_config`).
"""
from __future__ import annotations

import os
import re

from specwood.engine.config import meminfo
from specwood.errors import SpecwoodError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "123", "512M", "2G", "1.5GiB", ...; a SpecwoodError naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if m is None:
        raise SpecwoodError(f"--kv-memory takes bytes or a size such as 512M or 4G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def machine_ram() -> int | None:
    """The machine's RAM in bytes (None where it cannot be read)."""
    total = meminfo("MemTotal")
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return total


def budget_warning(budget: int) -> str | None:
    """One line when `budget` exceeds the machine's RAM (the cache would never be allowed to fill it)."""
    ram = machine_ram()
    if ram is not None and budget > ram:
        return (f"--kv-memory {budget} bytes is more than this machine's {ram} bytes of RAM; the prefix cache may "
                "push the server into swap or an out-of-memory kill (give less)")
    return None
