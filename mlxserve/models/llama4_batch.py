"""Llama 4 (mlx-lm's `llama4`) over batched caches.

mlx-lm 0.32's Llama 4 forward pass assumes one sequence: it builds the
chunked layers' mask from `cache[0].start_position` and an integer offset,
and its no-RoPE layers scale queries by `mx.arange(offset + 1, ...)`. In a
batch every row has its own offset (an array), so both fail. With a batched
cache (per-row offsets) these versions take the chunked mask from the cache
(`BatchChunkedKVCache.make_mask`: each row's chunks sit at its own absolute
positions) and scale each row's queries at its own positions; a single
sequence still runs mlx-lm's code unchanged.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama4
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

_model_call = llama4.LlamaModel.__call__
_attention_call = llama4.Attention.__call__


def _chunked(idx: int) -> bool:
    return (idx + 1) % 4 != 0  # as mlx-lm's llama4: every fourth layer attends globally


def _batched(cache) -> bool:
    return cache is not None and isinstance(cache[0].offset, mx.array)


def model_call(self, inputs: mx.array, cache=None):
    if not _batched(cache):
        return _model_call(self, inputs, cache)
    h = self.embed_tokens(inputs)
    chunked = [c for i, c in enumerate(cache) if _chunked(i)]
    for c in chunked:
        c.maybe_trim_front()
    chunk_mask = chunked[0].make_mask(h.shape[1])  # the chunked layers' caches move in step
    global_mask = create_attention_mask(h, cache[3])
    for idx, (layer, c) in enumerate(zip(self.layers, cache)):
        h = layer(h, chunk_mask if _chunked(idx) else global_mask, cache=c)
    return self.norm(h)


def attention_call(self, x: mx.array, mask=None, cache=None):
    # Only the no-RoPE layers' temperature tuning reads the offset as a number;
    # RoPE itself takes per-row offsets.
    if cache is None or not isinstance(cache.offset, mx.array) or self.use_rope or not self.attn_temperature_tuning:
        return _attention_call(self, x, mask, cache)
    # mlx-lm's Attention.__call__ without RoPE (and so without QK norm), per-row positions.
    B, L, _ = x.shape
    queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    positions = cache.offset[:, None] + mx.arange(1, L + 1)[None]  # (B, L): mlx-lm's arange(offset + 1, ...)
    scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
    queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def install() -> None:
    """Let mlx-lm's Llama 4 run a BatchGenerator's batched caches."""
    llama4.LlamaModel.__call__ = model_call
    llama4.Attention.__call__ = attention_call
