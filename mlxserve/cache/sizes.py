"""Byte budgets: sizes written as 4GB / 512MB / 20%, the memory MLX may use, and how much
KV cache a sequence of n tokens takes (`KVFootprint`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import mlx.core as mx

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_limit() -> int:
    """Bytes MLX may use: Metal's recommended working set (or device memory), a CUDA GPU's memory
    (`total_memory`: its arrays live there, not in the host's RAM), else physical RAM."""
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - older MLX, or a backend without it
        info = {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mlx_memory() -> dict:
    """MLX's allocator, in bytes: arrays alive now, the most alive at once since start, and freed
    buffers it keeps for reuse (not returned to the system, so part of the process's RSS too)."""
    return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
            "cache_bytes": mx.get_cache_memory()}


def device_memory_limit() -> int:
    """What MLX may use: the smaller of the device's memory (`memory_limit`) and the limit MLX's
    allocator sets itself (`mx.get_memory_limit`: on Metal 1.5x the recommended working set,
    past which allocations swap)."""
    limits = [memory_limit()]
    try:
        limits.append(int(mx.get_memory_limit()))
    except Exception:  # noqa: BLE001 - an MLX without it
        pass
    return min(x for x in limits if x > 0)


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


@dataclass(frozen=True)
class KVFootprint:
    """Bytes of one sequence's cache when it holds n tokens (its batch row's share)."""

    per_token: int  # full-attention layers: every token adds this
    capped: tuple = ()  # (bytes per token, most tokens held) of sliding-window and chunked layers
    fixed: int = 0  # recurrent states: the same at any length
    step: int = 256  # KV caches grow by this many tokens at a time (mlx-lm's KVCache.step)

    def bytes(self, tokens: int) -> int:
        held = -(-tokens // self.step) * self.step
        return self.per_token * held + sum(b * min(held, cap) for b, cap in self.capped) + self.fixed

    def most_tokens(self, budget: int, limit: int) -> int:
        """The most tokens (<= limit) whose cache fits in `budget` bytes; 0 if none does."""
        lo, hi = 0, limit
        while lo < hi:  # bytes() only grows with tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes(mid) <= budget else (lo, mid - 1)
        return lo


def kv_footprint(model, cache_layers, prefill_chunk: int) -> KVFootprint:
    """The footprint of `cache_layers`, the model's fresh cache (as the engine makes it: quantized
    with --kv-bits), measured on a one-token forward pass that is never evaluated: MLX builds the
    graph lazily and knows the arrays' shapes, so this computes nothing. Each KV array is
    (..., tokens allocated, features): its bytes per token are its bytes over tokens. A
    sliding-window layer holds its window plus a prefill chunk while the chunk passes through."""
    from mlxserve.cache.layers import layer_spec

    model(mx.array([[0]]), cache=cache_layers)
    per_token, capped, fixed, step = 0, [], 0, 256

    def add(c, spec):
        nonlocal per_token, fixed, step
        if spec is not None and spec[0] == "list":
            for sub, sub_spec in zip(c.caches, spec[1]):
                add(sub, sub_spec)
            return
        arrays = _arrays(c.state)
        if spec is None or spec[0] in ("state", "positions"):
            fixed += sum(a.nbytes for a in arrays)
            return
        rate = sum(a.nbytes // max(a.shape[-2], 1) for a in arrays if a.ndim >= 2)
        if spec[0] == "full":
            per_token += rate
            step = getattr(c, "step", step)
        else:  # ("window", max_size, keep) or ("chunk", chunk_size)
            capped.append((rate, spec[1] + prefill_chunk))

    for c in cache_layers:
        add(c, layer_spec(c))
    return KVFootprint(per_token, tuple(capped), fixed, step)


def _arrays(x) -> list:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _arrays(y)]
    return []
