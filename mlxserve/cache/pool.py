"""The hot tier: cached blocks in memory, ref-counted while in use, bounded in bytes.

Eviction takes the least recently used FREE LEAF: a free block none of whose
children is cached. A lookup walks a chain from its first block, so a child
whose parent is gone can never be found again; evicting leaves first means
that never happens, with no cascade to undo. It also makes storing a long
prefix into a small budget work: the parent of the block being stored gets a
child before room is made, so the chain being extended is never evicted to
make room for its own continuation (the tails of other prompts go instead,
and when nothing else can go the store is refused: the prefix is cached
shorter, never broken).

Blocks in use (ref count > 0) are never evicted; their ancestors are in use
too, since a lookup acquires whole chains from the root.

A pinned block (`pin`, for a fixed system prompt kept for good) holds one
reference per pin, so eviction passes it over like any block in use, and
`reset` keeps it. Pins take whole chains from the root too, so what stays is
always reachable.

Each parent's cached children are indexed (newest first) with the tokens they
hold, so a prompt that parts from a cached chain midway through a block can
still use that block's first tokens.

The LRU is a heap of (last use, key) over free leaves with lazy deletion: an
entry is skipped when the block is gone, in use, has a child or was used
again since it was pushed. A parent becomes a leaf when its last child goes,
and must rejoin the order at its own last use, which a plain OrderedDict
cannot do in O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from mlxserve.cache.layers import payload_nbytes


@dataclass(eq=False)
class Block:
    hash: bytes
    parent: bytes | None
    payload: Any
    nbytes: int
    num_tokens: int
    ref_count: int = 0
    pins: int = 0  # of ref_count, the references pins hold (kept across reset)
    children: int = 0  # cached children: a block with children is not evictable
    last_used: int = 0
    cached: bool = True  # False once out of the index (evicted, or reset while in use)
    # What it holds, for matching a prompt against part of it: its token ids
    # (a numpy array, fewer than a block's for a finished request's tail) and
    # the extra keys (media) of those tokens. None if not given.
    token_ids: Any = None
    extra: Any = None


class BlockPool:
    def __init__(self, budget_bytes: int, *, sizeof: Callable[[Any], int] = payload_nbytes, ghosts: int = 1 << 16):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self.budget = int(budget_bytes)
        self._sizeof = sizeof
        self._blocks: dict[bytes, Block] = {}
        # parent key (None: a prompt's first block) -> its cached children's keys, oldest first
        self._children_of: dict[bytes | None, dict[bytes, None]] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._clock = itertools.count(1)
        self.nbytes = 0  # every block's payload, in use or not, detached or not
        self._free_bytes = 0  # cached blocks with ref count 0
        self._in_use = 0
        self._detached = 0
        self._pinned: dict[bytes, Block] = {}  # blocks with pins > 0
        # Keys of recently evicted blocks, so a miss can be told apart from an
        # eviction (a budget too small) from a prompt never seen.
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()
        self._max_ghosts = ghosts
        # First-block content key -> fingerprint that stored it (for model mismatches),
        # and fingerprint -> layer specs (so any PrefixCache on this pool can plan restores).
        self._roots: OrderedDict[bytes, str] = OrderedDict()
        self.layouts: dict[str, tuple] = {}
        self.evictions = 0
        self.stored = 0
        self.refused: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> Block | None:
        """The cached block under `key`, without acquiring it."""
        return self._blocks.get(key)

    def blocks(self) -> list[Block]:
        return list(self._blocks.values())

    # ---- use ----

    def lookup(self, hashes) -> list[Block]:
        """The longest run of cached blocks from the start of `hashes`, each acquired."""
        found = []
        for key in hashes:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        now = next(self._clock)
        for block in found:
            self._acquire(block)
            block.last_used = now
        return found

    def release(self, blocks) -> None:
        """Give back blocks from `lookup`; free ones become evictable."""
        blocks = list(blocks)
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError("a block was released more often than it was acquired")
        # Tail first: the tail gets the older stamp, as in vLLM's free queue.
        for block in reversed(blocks):
            self._release_one(block)

    def pin(self, blocks) -> None:
        """Keep blocks (acquired by the caller, who still releases its own references) until
        `unpin`: each pin holds a reference of its own, so eviction never takes them."""
        blocks = list(blocks)
        if any(not b.cached for b in blocks):
            raise ValueError("only cached blocks can be pinned")
        for block in blocks:
            self._acquire(block)
            block.pins += 1
            self._pinned[block.hash] = block

    def unpin(self, blocks) -> None:
        """Give back the references `pin` took; the blocks are evictable again once free."""
        blocks = list(blocks)
        for block in blocks:
            if block.pins <= 0:
                raise ValueError("a block was unpinned more often than it was pinned")
        for block in reversed(blocks):
            block.pins -= 1
            if not block.pins:
                del self._pinned[block.hash]
            self._release_one(block)

    def _acquire(self, block: Block) -> None:
        if block.ref_count == 0:
            self._in_use += 1
            if block.cached:
                self._free_bytes -= block.nbytes
        block.ref_count += 1

    def _release_one(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        self._in_use -= 1
        if not block.cached:  # reset while in use: it goes now
            self.nbytes -= block.nbytes
            self._detached -= 1
            return
        self._free_bytes += block.nbytes
        block.last_used = next(self._clock)
        self._push(block)

    # ---- store ----

    def children(self, parent: bytes | None, limit: int) -> list[Block]:
        """The `limit` most recently stored or used cached children of `parent` (None: first blocks)."""
        keys = self._children_of.get(parent, {})
        return [self._blocks[k] for k in itertools.islice(reversed(keys), limit)]

    def touch_child(self, block: Block) -> None:
        """Mark a child as just used: `children` lists it first."""
        keys = self._children_of.get(block.parent)
        if keys is not None and block.hash in keys:
            keys[block.hash] = keys.pop(block.hash)

    def store(self, key: bytes, parent: bytes | None, payload, *, num_tokens: int = 0, nbytes: int | None = None,
              token_ids=None, extra=None):
        """Cache a block; returns it, or None when refused (the reason is counted).

        A no-op returning the cached block if `key` is present. Refused when
        the parent is not cached (the block could never be found: "orphan"),
        when the block alone exceeds the budget ("too_big"), or when no free
        block can go to make room ("no_room": the rest is in use, or is the
        chain this block extends).
        """
        block = self._blocks.get(key)
        if block is not None:
            return block
        up = None
        if parent is not None:
            up = self._blocks.get(parent)
            if up is None:
                return self._refuse("orphan")
        nbytes = self._sizeof(payload) if nbytes is None else int(nbytes)
        if nbytes > self.budget:
            return self._refuse("too_big")
        if self.nbytes - self._free_bytes + nbytes > self.budget:
            return self._refuse("no_room")  # evicting every free block would not do
        if up is not None:
            up.children += 1  # before making room: the chain we extend must stay
        if not self._make_room(nbytes):
            if up is not None:
                up.children -= 1
                self._push(up)
            return self._refuse("no_room")
        block = Block(key, parent, payload, nbytes, num_tokens, last_used=next(self._clock),
                      token_ids=token_ids, extra=extra)
        self._blocks[key] = block
        self._children_of.setdefault(parent, {})[key] = None
        self.nbytes += nbytes
        self._free_bytes += nbytes
        self._ghosts.pop(key, None)
        self.stored += 1
        self._push(block)
        return block

    def update(self, key: bytes, payload, *, nbytes: int | None = None) -> bool:
        """Replace a cached block's payload with a more complete one (same tokens).

        Safe while the block is in use: payloads are immutable and a holder
        that already read the old one keeps it.
        """
        block = self._blocks.get(key)
        if block is None:
            return False
        nbytes = self._sizeof(payload) if nbytes is None else int(nbytes)
        grow = nbytes - block.nbytes
        if grow > 0:
            if nbytes > self.budget:
                self._refuse("too_big")
                return False
            self._acquire(block)  # not evicted to make room for itself
            ok = self._make_room(grow)
            self._release_one(block)
            if not ok:
                self._refuse("no_room")
                return False
        block.payload = payload
        self.nbytes += grow
        if block.ref_count == 0:
            self._free_bytes += grow
        return True

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return None

    # ---- eviction ----

    def _evictable(self, block: Block) -> bool:
        return block.cached and block.ref_count == 0 and block.children == 0

    def _push(self, block: Block) -> None:
        if self._evictable(block):
            heapq.heappush(self._heap, (block.last_used, block.hash))
            if len(self._heap) > 2 * len(self._blocks) + 1024:
                self._compact()

    def _compact(self) -> None:
        self._heap = [(b.last_used, b.hash) for b in self._blocks.values() if self._evictable(b)]
        heapq.heapify(self._heap)

    def _make_room(self, nbytes: int) -> bool:
        while self.nbytes + nbytes > self.budget:
            if not self._heap:
                return False
            stamp, key = heapq.heappop(self._heap)
            block = self._blocks.get(key)
            if block is None or block.last_used != stamp or not self._evictable(block):
                continue  # stale entry
            self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        del self._blocks[block.hash]
        block.cached = False
        self.nbytes -= block.nbytes
        self._free_bytes -= block.nbytes
        self.evictions += 1
        self._ghosts[block.hash] = None
        if len(self._ghosts) > self._max_ghosts:
            self._ghosts.popitem(last=False)
        siblings = self._children_of[block.parent]
        del siblings[block.hash]
        if not siblings:
            del self._children_of[block.parent]
        up = self._blocks.get(block.parent) if block.parent is not None else None
        if up is not None:
            up.children -= 1
            self._push(up)  # a leaf now: it joins the order at its own last use

    def was_evicted(self, key: bytes) -> bool:
        return key in self._ghosts

    def reset(self) -> None:
        """Drop every free block. Blocks in use leave the index at once (no new
        request finds them) and their memory goes when they are released.
        Pinned blocks stay (whole chains from the root: they stay reachable)."""
        kept = self._pinned
        for block in list(self._blocks.values()):
            if block.hash in kept:
                continue
            block.cached = False
            if block.ref_count:
                self._detached += 1
            else:
                self.nbytes -= block.nbytes
        self._blocks = dict(kept)
        self._children_of.clear()
        for block in kept.values():
            block.children = 0
        for block in kept.values():
            self._children_of.setdefault(block.parent, {})[block.hash] = None
            if block.parent is not None:
                self._blocks[block.parent].children += 1
        self._heap.clear()  # every kept block is in use: none is evictable
        self._free_bytes = 0
        self._ghosts.clear()
        self._roots.clear()

    # ---- what other layers need to know about stored prompts ----

    def note_root(self, content_key: bytes, fingerprint: str) -> None:
        self._roots[content_key] = fingerprint
        self._roots.move_to_end(content_key)
        if len(self._roots) > self._max_ghosts:
            self._roots.popitem(last=False)

    def root_owner(self, content_key: bytes) -> str | None:
        return self._roots.get(content_key)

    def stats(self) -> dict:
        return {
            "blocks": len(self._blocks),
            "tokens": sum(b.num_tokens for b in self._blocks.values()),
            "bytes": self.nbytes,
            "budget": self.budget,
            "in_use_blocks": self._in_use,  # pinned blocks included
            "pinned_blocks": len(self._pinned),
            "pinned_tokens": sum(b.num_tokens for b in self._pinned.values()),
            "pinned_bytes": sum(b.nbytes for b in self._pinned.values()),
            "free_bytes": self._free_bytes,
            "detached_blocks": self._detached,
            "stored_blocks": self.stored,
            "evictions": self.evictions,
            "refused": dict(self.refused),
        }
