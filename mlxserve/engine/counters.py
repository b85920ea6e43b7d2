"""The numbers /metrics reads of an engine: its caches' and speculative decoding's counters."""

from __future__ import annotations


def engine_counters(engine) -> dict:
    """The caches' and speculation's counters for /metrics: plain numbers, read from any thread
    (ints, as the MLX thread leaves them between two writes; the one dict copied has fixed keys).
    An engine process's are read by its receiving thread and pickled to the server."""
    out = {}
    pc = engine.prefix_cache
    if pc is not None:
        pool = pc.pool
        out["prefix_cache"] = {"queried_tokens": pc.queried_tokens, "hit_tokens": pc.hit_tokens,
                               "evictions": pool.evictions, "bytes": pool.nbytes, "budget": pool.budget,
                               "blocks": len(pool)}
        d = pc.disk
        if d is not None:
            out["disk"] = {"reads": d.reads, "writes": d.writes, "evictions": d.evictions, "faults": d.faults,
                           "abandoned": d.abandoned, "bytes": d.bytes, "written_bytes": d.written_bytes,
                           "write_wait_s": d.budget_writes.waited_s,
                           "dropped": dict(list(d.dropped.items())),  # fixed sets of keys
                           "skips": dict(list(d.skips.items()))}
    vc = engine.vision_cache
    if vc is not None:
        out["vision_cache"] = {"hits": vc.hits, "misses": vc.misses, "evictions": vc.evictions,
                               "releases": vc.releases, "bytes": vc.bytes, "entries": len(vc.entries)}
    if engine.speculation is not None:
        out["speculation"] = engine.speculation.stats
    return out
