"""Vision-embedding cache: an image's projected embeddings, by content, under a byte budget.

Keyed by (model fingerprint, processor settings, pixel hash): the same
picture sent as a URL, a data URL or a file is one entry, and the same
pixels under other resize settings are another. The first two are the
cache's `scope` (one model per engine); callers give the pixel hash. LRU: a hit moves an entry to
the back, and inserting evicts from the front until the budget holds. An
entry larger than the whole budget is not kept.
"""

from __future__ import annotations

from collections import OrderedDict


class VisionCache:
    def __init__(self, budget_bytes: int, scope: tuple = ()):
        self.budget = budget_bytes
        self.scope = scope
        self.entries: OrderedDict[tuple, object] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, content_hash: str):
        key = (*self.scope, content_hash)
        feats = self.entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return feats

    def contains(self, content_hash: str) -> bool:
        return (*self.scope, content_hash) in self.entries  # one dict lookup: safe from another thread

    def put(self, content_hash: str, feats) -> None:
        key = (*self.scope, content_hash)
        size = feats.nbytes
        if key in self.entries or size > self.budget:
            return
        while self.entries and self.bytes + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        self.entries[key] = feats
        self.bytes += size

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {
            "entries": len(self.entries),
            "bytes": self.bytes,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
