"""Blocks' full-attention KV as a few stacked arrays (`Payload.stacks`) instead of a few per layer:
a restore concatenates a few arrays per block instead of a few per block and layer, and on a GPU
each is a kernel launch."""

from __future__ import annotations

import mlx.core as mx

from mlxserve.cache.payload import KV, Payload, QuantizedKV


def copy(x: mx.array) -> mx.array:
    # A slice is a view that keeps the whole (step-allocated, much larger)
    # cache buffer alive; `contiguous` copies unless the buffer is already
    # about the slice's size.
    return mx.contiguous(x)


def _layout(e) -> tuple:
    """What must agree for entries to share stacks: kind, shapes, dtypes, quantization."""
    if isinstance(e, KV):
        return KV, e.keys.shape, e.values.shape, e.keys.dtype
    return (QuantizedKV, e.group_size, e.bits) + tuple((a.shape, a.dtype) for a in (*e.keys, *e.values))


def _keys_like_values(e) -> bool:
    """Keys and values of one shape: they can share a stack."""
    if isinstance(e, KV):
        return e.keys.shape == e.values.shape
    return all(k.shape == v.shape for k, v in zip(e.keys, e.values))


def _copied(e):
    if isinstance(e, KV):
        return KV(copy(e.keys), copy(e.values))
    return QuantizedKV(tuple(map(copy, e.keys)), tuple(map(copy, e.values)), e.group_size, e.bits)


def stacked(entries: list, stackable) -> Payload:
    """A Payload whose full-attention KV (views into the cache) at layers `stackable` is stacked
    copies (or, where those layers differ in layout, a copy each)."""
    payload = Payload(entries)
    # Not the entries whose KV stays in a paged pool (paged.PooledKV): no copy of them is made.
    full = [i for i in stackable if isinstance(entries[i], (KV, QuantizedKV)) and not getattr(entries[i], "pooled", False)]
    if len(full) < 2 or len({_layout(entries[i]) for i in full}) != 1 or not _keys_like_values(entries[full[0]]):
        for i in full:
            payload[i] = _copied(entries[i])
        return payload
    if isinstance(entries[full[0]], KV):
        stacks = (_stack([entries[i].keys for i in full] + [entries[i].values for i in full]),)
    else:
        packed = _stack([entries[i].keys[0] for i in full] + [entries[i].values[0] for i in full])
        meta = _stack([entries[i].keys[1] for i in full] + [entries[i].keys[2] for i in full]
                      + [entries[i].values[1] for i in full] + [entries[i].values[2] for i in full])
        stacks = (packed, meta)
    return views(payload, stacks, tuple(full), entries)


def _stack(arrays: list) -> mx.array:
    """`mx.stack(arrays)`, built as one concatenate and a reshape (the same layout): MLX's stack
    adds an expand_dims node per array, and a store's host time goes mostly to building and
    scheduling nodes (CPU: 600 -> 400 µs for a block of 28 layers)."""
    return mx.concatenate(arrays, axis=0).reshape(len(arrays), *arrays[0].shape)


def views(payload: Payload, stacks: tuple, layers: tuple, like) -> Payload:
    """`payload` with the entries of `layers` as views of `stacks`, each entry shaped as `like[i]`
    says (KV, or QuantizedKV with its group size and bits)."""
    n = len(layers)
    rows = [_rows(s) for s in stacks]
    for j, i in enumerate(layers):
        if isinstance(like[i], KV):
            payload[i] = KV(rows[0][j], rows[0][n + j])
        else:
            payload[i] = quantized_rows(rows, n, j, like[i], row=lambda r, k: r[k])
    payload.stacks, payload.stack_layers = stacks, layers
    return payload


def _rows(stack) -> list:
    """Every row of a stack, (1, ...) each, as views: one reshape and one split instead of a
    slice and a reshape per row (a store makes a few hundred; each is host time). Integer
    indexing (`stack[r]`) would be a gather in MLX, a copy that would hold every block's KV
    twice behind the pool's back."""
    return mx.split(stack.reshape(stack.shape[0], *stack.shape[2:]), stack.shape[0], axis=0)


def quantized_rows(stacks, n, j, like, row) -> QuantizedKV:
    """Layer j (of n stacked) of quantized stacks, as a QuantizedKV; `row(stack, r)` reads a row."""
    packed, meta = stacks
    keys = (row(packed, j), row(meta, j), row(meta, n + j))
    values = (row(packed, n + j), row(meta, 2 * n + j), row(meta, 3 * n + j))
    return QuantizedKV(keys, values, like.group_size, like.bits)
