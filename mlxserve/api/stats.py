"""What the web dashboard shows: one JSON snapshot of the server, and rates between two.

Everything here is read from what the engine and the metrics already keep
(the Prometheus registry's counters, the engine's running/waiting counts, the
caches' own stats): nothing new is counted on the MLX thread.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time

from mlxserve.api.errors import first_line

# Prometheus sample name -> the snapshot's key under "requests".
_COUNTERS = {
    "mlxserve_prompt_tokens_total": "prompt_tokens",
    "mlxserve_cached_prompt_tokens_total": "cached_prompt_tokens",
    "mlxserve_generation_tokens_total": "generation_tokens",
}


def engine_part(engine) -> dict:
    """The engine's plain counters (ints, safe to read from any thread)."""
    return {"alive": engine.alive, "running": engine.num_running, "waiting": engine.num_waiting,
            "steps": engine.steps, "max_num_seqs": engine.config.max_num_seqs,
            "max_model_len": engine.max_model_len}


def requests_part(registry) -> dict:
    """Token counters, finished requests by reason, HTTP responses by status and the mean
    latencies, from one pass over the app's Prometheus registry."""
    out = {key: 0 for key in _COUNTERS.values()}
    finished: dict[str, int] = {}
    statuses: dict[str, int] = {}
    sums: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in _COUNTERS:
                out[_COUNTERS[s.name]] = int(s.value)
            elif s.name == "mlxserve_request_finished_total":
                finished[s.labels["reason"]] = int(s.value)
            elif s.name == "mlxserve_requests_total":
                status = s.labels["status"]
                statuses[status] = statuses.get(status, 0) + int(s.value)
            elif s.name.endswith(("_seconds_sum", "_seconds_count")):
                sums[s.name] = s.value
    # The first token's phases (queue, prefill, first step) add up to the TTFT: where it goes.
    for name, key in (("time_to_first_token", "mean_ttft_s"), ("queue", "mean_queue_s"),
                      ("prefill", "mean_prefill_s"), ("first_step", "mean_first_step_s"),
                      ("e2e_request_latency", "mean_e2e_s")):
        count = sums.get(f"mlxserve_{name}_seconds_count", 0)
        out[key] = sums[f"mlxserve_{name}_seconds_sum"] / count if count else None
    out["finished"] = finished
    out["http_statuses"] = statuses
    return out


def memory_part(caches: dict) -> dict:
    """MLX's allocator counters (no arrays are touched), the process's resident size, and
    the bytes each cache holds."""
    import mlx.core as mx

    rss = None
    try:  # Linux: the second field of statm is resident pages
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    pc, vc = caches.get("prefix_cache") or {}, caches.get("vision_cache") or {}
    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(), "process_rss_bytes": rss,
            "process_peak_rss_bytes": peak,
            "prefix_cache_bytes": pc.get("bytes"), "prefix_cache_budget_bytes": pc.get("budget"),
            "vision_cache_bytes": vc.get("bytes"), "vision_cache_budget_bytes": vc.get("budget_bytes"),
            "disk_tier_bytes": (pc.get("disk") or {}).get("bytes"),
            "disk_tier_budget_bytes": (pc.get("disk") or {}).get("budget")}


def snapshot(state, caches: dict | None) -> dict:
    """The dashboard's view of the server now. `caches` is the engine's cache stats, or None
    when they could not be read (the engine is dead, or still busy with the last read)."""
    engine = state.engine
    return {"time": time.time(), "model": state.model_name,
            "status": "shutting_down" if state.draining else "ok" if engine.alive else "dead",
            "reason": None if engine.alive else first_line(engine.fatal_error or "the engine is not running"),
            "engine": engine_part(engine), "requests": requests_part(state.metrics.registry),
            "caches": caches, "memory": memory_part(caches or {})}


def rates(prev: dict | None, cur: dict) -> dict:
    """Per-second rates and hit rates between two snapshots; a hit rate is None when nothing
    was looked up in between (a gap in the chart, not a drop to 0)."""
    if prev is None:
        return {"interval_s": None, "generation_tokens_per_s": None, "prompt_tokens_per_s": None,
                "prefix_hit_rate": None, "vision_hit_rate": None}
    dt = max(cur["time"] - prev["time"], 1e-6)
    a, b = prev["requests"], cur["requests"]
    out = {"interval_s": dt,
           "generation_tokens_per_s": (b["generation_tokens"] - a["generation_tokens"]) / dt,
           "prompt_tokens_per_s": (b["prompt_tokens"] - a["prompt_tokens"]) / dt}
    pa, pb = _cache(prev, "prefix_cache"), _cache(cur, "prefix_cache")
    queried = pb.get("queried_tokens", 0) - pa.get("queried_tokens", 0)
    out["prefix_hit_rate"] = (pb["hit_tokens"] - pa["hit_tokens"]) / queried if queried > 0 else None
    va, vb = _cache(prev, "vision_cache"), _cache(cur, "vision_cache")
    hits = vb.get("hits", 0) - va.get("hits", 0)
    looked = hits + vb.get("misses", 0) - va.get("misses", 0)
    out["vision_hit_rate"] = hits / looked if looked > 0 else None
    return out


def _cache(snap: dict, name: str) -> dict:
    return (snap.get("caches") or {}).get(name) or {}


class CacheReader:
    """Reads the engine's cache stats without ever waiting on the MLX thread for long.

    The stats are read between two engine steps; a step can take seconds on a
    CPU (a long prefill). A read still pending when `wait` runs out is left to
    finish, and the next tick takes its result (cancelling it would only throw
    away a read already queued); meanwhile the tick reuses the last stats it got.
    """

    def __init__(self, engine):
        self.engine = engine
        self.last: dict | None = None
        self.pending: asyncio.Future | None = None

    async def read(self, wait: float) -> dict | None:
        if self.pending is None:
            if not self.engine.alive:
                return None
            self.pending = asyncio.ensure_future(self.engine.cache_stats())
        done, _ = await asyncio.wait({self.pending}, timeout=wait)
        if done:
            future, self.pending = self.pending, None
            self.last = None if future.exception() is not None else future.result()
        return self.last

    def close(self) -> None:
        if self.pending is not None:  # retrieve its outcome when it comes, so none is left unread
            self.pending.add_done_callback(lambda f: f.cancelled() or f.exception())
