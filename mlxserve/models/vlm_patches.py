"""Narrow fixes to mlx-vlm code the generic VLM adapter meets (models/vlm_generic.py), each
installed once when a family that needs it loads, and what this path refuses before any
weight is read (`check_supported`). Each patch says which mlx-vlm behaviour it mends and why.
"""

from __future__ import annotations

from mlxserve.models.vlm_spans import deepseek_vl2_spatial_crops


def _qwen3_5_row_caches() -> None:
    """Let mlx-vlm's Qwen3.5 split mlx-lm's batch caches into rows.

    Qwen3_5Model.__call__ runs a one-row batch (and a left-padded one) row by
    row, cutting each cache with `_extract_row_cache`, which knows mlx-vlm's
    cache classes only: an empty mlx-lm cache of a recurrent layer becomes an
    (mlx-vlm) KVCache, and the layer fails. Here mlx-lm's ArraysCache gives
    its row's arrays (and lengths), an empty batch KV cache an empty KVCache.
    """
    import mlx_vlm.models.qwen3_5.language as qwen3_5
    from mlx_lm.models.cache import ArraysCache, KVCache

    original = qwen3_5._extract_row_cache
    if getattr(original, "mlxserve", False):
        return

    def extract_row_cache(entry, row: int):
        if isinstance(entry, ArraysCache):
            out = ArraysCache(len(entry.cache))
            out.cache = [None if a is None else a[row : row + 1] for a in entry.cache]
            if entry.lengths is not None:
                out.lengths = entry.lengths[row : row + 1]
            return out
        if hasattr(entry, "left_padding") and hasattr(entry, "empty") and entry.empty():
            return KVCache()
        return original(entry, row)

    extract_row_cache.mlxserve = True
    qwen3_5._extract_row_cache = extract_row_cache


# Fixes for mlx-vlm code that meets mlx-lm's batch caches, by the module of the language model
# class (or of a class it derives from: Qwen3.5 MoE's, IndicOCR's).
def _zaya_cache_pairs() -> None:
    """Let mlx-vlm's ZAYA1 split mlx-lm's CacheList into its layer's KV and state caches.

    Its `_split_cache` knows mlx-vlm's CacheList class only; given mlx-lm's (which
    BatchGenerator merges and the prefix cache stores), it takes the pair for a KV cache,
    and the layer fails. Here mlx-lm's pair is split as mlx-vlm's is.
    """
    import mlx_vlm.models.zaya1_vl.language as zaya
    from mlx_lm.models.cache import CacheList

    original = zaya._split_cache
    if getattr(original, "mlxserve", False):
        return

    def split_cache(cache):
        return (cache[0], cache[1]) if isinstance(cache, CacheList) else original(cache)

    split_cache.mlxserve = True
    zaya._split_cache = split_cache


def _jina_embedding_rows() -> None:
    """Let mlx-vlm's Jina VLM read its embedding rows without copying its whole table.

    Its ExtendedEmbedding (the vocabulary's table and 128 added rows) concatenates the two
    tables on every call, then takes the ids' rows: a copy of the whole vocabulary's table for
    every prompt chunk and every decoded token (622 MB in bfloat16 for jina-vlm's 2048-wide
    table; a third of the tiny model's generated test). Here each id's row is read from the
    table that holds it: the same rows, bit for bit.
    """
    import mlx.core as mx
    import mlx_vlm.models.jina_vlm.language as jina

    original = jina.ExtendedEmbedding.__call__
    if getattr(original, "mlxserve", False):
        return

    def rows(self, x):
        vocab, added = self.embedding.shape[0], self.new_embedding.shape[0]
        base = self.embedding[mx.minimum(x, vocab - 1)]
        extra = self.new_embedding[mx.clip(x - vocab, 0, added - 1)]
        return mx.where((x < vocab)[..., None], base, extra)

    rows.mlxserve = True
    rows.original = original  # mlx-vlm's own (tests compare with it)
    jina.ExtendedEmbedding.__call__ = rows


def _jina_row_positions() -> None:
    """Give each row of a batch cache its own rotary positions in mlx-vlm's Jina VLM.

    Its RoPE takes a batch cache's per-row offsets as their largest (`offset.max().item()`) for
    every row: a row whose cache holds fewer tokens (a prompt that joined a running batch, a
    prefix-cache hit of another length) gets positions past its own, and its tokens change (the
    generated test: a batch of 3 gave other tokens than each prompt alone). Here each row's
    positions start at its own offset, as a one-row cache's do (the same float32 values).
    """
    import mlx.core as mx
    import mlx_vlm.models.jina_vlm.language as jina

    original = jina.RoPE.__call__
    if getattr(original, "mlxserve", False):
        return

    def rope(self, x, offset=0):
        if not isinstance(offset, mx.array) or offset.ndim == 0:
            return original(self, x, offset)
        positions = (offset[:, None] + mx.arange(x.shape[2])).astype(mx.float32)  # (rows, L)
        freqs = positions[..., None] * self._inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]  # (rows, 1, L, dims): every head
        half = self.dims // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * mx.cos(emb) + rotated * mx.sin(emb)).astype(x.dtype)

    rope.mlxserve = True
    rope.original = original
    jina.RoPE.__call__ = rope


def _jina_vlm() -> None:
    _jina_embedding_rows()
    _jina_row_positions()


def jina_crop_size(model, images) -> None:
    """Crop Jina VLM's images at the size its model's connector reads (models/vlm_layouts.py MODEL_FIXES).

    Its processor builds its ImageProcessor with the code's defaults (378 px crops of 14 px patches,
    pooled 2 x 2), while its connector computes a crop's patch grid and pooled rows from the config's
    vision_config (image_size, patch_size, pooling_h, pooling_w). Real configs give those defaults (or
    nothing), so their processor is left as it is; a config that gives other sizes (a tiny one: 140 px
    crops, 64 tokens an image instead of 424) gets crops its connector can read.
    """
    from mlx_vlm.models.jina_vlm.image_processor import ImageProcessor

    vc, proc = model.config.vision_config, images.proc._image_proc
    sizes = {"base_input_size": (vc.image_size, vc.image_size), "patch_size": vc.patch_size,
             "pooling_h": vc.pooling_h, "pooling_w": vc.pooling_w}
    if any(getattr(proc, k) != v for k, v in sizes.items()):
        images.proc._image_proc = ImageProcessor(**sizes)


def _deepseek_v3_embeddings() -> None:
    """Let mlx-vlm's DeepSeek-V3 language model (Mistral Large 3's) take the prompt's embeddings.

    Its LanguageModel.__call__ accepts `inputs_embeds` and drops it: the model embeds the ids
    again, so an image's rows never reach the layers (mlx-vlm's own generate too) and a Mistral
    Large 3 prompt gives the same tokens whatever its image (its generated test found it). Here
    given embeddings stand in for the embedding lookup of that one call; the rest of the pass
    (mask, pipeline ranks, layers, norm, head) is mlx-vlm's own. Without them it is unchanged.
    """
    import mlx_vlm.models.deepseek_v3.language as deepseek_v3

    original = deepseek_v3.LanguageModel.__call__
    if getattr(original, "mlxserve", False):
        return

    def call(self, inputs=None, cache=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            return original(self, inputs, cache, **kwargs)
        model, table = self.model, self.model.embed_tokens
        model.embed_tokens = lambda ids: inputs_embeds  # this pass's rows, in place of the ids' own
        try:
            return original(self, inputs, cache, **kwargs)
        finally:
            model.embed_tokens = table

    call.mlxserve = True
    call.original = original
    deepseek_v3.LanguageModel.__call__ = call


_PATCHES = {"mlx_vlm.models.qwen3_5.language": _qwen3_5_row_caches,
            "mlx_vlm.models.deepseek_v3.language": _deepseek_v3_embeddings,
            "mlx_vlm.models.deepseek_vl_v2.language": deepseek_vl2_spatial_crops,  # models/vlm_spans.py
            "mlx_vlm.models.jina_vlm.language": _jina_vlm,
            "mlx_vlm.models.zaya1_vl.language": _zaya_cache_pairs}


def _gemma4_mask_after_cache() -> None:
    """Keep Gemma 4's both-ways image attention in a prompt chunk that follows cached tokens.

    With use_bidirectional_attention='vision' (26B-A4B, 31B) mlx-vlm ORs "same
    image" (a run of media tokens in `mm_token_type_ids`) into the causal mask
    of a pass, but only when the mask is square, i.e. no tokens are cached
    before the chunk; otherwise it returns the causal mask as it is, so an image
    prefilled after cached tokens attends causally only. (mlx-vlm itself
    prefills such prompts in one pass.) Here the overlay covers the chunk's own
    keys, the last L columns of the mask over cache + chunk; the cached keys
    keep what the causal (and sliding-window) mask gives them. That is exact
    because mlxserve never splits an image between passes (Sequence.cut, and
    prefix-cache hits back off to an image's start), so the tokens of an image
    in the chunk have none of their image in the cache. A square mask (nothing
    cached) goes to mlx-vlm's own overlay.
    """
    import mlx.core as mx
    import mlx_vlm.models.gemma4.language as gemma4

    model = gemma4.Gemma4TextModel
    original = model._apply_blockwise_bidirectional_overlay
    if getattr(original, "mlxserve", False):
        return

    def overlay(self, base_mask, mm_token_type_ids):
        chunk, keys = base_mask.shape[-2:]
        if mm_token_type_ids is None or mm_token_type_ids.shape[1] != chunk or keys == chunk:
            return original(self, base_mask, mm_token_type_ids)
        blocks = self._block_sequence_ids_for_mask(mm_token_type_ids)
        same = (blocks[:, :, None] != -1) & (blocks[:, :, None] == blocks[:, None, :])
        cached = mx.zeros((*same.shape[:2], keys - chunk), dtype=mx.bool_)
        return base_mask | mx.concatenate([cached, same], axis=-1)[:, None]

    overlay.mlxserve = True
    overlay.original = original  # mlx-vlm's own (tests compare with it)
    model._apply_blockwise_bidirectional_overlay = overlay


# Families whose mask keeps an image's tokens attending both ways after cached tokens.
_BIDIRECTIONAL = {"gemma4": _gemma4_mask_after_cache}


def bidirectional_images(config: dict) -> bool:
    """Whether the model's image tokens attend to each other both ways (Gemma 4 26B-A4B / 31B)."""
    return (config.get("text_config") or config).get("use_bidirectional_attention") == "vision"


def check_supported(config: dict) -> None:
    """Refuse, before any weight is read, what this path cannot serve exactly."""
    from mlxserve.models.files import ModelLoadError

    if bidirectional_images(config) and config["model_type"] not in _BIDIRECTIONAL:
        raise ModelLoadError(
            f"{config['model_type']} with use_bidirectional_attention='vision' (attention both ways within each "
            "image) is not supported: mlx-vlm drops it whenever a prompt chunk follows cached tokens, and "
            "mlxserve mends that for Gemma 4 only")
