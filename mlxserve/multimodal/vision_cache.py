"""Vision-embedding cache: an image's projected embeddings, by content, under a byte budget.

Keyed by (model fingerprint, processor settings, pixel hash): the same
picture sent as a URL, a data URL or a file is one entry, and the same
pixels under other resize settings are another. The first two are the
cache's `scope` (one model per engine); callers give the pixel hash. LRU: a hit moves an entry to
the back, and inserting evicts from the front until the budget holds. An
entry larger than the whole budget is not kept.

Once the prefix cache holds an image's KV blocks, its embeddings are
`release`d: later turns restore the KV and never read them, so an image
costs its KV alone. The key stays known (`knows`), so callers still skip
the image's pixel array; if the tower is needed after all (the same picture
under another prefix, or its blocks evicted), the pixels are made then.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_RELEASED = 4096  # keys of released images remembered (a few hundred bytes each)


class VisionCache:
    def __init__(self, budget_bytes: int, scope: tuple = ()):
        self.budget = budget_bytes
        self.scope = scope
        self.entries: OrderedDict[tuple, object] = OrderedDict()
        self.released: OrderedDict[tuple, None] = OrderedDict()  # embeddings dropped: their KV is cached
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.releases = 0
        self.released_bytes = 0

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

    def knows(self, content_hash: str) -> bool:
        """Whether the image's embeddings are here or were released for its cached KV
        (dict lookups: safe from another thread)."""
        key = (*self.scope, content_hash)
        return key in self.entries or key in self.released

    def put(self, content_hash: str, feats) -> None:
        key = (*self.scope, content_hash)
        size = feats.nbytes
        if key in self.entries or size > self.budget:
            return
        while self.entries and self.bytes + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        self.released.pop(key, None)
        self.entries[key] = feats
        self.bytes += size

    def release(self, content_hash: str) -> None:
        """Drop an image's embeddings because the prefix cache now holds its KV."""
        key = (*self.scope, content_hash)
        feats = self.entries.pop(key, None)
        if feats is None:
            return
        self.bytes -= feats.nbytes
        self.releases += 1
        self.released_bytes += feats.nbytes
        self.released[key] = None
        while len(self.released) > MAX_RELEASED:
            self.released.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()
        self.released.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {
            "entries": len(self.entries),
            "bytes": self.bytes,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "released": self.releases,
            "released_bytes": self.released_bytes,
        }
