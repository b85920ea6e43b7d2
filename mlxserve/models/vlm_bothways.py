"""Families whose image rows attend each other both ways, or whose positions are not one index a
token, served by the generic adapter (models/vlm_generic.py) with what their Family says:

- `both_ways`: an image's span attends to itself both ways. The engine prefills such a span whole
  in one pass (VisionAdapter.whole_images: Sequence.cut, and prefix-cache hits back off to its
  start), so a pass's mask is causal except inside the spans it holds: `image_blocks` marks them
  per chunk, `both_ways_mask` builds the mask over the cached keys and the chunk's. Moondream's
  span is its BOS and the image's rows (a prefix mask over the first 1 + 729 positions in mlx-vlm),
  Falcon OCR's its image block less the end token (mlx-vlm's mask from the ids, its
  create_falcon_ocr_mask).
- `positions`: "golden" (Falcon OCR: one 1-D position for a whole image block, and 2-D (row,
  column) golden rotary positions `pos_hw` for its patches) and "xdrope" (HunyuanVL: the index,
  column, row and time of each token as four rotary axes). mlx-vlm computes them from the whole
  prompt and keeps what later passes need on the model object (Falcon's delta; HunyuanVL's
  positions, which it applies in a pass from position 0 only). Here, as for M-RoPE, the whole
  prompt's are computed once (`POSITIONS`), each pass is given its own, and a decoding row its
  offset plus its delta (`BlockTextModel`).
"""

from __future__ import annotations

import numpy as np

from mlxserve.models.vlm import ImageInput, TextModel
from mlxserve.models.vlm_standin import stand_in


# ---- both ways ----


def image_blocks(length: int, spans, tail: int):
    """(1, length) int32: for each token of a chunk, which of its image spans it attends both ways
    in (-1: none). `spans` are (chunk start, rows) pairs, each a whole span (the engine never cuts
    one); its last `tail` rows stay causal."""
    import mlx.core as mx

    blocks = np.full(length, -1, np.int32)
    for i, (start, rows) in enumerate(sorted(spans, key=lambda s: s[0])):
        blocks[start: start + rows.shape[0] - tail] = i
    return mx.array(blocks)[None]


def both_ways_mask(blocks, offset: int):
    """The attention mask of a chunk of len(blocks) tokens after `offset` cached ones: causal, and
    both ways between tokens of one block. (1, 1, L, offset + L), True where a query may attend."""
    import mlx.core as mx

    b = blocks[0]
    n = b.shape[0]
    keys = mx.arange(offset + n)[None] - offset
    causal = keys <= mx.arange(n)[:, None]
    same = (b[:, None] >= 0) & (b[:, None] == b[None, :])
    same = mx.concatenate([mx.zeros((n, offset), mx.bool_), same], axis=1)
    return (causal | same)[None, None]


class BlockTextModel(TextModel):
    """TextModel for these families: a chunk's `image_blocks` become its mask, and positions go to
    the language model in its own layout."""

    def __init__(self, language_model, mrope: bool, layout: str | None):
        super().__init__(language_model, mrope)
        self.layout = layout  # None, "golden" or "xdrope"
        self.axes = 4 if layout == "xdrope" else 3
        if layout == "xdrope":
            check_xdrope(language_model)
            hunyuan_positions_any_offset()

    def _offset(self, cache) -> int:
        return 0 if cache is None else cache[self.offset_index].offset

    def _decode_positions(self, inputs, cache):
        import mlx.core as mx

        pos = super()._decode_positions(inputs, cache)
        return mx.broadcast_to(pos[:1], (self.axes, *pos.shape[1:]))

    def _position_kwargs(self, inputs, cache, positions) -> dict:
        import mlx.core as mx

        if self.layout == "xdrope":  # (batch, axes, seq), the processor's [index, column, row, time]
            if positions is None:
                positions = self._decode_positions(inputs, cache)
            return {"position_ids": positions.transpose(1, 0, 2)}
        if positions is None:  # decoding, or text: its language model adds the row's delta to its offset
            return {} if cache is None else {"rope_deltas": cache[-1].deltas(inputs.shape[0])}
        # A chunk of a prompt with images: Falcon OCR's language model reads a pass's positions out of
        # the whole prompt's at the cache offset, so the chunk's are placed there.
        offset = self._offset(cache)
        pos = mx.concatenate([mx.zeros((1, offset), mx.int32), positions[0].astype(mx.int32)], axis=1)
        hw = mx.concatenate([mx.zeros((1, offset, 2)), positions[1:].transpose(1, 2, 0)], axis=1)
        return {"position_ids": pos, "pos_hw": hw}

    def __call__(self, inputs, cache=None, positions=None, inputs_embeds=None, image_blocks=None, **extras):
        if image_blocks is not None:
            extras["mask"] = both_ways_mask(image_blocks, self._offset(cache))
        if self.layout is None:
            return super().__call__(inputs, cache, positions, inputs_embeds, **extras)
        extras |= self._position_kwargs(inputs, cache, positions)
        layer_cache = cache[: self.n_layers] if cache is not None else None
        return self.lm(inputs, inputs_embeds=inputs_embeds, cache=layer_cache, **extras).logits


# ---- images ----


class MoondreamImages:
    """Moondream 2 / 3: mlx-vlm's Moondream3Processor's crops (the whole image at crop_size, then
    a grid of overlapping crops when the image is large enough), and its prompt, which puts BOS
    and then the image as (crop_size / patch)^2 copies of id 0, a text token, first. Here the span
    is BOS and the image's rows, as stand-in tokens (models/vlm_standin.py: text holding id 0 is
    text, and text holding the stand-in is refused); the tower is given BOS and the run of 0 (its
    merge reads neither id: BOS's row is its embedding, the others the image's features)."""

    expands = False

    def __init__(self, config: dict, pc: dict, tokenizer):
        vc = config.get("vision_config") or {}
        own = pc.get("processor_config", {})  # processor_config.json, read over config.json's as mlx-vlm does
        self.crop = own.get("crop_size", vc.get("crop_size", 378))
        self.max_crops = own.get("max_crops", vc.get("max_crops", 12))
        self.margin = own.get("overlap_margin", vc.get("overlap_margin", 4))
        self.rows = (self.crop // vc.get("patch_size", 14)) ** 2
        self.tokenizer = tokenizer
        self.stand_in = stand_in(tokenizer)
        # The processor's BOS: the tokenizer's, else "<|endoftext|>" (which it sets as BOS), else 0.
        bos = tokenizer.bos_token_id
        self.bos = (bos if bos is not None else tokenizer.convert_tokens_to_ids("<|endoftext|>")) or 0

    def _layout(self, image):
        """The crop grid create_crops picks for this image, or None (the whole image alone)."""
        from mlx_vlm.models.moondream3.image_crops import select_crop_grid

        if self.max_crops <= 1:
            return None
        grid = select_crop_grid(image.width, image.height, self.crop, self.max_crops, self.margin)
        return grid if grid is not None and grid[0] * grid[1] + 1 <= self.max_crops else None

    def layout(self, image) -> ImageInput:
        grid = self._layout(image)
        n = 1 + self.rows
        return ImageInput(None, None, n, ids=(self.stand_in,) * n, tower_ids=(self.bos,) + (0,) * self.rows,
                          extras={"num_crops": 1 + (grid[0] * grid[1] if grid else 0), "crop_layout": grid})

    def pixels(self, image) -> np.ndarray:
        from mlx_vlm.models.moondream3.image_crops import create_crops

        crops, _ = create_crops(image.convert("RGB"), self.crop, self.max_crops, self.margin)
        return np.stack(crops).astype(np.float32)

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {"num_crops": [inp.extras["num_crops"]], "crop_layouts": [inp.extras["crop_layout"]]}


class FalconImages:
    """Falcon OCR: no tower, the patches projected; mlx-vlm's preprocess_image (resized into 64 to
    1024 px, sides multiples of the patch), and its processor's expansion of an image: its CLS and
    four register tokens, a token a patch, the end token."""

    def __init__(self, config: dict, pc: dict, tokenizer):
        def token(key: str, default: int) -> int:
            return config.get(key, default)

        self.tokenizer = tokenizer
        self.patch = (config.get("vision_config") or {}).get("spatial_patch_size", config.get("spatial_patch_size", 16))
        self.image = token("img_id", 227)
        self.head = tuple(token(k, d) for k, d in (("image_cls_token_id", 244), ("image_reg_1_token_id", 245),
                                                   ("image_reg_2_token_id", 246), ("image_reg_3_token_id", 247),
                                                   ("image_reg_4_token_id", 248)))
        self.end = token("img_end_id", 230)
        probe = [*self.head, self.image, self.image, self.end]
        text = tokenizer.decode(probe, clean_up_tokenization_spaces=False)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != probe:
            raise ValueError("the tokenizer does not give Falcon OCR's image tokens back as themselves")

    def span_ids(self) -> set[int]:
        """Ids that mark images: a prompt's text holding one outside its images is refused (mlx-vlm's
        positions and mask would read it as an image's)."""
        return {self.image, self.end, *self.head}

    def _run(self, image):
        from mlx_vlm.models.falcon_ocr.processing_falcon_ocr import preprocess_image

        pixels, gh, gw = preprocess_image(image.convert("RGB"), self.patch)
        return pixels[None].astype(np.float32), gh, gw

    def layout(self, image) -> ImageInput:
        pixels, gh, gw = self._run(image)
        ids = (*self.head, *(self.image,) * (gh * gw), self.end)
        return ImageInput(pixels, (1, gh, gw), len(ids), ids=ids)

    def pixels(self, image) -> np.ndarray:
        return self._run(image)[0]

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {"image_grid_hw": mx.array([inp.grid_thw[1:]])}


class HunyuanImages:
    """HunyuanVL: mlx-vlm's HunYuanVLImageProcessor (smart-resized to multiples of patch x merge,
    patches in merge order, one (1, h, w) grid), with preprocessor_config.json's settings over its
    defaults; an image takes rows x (columns + 1) + 2 tokens (a newline row after each row, its
    tower's begin and end rows), one run of the image token."""

    def __init__(self, config: dict, pc: dict, tokenizer):
        from mlx_vlm.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLImageProcessor

        self.tokenizer, self.image_token = tokenizer, config.get("image_token_id", 120120)
        vc = config.get("vision_config") or {}
        settings = {"patch_size": vc.get("patch_size"), "merge_size": vc.get("spatial_merge_size")}
        settings |= {k: pc[k] for k in ("min_pixels", "max_pixels", "patch_size", "merge_size", "image_mean",
                                        "image_std") if k in pc}
        self.proc = HunYuanVLImageProcessor(**{k: v for k, v in settings.items() if v is not None})

    def layout(self, image) -> ImageInput:
        out = self.proc.preprocess([image.convert("RGB")])
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        m = self.proc.merge_size
        return ImageInput(out["pixel_values"].astype(np.float32), grid, grid[1] // m * (grid[2] // m + 1) + 2)

    def pixels(self, image) -> np.ndarray:
        return self.proc.preprocess([image.convert("RGB")])["pixel_values"].astype(np.float32)

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {"image_grid_thw": mx.array([inp.grid_thw])}

    def prompt_kwargs(self, inp: ImageInput, start: int, length: int) -> dict:
        """What mlx-vlm's own pass over a prompt of `length` ids, the image's run at `start`, is given
        with its pixels (tests compare with it): the grid, and the positions mlx-vlm's HunYuanVLProcessor
        builds, run on a prompt with the image token there amid other tokens (it reads where the image
        tokens are, nothing else)."""
        import mlx.core as mx
        from mlx_vlm.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLProcessor

        class Grid:  # its image processor, as far as it reads it: this image's grid
            merge_size = self.proc.merge_size

            def __call__(self, images):
                return {"image_grid_thw": np.asarray([inp.grid_thw])}

        proc = HunYuanVLProcessor(image_processor=self.proc, tokenizer=self.tokenizer)
        proc.image_processor, proc.image_token_id = Grid(), self.image_token
        proc.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token)
        other = self.tokenizer.eos_token
        out = proc(images=[None], text=[other * start + proc.image_token + other * (length - start - inp.num_tokens)])
        if np.asarray(out["input_ids"]).shape[-1] != length:
            raise ValueError("the processor laid the image out otherwise")
        return self.image_kwargs(inp) | {"position_ids": mx.array(np.asarray(out["position_ids"]))}


IMAGES = {"moondream": MoondreamImages, "falcon_ocr": FalconImages, "hunyuan_vl": HunyuanImages}


# ---- positions ----


def xd_positions(length: int, runs, merge: int):
    """HunyuanVL's positions of a prompt, as HunYuanVLProcessor builds them: (4, 1, length), the
    axes [index, column, row, time]; text takes its index on all four, and each image run (start,
    (t, h, w) grid), after its first token, its (column, row) in the merged grid and time 0."""
    import mlx.core as mx

    axes = np.tile(np.arange(length), (4, 1))
    for start, (_, gh, gw) in runs:
        rows, cols = gh // merge, gw // merge
        s, n = start + 1, rows * (cols + 1)
        axes[1, s: s + n] = np.tile(np.arange(cols + 1), rows)
        axes[2, s: s + n] = np.repeat(np.arange(rows), cols + 1)
        axes[3, s: s + n] = 0
    return mx.array(axes)[:, None]


def xdrope_positions(vlm, token_ids, images):
    """HunyuanVL: each image's run is found as its processor finds it (the i-th starts at the image
    token after the first i images' tokens); text after images keeps its index (delta 0)."""
    where = np.flatnonzero(np.asarray(token_ids) == vlm.image_token_id)
    runs, seen = [], 0
    for im in images:
        runs.append((int(where[seen]), im.grid_thw))
        seen += im.num_tokens
    return xd_positions(len(token_ids), runs, vlm.images.proc.merge_size), 0


def golden_positions(vlm, token_ids, images):
    """Falcon OCR: mlx-vlm's get_rope_index over the whole prompt (its mask, lazily built, is never
    computed): (3, 1, S) rows [1-D position, row, column], and the delta of the text after."""
    import mlx.core as mx

    grids = [im.grid_thw[1:] for im in images]
    # One-dimensional ids: given a batch, get_rope_index keeps the first image's grid alone.
    pos, hw, delta, _ = vlm.model.language_model.get_rope_index(mx.array(token_ids), mx.array(grids))
    return mx.concatenate([pos.astype(mx.float32)[None, None], hw.transpose(2, 0, 1)]), int(delta)


POSITIONS = {"xdrope": xdrope_positions, "golden": golden_positions}


# ---- HunyuanVL's XD-RoPE at any offset ----


def hunyuan_positions_any_offset() -> None:
    """Let mlx-vlm's HunyuanVL take a pass's own XD-RoPE positions at any cache offset.

    Its attention applies XD-RoPE only in a pass from position 0 (else plain RoPE at one offset for
    every row, the batch's shared timeline, padding included), and its language model reads the
    positions it kept on the model object from the last image's get_input_embeddings. So an image
    in a later prompt chunk, or after a cached prefix, got plain positions, and a batch row with
    left padding positions shifted by its padding. Here, where positions of the pass's own tokens
    are given, the language model passes them on and keeps nothing, and attention rotates by them
    at any offset (the rotary table runs to the cache's end, past every row's positions; left
    padding's negative positions, masked out, read row 0). mlx-vlm's own calls (no positions, or a
    pass from 0 on one sequence) run its code as it is.
    """
    import mlx.core as mx
    import mlx_vlm.models.hunyuan_vl.language as hy

    if getattr(hy.Attention.__call__, "mlxserve", False):
        return
    attend, call = hy.Attention.__call__, hy.LanguageModel.__call__

    def attention(self, x, mask=None, cache=None, position_ids=None):
        offset = 0 if cache is None else cache.offset
        if position_ids is None or (not isinstance(offset, mx.array) and offset == 0):
            return attend(self, x, mask, cache, position_ids)
        B, L, _ = x.shape

        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        cos, sin = self.rotary_emb(v, seq_len=hy.cache_position_offset(cache) + L)
        q, k = hy.apply_rotary_pos_emb_xdrope(q, k, cos, sin, mx.maximum(position_ids, 0), self.xdrope_section,
                                              (B, self.n_heads, L, L))
        if self.config.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        k, v = cache.update_and_fetch(k, v)
        if isinstance(mask, mx.array):
            mask = mask[..., : hy.kv_sequence_length(k)]
        out = hy.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def language_model(self, inputs=None, inputs_embeds=None, mask=None, cache=None, **kwargs):
        pos = kwargs.get("position_ids")
        length = (inputs_embeds if inputs_embeds is not None else inputs).shape[1]
        if not isinstance(pos, mx.array) or pos.shape[-1] != length:
            return call(self, inputs, inputs_embeds, mask, cache, **kwargs)
        out = self.model(input_ids=inputs, inputs_embeds=inputs_embeds, mask=mask, cache=cache, position_ids=pos)
        logits = self.model.embed_tokens.as_linear(out) if self.args.tie_word_embeddings else self.lm_head(out)
        return hy.LanguageModelOutput(logits=logits)

    attention.mlxserve = language_model.mlxserve = True
    hy.Attention.__call__, hy.LanguageModel.__call__ = attention, language_model


def check_xdrope(language_model) -> None:
    """HunyuanVL's processor builds four position axes: its rotary must split into four sections."""
    section = (language_model.args.rope_scaling or {}).get("xdrope_section")
    if section is None or len(section) != 4:
        raise ValueError(f"rope_scaling.xdrope_section must have 4 sections (the processor's index, column, "
                         f"row and image axes), not {section}")
