"""The running batch's full-attention layers over the block pool (`paged.py`; issue 35).

- `PagedRows`: the block tables and token counts of one batch's rows (mlx-lm's BatchGenerator
  has two batches: prompts being prefilled, rows decoding), shared by that batch's paged layers.
  It holds one reference per (row, block); dropped rows and dropped batches give theirs back.
- `PagedBatchKVCache`: one paged layer of a batch, what the model and BatchGenerator see.
  BatchGenerator calls filter/extend/prepare/finalize on every layer and the model calls each
  layer's update_and_fetch, so the first layer to make a call applies it to the shared rows
  and the others follow it (`PagedRows.step`). Merging and extending concatenate tables,
  never KV; a row's new tokens are scattered into its blocks.
- `PagedKVCache`: a request's own full-attention layer as it joins the batch (`adopt`): the
  blocks of a prefix-cache hit it takes by reference, and mlx-lm's KVCache with the rest (a
  restored prefix past them, or the solo path's KV), which the batch's merge writes into blocks.

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

import functools
import sys
import weakref

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as _base
from mlx_lm.models.cache import KVCache, _BaseCache

from mlxserve.cache.paged import BlockRef, KVBlocks, PagedRow, TokenSlots, paged_layers, pooled_kv
from mlxserve.cache.paged_attention import (kernel_here, kernel_supports, paged_attention_gather,
                                            paged_attention_kernel)

KV_LAYOUTS = ("contiguous", "paged")


def adopt(pool: KVBlocks, cache: list, attached: list[BlockRef] = ()) -> list:
    """A request's cache list with its paged layers (mlx-lm's KVCache) as PagedKVCache, so that
    BatchGenerator's merge puts them in blocks. `attached`: blocks of a prefix-cache hit the row
    starts with, by reference; the KVCaches then hold only the tokens after them (a restore's
    `full_from`). A list adopted already comes back as it is."""
    if any(isinstance(c, PagedKVCache) for c in cache):
        return cache
    at = paged_layers_of(pool, cache)
    # A cache that holds pool blocks' very KV (the solo path's, which stored them or restored
    # them from there) takes those blocks too.
    group = _Request(list(attached) or pool.noted(cache))
    out = list(cache)
    for j, i in enumerate(at):
        out[i] = PagedKVCache(pool, j, group, cache[i])
    return out


def paged_layers_of(pool: KVBlocks, cache: list) -> list[int]:
    at = [i for i, c in enumerate(cache) if type(c) is KVCache]
    if at != pool.layers:
        raise ValueError(f"a cache with full-attention layers {at}, the pool's are {pool.layers}")
    return at


def merged_rows(pool: KVBlocks, caches: list) -> PagedRows:
    """The rows of a batch merged from `caches` (one PagedKVCache per request, of one layer):
    made at the first layer's merge, each row's table its attached blocks and new ones for the
    rest of its tokens; the other layers' merges share it."""
    key = tuple(id(c.group) for c in caches)
    layer = caches[0].layer
    entry = pool.merges.get(key)
    if entry is None or layer in entry[2]:
        tables, starts, lengths = [], [], []
        for c in caches:
            ids = [r.id for r in c.group.attached]
            pool.retain(ids)
            tables.append(ids + pool.allocate(-(-c.offset // pool.block_size) - len(ids)))
            starts.append(c.start)
            lengths.append(c.offset)
        rows = PagedRows(pool, tables, lengths)
        rows.writes = rows.positions(starts, lengths)
        entry = ([c.group for c in caches], rows, set())  # the groups keep their ids valid
        pool.merges[key] = entry
        while len(pool.merges) > 8:  # a merge that failed halfway is not waited for
            del pool.merges[next(iter(pool.merges))]
    entry[2].add(layer)
    if len(entry[2]) >= len(pool.layers):
        del pool.merges[key]
    return entry[1]


class _Request:
    """Ties the paged layers of one request together (PagedKVCache.group), with the blocks it
    takes by reference."""

    def __init__(self, attached: list[BlockRef]):
        self.attached = attached


class PagedRows:
    """Block tables and token counts of a batch's rows, shared by its paged layers."""

    def __init__(self, pool: KVBlocks, tables: list[list[int]], lengths: list[int]):
        self.pool = pool
        self.tables = tables  # one reference per (row, block); the list object is never replaced
        self.lengths = lengths
        self.before: list[int] | None = None  # the lengths before the last update
        self.padding: list[int] | None = None  # a right-padded prefill's, until finalize
        self.writes: TokenSlots | None = None  # where the last update's tokens go, for every layer
        self.ops = 0  # batch-wide calls applied
        self.last = None  # the last of them
        self._arrays = None
        self._offsets = {}
        self._row_refs = None
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

    def row_refs(self, row: int) -> list[BlockRef]:
        """BlockRefs of a row's blocks (one list for every layer's `extract` of it)."""
        if self._row_refs is None or self._row_refs[0] != (self.ops, row):
            self._row_refs = ((self.ops, row), [self.pool.ref(b) for b in self.tables[row]])
        return self._row_refs[1]

    def positions(self, starts, ends) -> TokenSlots:
        """Where tokens [starts[r], ends[r]) of every row go, row-major."""
        bs = self.pool.block_size
        ids, slots = [], []
        for table, a, b in zip(self.tables, starts, ends):
            pos = np.arange(a, b)
            ids.append(np.asarray(table, dtype=np.int64)[pos // bs] if len(pos) else pos)
            slots.append(pos % bs)
        return TokenSlots(np.concatenate(ids) if ids else np.zeros(0, np.int64),
                          np.concatenate(slots) if slots else np.zeros(0, np.int64), bs)

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
        self.fetched = None  # what update_and_fetch returned last
        self._stand_in = None  # (shape, keys, values): `_stand_ins`

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
        self.fetched = None  # the last step's lazy reads of the pool go before the write, which is then in place
        self.pool.write(self.layer, self.rows.writes, keys, values)
        self.fetched = self.keys_and_values() if self.pool.fetch_read else self._stand_ins()
        return self.fetched

    def _stand_ins(self):
        """What update_and_fetch returns where only the attention wrapper reads it (the pool's
        `fetch_read` off, as `fetch_is_read` measured for the model): arrays of the gathered KV's
        shape and dtype, never computed, made once per shape. The gathered KV would cost six
        graph nodes a layer every step that nothing evaluates."""
        table, _ = self.rows.arrays()
        k, v = self.pool.keys[self.layer], self.pool.values[self.layer]
        shape = (table.shape[0], k.shape[1], table.shape[1] * k.shape[2])
        if self._stand_in is None or self._stand_in[0] != shape:
            nan = float("nan")  # should anything read them after all, it shows
            self._stand_in = (shape, mx.full(shape + (k.shape[3],), nan, k.dtype),
                              mx.full(shape + (v.shape[3],), nan, v.dtype))
        return self._stand_in[1:]

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
        k, v = self.pool.keys[self.layer], self.pool.values[self.layer]
        # Decode steps through the kernel where there is one, prefill chunks through the gather path
        # (measured faster). The shapes are the batch's own: called per layer per step, this skips
        # paged_attention's checks.
        if queries.shape[2] == 1 and decode_kernel() and kernel_supports(queries, k):
            return paged_attention_kernel(queries, k, v, table, lengths, scale, window, decode_kernel())
        return paged_attention_gather(queries, k, v, table, lengths, scale, window)

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

    def extract(self, idx: int) -> PagedRow:
        """Row `idx` as the prefix cache reads a finished row: its blocks, by reference."""
        return PagedRow(self.pool, self.layer, self.rows.row_refs(idx), self.rows.lengths[idx])

    def pooled(self, row: int, start: int, end: int):
        """Tokens [start, end) of a row for a prefix-cache block (`paged.pooled_kv`)."""
        return pooled_kv(self.pool, self.layer, self.rows.tables[row], self.rows.lengths[row], start, end)

    @classmethod
    def merge(cls, caches):
        """A batch of requests' caches of one layer (PagedKVCache): their rows' tables, and the KV
        they bring (a restored prefix, the solo path's) written into the rows' blocks."""
        for c in caches:
            if not isinstance(c, PagedKVCache):
                raise TypeError(f"a paged batch merges PagedKVCache, not {type(c).__name__}")
        pool = caches[0].pool
        rows = merged_rows(pool, caches)
        layer = caches[0].layer
        if [c.offset for c in caches] != rows.lengths:
            raise ValueError("the layers of a request hold different token counts")
        full = [c for c in caches if c.offset > c.start]
        if full:
            keys = mx.concatenate([c.keys[..., c.start - c.keys_from:c.offset - c.keys_from, :] for c in full], axis=2)
            values = mx.concatenate([c.values[..., c.start - c.keys_from:c.offset - c.keys_from, :] for c in full],
                                    axis=2)
            pool.write(layer, rows.writes, keys, values)
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
    """A request's full-attention layer on its way into a paged batch: the blocks it takes by
    reference (its group's `attached`, tokens [0, start)) and mlx-lm's KVCache arrays (not
    copied) with tokens [start, offset); its merge makes a PagedBatchKVCache."""

    def __init__(self, pool: KVBlocks, layer: int, group: _Request, cache: KVCache):
        super().__init__()
        self.keys, self.values, self.offset = cache.keys, cache.values, cache.offset
        self.keys_from = getattr(cache, "paged_from", 0)  # a restore's full_from: its keys start there
        self.start = len(group.attached) * pool.block_size  # the tokens before are in attached blocks
        if not self.keys_from <= self.start <= self.offset:
            raise ValueError(f"a cache of {self.offset} tokens from {self.keys_from}, {self.start} attached")
        self.pool, self.layer, self.group = pool, layer, group

    @classmethod
    def merge(cls, caches):
        return PagedBatchKVCache.merge(caches)


# ---- attention ----

def attends_through_mlx_lm(model) -> bool:
    """Whether the model's layers are mlx-lm's, whose attention and masks the paged batch serves
    (mlx-lm's scaled_dot_product_attention, wrapped by `install`, and create_attention_mask, which
    asks the cache for its mask); mlx-vlm's language models (served as text too) make their own."""
    return not any(type(m).__module__.startswith("mlx_vlm") for _, m in model.named_modules())


# The kernel decode steps use (paged_attention's auto), looked up once: every layer asks every step.
decode_kernel = functools.cache(kernel_here)


_sdpa = _base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's, but a paged layer's attention reads its blocks (`paged_attention`)."""
    # Only on the KV update_and_fetch returned: a model that changed it first (plamo tiles its
    # heads, which pairs query head h with kv head h % kv_heads, not GQA's h // group) gets MLX's
    # attention on what it passes.
    if isinstance(cache, PagedBatchKVCache) and cache.fetched is not None and \
            keys is cache.fetched[0] and values is cache.fetched[1]:
        if sinks is None and cache.pageable(queries):
            ours, window = cache.window_of(mask)
            if ours:
                return cache.attention(queries, scale, window)
        if not cache.pool.fetch_read:  # stand-ins: MLX's attention reads the real KV
            keys, values = cache.keys_and_values()
    return _sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def fetch_is_read(model, block_size: int) -> bool:
    """Whether anything but the attention wrapper reads the KV a paged layer's update_and_fetch
    returns, for this model (Gemma's shared-KV layers, a model that reshapes KV before attention
    would). Measured, not assumed: two rows (prompts of 5 and 9 tokens, prefilled alone) merge into a
    paged batch, then a chunk of 2 tokens and two decode steps, once returning the gathered KV and
    once NaN stand-ins; other logits the second time say something else reads it. A model the
    check cannot run counts as read (the safe side)."""
    from mlx_lm.models.cache import make_prompt_cache

    runs = []
    try:
        layers = paged_layers(make_prompt_cache(model))
        for read in (True, False):
            pool = KVBlocks(block_size, layers, initial_blocks=4)
            pool.fetch_read = read
            rows = []
            for n in (5, 9):
                cache = make_prompt_cache(model)
                model(mx.array([list(range(1, n + 1))]), cache=cache)
                rows.append(adopt(pool, cache))
            batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
            logits = [model(mx.array([[3, 4], [5, 6]]), cache=batch)]
            for t in (7, 8):
                logits.append(model(mx.array([[t], [t + 1]]), cache=batch))
            mx.eval(logits)
            runs.append(logits)
    except Exception:  # noqa: BLE001 - any failure: keep the gathered KV
        return True
    return not all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(*runs))


def install() -> None:
    """Wrap mlx-lm's `scaled_dot_product_attention` in the modules that imported it (models
    import it by name) and in mlx_lm.models.base, which later imports copy. Idempotent."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(("mlx_lm.", "mlxserve.")) and \
                getattr(module, "scaled_dot_product_attention", None) is _sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
