"""Byte budgets: sizes written as 4GB / 512MB / 20%, and the memory MLX may use."""

from __future__ import annotations

import os
import re

import mlx.core as mx

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_limit() -> int:
    """Bytes MLX may use: Metal's recommended working set (or device memory), else physical RAM."""
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - older MLX, or a backend without it
        info = {}
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mlx_memory() -> dict:
    """MLX's allocator, in bytes: arrays alive now, the most alive at once since start, and freed
    buffers it keeps for reuse (not returned to the system, so part of the process's RSS too)."""
    return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
            "cache_bytes": mx.get_cache_memory()}


def parse_size(value) -> int:
    """Bytes from 4GB / 512MB / 1.5G / 1024 / 20% (of `memory_limit()`).

    Units are binary (GB = GiB = 2**30), as memory sizes usually are.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must be >= 0, not {value}")
        return int(value)
    text = str(value).strip().upper().replace(" ", "")
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 <= pct <= 100:
            raise ValueError(f"percentage must be within 0-100, not {value!r}")
        return int(memory_limit() * pct / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)(?:I?B)?", text)
    if not m:
        raise ValueError(f"cannot read {value!r} as a size (e.g. 4GB, 512MB, 20%)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])
