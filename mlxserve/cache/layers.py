"""What a cached block keeps of each layer, and how blocks are cut from a prompt cache
(`restore.py` rebuilds a cache from them).

A block's payload is a list with one entry per layer of the model's cache:

- `KV(keys, values)`: the block's tokens of an attention layer, full,
  sliding-window or chunked, each (1, kv_heads, block_size, head_dim).
- `QuantizedKV(keys, values, group_size, bits)`: the same, from a quantized
  cache (`--kv-bits`; keys and values are (packed, scales, biases)).
- `State(arrays)`: a recurrent layer's state (`ArraysCache`) after the block's
  last token. A recurrent state exists only where the cache ended when the
  block was stored, so only such blocks have one, and restores of recurrent
  models happen at their ends.
- `Nested(parts)`: a `CacheList` layer, one entry (or None) per sub-cache:
  Falcon-H1 pairs a recurrent state with attention KV in one layer, and the
  KV must not be lost in the blocks where the state is absent.
- `None`: not available (a sliding-window or chunked cache no longer held
  those tokens, a recurrent layer mid-stream, an unsupported cache class).

A layer's spec says what a restore at token p reads: ("full",) every block;
("window", max_size, keep) the blocks of the first `keep` and the last
`max_size - keep` tokens; ("chunk", chunk_size) the blocks from p's chunk start
(`chunked.py`); ("state",) the block ending at p; ("list", specs);
("positions",) nothing: a `PositionState` entry is per-request state that the
runner sets, never part of a block.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxserve.cache import chunked
from mlxserve.cache.chunked import BatchChunkedKVCache
from mlxserve.cache.paged import PagedRow
from mlxserve.cache.paged_batch import PagedBatchKVCache
from mlxserve.cache.payload import KV, Nested, Payload, QuantizedKV, State, payload_nbytes  # noqa: F401 - re-exported
from mlxserve.cache.quantized import BatchQuantizedKVCache
from mlxserve.cache.quantized import QuantizedKVCache as BatchableQuantizedKVCache
from mlxserve.cache.stacks import copy, stacked


class PositionState(ArraysCache):
    """Per-sequence rotary position offset, carried in the cache list.

    Qwen-VL's M-RoPE gives an image's tokens fewer positions than tokens, so
    text after an image sits at `cache offset + delta` (delta <= 0). Keeping
    delta as the last entry of the model's cache list makes mlx-lm's
    BatchGenerator merge, filter and extend it with the batch's rows like any
    other state. Prefix blocks never store it: a request sets its own delta
    after its prompt (text-only requests keep 0).
    """

    def __init__(self, size: int = 1, left_padding=None):  # ArraysCache.merge calls cls(size)
        super().__init__(1, left_padding)
        # A 0 from the start, not None: ArraysCache reads its batch size from its arrays, else
        # from padding state that a padded prefill drops, else says 1. A batch of text-only rows
        # holding None then grew by one row, not by its own size, when image rows joined it
        # (or joined them), and every later step failed on mismatched shapes.
        self.cache[0] = mx.zeros((1, 1), mx.int32)

    def deltas(self, batch_size: int) -> mx.array:
        d = self.cache[0]
        return mx.zeros((batch_size, 1), mx.int32) if d is None else d

    def set(self, delta: int) -> None:
        self.cache[0] = mx.array([[delta]], mx.int32)

    def extract(self, idx):
        c = PositionState()
        c.cache = [None if a is None else a[idx : idx + 1] for a in self.cache]
        return c


# ---- specs ----


def layer_spec(c):
    """The restore-relevant kind of one cache object (single or batched); None if unsupported."""
    # Exact classes first: a subclass may keep state these functions don't know.
    if isinstance(c, PositionState):
        return ("positions",)
    if isinstance(c, (PagedBatchKVCache, PagedRow)):
        return ("full",)
    if isinstance(c, (ChunkedKVCache, BatchChunkedKVCache)):  # before BatchKVCache, its base
        return ("chunk", c.chunk_size)
    if isinstance(c, (KVCache, QuantizedKVCache, BatchKVCache)):
        return ("full",)
    if isinstance(c, RotatingKVCache):
        return ("window", c.max_size, c.keep)
    if isinstance(c, BatchRotatingKVCache):
        return ("window", c.max_size, 0)  # batched rotating caches have no `keep`
    if isinstance(c, ArraysCache):
        return ("state",)
    if isinstance(c, CacheList):
        subs = tuple(layer_spec(s) for s in c.caches)
        return None if None in subs else ("list", subs)
    return None  # a class blocks cannot hold


def layer_specs(cache_layers) -> tuple:
    return tuple(layer_spec(c) for c in cache_layers)


def model_specs(model) -> tuple:
    return layer_specs(make_prompt_cache(model))


def unsupported_layers(cache_layers) -> str | None:
    """Which layers of a prompt cache blocks cannot hold, in words (None if all can)."""
    layers = {}
    for i, c in enumerate(cache_layers):
        if layer_spec(c) is None:
            layers.setdefault(type(c).__name__, []).append(i)
    if not layers:
        return None
    return "; ".join(f"{name} in cache layers {', '.join(map(str, idx))}" for name, idx in layers.items())


KIND_NAMES = {"full": "full attention", "window": "sliding window", "chunk": "chunked attention",
              "state": "recurrent state"}


def describe_specs(specs) -> dict:
    """{kind: number of cache layers} over the leaf layers (CacheLists opened up)."""
    counts = {}
    for s in flat_specs(specs):
        if s is not None and s[0] != "positions":
            counts[s[0]] = counts.get(s[0], 0) + 1
    return counts


def spec_kinds(specs) -> set:
    """The layer kinds in `specs`, looking inside CacheLists."""
    kinds = set()
    for s in specs:
        if s is not None:
            kinds |= spec_kinds(s[1]) if s[0] == "list" else {s[0]}
    return kinds


def flat_specs(specs) -> list:
    """Leaf specs in order, CacheLists opened up."""
    out = []
    for s in specs:
        out += flat_specs(s[1]) if s is not None and s[0] == "list" else [s]
    return out


def flat_entries(payload, specs) -> list:
    """A payload's leaf entries, aligned with `flat_specs(specs)`."""
    out = []
    for e, s in zip(payload, specs):
        if s is not None and s[0] == "list":
            out += flat_entries(e.parts if e is not None else (None,) * len(s[1]), s[1])
        else:
            out.append(e)
    return out


def missing_leaves(payload, specs) -> list[int]:
    """Indices (into `flat_specs(specs)`) of the leaf layers a payload lacks."""
    return [
        i
        for i, (e, s) in enumerate(zip(flat_entries(payload, specs), flat_specs(specs)))
        if e is None and s[0] != "positions"
    ]


def needed_blocks(spec, num_tokens: int, block_size: int, state_end: int | None = None):
    """Block index ranges [a, b) that a restore at `num_tokens` reads for one layer.

    None when this layer cannot be restored there: a recurrent state exists
    only at the end of a block, a full one or, at `state_end`, a partial one
    (a prompt's or a finished sequence's tail).
    """
    nb = -(-num_tokens // block_size)
    kind = spec[0]
    if kind == "full":
        return [(0, nb)]
    if kind == "window":
        _, max_size, keep = spec
        if num_tokens <= max_size:
            return [(0, nb)]
        ranges = [((num_tokens - (max_size - keep)) // block_size, nb)]
        if keep:
            ranges.insert(0, (0, -(-keep // block_size)))
        return ranges
    if kind == "chunk":
        start, _ = chunked.restore_range(spec[1], num_tokens)
        return [(start // block_size, nb)] if start < num_tokens else []
    if kind == "state":
        return [(nb - 1, nb)] if num_tokens % block_size == 0 or num_tokens == state_end else None
    if kind == "positions":
        return []
    if kind == "list":
        ranges = []
        for sub in spec[1]:
            r = needed_blocks(sub, num_tokens, block_size, state_end)
            if r is None:
                return None
            ranges += r
        return ranges
    raise ValueError(f"unsupported layer spec {spec!r}")


def _merge_entry(old, new):
    if old is None:
        return new
    if isinstance(old, Nested) and isinstance(new, Nested):
        return Nested(tuple(_merge_entry(o, n) for o, n in zip(old.parts, new.parts)))
    return old


def _present(e) -> int:
    if isinstance(e, Nested):
        return sum(_present(p) for p in e.parts)
    return e is not None


def fill_missing(old, new):
    """`old` with its missing entries (CacheList parts too) taken from `new`; None if `new` adds nothing."""
    if len(old) != len(new):
        raise ValueError("payloads of different layer counts")
    merged = Payload(_merge_entry(o, n) for o, n in zip(old, new))
    if sum(map(_present, merged)) == sum(map(_present, old)):
        return None
    if isinstance(old, Payload):  # its full-attention entries are kept, so is their stack
        merged.stacks, merged.stack_layers = old.stacks, old.stack_layers
    return merged


# ---- blocks' KV ----


def _take(x: mx.array, rows: slice, runs, view: bool = False) -> mx.array:
    parts = [x[rows, :, a:b, :] for a, b in runs]
    if len(parts) == 1:
        return parts[0] if view else copy(parts[0])
    return mx.concatenate(parts, axis=2)


def _take_kv(c, rows: slice, runs):
    """The KV (QuantizedKV for a quantized cache) of token `runs` in `rows` of an attention cache."""
    view = _stackable(c)  # copied by stacks.stacked
    if isinstance(c, (QuantizedKVCache, BatchQuantizedKVCache)):  # keys, values: (packed, scales, biases)
        return QuantizedKV(tuple(_take(a, rows, runs, view) for a in c.keys),
                           tuple(_take(a, rows, runs, view) for a in c.values), c.group_size,
                           getattr(c, "kv_bits", None) or c.bits)  # ours hide `bits` when dequantizing
    return KV(_take(c.keys, rows, runs, view), _take(c.values, rows, runs, view))


def _stackable(c) -> bool:
    return type(c) in (KVCache, BatchKVCache, QuantizedKVCache, BatchableQuantizedKVCache, BatchQuantizedKVCache)


def _stacked(entries: list, cache_layers) -> Payload:
    return stacked(entries, [i for i, c in enumerate(cache_layers) if _stackable(c)])


# ---- single-sequence caches ----


def _rotating_runs(c: RotatingKVCache, start: int, end: int):
    """Buffer slices holding tokens [start, end) of a RotatingKVCache, in order; None if any is gone.

    The buffer keeps tokens [0, keep) at the front; the other slots are a
    ring written at `_idx`, so the oldest token still held sits at `_idx`.
    """
    offset, idx, keep = c.offset, c._idx, c.keep
    size = c.keys.shape[2]
    if idx >= offset:  # nothing overwritten yet: token j is in slot j
        return [(start, end)]
    runs = []
    if start < keep:
        runs.append((start, min(end, keep)))
        start = min(end, keep)
        if start == end:
            return runs
    ring = size - keep
    first = offset - ring  # oldest token in the ring
    if start < first:
        return None
    slot = keep + (start - first + idx - keep) % ring
    n = end - start
    if slot + n <= size:
        return runs + [(slot, slot + n)]
    return runs + [(slot, size), (keep, keep + n - (size - slot))]


def _offsets(cache_layers) -> list[int]:
    """Token counts of the layers that keep one (attention layers)."""
    out = []
    for c in cache_layers:
        if isinstance(c, CacheList):
            out += _offsets(c.caches)
        elif isinstance(c, (KVCache, QuantizedKVCache, RotatingKVCache, ChunkedKVCache, PagedRow)):
            out.append(c.offset)
    return out


def _extract_single(c, start, end, state_here):
    if isinstance(c, PositionState):
        return None
    if isinstance(c, PagedRow):  # a finished paged row: its blocks by reference
        return c.pooled(start, end)
    if isinstance(c, ChunkedKVCache):
        runs = chunked.single_runs(c, start, end)
        return None if runs is None else _take_kv(c, slice(0, 1), runs)
    if isinstance(c, (KVCache, RotatingKVCache, QuantizedKVCache)):
        if c.keys is None or end > c.offset:
            return None
        runs = _rotating_runs(c, start, end) if isinstance(c, RotatingKVCache) else [(start, end)]
        if runs is None:
            return None
        return _take_kv(c, slice(0, 1), runs)
    if isinstance(c, ArraysCache):
        if not state_here or c.cache[0] is None:
            return None
        return State(tuple(None if a is None else copy(a[0:1]) for a in c.cache))
    if isinstance(c, CacheList):
        parts = tuple(_extract_single(s, start, end, state_here) for s in c.caches)
        return None if all(p is None for p in parts) else Nested(parts)
    return None


def extract_blocks(cache_layers, start_token, block_size, n_blocks, *, num_tokens=None, layers=None,
                   states=True, pool=None):
    """Payloads of blocks [start_token + i*block_size, +block_size), i < n_blocks, of a single-sequence cache.

    `num_tokens` is how many tokens the cache holds (default: what its
    attention layers say); a recurrent state goes to the block ending there,
    and only if every attention layer agrees, so a state is never filed under
    the wrong position; `states=False` takes none. `layers` limits extraction
    to those layer indices. Entries that cannot be extracted are None. `pool`: a paged KV pool
    (cache/paged.py) that keeps the blocks' full-attention KV instead of payload arrays.
    """
    return _extract_span(cache_layers, _offsets(cache_layers), start_token, block_size, n_blocks,
                         num_tokens, layers, states, _extract_single, pool)


def _extract_span(cache_layers, offsets, start_token, block_size, n_blocks, num_tokens, layers, states,
                  extract_one, pool=None):
    """Per block, per layer: extract_one(layer cache, start, end, state_here).

    Each block gets a stack of its own: blocks sharing one stack copied once for all of them
    (fewer copy kernels) measured no faster on MLX CUDA and slower on the CPU, and would free
    their memory only together (`benchmarks/shared-stacks-20261125-2320.md`).
    """
    if num_tokens is None:
        num_tokens = offsets[0] if offsets else None
    state_ok = states and num_tokens is not None and all(o == num_tokens for o in offsets)
    blocks, starts = [], []
    for b in range(n_blocks):
        start = start_token + b * block_size
        end = start + block_size
        state_here = state_ok and end == num_tokens
        starts.append(start)
        blocks.append([
            extract_one(c, start, end, state_here) if layers is None or i in layers else None
            for i, c in enumerate(cache_layers)
        ])
    if pool is not None:
        blocks = pool.pool_blocks(blocks, starts, cache_layers)
    return [_stacked(entries, cache_layers) for entries in blocks]


# ---- one row of a batched cache ----


def _row_tokens(c, row) -> int:
    return c.offset[row].item()


def _positions(c) -> int:
    """How many positions a batched attention cache holds, in temporal order.

    Rows are right-aligned: prefill chunks are finalized so every row ends at
    the last position, and decode steps append to all rows. So token j of a
    row holding n tokens is at position `positions - n + j`. (`left_padding`
    is not a reliable start: `BatchRotatingKVCache.merge` of a cache that
    has already dropped tokens sets it as if the row began in the buffer.)
    """
    if isinstance(c, BatchRotatingKVCache) and c.rotated:
        return c.keys.shape[2]  # the ring is full; temporal order starts at `_idx`
    return c._idx


def _batch_runs(c, n, start, end):
    if c.keys is None or end > n:
        return None
    total = _positions(c)
    t0 = total - n + start
    if t0 < 0:
        return None  # dropped (sliding window) or never there
    t1 = t0 + end - start
    if not (isinstance(c, BatchRotatingKVCache) and c.rotated):
        return [(t0, t1)]
    # A rotated ring: position t is in slot (t + _idx) % size.
    size = total
    slot = (t0 + c._idx) % size
    if slot + (t1 - t0) <= size:
        return [(slot, slot + t1 - t0)]
    return [(slot, size), (0, t1 - t0 - (size - slot))]


def _batch_attention(cache_layers) -> list:
    out = []
    for c in cache_layers:
        if isinstance(c, CacheList):
            out += _batch_attention(c.caches)
        elif isinstance(c, (BatchKVCache, BatchRotatingKVCache, PagedBatchKVCache)):
            out.append(c)
    return out


def _batch_offsets(cache_layers, row, seen: dict) -> list[int]:
    """The row's token count in each batched attention layer, read in one host sync (one per
    layer made a store cost a sync per layer, each waiting for the step queued ahead); noted in
    `seen` for _extract_row."""
    caches = _batch_attention(cache_layers)
    if not caches:
        return []
    paged = {id(c): c.rows.lengths[row] for c in caches if isinstance(c, PagedBatchKVCache)}  # known on the host
    read = [c for c in caches if id(c) not in paged]
    read = dict(zip(map(id, read), mx.stack([c.offset[row] for c in read]).tolist())) if read else {}
    out = [paged[id(c)] if id(c) in paged else read[id(c)] for c in caches]
    for c, n in zip(caches, out):
        if not isinstance(c, BatchChunkedKVCache):  # chunked.row_runs keeps its own entries there
            seen[id(c)] = n
    return out


def _extract_row(c, row, start, end, state_here, seen):
    if isinstance(c, PagedBatchKVCache):  # a block's tokens are a pool block's: by reference
        return c.pooled(row, start, end)
    if isinstance(c, BatchChunkedKVCache):  # before BatchKVCache, its base
        runs = chunked.row_runs(c, row, start, end, seen)
        return None if runs is None else _take_kv(c, slice(row, row + 1), runs)
    if isinstance(c, (BatchKVCache, BatchRotatingKVCache)):
        if id(c) not in seen:  # one device sync per layer and call, not per block
            seen[id(c)] = _row_tokens(c, row)
        runs = _batch_runs(c, seen[id(c)], start, end)
        if runs is None:
            return None
        return _take_kv(c, slice(row, row + 1), runs)
    if isinstance(c, PositionState):
        return None
    if isinstance(c, ArraysCache):
        if not state_here or c.cache[0] is None:
            return None
        return State(tuple(None if a is None else copy(a[row : row + 1]) for a in c.cache))
    if isinstance(c, CacheList):
        parts = tuple(_extract_row(s, row, start, end, state_here, seen) for s in c.caches)
        return None if all(p is None for p in parts) else Nested(parts)
    return None


def extract_blocks_from_batch(
    batch_cache_layers, row, start_token, block_size, n_blocks, *, num_tokens=None, layers=None, states=True
):
    """`extract_blocks` for one row of a BatchGenerator's batched cache.

    Reads only the block's slots (mlx-lm's `extract()` copies the whole
    sequence). Call it between prefill chunks or decode steps, not between
    a `prepare` and its `finalize`.
    """
    seen = {}

    def extract_one(c, start, end, state_here):
        return _extract_row(c, row, start, end, state_here, seen)

    return _extract_span(batch_cache_layers, _batch_offsets(batch_cache_layers, row, seen), start_token,
                         block_size, n_blocks, num_tokens, layers, states, extract_one)


def oldest_window_token(cache_layers, row=None) -> int:
    """The oldest token every sliding-window and chunked layer still holds (0 if none has dropped any).

    Blocks before it cannot get those layers' payloads from this cache any more.
    """
    oldest = 0
    for c in cache_layers:
        if isinstance(c, CacheList):
            oldest = max(oldest, oldest_window_token(c.caches, row))
        elif isinstance(c, (ChunkedKVCache, BatchChunkedKVCache)):
            oldest = max(oldest, chunked.oldest_held(c, row))
        elif isinstance(c, RotatingKVCache) and c.keys is not None and c._idx < c.offset:
            oldest = max(oldest, c.offset - (c.keys.shape[2] - c.keep))
        elif isinstance(c, BatchRotatingKVCache) and c.keys is not None and row is not None:
            oldest = max(oldest, _row_tokens(c, row) - _positions(c))
    return oldest


# ---- restore ----
