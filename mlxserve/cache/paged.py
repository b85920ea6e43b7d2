"""Paged KV for full-attention layers (issue 35): the running batch's keys and values live in a
block pool, and attention reads them through block tables (`paged_attention.py`).

- `KVBlocks`, one per runner: per paged layer, keys and values each `(capacity, kv_heads,
  block_size, head_dim)`. One block id names a token range's KV in every paged layer; ids come
  from a free list and are counted by reference. The pool grows (doubling) when it runs out.
- `PagedRows`: the block tables and token counts of one batch's rows (mlx-lm's BatchGenerator
  has two batches: prompts being prefilled, rows decoding), shared by that batch's paged layers.
  It holds one reference per (row, block); dropped rows and dropped batches give theirs back.
- `PagedBatchKVCache`: one paged layer of a batch, what the model and BatchGenerator see.
  BatchGenerator calls filter/extend/prepare/finalize on every layer and the model calls each
  layer's update_and_fetch, so the first layer to make a call applies it to the shared rows
  and the others follow it (`PagedRows.step`). Merging and extending concatenate tables,
  never KV; a row's new tokens are scattered into its blocks.
- `PagedKVCache`: a request's own full-attention layer as it joins the batch (`adopt`), still
  mlx-lm's KVCache (a restored prefix, or the solo path's KV); the batch's merge writes its KV
  into blocks.

Which layers: the model's top-level `KVCache` layers (full attention, unquantized). Sliding
window, chunked, recurrent, quantized and nested (CacheList) layers keep their classes in the
same batch.

Attention: models import mlx-lm's `scaled_dot_product_attention` from mlx_lm.models.base;
`install` wraps it where it was imported, so a paged layer's attention runs `paged_attention`
(its CUDA kernel for decode steps where CUDA is available, else the gather path; prefill chunks
through the gather path, measured faster). Any other reader of a paged layer's KV (a model that
passes one layer's KV on to later layers, one that calls MLX's SDPA itself, attention sinks, a
mask the model made itself) gets what a batch cache gives: `update_and_fetch` returns the rows'
KV gathered from their blocks into (B, kv_heads, blocks * block_size, head_dim) and `make_mask`
the mask for that layout. Both are lazy: nothing is computed unless read.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as _base
from mlx_lm.models.cache import KVCache, _BaseCache

from mlxserve.cache.paged_attention import paged_attention
from mlxserve.cache.payload import KV

KV_LAYOUTS = ("contiguous", "paged")


class KVBlocks:
    """The block pool of the paged layers of one model: arrays per layer, ids shared by all."""

    def __init__(self, block_size: int, initial_blocks: int = 64):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.initial_blocks = initial_blocks
        self.keys: list[mx.array | None] = []  # per paged layer, allocated at its first write
        self.values: list[mx.array | None] = []
        self.capacity = 0
        self.refs: list[int] = []  # per block id
        self.free: list[int] = []  # ids with no reference; the lowest is handed out first
        self.num_layers = 0
        # Merges in progress: BatchGenerator merges a batch's requests layer by layer, and the
        # paged layers of one merge must share one PagedRows (see PagedBatchKVCache.merge).
        self._merges: OrderedDict[tuple, tuple] = OrderedDict()

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

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self.free)

    def block_nbytes(self) -> int:
        """Bytes of one block id over every paged layer (keys and values)."""
        return sum(a.nbytes // a.shape[0] for arrays in (self.keys, self.values) for a in arrays
                   if a is not None and a.shape[0])

    def stats(self) -> dict:
        per_block = self.block_nbytes()
        return {"block_size": self.block_size, "capacity_blocks": self.capacity, "used_blocks": self.used_blocks,
                "used_bytes": self.used_blocks * per_block, "capacity_bytes": self.capacity * per_block}

    # ---- KV ----

    def write(self, layer: int, ids: mx.array, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter tokens into layer `layer`: keys, values (B, kv_heads, L, D); ids, slots (B * L,)
        row-major, where each token goes."""
        B, heads, L, dk = keys.shape
        dv = values.shape[3]
        if B * L == 0:
            return
        if self.keys[layer] is None:
            self.keys[layer] = mx.zeros((self.capacity, heads, self.block_size, dk), keys.dtype)
            self.values[layer] = mx.zeros((self.capacity, heads, self.block_size, dv), values.dtype)
        self.keys[layer][ids, :, slots] = keys.transpose(0, 2, 1, 3).reshape(B * L, heads, dk)
        self.values[layer][ids, :, slots] = values.transpose(0, 2, 1, 3).reshape(B * L, heads, dv)

    # ---- requests joining a batch ----

    def adopt(self, cache: list) -> list:
        """A request's cache list with its full-attention layers (mlx-lm's KVCache, exactly)
        as PagedKVCache, so that BatchGenerator's merge puts them in blocks."""
        group = _Request()
        out, layer = [], 0
        for c in cache:
            if type(c) is KVCache:
                out.append(PagedKVCache(self, layer, group, c))
                layer += 1
            else:
                out.append(c)
        if self.num_layers and layer != self.num_layers:
            raise ValueError(f"a cache with {layer} full-attention layers, the pool has {self.num_layers}")
        if not self.num_layers:
            self.num_layers = layer
            self.keys += [None] * layer
            self.values += [None] * layer
        return out

    def merged_rows(self, caches: list) -> PagedRows:
        """The rows of a batch merged from `caches` (one PagedKVCache per request, of one layer):
        made, with blocks for each request's KV, at the first layer's merge; the others' share it."""
        key = tuple(id(c.group) for c in caches)
        layer = caches[0].layer
        entry = self._merges.get(key)
        if entry is None or layer in entry[2]:
            lengths = [c.offset if c.keys is not None else 0 for c in caches]
            rows = PagedRows(self, [self.allocate(-(-n // self.block_size)) for n in lengths], lengths)
            rows.writes = rows.positions([0] * len(lengths), lengths)
            entry = ([c.group for c in caches], rows, set())  # the groups keep their ids valid
            self._merges[key] = entry
            while len(self._merges) > 8:  # a merge that failed halfway is not waited for
                self._merges.popitem(last=False)
        entry[2].add(layer)
        if len(entry[2]) >= self.num_layers:
            del self._merges[key]
        return entry[1]


class _Request:
    """Ties the paged layers of one request together (PagedKVCache.group)."""


class PagedRows:
    """Block tables and token counts of a batch's rows, shared by its paged layers."""

    def __init__(self, pool: KVBlocks, tables: list[list[int]], lengths: list[int]):
        self.pool = pool
        self.tables = tables  # one reference per (row, block); the list object is never replaced
        self.lengths = lengths
        self.before: list[int] | None = None  # the lengths before the last update
        self.padding: list[int] | None = None  # a right-padded prefill's, until finalize
        self.writes = None  # (block ids, slots) of the last update's tokens, for every layer
        self.ops = 0  # batch-wide calls applied
        self.last = None  # the last of them
        self._arrays = None
        self._offsets = {}
        self.masks: list = []  # (mask, window) made lately, for the attention wrapper
        weakref.finalize(self, pool.release_tables, tables)

    def __deepcopy__(self, memo):
        tables = [list(t) for t in self.tables]
        for t in tables:
            self.pool.retain(t)
        rows = PagedRows(self.pool, tables, list(self.lengths))
        rows.before, rows.padding, rows.writes = self.before, self.padding, self.writes
        rows.ops, rows.last = self.ops, self.last
        return rows

    def step(self, layer: PagedBatchKVCache, op, apply) -> None:
        """Apply a batch-wide call once: the first paged layer that makes it applies it, the
        others (each makes every call once, in the same order) follow."""
        if layer.ops == self.ops:
            apply()
            self.ops += 1
            self.last = op
            self._arrays = None
            self._offsets = {}
        elif layer.ops != self.ops - 1 or self.last != op:
            raise RuntimeError(f"paged layers out of step: {op!r} after {self.last!r}")
        layer.ops += 1

    def lengths_for(self, layer: PagedBatchKVCache) -> list[int]:
        """The token counts as `layer` sees them: before the update it has not made yet."""
        if layer.ops == self.ops - 1 and self.last is not None and self.last[0] == "update":
            return self.before
        return self.lengths

    def offsets(self, layer: PagedBatchKVCache) -> mx.array:
        lengths = self.lengths_for(layer)
        key = id(lengths)
        if key not in self._offsets:
            self._offsets[key] = mx.array(lengths, dtype=mx.int32)
        return self._offsets[key]

    def arrays(self) -> tuple[mx.array, mx.array]:
        """(block tables (B, max blocks) int32, padded with 0; token counts (B,) int32)."""
        if self._arrays is None:
            width = max((len(t) for t in self.tables), default=0) or 1
            table = np.zeros((len(self.tables), width), dtype=np.int32)
            for r, t in enumerate(self.tables):
                table[r, :len(t)] = t
            self._arrays = (mx.array(table), mx.array(self.lengths, dtype=mx.int32))
        return self._arrays

    def positions(self, starts, ends) -> tuple[mx.array, mx.array]:
        """(block ids, slots) of tokens [starts[r], ends[r]) of every row, row-major."""
        bs = self.pool.block_size
        ids, slots = [], []
        for table, a, b in zip(self.tables, starts, ends):
            pos = np.arange(a, b)
            ids.append(np.asarray(table, dtype=np.int32)[pos // bs] if len(pos) else pos)
            slots.append(pos % bs)
        ids = np.concatenate(ids) if ids else np.zeros(0)
        slots = np.concatenate(slots) if slots else np.zeros(0)
        return mx.array(ids.astype(np.int32)), mx.array(slots.astype(np.int32))

    # ---- batch-wide calls ----

    def update(self, n: int) -> None:
        """Room for n more tokens in every row; `writes` says where they go."""
        bs = self.pool.block_size
        for table, length in zip(self.tables, self.lengths):
            table += self.pool.allocate(-(-(length + n) // bs) - len(table))
        self.before = self.lengths
        self.lengths = [length + n for length in self.lengths]
        self.writes = self.positions(self.before, self.lengths)

    def _fit(self) -> None:
        """Give back the blocks past each row's tokens."""
        bs = self.pool.block_size
        for table, length in zip(self.tables, self.lengths):
            keep = -(-length // bs)
            if len(table) > keep:
                self.pool.release(table[keep:])
                del table[keep:]

    def prepare(self, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and any(left_padding):
            raise ValueError("paged rows take no left padding")  # mlx-lm 0.32 pads prompts on the right
        if right_padding is not None and max(right_padding) > 0:
            self.padding = list(right_padding)

    def finalize(self) -> None:
        """After a right-padded prefill: each row ends at its own last token (the padding's
        positions, written past it, are overwritten by its next tokens)."""
        if self.padding is not None:
            self.lengths = [n - p for n, p in zip(self.lengths, self.padding)]
            self.padding = None
            self._fit()

    def filter(self, keep) -> None:
        kept = set(keep)
        for r, table in enumerate(self.tables):
            if r not in kept:
                self.pool.release(table)
        self.tables[:] = [self.tables[r] for r in keep]
        self.lengths = [self.lengths[r] for r in keep]

    def extend(self, other: PagedRows) -> None:
        for table in other.tables:
            self.pool.retain(table)
            self.tables.append(list(table))
        self.lengths = self.lengths + other.lengths

    def trim(self, n: int) -> None:
        self.lengths = [max(0, length - n) for length in self.lengths]
        self._fit()


class PagedBatchKVCache(_BaseCache):
    """A paged full-attention layer of a batch (see the module doc)."""

    def __init__(self, rows: PagedRows, layer: int):
        self.rows = rows
        self.layer = layer
        self.ops = rows.ops  # batch-wide calls this layer has made (PagedRows.step)

    @property
    def pool(self) -> KVBlocks:
        return self.rows.pool

    @property
    def offset(self) -> mx.array:
        """Each row's token count (as mlx-lm's batch caches: an array, one per row)."""
        return self.rows.offsets(self)

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        self.rows.step(self, ("update", n), lambda: self.rows.update(n))
        ids, slots = self.rows.writes
        self.pool.write(self.layer, ids, slots, keys, values)
        return self.keys_and_values()

    def _gathered(self, pool: mx.array) -> mx.array:
        table, _ = self.rows.arrays()
        B, width = table.shape
        _, heads, bs, dim = pool.shape
        return pool[table].transpose(0, 2, 1, 3, 4).reshape(B, heads, width * bs, dim)

    def keys_and_values(self):
        """The rows' KV gathered from their blocks, (B, kv_heads, blocks * block_size, D): each
        row's tokens from position 0, garbage past its count (`make_mask` masks it)."""
        return self._gathered(self.pool.keys[self.layer]), self._gathered(self.pool.values[self.layer])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        """(B, 1, N, width): the mask over `keys_and_values()` after an update of N tokens (query
        i of a row holding n tokens sits at position n + i)."""
        lengths = self.rows.lengths_for(self)
        bs = self.pool.block_size
        width = max((-(-(n + N) // bs) for n in lengths), default=1) * bs
        queries = mx.array(lengths, dtype=mx.int32)[:, None] + mx.arange(N)[None]  # (B, N)
        keys = mx.arange(width)[None, None]
        mask = keys <= queries[..., None]
        if window_size is not None:
            mask = mask & (keys > queries[..., None] - window_size)
        mask = mask[:, None]
        self.rows.masks = [(mask, window_size)] + self.rows.masks[:3]
        return mask

    def window_of(self, mask):
        """(True, window) if `mask` is None, "causal" or one `make_mask` made lately; else (False, None)."""
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            return True, None
        for made, window in self.rows.masks:
            if made is mask:
                return True, window
        return False, None

    def attention(self, queries: mx.array, scale: float, window: int | None = None) -> mx.array:
        """Attention of the last update's queries over the rows' blocks."""
        table, lengths = self.rows.arrays()
        kernel = "auto" if queries.shape[2] == 1 else "gather"  # prefill chunks: the gather path (measured)
        return paged_attention(queries, self.pool.keys[self.layer], self.pool.values[self.layer], table, lengths,
                               scale, window=window, kernel=kernel)

    def pageable(self, queries) -> bool:
        """Whether `paged_attention` takes this layer (keys and values of one shape and the queries' dtype)."""
        k, v = self.pool.keys[self.layer], self.pool.values[self.layer]
        return k is not None and k.shape == v.shape and k.dtype == queries.dtype

    # ---- BatchGenerator's calls ----

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        self.rows.step(self, "prepare", lambda: self.rows.prepare(left_padding, lengths, right_padding))

    def finalize(self):
        self.rows.step(self, "finalize", self.rows.finalize)

    def filter(self, batch_indices):
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        self.rows.step(self, ("filter", tuple(keep)), lambda: self.rows.filter(keep))

    def extend(self, other: PagedBatchKVCache):
        self.rows.step(self, ("extend", id(other.rows)), lambda: self.rows.extend(other.rows))

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(n, min(self.rows.lengths_for(self), default=0))
        self.rows.step(self, ("trim", n), lambda: self.rows.trim(n))
        return n

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as mlx-lm's single-sequence cache (its KV copied out of the blocks)."""
        n = self.rows.lengths[idx]
        cache = KVCache()
        if n:
            ids = mx.array(self.rows.tables[idx], dtype=mx.int32)
            cache.keys, cache.values = (mx.contiguous(self._row(pool, ids)[..., :n, :])
                                        for pool in (self.pool.keys[self.layer], self.pool.values[self.layer]))
            cache.offset = n
        return cache

    @staticmethod
    def _row(pool: mx.array, ids: mx.array) -> mx.array:
        _, heads, bs, dim = pool.shape
        return pool[ids].transpose(1, 0, 2, 3).reshape(1, heads, len(ids) * bs, dim)

    def block_kv(self, row: int, start: int, end: int) -> KV | None:
        """Tokens [start, end) of a row (None if it holds fewer): views of the pool where they
        lie in one block, as a prefix-cache block's do (blocks of the same size)."""
        if end > self.rows.lengths[row] or start >= end:
            return None
        bs, table = self.pool.block_size, self.rows.tables[row]
        parts = []
        for pool in (self.pool.keys[self.layer], self.pool.values[self.layer]):
            runs = [pool[table[b]:table[b] + 1, :, max(start - b * bs, 0):min(end - b * bs, bs)]
                    for b in range(start // bs, (end - 1) // bs + 1)]
            parts.append(runs[0] if len(runs) == 1 else mx.concatenate(runs, axis=2))
        return KV(*parts)

    @classmethod
    def merge(cls, caches):
        """A batch of requests' caches of one layer (PagedKVCache): their rows' tables, and their
        KV (a restored prefix, the solo path's) written into the rows' blocks."""
        for c in caches:
            if not isinstance(c, PagedKVCache):
                raise TypeError(f"a paged batch merges PagedKVCache, not {type(c).__name__}")
        pool = caches[0].pool
        rows = pool.merged_rows(caches)
        layer = caches[0].layer
        full = [c for c in caches if c.keys is not None and c.offset]
        if full:
            if [c.offset if c.keys is not None else 0 for c in caches] != rows.lengths:
                raise ValueError("the layers of a request hold different token counts")
            keys = mx.concatenate([c.keys[..., :c.offset, :] for c in full], axis=2)
            values = mx.concatenate([c.values[..., :c.offset, :] for c in full], axis=2)
            ids, slots = rows.writes
            pool.write(layer, ids, slots, keys, values)
        return cls(rows, layer)

    def size(self):
        return max(self.rows.lengths, default=0)

    def empty(self):
        return not any(self.rows.lengths)

    @property
    def state(self):
        return [a for a in (self.pool.keys[self.layer], self.pool.values[self.layer]) if a is not None]

    @state.setter
    def state(self, v):
        raise ValueError("a paged cache's state lives in its pool")

    @property
    def nbytes(self):
        k, v = self.pool.keys[self.layer], self.pool.values[self.layer]
        if k is None:
            return 0
        blocks = len({b for t in self.rows.tables for b in t})
        return blocks * (k.nbytes + v.nbytes) // k.shape[0]


class PagedKVCache(KVCache):
    """A request's full-attention layer on its way into a paged batch: mlx-lm's KVCache (its
    arrays, not copied), whose merge makes a PagedBatchKVCache."""

    def __init__(self, pool: KVBlocks, layer: int, group: _Request, cache: KVCache):
        super().__init__()
        self.keys, self.values, self.offset = cache.keys, cache.values, cache.offset
        self.pool, self.layer, self.group = pool, layer, group

    @classmethod
    def merge(cls, caches):
        return PagedBatchKVCache.merge(caches)


# ---- attention ----

_sdpa = _base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's, but a paged layer's attention reads its blocks (`paged_attention`)."""
    if isinstance(cache, PagedBatchKVCache) and sinks is None and cache.pageable(queries):
        ours, window = cache.window_of(mask)
        if ours:
            return cache.attention(queries, scale, window)
    return _sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Wrap mlx-lm's `scaled_dot_product_attention` in the modules that imported it (models
    import it by name) and in mlx_lm.models.base, which later imports copy. Idempotent."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(("mlx_lm.", "mlxserve.")) and \
                getattr(module, "scaled_dot_product_attention", None) is _sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
