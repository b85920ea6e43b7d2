"""Generic-adapter families beyond one tower input an image (models/vlm_generic.py FAMILIES):

- image processors of families whose image is several tower inputs (InternVL's tiles) or one
  fixed square (GOT-OCR 2.0), laid out as one run of image tokens between the family's marks:
  how the image is cut (numpy and PIL, off the engine thread) and how many tokens it takes, as
  mlx-vlm's own processor for the family does, read from the files that processor reads;
- mends of mlx-vlm models the generic path needs (MODEL_FIXES, LAYER_FEATURES): LLaVA-NeXT's and
  Granite Vision's merge, Granite 4 Vision's layer-wise image features.

vlm_images.py holds the single-input families' processors, and vlm_images.OwnLayout the families
whose own processor puts text between an image's tiles.
"""

from __future__ import annotations

import numpy as np

from mlxserve.models.vlm import ImageInput

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


class InternVLTiles:
    """InternVL: the image resized to the grid of square tiles closest to its aspect (between
    min and max_dynamic_patch tiles), cut into them, and a thumbnail after them when there are
    several; each tile `num_image_token` tokens, all one run between <img> and </img>. As
    mlx-vlm's InternVLImageProcessor (its `dynamic_preprocess` cuts the tiles), normalized in
    numpy: mlx-vlm does it with MLX, which may not run off the engine thread.

    `chat`: InternVL-Chat's remote-code checkpoints (tile size from force_image_size, tokens a
    tile from the tile's patches after the pixel shuffle); else transformers' InternVL format
    (the tower's image size, tokens a tile from processor_config.json's image_seq_length)."""

    def __init__(self, config: dict, pc: dict, chat: bool):
        vc, names = config["vision_config"], (pc or {}).get("processor_config", {})
        if chat:  # as mlx-vlm's InternVLChatProcessor.from_pretrained reads them
            self.size = _side(names.get("image_size", config.get("force_image_size", vc.get("image_size", 448))))
            patch = _side(names.get("patch_size", vc.get("patch_size", 14)))
            ratio = names.get("downsample_ratio", config.get("downsample_ratio", 0.5))
            self.per_tile = names.get("num_image_token", int((self.size // patch) ** 2 * ratio**2))
        else:  # as mlx-vlm's InternVLProcessor.from_pretrained
            self.size = _side(vc.get("image_size", 448))
            self.per_tile = names.get("image_seq_length", 256)
        self.min_tiles = config.get("min_dynamic_patch", 1)
        self.max_tiles = config.get("max_dynamic_patch", 12)
        self.thumbnail = config.get("use_thumbnail", True)

    def _tiles(self, image) -> int:
        """How many tower inputs `dynamic_preprocess` cuts the image into."""
        from mlx_vlm.models.internvl_chat.processor import find_closest_aspect_ratio

        lo, hi = self.min_tiles, self.max_tiles
        ratios = sorted({(i, j) for n in range(lo, hi + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                         if lo <= i * j <= hi}, key=lambda r: r[0] * r[1])
        cols, rows = find_closest_aspect_ratio(image.width / image.height, ratios, image.width, image.height,
                                               self.size)
        return cols * rows + (1 if self.thumbnail and cols * rows > 1 else 0)

    def layout(self, image) -> ImageInput:
        return ImageInput(None, None, self._tiles(image) * self.per_tile)

    def pixels(self, image) -> np.ndarray:
        from mlx_vlm.models.internvl_chat.processor import dynamic_preprocess
        from PIL import Image

        tiles = dynamic_preprocess(image.convert("RGB"), self.min_tiles, self.max_tiles, self.size, self.thumbnail)
        x = np.stack([np.asarray(t.resize((self.size, self.size), resample=Image.Resampling.BICUBIC), np.float32)
                      for t in tiles]) / 255.0
        return np.ascontiguousarray(((x - IMAGENET_MEAN) / IMAGENET_STD).transpose(0, 3, 1, 2))

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


class GotImages:
    """GOT-OCR 2.0: the image resized to the tower's square input (mlx-vlm's GotOcrImageProcessor,
    numpy), a fixed run of tokens: its patch grid after the tower's two stride-2 convolutions."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.got.processing_got import GotOcrImageProcessor

        vc = config.get("vision_config") or {}
        size = vc.get("img_size", 1024)
        self.proc = GotOcrImageProcessor(image_size=size, **{k: v for k, v in (pc or {}).items()
                                                             if k in ("image_mean", "image_std")})
        self.tokens = (size // vc.get("patch_size", 16) // 4) ** 2  # 256 at 1024 px

    def layout(self, image) -> ImageInput:
        return ImageInput(None, None, self.tokens)

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self.proc([image])["pixel_values"])

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


def anyres_merge(model, images) -> None:
    """Mend mlx-vlm 0.7.10's LLaVA-NeXT merge (Granite Vision's is a copy of it).

    Its get_input_embeddings puts one tile's rows in place of each of the first image tokens,
    then as many rows of image_newline, and drops the other image tokens: the rows it gives are
    not the image tokens its processor lays out (a tiny 5-tile image: 40 rows for 24 tokens), so
    the prompt's length changes under it. Here an image's rows are packed as transformers'
    LLaVA-NeXT packs them, which is what its processor counts: the whole image's rows, then the
    tiles' rows as one grid unpadded to the image's aspect, a newline row ending each row of it;
    they fill the image tokens one to one. The tile grid is the processor's own
    (`image_grid_pinpoints` of preprocessor_config.json), as the processor picks it.
    """
    import types

    original = model.get_input_embeddings
    pinpoints = images.proc.image_processor.image_grid_pinpoints

    def get_input_embeddings(self, input_ids=None, pixel_values=None, **kwargs):
        import mlx.core as mx
        from mlx_vlm.models.base import InputEmbeddingsFeatures

        if pixel_values is None:
            return original(input_ids, None, **kwargs)
        embeds = self.language_model.model.embed_tokens(input_ids)
        sizes = np.asarray(kwargs["image_sizes"]).reshape(-1, 2).tolist()
        tiles = pixel_values if pixel_values.ndim == 5 else pixel_values[None]
        rows = mx.concatenate([_anyres_rows(self, tiles[i], size, pinpoints) for i, size in enumerate(sizes)])
        mask = input_ids == self.config.image_token_index
        if int(mask.sum().item()) != rows.shape[0]:
            raise ValueError(f"image tokens {int(mask.sum().item())} and image rows {rows.shape[0]} do not match")
        at = mx.clip(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0, rows.shape[0] - 1).reshape(mask.shape)
        return InputEmbeddingsFeatures(inputs_embeds=mx.where(mask[..., None], rows.astype(embeds.dtype)[at], embeds))

    get_input_embeddings.mlxserve = True
    model.get_input_embeddings = types.MethodType(get_input_embeddings, model)


def _anyres_rows(model, tiles, size, pinpoints):
    """One image's rows: its tiles (the whole image first) through the tower, the feature layer(s)
    and projector, packed as transformers' LlavaNextModel.pack_image_features packs them."""
    import mlx.core as mx
    from transformers.image_processing_utils import select_best_resolution

    cfg, vc = model.config, model.config.vision_config
    *_, hidden = model.vision_tower(tiles.transpose(0, 2, 3, 1), output_hidden_states=True)
    layer = cfg.vision_feature_layer
    feats = hidden[layer] if isinstance(layer, int) else mx.concatenate([hidden[i] for i in layer], axis=-1)
    if cfg.vision_feature_select_strategy == "default":
        feats = feats[:, 1:]  # the CLS row
    feats = model.multi_modal_projector(feats)
    newline = model.image_newline.astype(feats.dtype)
    if feats.shape[0] == 1:
        return mx.concatenate([feats[0], newline[None]])
    side, dim = vc.image_size // vc.patch_size, feats.shape[-1]
    height, width = (x // vc.image_size for x in select_best_resolution(size, pinpoints))
    grid = feats[1 : 1 + height * width].reshape(height, width, side, side, dim)
    grid = grid.transpose(0, 2, 1, 3, 4).reshape(height * side, width * side, dim)
    # Unpadded to the image's aspect, rounded as the processor counts it.
    (h, w), (gh, gw) = size, grid.shape[:2]
    if w / h > gw / gh:
        pad = (gh - int(round(h * (gw / w), 7))) // 2
        grid = grid[pad : gh - pad]
    else:
        pad = (gw - int(round(w * (gh / h), 7))) // 2
        grid = grid[:, pad : gw - pad]
    grid = mx.concatenate([grid, mx.broadcast_to(newline, (grid.shape[0], 1, dim))], axis=1)
    return mx.concatenate([feats[0], grid.reshape(-1, dim)])


class ChunkRows:
    """A prompt chunk's per-position array (its image-token mask, a layer's feature rows) for
    mlx-vlm's Granite 4 Vision layers, which slice such arrays at the cache's offset as if they
    covered the whole prompt (mlx-vlm prefills a prompt in one pass): any slice of it is the
    chunk's own, which is what the chunk's positions are. An int index picks one layer's rows."""

    def __init__(self, array):
        self.array = array

    def __getitem__(self, key):
        return ChunkRows(self.array[key]) if isinstance(key, int) else self.array


def granite4_layer_features(model, images) -> None:
    """Granite 4 Vision's image enters as features added at chosen language-model layers; the
    layers are read off state its get_input_embeddings leaves on the model at each encode. Set
    here from the config once (a prompt whose image rows come from the caches encodes nothing)."""
    cfg = model.config
    layers = [llm for _, llm in cfg.deepstack_layer_map or []]
    if cfg.use_spatial_sampling and model.spatial_projectors is not None:
        layers += list(cfg.spatial_target_layers or [])
    model.language_model.model._deepstack_target_layers = layers or None


def granite4_chunk_extras(out: dict, media, rows) -> dict:
    """A chunk's layer features as Granite 4's layers read them: one (chunk, D) array a layer,
    zeros off the image tokens, and the mask, each sliced as the chunk's own (ChunkRows)."""
    import mlx.core as mx

    at = mx.clip(mx.cumsum(media[0].astype(mx.int32)) - 1, 0, rows.shape[0] - 1)
    full = mx.where(media[0][:, None, None], rows[at], 0).astype(rows.dtype)  # (chunk, layers, D)
    out["visual_pos_masks"] = ChunkRows(media)
    out["deepstack_visual_embeds"] = ChunkRows(full.transpose(1, 0, 2))
    return out


def _jina_crops(model, images) -> None:
    from mlxserve.models.vlm_patches import jina_crop_size

    jina_crop_size(model, images)


# Mends of mlx-vlm models, by model type: each given the model and its adapter's image processor.
MODEL_FIXES = {"llava_next": anyres_merge, "granite_vision": anyres_merge, "granite4_vision": granite4_layer_features,
               "jina_vlm": _jina_crops}  # models/vlm_patches.py
# A family's per-layer image features in the form its layers read: the chunk's extras, its image-token
# mask and its image tokens' rows [n, layers, D] -> the extras.
LAYER_FEATURES = {"granite4_vision": granite4_chunk_extras}
