"""mlx-lm 0.32.2 model code patched where a batch, a cache hit or a chunked prefill would
change its tokens (found by tests/test_architectures.py), each as narrowly as it allows.

A BatchGenerator's batch has per-row offsets (an array: rows are right-aligned, shorter
prompts left-padded) and its caches make (B, 1, L, S) masks; a single sequence has an int
offset and an (L, S) mask. Each patch leaves a single sequence to mlx-lm's own code unless
the bug is in that code too (said where so). Llama 4's is in llama4_batch.py.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx_lm.models import afm7, gemma2, gpt_bigcode, phi3small, plamo3
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache

nemotron_nas = importlib.import_module("mlx_lm.models.nemotron-nas")


def _batched(cache) -> bool:
    return cache is not None and cache[0] is not None and isinstance(cache[0].offset, mx.array)


def _grouped(mask):
    """A batch's (B, 1, L, S) mask for scores grouped as (B, kv_heads, repeats, L, S): (B, 1, 1, L, S).
    As it came, it broadcast against (kv_heads, repeats): B = kv_heads gave each row another
    row's mask (silently other tokens), other B a broadcast error (HTTP 500)."""
    return mx.expand_dims(mask, 2) if isinstance(mask, mx.array) and mask.ndim == 4 else mask


# ---- Gemma 2: grouped-query scores with a batch's mask ----

_gemma2_attention = gemma2.Attention.__call__


def gemma2_attention(self, x, mask=None, cache=None):
    return _gemma2_attention(self, x, _grouped(mask) if self.repeats > 1 else mask, cache)


# ---- Phi-3-small: its block-sparse layers add the mask to grouped scores ----

_phi3small_block_sparse = phi3small.Attention._block_sparse_attention


def phi3small_block_sparse(self, queries, keys, values, scale, mask):
    # It adds the mask to the scores, but mlx-lm's masks are boolean now: adding True/False
    # (1/0) masked nothing, so inside a 64-token block a prompt's tokens saw later ones, alone
    # too, and a prompt's tokens depended on where prefill chunks (and cache hits) cut it.
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask = mx.where(mask, mx.array(0, queries.dtype), mx.array(-float("inf"), queries.dtype))
    return _phi3small_block_sparse(self, queries, keys, values, scale, _grouped(mask))


# ---- AFM 7: the KV-reuse layers place queries by the cache's width ----

_afm7_model_call = afm7.AFMModel.__call__


def afm7_model_call(self, inputs, cache=None):
    # The KV-reuse layers rotate queries at `keys.shape[2] - L`, which in a batch counts the
    # left padding: every shorter row's queries sat at wrong positions. Here each row's own.
    if not _batched(cache):
        return _afm7_model_call(self, inputs, cache)
    h = self.embedding(inputs)
    mask = create_attention_mask(h, cache[0])
    for layer, c in zip(self.layers, cache):
        h = layer(h, mask, cache=c)
    keys, values = cache[-1].keys_and_values()
    B, L, _ = h.shape
    positions = cache[-1].offset - L  # each row's first new position
    for layer in self.kv_reuse_layers:  # mlx-lm's KVReuseTransformerBlock, per-row positions
        attn = layer.self_attn
        queries = attn.q_proj(layer.input_layernorm(h)).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
        queries = attn.q_norm(attn.rope(queries, offset=positions))
        out = scaled_dot_product_attention(queries, keys, values, cache=None, scale=attn.scale, mask=mask)
        h = h + attn.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return self.output_norm(h)


# ---- GPT-BigCode: learned positions from an int offset ----

_bigcode_model_call = gpt_bigcode.GPTBigCodeModel.__call__


def bigcode_model_call(self, inputs, cache=None):
    # It made position ids with numpy from `cache[0].offset`, which a batch has per row: a
    # batch failed (HTTP 500). Each row's own positions, as mlx-lm's GPT-2 makes them; a left
    # pad's (masked out) would be negative.
    if not _batched(cache):
        return _bigcode_model_call(self, inputs, cache)
    h = self.wte(inputs)
    mask = create_attention_mask(h, cache[0])
    h = h + self.wpe(mx.maximum(cache[0].offset[:, None] + mx.arange(inputs.shape[1]), 0))
    for layer, c in zip(self.h, cache):
        h = layer(h, mask, cache=c)
    return self.ln_f(h)


# ---- Nemotron-NAS: caches for layers that keep no KV ----

def _keeps_kv(layer) -> bool:
    return isinstance(layer.self_attn, nemotron_nas.Attention)


def nemotron_nas_make_cache(self):
    # mlx-lm gave a cache to every layer with an attention block, a linear replacement too;
    # such a cache stays empty, and a batch's (or a cached block's) empty cache fails. Only
    # the layers that attend keep KV here.
    return [KVCache() for layer in self.layers if _keeps_kv(layer)]


def nemotron_nas_model_call(self, inputs, cache=None):
    h = self.embed_tokens(inputs)
    if cache is None:
        cache = [None] * sum(map(_keeps_kv, self.layers))
    mask = create_attention_mask(h, cache[0])
    caches = iter(cache)
    for layer in self.layers:
        h = layer(h, mask, cache=next(caches) if _keeps_kv(layer) else None)
    return self.norm(h)


# ---- PLaMo 3: a window mask one wider than its cache ----

_plamo3_make_cache = plamo3.Model.make_cache


def plamo3_make_cache(self):
    # Its sliding layers' mask lets a token see window_size + 1 keys, but their cache holds
    # window_size: a token at a prefill chunk's start (or after a cache hit) saw one key
    # fewer than the same token later in a chunk, so where a prompt was cut changed its
    # tokens. A cache as wide as the mask sees the same keys everywhere.
    return [RotatingKVCache(max_size=c.max_size + 1) if isinstance(c, RotatingKVCache) else c
            for c in _plamo3_make_cache(self)]


def install() -> None:
    """Patch mlx-lm's model classes (engine/runner.py installs this with the engine)."""
    gemma2.Attention.__call__ = gemma2_attention
    phi3small.Attention._block_sparse_attention = phi3small_block_sparse
    afm7.AFMModel.__call__ = afm7_model_call
    gpt_bigcode.GPTBigCodeModel.__call__ = bigcode_model_call
    nemotron_nas.Model.make_cache = nemotron_nas_make_cache
    nemotron_nas.NemotronNASModel.__call__ = nemotron_nas_model_call
    plamo3.Model.make_cache = plamo3_make_cache
