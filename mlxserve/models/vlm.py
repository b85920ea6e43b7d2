"""Vision-language models through mlx-vlm: one small adapter per family.

mlx-vlm gives the modules (vision tower, projector, language model) and the
image processors. mlxserve does the rest itself, because mlx-vlm's request
loop keeps per-request state on the model object (Qwen's rope deltas) and
embeds whole prompts at once, which rules out batching mixed requests and
prefix caching. An adapter splits a VLM into what the engine needs:

- `preprocess(image)`: pixels to the tower's input (numpy, any thread);
- `encode(pixels)`: the vision tower for ONE image, giving the embeddings
  its placeholder tokens take (MLX thread), so each image is cached alone;
- `text_model`: the language model as an mlx-lm-style module
  (`model(tokens, cache=...)` -> logits, `make_cache()`, `layers`), which
  `BatchGenerator` batches like any text model, plus `prefill(...)` for
  prompt chunks given as embeddings;
- `positions(...)`: rotary positions of a prompt with images (Qwen's M-RoPE).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VLM_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "gemma3", "llava")  # hand-written adapters, below


def is_vlm_config(config: dict) -> bool:
    from mlxserve.models.vlm_families import FAMILIES

    from mlxserve.models.vlm_thinker import has_thinker_vision

    vision = "vision_config" in config or has_thinker_vision(config)  # (Qwen3-Omni's thinker's)
    return vision and config.get("model_type") in (*VLM_FAMILIES, *FAMILIES)


@dataclass
class ImageInput:
    """One image for the tower: its token count now, its pixel array when needed.

    Made off the MLX thread. When the vision cache already holds the image's
    embeddings, the pixel array is not computed (for a 1024 px Qwen image it
    costs ~80 ms a turn); `image` is kept so it can still be, if the entry
    was evicted meanwhile.
    """

    pixel_values: np.ndarray | None
    grid_thw: tuple[int, int, int] | None  # Qwen: (t, h, w) patch grid
    num_tokens: int  # placeholder tokens it takes in the prompt
    image: object = None  # while pixel_values is None: the decoded image, or (VideoFrames, group) for video
    video: int | None = None  # for a group of video frames: which video of the request it belongs to
    seconds: float | None = None  # for a group of video frames: its time in the video (Qwen3-VL)
    # A family whose own processor lays the image out (tiles, crops, rows): the image's whole span
    # of ids (image tokens and the text between them) and the processor's other outputs for the
    # tower (numpy: pixel masks, image sizes).
    ids: tuple[int, ...] | None = None
    extras: dict | None = None
    # A family whose processor marks an image with ids outside the vocabulary (LLaVA-Bunny's -200,
    # Phi-3-vision's run of -1): those ids, which the tower is given; `ids` are then stand-ins
    # (models/vlm_standin.py).
    tower_ids: tuple[int, ...] | None = None


class VideoFrames:
    """A video's decoded frames, and their pixel array once some group needs it (made once, shared)."""

    def __init__(self, frames: list):
        self.frames = frames
        self._pixels = None

    def pixels(self, processor) -> np.ndarray:
        if self._pixels is None:
            self._pixels = np.asarray(processor(videos=[self.frames])["pixel_values_videos"])
            self.frames = None
        return self._pixels


class TextModel:
    """The language half of a VLM, shaped like an mlx-lm model for the engine."""

    def __init__(self, language_model, mrope: bool):
        self.lm = language_model
        self.mrope = mrope
        made = language_model.make_cache() if hasattr(language_model, "make_cache") else None
        if made is None:
            made = [None] * len(language_model.layers)
        try:
            self._template = [_cache_kind(c, type(language_model).__module__) for c in made]
            self.own_cache_classes = []
        except ValueError:
            # A class mlx-lm has no copy of (GLM-5 Next's PoolingCache): every layer keeps mlx-vlm's own
            # classes, which work together; the engine then runs the model one request at a time and
            # uncached (families.unbatchable_layers reads own_cache_classes), as models/vlm_text.py does.
            from mlxserve.models.vlm_text import _unmapped

            self._template = None
            self.own_cache_classes = sorted({name for c in made for name in _unmapped(c)})
        if self._template is None:  # the offset is read off the first cache that counts tokens
            self.n_layers, self.positions_last = len(made), False
            self.offset_index = next((i for i, c in enumerate(made) if isinstance(getattr(c, "offset", None), int)), 0)
            return
        if any("ArraysCache" in _leaf_kinds(kind) for kind in self._template):
            add_recurrent_cache_methods()
        # Layer caches: fewer than layers when the last layers share earlier KV (Gemma 4).
        self.n_layers = len(self._template)
        # M-RoPE positions as (batch, seq, 3) rather than (3, batch, seq) (ERNIE 4.5 VL's language model):
        # the engine keeps them (3, batch, seq), moved for the model here.
        self.positions_last = False
        # Where the position offset is read: the first attention cache (a recurrent state has none).
        self.offset_index = next((i for i, kind in enumerate(self._template)
                                  if kind[0] in ("KVCache", "RotatingKVCache")), 0)

    @property
    def layers(self):
        return self.lm.layers

    def make_cache(self) -> list:
        # mlx-lm's cache classes (not mlx-vlm's copies): BatchGenerator merges
        # them into batched caches, and the prefix cache knows how to store them.
        from mlxserve.cache.layers import PositionState

        caches = self.lm.make_cache() if self._template is None else [_make_cache(kind) for kind in self._template]
        if self.mrope:
            caches.append(PositionState())
        return caches

    def _decode_positions(self, inputs, cache):
        """Positions of tokens after a prompt: cache offset + the row's rope delta, on all 3 M-RoPE axes."""
        import mlx.core as mx

        B, L = inputs.shape
        offset = cache[self.offset_index].offset
        offset = mx.array(offset).reshape(-1, 1) if isinstance(offset, mx.array) else mx.full((1, 1), offset)
        start = offset + cache[-1].deltas(B)
        pos = start + mx.arange(L)[None]
        return mx.broadcast_to(pos[None], (3, B, L))

    def __call__(self, inputs, cache=None, positions=None, inputs_embeds=None, **extras):
        """`extras`: per-chunk inputs of a prompt chunk given as embeddings (deepstack rows,
        per-layer inputs, media token types); decode steps pass tokens alone."""
        kwargs = dict(extras)
        if self.mrope:
            if positions is None:
                positions = self._decode_positions(inputs, cache) if cache is not None else None
            kwargs["position_ids"] = positions.transpose(1, 2, 0) if self.positions_last else positions
        layer_cache = cache[: self.n_layers] if cache is not None else None
        logits = self.lm(inputs, inputs_embeds=inputs_embeds, cache=layer_cache, **kwargs).logits
        if cache is not None:
            # Some language models replace entries of the list they get (mlx-vlm's Qwen3.5 runs
            # left-padded batch rows one by one and merges their caches into new objects):
            # the caller's list must hold those.
            for i, c in enumerate(layer_cache):
                if cache[i] is not c:
                    cache[i] = c
        return logits


def _cache_kind(c, where: str) -> tuple:
    """What an mlx-vlm cache object is, to make mlx-lm's own of: (class name, its settings)."""
    kind = type(c).__name__ if c is not None else "KVCache"
    if kind == "RotatingKVCache":
        return kind, c.max_size, getattr(c, "keep", 0)
    if kind == "ArraysCache":
        return kind, len(c.cache)
    if kind == "CacheList":  # one layer's several caches (an attention and a recurrent mixer side by side)
        return (kind, *(_cache_kind(part, where) for part in c.caches))
    if kind != "KVCache":
        raise ValueError(f"{where}: cache class {kind} is not supported")
    return (kind,)


def _leaf_kinds(kind: tuple) -> list[str]:
    return [n for part in kind[1:] for n in _leaf_kinds(part)] if kind[0] == "CacheList" else [kind[0]]


def _make_cache(kind: tuple):
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    if kind[0] == "RotatingKVCache":
        return RotatingKVCache(max_size=kind[1], keep=kind[2])
    if kind[0] == "ArraysCache":
        return ArraysCache(kind[1])
    if kind[0] == "CacheList":
        return CacheList(*(_make_cache(part) for part in kind[1:]))
    return KVCache()


def add_recurrent_cache_methods() -> None:
    """Give mlx-lm's ArraysCache the two methods mlx-vlm's Gated-DeltaNet layers call.

    mlx-vlm's Qwen3.5 layers write their conv window and recurrent state through
    `cache.update_window` / `cache.update_recurrent`, which only mlx-vlm's own
    ArraysCache has. mlxserve keeps mlx-lm's class (BatchGenerator merges it, the
    prefix cache stores it; both make plain ArraysCache objects, so a subclass
    would be lost), and adds the methods to it: what mlx-vlm's do, less the
    speculative-decoding history mlxserve never asks for. mlx-lm's own models
    index the cache directly and never call them.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    if hasattr(ArraysCache, "update_recurrent"):
        return

    def update_recurrent(self, index, length, update):
        output, state = update(self.cache[index], None)[:2]
        self.cache[index] = state
        return output, state

    def update_window(self, index, source, width, *, lengths=None):
        width = int(width)
        length = source.shape[1] - width
        if lengths is None:
            state = mx.contiguous(source[:, length : length + width])
        else:
            pos = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
            pos = pos.reshape(*pos.shape, *([1] * (source.ndim - 2)))
            state = mx.take_along_axis(source, pos, axis=1)
        self.cache[index] = state
        return state

    ArraysCache.update_recurrent = update_recurrent
    ArraysCache.update_window = update_window


class VisionAdapter:
    """What every family shares; subclasses fill in the family's specifics."""

    family = ""

    def __init__(self, model, config: dict, processor_config: dict, tokenizer):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.text_model = TextModel(model.language_model, mrope=self.mrope)
        self.processor_config = processor_config  # an engine process's parent builds its own adapter from it
        self._settings_key = json.dumps({"family": self.family, "processor": processor_config}, sort_keys=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id)

    mrope = False
    whole_images = False  # an image's tokens attend to each other both ways: a prefill pass holds all or none
    image_token_id: int

    def settings_key(self) -> str:
        """What, besides the pixels, decides an image's embeddings (part of the vision-cache key)."""
        return self._settings_key

    def tower_blocks(self) -> list:
        """The vision tower's transformer blocks: an encode may pause after any of them."""
        return []

    def preprocess(self, image, pixels: bool = True) -> ImageInput:
        """The image's token count, and its pixel array unless `pixels` is False."""
        inp = self._layout(image)
        if pixels:
            inp.pixel_values = self._pixels(image)
        else:
            inp.image = image
        return inp

    def pixels(self, inp: ImageInput) -> np.ndarray:
        if inp.pixel_values is None:
            if inp.video is None:
                inp.pixel_values = self._pixels(inp.image)
            else:
                frames, group = inp.image
                per_group = inp.grid_thw[1] * inp.grid_thw[2]
                inp.pixel_values = frames.pixels(self.video_processor)[group * per_group : (group + 1) * per_group]
            inp.image = None
        return inp.pixel_values

    video_token_id: int | None = None  # set by families that take video

    def image_span_ids(self) -> set[int]:
        """The token ids an image's placeholder is made of (more than its image token where rows
        of an image end in a break token)."""
        return {self.image_token_id}

    def preprocess_video(self, frames: list, video: int) -> list[ImageInput]:
        """The video's frame groups, token counts known, pixel arrays made on first `pixels()`."""
        raise ValueError("this model takes images, not video")

    def video_placeholder(self, groups: list[ImageInput]) -> str:
        raise ValueError("this model takes images, not video")

    def embed(self, token_ids, spans):
        """Input embeddings of a prompt chunk.

        `spans` are (chunk_start, features) pairs: `features` rows replace the
        token embeddings from `chunk_start` on (image placeholder tokens).
        """
        import mlx.core as mx

        ids = mx.array(token_ids)[None]
        text = self.model.language_model.model.embed_tokens(ids)[0]
        if not spans:
            return text[None]
        pieces, pos = [], 0
        for start, feats in sorted(spans, key=lambda s: s[0]):
            if start > pos:
                pieces.append(text[pos:start])
            pieces.append(feats.astype(text.dtype))
            pos = start + feats.shape[0]
        if pos < text.shape[0]:
            pieces.append(text[pos:])
        return mx.concatenate(pieces)[None]

    def inputs(self, token_ids, spans) -> dict:
        """The language model's inputs for a prompt chunk given as embeddings: `inputs_embeds`,
        plus whatever else the family needs per chunk (see the generic adapter)."""
        return {"inputs_embeds": self.embed(token_ids, spans)}

    def positions(self, token_ids, images):
        """Rotary positions of a whole prompt, or None if plain (offset-based) positions are right."""
        return None, 0

    def rope_delta(self, token_ids, images) -> int:
        """What `positions` gives as the delta, for a prompt whose image tokens need no positions."""
        return self.positions(token_ids, images)[1]


class QwenVL(VisionAdapter):
    """Qwen2-VL / Qwen2.5-VL: dynamic resolution, 2x2 patch merge, M-RoPE."""

    family = "qwen-vl"
    mrope = True

    def __init__(self, model, config, processor_config, tokenizer):
        super().__init__(model, config, processor_config, tokenizer)
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

        vc = config["vision_config"]
        self.image_token_id = config.get("image_token_id", 151655)
        self._wrap = (self.token_text(config.get("vision_start_token_id", 151652)),
                      self.token_text(self.image_token_id),
                      self.token_text(config.get("vision_end_token_id", 151653)))
        self.merge = vc.get("spatial_merge_size", 2)
        pc = processor_config
        self.image_processor = Qwen3VLImageProcessor(
            patch_size=pc.get("patch_size", vc.get("patch_size", 14)),
            merge_size=pc.get("merge_size", self.merge),
            temporal_patch_size=pc.get("temporal_patch_size", vc.get("temporal_patch_size", 2)),
            min_pixels=pc.get("min_pixels", 56 * 56),
            max_pixels=pc.get("max_pixels", 14 * 14 * 4 * 1280),
            image_mean=pc.get("image_mean"),
            image_std=pc.get("image_std"),
        )
        _guard_window_index(model.vision_tower)
        self._deltas: OrderedDict[tuple, int] = OrderedDict()  # image grids -> M-RoPE delta
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLVideoProcessor

        self.video_token_id = config.get("video_token_id", 151656)
        self._video_pad = self.token_text(self.video_token_id)
        self.video_processor = Qwen3VLVideoProcessor(
            patch_size=self.image_processor.patch_size,
            merge_size=self.image_processor.merge_size,
            temporal_patch_size=self.image_processor.temporal_patch_size,
            min_pixels=pc.get("video_min_pixels", 128 * 28 * 28),
            max_pixels=pc.get("video_max_pixels", 768 * 28 * 28),
            image_mean=pc.get("image_mean"),
            image_std=pc.get("image_std"),
        )

    def tower_blocks(self) -> list:
        return list(self.model.vision_tower.blocks)

    def _layout(self, image) -> ImageInput:
        # The processor's own size rule (smart resize to multiples of patch x merge).
        h, w = self.image_processor._resolved_size(image.height, image.width)
        patch = self.image_processor.patch_size
        grid = (1, h // patch, w // patch)
        return ImageInput(None, grid, math.prod(grid) // self.merge**2)

    def _pixels(self, image) -> np.ndarray:
        return np.asarray(self.image_processor(images=[image])["pixel_values"])

    def placeholder(self, image: ImageInput) -> str:
        start, pad, end = self._wrap
        return start + pad * image.num_tokens + end

    def encode(self, image: ImageInput):
        import mlx.core as mx

        tower = self.model.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        pixels = mx.array(self.pixels(image)).astype(dtype)
        return tower(pixels, mx.array([image.grid_thw]), output_hidden_states=False)

    def preprocess_video(self, frames: list, video: int) -> list[ImageInput]:
        return video_groups(self.video_processor, frames, video)

    def video_placeholder(self, groups: list[ImageInput]) -> str:
        start, _, end = self._wrap
        return start + self._video_pad * sum(g.num_tokens for g in groups) + end

    def positions(self, token_ids, images):
        import mlx.core as mx

        image_grids = [im.grid_thw for im in images if im.video is None]
        video_grids = {}
        for im in images:
            if im.video is not None:  # one (t, h, w) per video: its groups stacked in time
                t, h, w = video_grids.get(im.video, (0, *im.grid_thw[1:]))
                video_grids[im.video] = (t + 1, h, w)
        pos, delta = self.model.language_model.get_rope_index(
            mx.array([token_ids]), mx.array(image_grids) if image_grids else None,
            mx.array(list(video_grids.values())) if video_grids else None, None)
        delta = int(delta.reshape(-1)[0].item())
        self._deltas[self._grids(images)] = delta
        while len(self._deltas) > 1024:
            self._deltas.popitem(last=False)
        return pos, delta

    @staticmethod
    def _grids(images) -> tuple:
        return tuple((tuple(im.grid_thw), im.video) for im in images)

    def rope_delta(self, token_ids, images) -> int:
        # Each image shifts the positions of the text after it by the positions it
        # spans minus the tokens it takes, both set by its grid, wherever it sits:
        # the delta is a function of the grids alone. A later turn about the same
        # images (their tokens all cached) reuses it, skipping get_rope_index's
        # pass over the whole prompt (2-3 ms on a GPU).
        grids = self._grids(images)
        delta = self._deltas.get(grids)
        if delta is None:
            return self.positions(token_ids, images)[1]
        self._deltas.move_to_end(grids)
        return delta


def video_groups(vp, frames: list, video: int) -> list[ImageInput]:
    """A video's frames as groups of `temporal_patch_size` frames, each a tower input of its own.

    The frames are resized and patchified as one video by Qwen's video processor
    `vp` (the size depends on the frame count), then split by group: Qwen's
    towers attend within a group only (full-attention blocks per temporal step,
    windows inside them; Qwen3-VL's position embeddings repeat per step), so
    encoding groups one by one gives the whole video's rows.
    """
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import _smart_resize_video

    h, w = _smart_resize_video(num_frames=len(frames), height=frames[0].height, width=frames[0].width,
                               temporal_factor=vp.temporal_patch_size, factor=vp.patch_size * vp.merge_size,
                               min_pixels=vp.min_pixels, max_pixels=vp.max_pixels)
    grid = (1, h // vp.patch_size, w // vp.patch_size)
    shared = VideoFrames(frames)
    groups = -(-len(frames) // vp.temporal_patch_size)
    return [ImageInput(None, grid, math.prod(grid) // vp.merge_size**2, image=(shared, g), video=video)
            for g in range(groups)]


def _guard_window_index(tower) -> None:
    """Drop repeated window bounds from mlx-vlm's Qwen2.5-VL `get_window_index`.

    For images whose merged grid is a multiple of the window (sides of
    112 px multiples), padding windows are empty and their bound repeats.
    mlx-vlm means to drop repeats, but tests `x not in seen` with MLX arrays,
    which hash by identity, so none are dropped; on MLX-CUDA an empty window
    then kills the process with a floating point exception. (Qwen2-VL's tower
    has no windows and no such method.)
    """
    original = getattr(tower, "get_window_index", None)
    if original is None:
        return

    def get_window_index(grid_thw):
        import mlx.core as mx

        index, bounds = original(grid_thw)
        return index, mx.array(list(dict.fromkeys(bounds.tolist())), dtype=bounds.dtype)

    tower.get_window_index = get_window_index


def _square_pixels(image, size: int, mean, std, crop: bool):
    """A square tower input: resize (shortest side, then center crop, if `crop`), scale to [0, 1], normalize.

    What Gemma3ImageProcessor (no pan-and-scan: plain resize) and
    CLIPImageProcessor (shortest side, center crop) do, in numpy, so no
    torch-backed processor is needed.
    """
    from PIL import Image

    image = image.convert("RGB")
    if crop:
        scale = size / min(image.size)
        w, h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
        image = image.resize((w, h), Image.Resampling.BICUBIC)
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    else:
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    x = (np.asarray(image, np.float32) / 255.0 - mean) / std
    return x.transpose(2, 0, 1)[None].copy()


class SquareTower(VisionAdapter):
    """Families whose tower (SigLIP, CLIP) takes one fixed square input and gives a fixed number of tokens."""

    crop = False  # True: shortest side resized, then a center crop (CLIP); False: a plain resize
    default_mean = default_std = (0.5, 0.5, 0.5)

    def __init__(self, model, config, processor_config, tokenizer, *, size: int, tokens_per_image: int):
        super().__init__(model, config, processor_config, tokenizer)
        self.size = size
        self.tokens_per_image = tokens_per_image
        self.mean = np.array(processor_config.get("image_mean", self.default_mean), np.float32)
        self.std = np.array(processor_config.get("image_std", self.default_std), np.float32)

    def tower_blocks(self) -> list:
        return list(self.model.vision_tower.vision_model.encoder.layers)

    def _layout(self, image) -> ImageInput:
        return ImageInput(None, None, self.tokens_per_image)

    def _pixels(self, image) -> np.ndarray:
        return _square_pixels(image, self.size, self.mean, self.std, crop=self.crop)


class Gemma3VL(SquareTower):
    """Gemma 3: a SigLIP tower at a fixed size, pooled to `mm_tokens_per_image` soft tokens."""

    family = "gemma3"

    def __init__(self, model, config, processor_config, tokenizer):
        super().__init__(model, config, processor_config, tokenizer,
                         size=config["vision_config"].get("image_size", 896),
                         tokens_per_image=config.get("text_config", config).get("mm_tokens_per_image", 256))
        self.image_token_id = config.get("image_token_index", 262144)
        self._wrap = (self.token_text(config.get("boi_token_index", 255999)),
                      self.token_text(self.image_token_id),
                      self.token_text(config.get("eoi_token_index", 256000)))

    def placeholder(self, image: ImageInput) -> str:
        start, soft, end = self._wrap
        return "\n\n" + start + soft * image.num_tokens + end + "\n\n"

    def encode(self, image: ImageInput):
        import mlx.core as mx

        m = self.model
        dtype = m.language_model.model.embed_tokens.weight.dtype
        pixels = mx.array(self.pixels(image)).transpose(0, 2, 3, 1).astype(dtype)
        hidden, _, _ = m.vision_tower(pixels, output_hidden_states=False)
        feats = m.multi_modal_projector(hidden)[0]
        # Gemma's language model scales its input embeddings by sqrt(hidden);
        # image features enter pre-divided, as mlx-vlm's merge does.
        return feats / math.sqrt(m.config.text_config.hidden_size)


class Llava(SquareTower):
    """LLaVA(-1.5): a CLIP tower at a fixed size, one token per patch (CLS dropped), an MLP projector."""

    family = "llava"
    crop = True
    default_mean = (0.48145466, 0.4578275, 0.40821073)  # CLIP's
    default_std = (0.26862954, 0.26130258, 0.27577711)

    def __init__(self, model, config, processor_config, tokenizer):
        vc = config["vision_config"]
        size = vc.get("image_size", 336)
        super().__init__(model, config, processor_config, tokenizer,
                         size=size, tokens_per_image=(size // vc.get("patch_size", 14)) ** 2)
        self.image_token_id = config.get("image_token_index", 32000)

    def placeholder(self, image: ImageInput) -> str:
        return self.token_text(self.image_token_id) * image.num_tokens

    def encode(self, image: ImageInput):
        import mlx.core as mx

        # mlx-vlm's own merge on a prompt of only image tokens: its rows are the image's embeddings.
        ids = mx.array([[self.image_token_id] * image.num_tokens])
        return self.model.get_input_embeddings(ids, mx.array(self.pixels(image))).inputs_embeds[0]


ADAPTERS = {"qwen2_5_vl": QwenVL, "qwen2_vl": QwenVL, "gemma3": Gemma3VL, "llava": Llava}


def check_supported(config: dict) -> None:
    """Raise ModelLoadError for a VLM config that cannot be served exactly (before weights are read)."""
    from mlxserve.models.vlm_families import FAMILIES
    from mlxserve.models.vlm_patches import check_supported

    if config.get("model_type") in FAMILIES:
        check_supported(config)


def load_vlm_weights(folder):
    from mlx_vlm.utils import load_model

    check_supported(json.loads((Path(folder) / "config.json").read_text()))
    return load_model(Path(folder))


def processor_config(folder) -> dict:
    """preprocessor_config.json, with video_preprocessor_config.json (where Qwen3-VL keeps its
    video settings) and processor_config.json (Pixtral's image tokens) under those names."""
    path = Path(folder) / "preprocessor_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    for name in ("video_preprocessor_config", "processor_config"):
        if (Path(folder) / f"{name}.json").is_file():
            config[name] = json.loads((Path(folder) / f"{name}.json").read_text())
    return config


def build_vlm(config: dict):
    """An mlx-vlm model object for `config` (weights not loaded)."""
    from mlx_vlm.utils import get_model_and_args

    from mlxserve.models.vlm_towers import size_fixed_tower

    check_supported(config)
    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(dict(config))
    model_config.vision_config = arch.VisionConfig.from_dict(config["vision_config"])
    text = dict(config.get("text_config") or config)
    text.setdefault("model_type", config["model_type"])
    model_config.text_config = arch.TextConfig.from_dict(text)
    for name in ("perceiver", "projector"):  # further module configs, as mlx-vlm's loader reads them (Idefics2's)
        if isinstance(config.get(f"{name}_config"), dict) and hasattr(arch, f"{name.title()}Config"):
            module_config = getattr(arch, f"{name.title()}Config").from_dict(config[f"{name}_config"])
            setattr(model_config, f"{name}_config", module_config)
    model = arch.Model(model_config)
    size_fixed_tower(model, model_config, config)  # Phi-3-vision's and FastVLM's (models/vlm_towers.py)
    if config["model_type"] == "paddleocr_vl":
        _paddle_projector_width(model, model_config)
    return model


def _paddle_projector_width(model, model_config) -> None:
    """mlx-vlm 0.7.10 builds PaddleOCR-VL's projector 1024 wide (its checkpoints' text width),
    whatever the config says; a random-weight config of another width gets one as wide as
    its text model (real checkpoints load through mlx-vlm's own loader, unchanged)."""
    from mlx_vlm.models.paddleocr_vl.vision import PaddleOCRProjector

    vc, width = model_config.vision_config, model_config.text_config.hidden_size
    model.visual.projector = PaddleOCRProjector(vc.hidden_size, width, vc.spatial_merge_size)
