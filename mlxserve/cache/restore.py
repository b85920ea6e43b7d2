"""Rebuilding a prompt cache from cached blocks (see `layers.py` for what a block keeps).

A restore at token p reads, per layer, the blocks its spec names: every block
for full attention, the first and last blocks of a sliding window, those from
p's chunk start for chunked attention, the block ending at p for a recurrent state.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxserve.cache.chunked import restore_range
from mlxserve.cache.layers import (
    KV,
    Nested,
    Payload,
    PositionState,
    QuantizedKV,
    State,
)
from mlxserve.cache.stacks import quantized_rows
from mlxserve.cache.quantized import QuantizedKVCache as BatchableQuantizedKVCache


def _block_size(payloads):
    for p in payloads:
        for e in p:
            while isinstance(e, Nested):
                e = next((x for x in e.parts if isinstance(x, (KV, QuantizedKV))), None)
            if isinstance(e, KV):
                return e.keys.shape[2]
            if isinstance(e, QuantizedKV):
                return e.keys[0].shape[2]
    return None


def _gather(entries, block_size, ranges, pick):
    """Concatenate `pick(entry)` over token ranges, reading only the blocks they cover."""
    parts = []
    for start, end in ranges:
        for b in range(start // block_size, -(-end // block_size)):
            e = entries[b]
            if e is None:
                raise ValueError(f"block {b} lacks this layer's payload")
            lo = max(start, b * block_size) - b * block_size
            hi = min(end, (b + 1) * block_size) - b * block_size
            a = pick(e)
            # A whole block goes in as it is: a slice would add a graph node per
            # block and layer, and long prefixes have thousands of them.
            parts.append(a if (lo, hi) == (0, a.shape[2]) else a[..., lo:hi, :])
    # concatenate also makes fresh arrays: a restored cache must never alias a
    # block's arrays, whose Python objects `cache.keys[...] = x` would mutate.
    return mx.concatenate(parts, axis=2)


def _restore_layer(t, entries, num_tokens, block_size, state_end, full_from=0):
    if isinstance(t, PositionState):
        return PositionState()
    if isinstance(t, (KVCache, QuantizedKVCache)):
        kinds = {KV if isinstance(e, KV) else type(e) for e in entries}  # KV in the paged pool too
        if kinds == {KV}:
            c = KVCache()
            if full_from:  # for a paged batch row that takes the blocks before it by reference
                c.paged_from = full_from
            if full_from < num_tokens:
                c.keys = _gather(entries, block_size, [(full_from, num_tokens)], lambda e: e.keys)
                c.values = _gather(entries, block_size, [(full_from, num_tokens)], lambda e: e.values)
            else:  # every token by reference: no KV of its own
                c.keys, c.values = entries[0].keys[..., :0, :], entries[0].values[..., :0, :]
        elif kinds == {QuantizedKV}:
            c = BatchableQuantizedKVCache(group_size=entries[0].group_size, bits=entries[0].bits)
            r = [(0, num_tokens)]
            c.keys = tuple(_gather(entries, block_size, r, lambda e, i=i: e.keys[i]) for i in range(3))
            c.values = tuple(_gather(entries, block_size, r, lambda e, i=i: e.values[i]) for i in range(3))
        else:
            raise ValueError(f"attention layer payloads are {sorted(k.__name__ for k in kinds)}")
        c.offset = num_tokens
        return c
    if isinstance(t, RotatingKVCache):
        # Hold what the live cache would after its next in-place update: the
        # first `keep` tokens and the last `max_size - keep`, in temporal
        # order, with `_idx` at the end, so the next update trims or rotates
        # exactly as it would have.
        keep, max_size = t.keep, t.max_size
        if num_tokens <= max_size:
            ranges = [(0, num_tokens)]
        else:
            ranges = [(0, keep)] if keep else []
            ranges.append((num_tokens - (max_size - keep), num_tokens))
        for b in {b for s, e in ranges for b in range(s // block_size, -(-e // block_size))}:
            if entries[b] is not None and not isinstance(entries[b], KV):
                raise ValueError(f"sliding-window layer payload is {type(entries[b]).__name__}")
        c = RotatingKVCache(max_size=max_size, keep=keep)
        c.keys = _gather(entries, block_size, ranges, lambda e: e.keys)
        c.values = _gather(entries, block_size, ranges, lambda e: e.values)
        c.offset = num_tokens
        c._idx = c.keys.shape[2]
        return c
    if isinstance(t, ChunkedKVCache):
        # The tokens from the current chunk's start: all that later queries read, fewer
        # than chunk_size, so the model's next `maybe_trim_front` keeps them all. At a
        # chunk boundary that is none: the cache is empty but at offset num_tokens.
        start, end = restore_range(t.chunk_size, num_tokens)
        c = ChunkedKVCache(t.chunk_size)
        c.offset, c.start_position = num_tokens, start
        if start < end:
            for b in range(start // block_size, -(-end // block_size)):
                if not isinstance(entries[b], KV):
                    raise ValueError(f"chunked layer payload is {type(entries[b]).__name__}")
            c.keys = _gather(entries, block_size, [(start, end)], lambda e: e.keys)
            c.values = _gather(entries, block_size, [(start, end)], lambda e: e.values)
        return c
    if isinstance(t, ArraysCache):
        last = entries[-1]
        if num_tokens != state_end:
            raise ValueError(f"the recurrent state is kept at token {state_end}, not {num_tokens}")
        if not isinstance(last, State) or len(last.arrays) != len(t.cache):
            raise ValueError("the block ending the prefix lacks the recurrent state")
        c = ArraysCache(len(last.arrays))
        c.cache = [None if a is None else mx.array(a) for a in last.arrays]
        return c
    if isinstance(t, CacheList):
        subs = []
        for j, sub in enumerate(t.caches):
            sub_entries = [None if e is None else e.parts[j] for e in entries]
            subs.append(_restore_layer(sub, sub_entries, num_tokens, block_size, state_end))
        return CacheList(*subs)
    raise TypeError(f"{type(t).__name__} layers cannot be restored from blocks")


def restore_cache(model, payloads, num_tokens: int, *, block_size: int | None = None,
                  state_end: int | None = None, full_from: int = 0) -> list:
    """A fresh single-sequence prompt cache (as `make_prompt_cache(model)` gives)
    holding exactly the first `num_tokens` tokens' state.

    `payloads` are the payloads of the blocks covering those tokens, in
    order; sliding-window layers read only the blocks inside their window,
    recurrent layers only the last block, whose state sits at `state_end`
    (default: the blocks' end; a partial last block ends sooner), which must
    be `num_tokens`.
    The result works for a `generate_step`-style loop and for
    `BatchGenerator.insert(caches=[...])` (its `merge` takes these classes).
    `full_from`: the full-attention layers (mlx-lm's KVCache) hold only the tokens from there
    (`paged_from` says so), for a paged batch's row that takes the blocks before by reference
    (cache/paged_batch.py); such a cache serves nothing else.
    """
    template = make_prompt_cache(model)
    if num_tokens <= 0:
        return template
    block_size = block_size or _block_size(payloads)
    n_blocks = len(payloads) if block_size is None else -(-num_tokens // block_size)
    if len(payloads) < n_blocks:
        raise ValueError(f"{len(payloads)} blocks cannot hold {num_tokens} tokens")
    payloads = payloads[:n_blocks]
    if state_end is None:
        state_end = n_blocks * block_size if block_size else num_tokens
    for p in payloads:
        if len(p) != len(template):
            raise ValueError(f"payload has {len(p)} layers, the model {len(template)}")
    stacked = {} if full_from else _restore_stacked(payloads, num_tokens)
    return [
        stacked[i] if i in stacked else _restore_layer(t, [p[i] for p in payloads], num_tokens, block_size,
                                                       state_end, full_from if type(t) is KVCache else 0)
        for i, t in enumerate(template)
    ]


def _restore_stacked(payloads, num_tokens: int) -> dict:
    """{layer: cache} for the full-attention layers every payload has stacked alike (else {})."""
    first = payloads[0]
    if not all(isinstance(p, Payload) and p.stacks and p.stack_layers == first.stack_layers
               and len(p.stacks) == len(first.stacks) for p in payloads):
        return {}
    # One concatenation per stack for all layers, with KVCache.step free slots after
    # the tokens: each layer's cache is a plain slice of it, so the next update writes
    # in place of a slice (one contiguous copy) instead of growing the cache (a copy
    # from a strided view), and a restore costs little more than the floor.
    joined = []
    for stack in range(len(first.stacks)):
        parts = [p.stacks[stack].squeeze(1) for p in payloads]  # (rows, heads, tokens, dim)
        spare = KVCache.step - (sum(a.shape[2] for a in parts) - num_tokens)
        if spare > 0:
            rows, heads, _, dim = parts[0].shape
            parts.append(mx.zeros((rows, heads, spare, dim), parts[0].dtype))
        joined.append(mx.concatenate(parts, axis=2))
    n = len(first.stack_layers)
    out = {}
    for j, i in enumerate(first.stack_layers):
        like = first[i]
        if isinstance(like, KV):
            c = KVCache()
            c.keys, c.values = joined[0][j:j + 1], joined[0][n + j:n + j + 1]
        else:
            c = BatchableQuantizedKVCache(group_size=like.group_size, bits=like.bits)
            c.keys, c.values = quantized_rows(joined, n, j, like, lambda a, r: a[r:r + 1])[:2]
        c.offset = num_tokens
        out[i] = c
    return out
