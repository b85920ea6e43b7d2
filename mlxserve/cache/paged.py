"""Paged KV (issue 35): the block pool of the running batch's full-attention layers, and what the
prefix cache keeps in it. The batch's caches over the pool are `paged_batch.py`'s.

- `KVBlocks`, one per runner: per paged layer, keys and values each `(capacity, kv_heads,
  block_size, head_dim)`, blocks of the prefix cache's size. One block id names a token range's
  KV in every paged layer; ids come from a free list and are counted by reference. The pool grows
  (doubling) when it runs out.
- `BlockRef`: one reference to a block for as long as a Python object holds it (the prefix
  cache's entries of the block, a hit's blocks on their way into the batch); given back when it
  is collected. One per block id at a time (`KVBlocks.ref`).
- `PooledKV`: a prefix-cache payload entry whose KV stays in the pool (tokens [0, n) of a
  block). It is a `payload.KV` to every reader, its keys and values slices of the pool, so
  restores, the disk tier and byte counts read it as any block. A batch row's blocks are stored
  this way without a copy (during prefill, and when the row finishes: `PagedRow`), and a hit on
  them puts them in its row's table by reference (`KVBlocks.attachable`).

Which layers are paged: the model's top-level `KVCache` layers (full attention, unquantized).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache

from mlxserve.cache.payload import KV


def paged_layers(cache: list) -> list[int]:
    """Indices of the layers of a prompt cache that a paged batch keeps in blocks."""
    return [i for i, c in enumerate(cache) if type(c) is KVCache]


class KVBlocks:
    """The block pool of one model's paged layers: arrays per layer, ids shared by all."""

    def __init__(self, block_size: int, layers: list[int], initial_blocks: int = 64):
        """layers: the prompt cache's indices of the paged layers (`paged_layers`)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.layers = list(layers)
        self.initial_blocks = initial_blocks
        self.keys: list[mx.array | None] = [None] * len(layers)  # per paged layer, made at its first write
        self.values: list[mx.array | None] = [None] * len(layers)
        self.capacity = 0
        self.peak_blocks = 0  # the most blocks in use at once
        self.refs: list[int] = []  # per block id
        self.free: list[int] = []  # ids with no reference; the lowest is handed out first
        self._block_refs = weakref.WeakValueDictionary()  # id -> its BlockRef, while one lives
        # Merges in progress (paged_batch.merged_rows): BatchGenerator merges a batch's requests
        # layer by layer, and the paged layers of one merge must share one PagedRows.
        self.merges = {}
        # Whether the batch's update_and_fetch must return its layers' KV gathered from the blocks
        # (something besides paged attention reads it), or may return stand-ins
        # (paged_batch.fetch_is_read measures it per model).
        self.fetch_read = True

    def __deepcopy__(self, memo):
        return self  # a copy of a batch (mlx-lm's split) shares the pool

    # ---- ids ----

    def allocate(self, n: int) -> list[int]:
        """n free block ids, one reference each."""
        if n <= 0:
            return []
        if n > len(self.free):
            self._grow(n - len(self.free))
        ids = self.free[-n:][::-1]
        del self.free[-n:]
        for i in ids:
            self.refs[i] = 1
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return ids

    def retain(self, ids) -> None:
        for i in ids:
            if self.refs[i] <= 0:
                raise ValueError(f"block {i} is free: it cannot be shared")
            self.refs[i] += 1

    def release(self, ids) -> None:
        for i in ids:
            if self.refs[i] <= 0:
                raise ValueError(f"block {i} was released more often than it was taken")
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free.append(i)

    def release_tables(self, tables) -> None:
        for table in tables:
            self.release(table)
        tables.clear()

    def ref(self, block_id: int) -> BlockRef:
        """The block's BlockRef (made, holding a reference, if none lives)."""
        ref = self._block_refs.get(block_id)
        if ref is None:
            ref = BlockRef(self, block_id)
            self._block_refs[block_id] = ref
        return ref

    def _grow(self, extra: int) -> None:
        new = max(2 * self.capacity, self.capacity + extra, self.initial_blocks)
        add = new - self.capacity
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                if a is not None:
                    arrays[i] = mx.concatenate([a, mx.zeros((add, *a.shape[1:]), a.dtype)])
        self.refs += [0] * add
        # The free list pops from its end: the new ids go below the free ones, lowest last.
        self.free[:0] = range(new - 1, self.capacity - 1, -1)
        self.capacity = new

    def shrink(self) -> int:
        """Give back memory a burst made the pool grow to, when no running row holds a block (the
        engine calls it while idle): the prefix cache's blocks move to the lowest free ids, and the
        capacity halves while its upper half is free, down to `initial_blocks`. One copy of the
        kept blocks per layer. Returns the blocks given back (0 if rows hold blocks or none are)."""
        used = self.used_blocks
        new = self.capacity
        while new // 2 >= max(used, self.initial_blocks, 1):
            new //= 2
        if new == self.capacity or self.merges:
            return 0
        held = [i for i, n in enumerate(self.refs) if n]
        if any(self.refs[i] != 1 or i not in self._block_refs for i in held):
            return 0  # a row's table (or a hit on its way into one) holds blocks: their ids must stay
        movers = [i for i in held if i >= new]
        targets = [i for i in range(new) if not self.refs[i]][:len(movers)]
        src, dst = mx.array(movers, dtype=mx.int32), mx.array(targets, dtype=mx.int32)
        for arrays in (self.keys, self.values):
            for j, a in enumerate(arrays):
                if a is not None:
                    if movers:
                        a[dst] = a[src]
                    arrays[j] = mx.contiguous(a[:new])  # a copy: a slice would keep the whole buffer
        for old, block in zip(movers, targets):
            ref = self._block_refs.pop(old)
            ref._ids[0] = block
            self._block_refs[block] = ref
            self.refs[block], self.refs[old] = 1, 0
        given = self.capacity - new
        self.refs = self.refs[:new]
        self.free = [i for i in range(new - 1, -1, -1) if not self.refs[i]]  # the lowest handed out first
        self.capacity = new
        mx.eval([a for arrays in (self.keys, self.values) for a in arrays if a is not None])
        return given

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self.free)

    def block_nbytes(self) -> int:
        """Bytes of one block id over every paged layer (keys and values)."""
        return sum(a.nbytes // a.shape[0] for arrays in (self.keys, self.values) for a in arrays
                   if a is not None and a.shape[0])

    def stats(self) -> dict:
        """Blocks in use (by running rows or the prefix cache), of them those the prefix cache's
        entries hold (a running row may use them too), the most in use at once, and the pool's
        capacity; bytes of each."""
        per_block, cached = self.block_nbytes(), len(self._block_refs)
        return {"block_size": self.block_size, "used_blocks": self.used_blocks, "cached_blocks": cached,
                "peak_blocks": self.peak_blocks, "capacity_blocks": self.capacity, "block_bytes": per_block,
                "used_bytes": self.used_blocks * per_block, "cached_bytes": cached * per_block,
                "peak_bytes": self.peak_blocks * per_block, "capacity_bytes": self.capacity * per_block}

    # ---- KV ----

    def write(self, layer: int, where: TokenSlots, keys: mx.array, values: mx.array) -> None:
        """Scatter tokens into paged layer `layer`: keys, values (B, kv_heads, L, D), token b * L + l
        going where `where` says."""
        B, heads, L, dk = keys.shape
        if B * L == 0:
            return
        if len(where) != B * L:
            raise ValueError(f"{len(where)} places for {B * L} tokens")
        if self.keys[layer] is None:
            self.keys[layer] = mx.zeros((self.capacity, heads, self.block_size, dk), keys.dtype)
            self.values[layer] = mx.zeros((self.capacity, heads, self.block_size, values.shape[3]), values.dtype)
        rows = where.rows(heads)
        for arrays, new in ((self.keys, keys), (self.values, values)):
            pool, d = arrays[layer], new.shape[3]
            # The pool seen as one row per (block, head, slot): one flat scatter, which MLX does in
            # place (the pool's only reference is dropped here), and 3x cheaper to build than
            # pool[ids, :, slots] = ... (a decode step makes it twice per layer).
            flat = pool.reshape(-1, d)
            flat[rows] = new.reshape(B * heads, d) if L == 1 else new.transpose(0, 2, 1, 3).reshape(-1, d)
            arrays[layer] = flat.reshape(pool.shape)

    # ---- the prefix cache's blocks ----

    def attachable(self, blocks, num_tokens: int) -> list[BlockRef]:
        """The pool blocks that hold the first whole blocks of a prefix-cache match (`blocks`,
        restoring `num_tokens`): its leading blocks whose paged layers' entries are this pool's
        whole blocks. A row takes them by reference; the rest (a block the hit ends inside, which
        the row will write on; blocks with KV of their own, from the solo path or the disk tier)
        it takes as copies."""
        bs, refs = self.block_size, []
        for k, block in enumerate(blocks):
            if (k + 1) * bs > num_tokens:
                break
            entries = [block.payload[i] for i in self.layers]
            first = entries[0] if entries else None
            if not (isinstance(first, PooledKV) and first.ref.pool is self and all(
                    isinstance(e, PooledKV) and e.ref is first.ref and e.layer == j and e.n == bs
                    for j, e in enumerate(entries))):
                break
            refs.append(first.ref)
        return refs

    def pool_blocks(self, blocks: list[list], starts: list[int], cache_layers: list | None) -> list[list]:
        """Blocks' payload entries extracted from a single sequence's cache (block i's tokens from
        `starts[i]`), or read back from the disk tier (no cache: None), their paged layers' KV
        written into pool blocks (PooledKV) instead of kept as arrays: one scatter per layer for
        them all. A whole block is noted on the cache (`note`), so that the sequence's row, if it
        joins a paged batch, takes it by reference: it holds this very KV. Blocks lacking a paged
        layer, or pooled already, stay as they are."""
        sizes = {b: self._tokens(entries) for b, entries in enumerate(blocks)}
        todo = [b for b, n in sizes.items() if 0 < n <= self.block_size]
        if not todo:
            return blocks
        sizes = [sizes[b] for b in todo]
        ids = self.allocate(len(todo))
        where = TokenSlots(np.array([i for i, n in zip(ids, sizes) for _ in range(n)]),
                           np.array([t for n in sizes for t in range(n)]), self.block_size)
        for j, i in enumerate(self.layers):
            self.write(j, where, mx.concatenate([blocks[b][i].keys for b in todo], axis=2),
                       mx.concatenate([blocks[b][i].values for b in todo], axis=2))
        out, noted = [list(entries) for entries in blocks], {}
        for b, block, n in zip(todo, ids, sizes):
            ref = self.ref(block)
            for j, i in enumerate(self.layers):
                out[b][i] = PooledKV(ref, j, n)
            if n == self.block_size and starts[b] % n == 0:
                noted[starts[b] // n] = ref
        self.release(ids)  # the BlockRefs' references are the blocks' ones
        if noted and cache_layers is not None:
            self.note(cache_layers, noted)
        return out

    def _tokens(self, entries: list) -> int:
        """Tokens of a block whose paged layers are all plain KV of one length (0 if not so)."""
        kv = [entries[i] for i in self.layers]
        if not kv or any(type(e) is not KV for e in kv):
            return 0
        n = kv[0].keys.shape[2]
        return n if all(e.keys.shape[2] == n == e.values.shape[2] for e in kv) else 0

    def note(self, cache_layers: list, refs: dict) -> None:
        """Note on a single sequence's cache that its whole blocks {index: BlockRef} hold the same
        KV as these pool blocks (it stored them, or restored them from there)."""
        owner = cache_layers[self.layers[0]]
        if type(owner) is KVCache:
            owner.__dict__.setdefault("pooled_blocks", {}).update(refs)

    def noted(self, cache_layers: list) -> list[BlockRef]:
        """The pool blocks noted on a cache (`note`) that hold its first whole blocks, in order."""
        owner = cache_layers[self.layers[0]] if self.layers else None
        blocks = getattr(owner, "pooled_blocks", None) or {}
        refs = []
        while len(refs) in blocks and (len(refs) + 1) * self.block_size <= owner.offset:
            refs.append(blocks[len(refs)])
        return refs


class TokenSlots:
    """Where tokens go in the pool: a block id and a slot per token (host arrays, token-major), and
    per kv-head count the rows of a layer's pool seen as (capacity * heads * block_size, D) that
    they fill, made once for every layer of that head count."""

    def __init__(self, ids: np.ndarray, slots: np.ndarray, block_size: int):
        self.ids, self.slots, self.block_size = ids.astype(np.int64), slots.astype(np.int64), block_size
        self._rows = {}

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, heads: int) -> mx.array:
        rows = self._rows.get(heads)
        if rows is None:
            flat = ((self.ids[:, None] * heads + np.arange(heads)) * self.block_size + self.slots[:, None]).reshape(-1)
            rows = self._rows[heads] = mx.array(flat.astype(np.int32 if flat.size == 0 or flat.max() < 2**31
                                                                    else np.int64))
        return rows


class BlockRef:
    """One reference to a pool block, given back when this object is collected. Its block may
    move (`KVBlocks.shrink`): readers take `id` when they read."""

    __slots__ = ("pool", "_ids", "__weakref__")

    def __init__(self, pool: KVBlocks, block_id: int):
        pool.retain([block_id])
        self.pool, self._ids = pool, [block_id]
        weakref.finalize(self, pool.release, self._ids)  # the list, so that a move carries over

    @property
    def id(self) -> int:
        return self._ids[0]


class PooledKV(KV):
    """A payload entry of a paged layer whose KV stays in the pool: tokens [0, n) of block
    `ref.id`. A `KV` to every reader: its keys and values are slices of the pool's arrays."""

    pooled = True  # stacks.stacked leaves it as it is

    def __new__(cls, ref: BlockRef, layer: int, n: int):
        entry = super().__new__(cls, None, None)
        entry.ref, entry.layer, entry.n = ref, layer, n
        return entry

    @property
    def keys(self) -> mx.array:
        b = self.ref.id
        return self.ref.pool.keys[self.layer][b:b + 1, :, :self.n]

    @property
    def values(self) -> mx.array:
        b = self.ref.id
        return self.ref.pool.values[self.layer][b:b + 1, :, :self.n]


def pooled_kv(pool: KVBlocks, layer: int, table: list[int], length: int, start: int, end: int) -> KV | None:
    """Tokens [start, end) of a row that holds `length` tokens in `table`'s blocks: by reference
    (PooledKV) where they start a block and fit in it, as the prefix cache's blocks of the pool's
    size do; else copied out. None if the row holds fewer."""
    if end > length or start >= end:
        return None
    bs = pool.block_size
    if start % bs == 0 and end - start <= bs:
        return PooledKV(pool.ref(table[start // bs]), layer, end - start)
    parts = []
    for arrays in (pool.keys, pool.values):
        runs = [arrays[layer][table[b]:table[b] + 1, :, max(start - b * bs, 0):min(end - b * bs, bs)]
                for b in range(start // bs, (end - 1) // bs + 1)]
        parts.append(mx.concatenate(runs, axis=2))
    return KV(*parts)


class PagedRow(_BaseCache):
    """One paged layer of a finished batch row, as the prefix cache reads it (mlx-lm hands a
    finished row's cache out through `extract`): its blocks by reference, no copy."""

    def __init__(self, pool: KVBlocks, layer: int, refs: list[BlockRef], length: int):
        self.pool, self.layer, self.offset = pool, layer, length
        self.refs = refs  # the row's blocks, held while it is read

    def pooled(self, start: int, end: int) -> KV | None:
        return pooled_kv(self.pool, self.layer, [r.id for r in self.refs], self.offset, start, end)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        return len(self.refs) * self.pool.block_nbytes() // max(len(self.pool.layers), 1)
