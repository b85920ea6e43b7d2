"""What a cached block holds: one entry per layer of the model's cache (the kinds are
described in `layers.py`), and what those entries weigh."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class KV(NamedTuple):
    keys: mx.array
    values: mx.array


class QuantizedKV(NamedTuple):
    keys: tuple
    values: tuple
    group_size: int
    bits: int


class State(NamedTuple):
    arrays: tuple


class Nested(NamedTuple):
    parts: tuple


class Payload(list):
    """A block's entries, one per layer.

    When the block's full-attention layers share a shape, their arrays live
    in `stacks` and their entries are views of them: a restore then
    concatenates a few arrays per block instead of a few per block and layer
    (on a GPU each is a kernel launch). Plain KV has one stack, all keys then
    all values, (2 * len(stack_layers), 1, kv_heads, block_size, head_dim);
    quantized KV two: the packed keys then values, and the keys' scales,
    keys' biases, values' scales, values' biases.
    """

    stacks: tuple = ()
    stack_layers: tuple = ()


def _entry_arrays(e) -> list:
    if e is None:
        return []
    if isinstance(e, KV):
        return [e.keys, e.values]
    if isinstance(e, QuantizedKV):
        return [*e.keys, *e.values]
    if isinstance(e, State):
        return [a for a in e.arrays if a is not None]
    if isinstance(e, Nested):
        return [a for p in e.parts for a in _entry_arrays(p)]
    raise TypeError(f"not a payload entry: {type(e).__name__}")


def payload_arrays(payload) -> list:
    return [a for e in payload for a in _entry_arrays(e)]


def payload_buffers(payload) -> list:
    """The arrays that hold a payload's memory: its stacks and its entries not stacked. A stacked
    layer's entry is a view of the stacks (no copy of its own), computed when first read."""
    stacked = set(getattr(payload, "stack_layers", ()))
    return [*getattr(payload, "stacks", ()),
            *(a for i, e in enumerate(payload) if i not in stacked for a in _entry_arrays(e))]


def payload_nbytes(payload) -> int:
    return sum(a.nbytes for a in payload_arrays(payload))
