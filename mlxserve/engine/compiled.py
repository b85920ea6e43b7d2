"""A compiled one-token decode step for the lone path (SoloDecoder).

On a GPU a lone decode step is bound by host work: Python walks the model and
builds a lazy graph of a few hundred ops each step, then MLX dispatches them.
`mx.compile` traces that graph once and replays it (fusing elementwise ops),
but only while every input keeps its shape. mlx-lm's KVCache does not: its
update returns the cache sliced to the tokens written, one longer each step,
and RoPE reads the position as a Python int. Here the step attends over the
KVCache's whole buffer instead, with a mask of the positions written, writes
the new token's KV at an array position (`mx.slice_update`) and gives RoPE
the position as an array: the shapes then change only when the buffer grows,
in geometric buckets, and each bucket is traced once.

The cache stays mlx-lm's KVCache throughout (its buffer may be longer than
its offset, which KVCache allows), so the prefix cache, the hand-over to the
batch and speculative decoding read it as before. Only models whose every
layer is plain full attention take it (Qwen2, Qwen3, Llama); the others keep
the eager step.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

# Model types whose attention does exactly: rope(offset=cache.offset), cache.update_and_fetch,
# sdpa(mask from create_attention_mask(h, cache[0])) — what _BufferView stands in for.
COMPILABLE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
BUCKET = 256  # buffer lengths are multiples of this


def model_type(model) -> str | None:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None)


def compilable(model, cache: list) -> bool:
    """Whether `model` with this cache (a plain KVCache per layer) can take the compiled step."""
    return model_type(model) in COMPILABLE_MODEL_TYPES and bool(cache) and all(type(c) is KVCache for c in cache)


def wanted(setting: str) -> bool:
    """--compile-decode on. Off by default: it measured slower on MLX CUDA (0.74x the eager step on
    an H200: a one-token attention under an array mask runs unfused there) and no faster on the
    CPU, where the step is bound by the matmuls; Metal, where that attention stays fused, is not
    measured yet (`mlxserve bench decode`)."""
    return setting == "on"


def _bucket(tokens: int) -> int:
    return max(BUCKET, -(-tokens // BUCKET) * BUCKET)


def capacity(tokens: int, limit: int | None = None) -> int:
    """The buffer length for `tokens` tokens: a quarter more, rounded up to BUCKET (about 20
    growths from 256 to 32k tokens), but no more than `limit` (the most the sequence will hold,
    what its KV budget counts), rounded up too. Each length is traced once per process."""
    want = _bucket(tokens + tokens // 4)
    return max(_bucket(tokens), min(want, _bucket(limit))) if limit is not None else want


class _BufferView:
    """One layer's KV while the step is traced: the whole buffer, written at an array position."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        # The positions the step attends to: those written before it and its own (n is 1).
        return (mx.arange(self.keys.shape[2]) < self.offset + n).reshape(1, 1, 1, -1)


class CompiledDecode:
    """The model's one-token forward pass over a KVCache list, compiled per buffer bucket."""

    def __init__(self, model):
        # A closure over the model alone: MLX drops the traces (which hold the weights) when
        # this compiled function goes, so nothing of it may refer back to it (an unloaded
        # model's weights must go with its engine).
        def step(token, offset, keys, values):
            views = [_BufferView(k, v, offset) for k, v in zip(keys, values)]
            logits = model(token[None], cache=views)[:, -1, :]
            return logits, [v.keys for v in views], [v.values for v in views]

        self._step = mx.compile(step)

    def __call__(self, token: mx.array, cache: list, limit: int | None = None) -> mx.array:
        """Logits (1, vocab) of the token after `token` (shape (1,)); writes its KV into `cache`
        (which holds at least one token: the prompt's prefill made its buffers). `limit`: the
        most tokens the cache will hold, which its buffers need not outgrow."""
        n = cache[0].offset
        length = cache[0].keys.shape[2]
        # Eager passes leave other lengths (a restored prefix, a chunk's prefill, a verify
        # pass growing the buffer by 256 from where it was): each would be a trace of its own.
        if n + 1 > length or length % BUCKET:
            _grow(cache, capacity(n + 1, limit))
        keys = [c.keys for c in cache]
        values = [c.values for c in cache]
        logits, keys, values = self._step(token, mx.array(n, dtype=mx.int32), keys, values)
        # The old buffers' last references go here, before the step runs: slice_update can
        # then write in place instead of copying the buffer.
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values, c.offset = k, v, n + 1
        return logits


def _grow(cache: list, length: int) -> None:
    """Make every layer's buffers `length` long, keeping the tokens written."""
    for c in cache:
        n = c.offset
        c.keys, c.values = (mx.concatenate([a[..., :n, :], mx.zeros((*a.shape[:2], length - n, a.shape[3]), a.dtype)],
                                           axis=2) for a in (c.keys, c.values))
