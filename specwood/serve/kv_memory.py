"""`--kv-memory`: how many bytes of finished requests' K/V the server keeps for reuse.

A size is bytes, or a number with a binary suffix (K, M, G, T; "2G" = 2 GiB). Without the flag the
budget is half the memory available (on the cache's device) once the model and the cache rows
are in place; 0 turns prefix reuse off.
"""
from __future__ import annotations

import os
import re

import torch

from specwood.errors import SpecwoodError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DEFAULT_SHARE = 0.5  # of the memory available at start-up


def parse_size(text: str) -> int:
    """Bytes from "123", "512M", "2G", "1.5GiB", ...; a SpecwoodError naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if m is None:
        raise SpecwoodError(f"--kv-memory takes bytes or a size such as 512M or 4G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_ram() -> int | None:
    """The machine's RAM in bytes (None where it cannot be read)."""
    total = _meminfo("MemTotal")
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return total


def default_kv_memory(device: torch.device | str = "cpu") -> int:
    """Half the memory available now on `device` (the entries live beside the cache rows; 1 GiB
    where it cannot be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_SHARE)
    available = _meminfo("MemAvailable")
    return int(available * DEFAULT_SHARE) if available is not None else 1 << 30


def budget_warning(budget: int) -> str | None:
    """One line when `budget` exceeds the machine's RAM (the cache would never be allowed to fill it)."""
    ram = machine_ram()
    if ram is not None and budget > ram:
        return (f"--kv-memory {budget} bytes is more than this machine's {ram} bytes of RAM; the prefix cache may "
                "push the server into swap or an out-of-memory kill (give less)")
    return None
