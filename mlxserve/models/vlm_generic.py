"""One adapter for the mlx-vlm families that follow its common interface.

mlx-vlm's models share `get_input_embeddings(input_ids, pixel_values, **image
inputs)`: ids -> the language model's input embeddings, the media rows merged
in, plus what the language model needs beside them (M-RoPE `position_ids`,
Qwen3-VL's `deepstack_visual_embeds` and `visual_pos_masks`, Gemma 4's
`per_layer_inputs`). This adapter uses it twice:

- an image's rows: `get_input_embeddings([image token] * n, its pixels)`, so
  the tower, projector and scaling are mlx-vlm's own; deepstack rows are kept
  beside them (an image is one `[n, 1 + k, D]` array in the vision cache);
- a prompt chunk: `get_input_embeddings(chunk ids)` without pixels gives the
  text rows the way the family scales them and its per-layer inputs (media
  ids zeroed); the image rows are spliced in, and the chunk's extras are
  passed to the language model with them.

A video is cut into frame groups (models/vlm.py `video_groups`), each encoded
like an image: `get_input_embeddings([video token] * n, pixel_values_videos=
its pixels, video_grid_thw=its grid)`, so a group is one vision-cache entry and
one extra key of the prefix blocks it falls in, as an image is.

What a family needs is read off the model (M-RoPE: the language model has
`get_rope_index`; deepstack: `deepstack_visual_indexes`; bidirectional image
attention: `use_bidirectional_attention`), and off the small FAMILIES table:
its image processor, the tokens around an image, how it takes video. A new
family that fits this interface is one FAMILIES entry.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mlxserve.models.vlm import ImageInput, VisionAdapter
from mlxserve.models.vlm_images import VIDEOS, OwnLayout, image_processor
from mlxserve.models.vlm_layouts import LAYER_FEATURES, MODEL_FIXES
from mlxserve.models.vlm_families import FAMILIES, Family, family_of  # noqa: F401 - read from here too
from mlxserve.models.vlm_patches import _BIDIRECTIONAL, _PATCHES, bidirectional_images, check_supported  # noqa: F401
from mlxserve.models.vlm_spans import ProcessorSpans
from mlxserve.models.vlm_bothways import IMAGES as BLOCK_IMAGES, POSITIONS, BlockTextModel, image_blocks
from mlxserve.models.vlm_standin import MARKED
from mlxserve.models.vlm_thinker import LAYER_FEATURES as THINKER_FEATURES, layer_rows, thinker_view
from mlxserve.models.vlm_prefix import CHAT_TEMPLATE as PREFIX_TEMPLATE, IMAGES as PREFIX_IMAGES, NEEDS_IMAGE
from mlxserve.models.vlm_prefix import PrefixTextModel, zero_padding


# What get_input_embeddings may return beside the embeddings; a family giving more
# (cross-attention states, encoder outputs) does not fit this path.
_KNOWN_FEATURES = {"inputs_embeds", "position_ids", "rope_deltas", "per_layer_inputs", "visual_pos_masks",
                   "deepstack_visual_embeds", "attention_mask_4d",
                   "pos_hw",  # Falcon OCR's 2-D positions: a chunk's come with its positions (vlm_bothways.py)
                   "attention_mask"}  # the mask it was given, given back (Cohere Compass)


def tower_blocks(tower) -> list:
    """The tower's transformer blocks, wherever the family keeps them."""
    for path in ("blocks", "encoder.layers", "vision_model.encoder.layers", "layers"):
        obj = tower
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if obj is not None:
            return list(obj)
    return []


def vision_tower(model):
    """The model's vision tower, under whichever name the family gives it."""
    for name in ("vision_tower", "visual", "vision_model", "vision"):
        if getattr(model, name, None) is not None:
            return getattr(model, name)
    return None


class GenericVLM(VisionAdapter):
    """Any FAMILIES model: images through mlx-vlm's get_input_embeddings, per-chunk extras passed on."""

    def __init__(self, model, config, processor_config, tokenizer):
        config = thinker_view(config)  # Qwen3-Omni's thinker's settings (models/vlm_thinker.py)
        self.family = config["model_type"]
        spec = FAMILIES[self.family]
        lm, cfg = model.language_model, getattr(model, "thinker", model).config
        self.mrope = hasattr(lm, "get_rope_index")  # Qwen3-VL, Qwen3.5: M-RoPE positions from the image grids
        self.mrope = self.mrope or spec.positions in POSITIONS  # HunyuanVL's (models/vlm_bothways.py)
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None)  # Qwen3-VL
                              or getattr(cfg, "deepstack_layer_map", None))  # Granite 4 Vision
        check_supported(config)
        for module in {klass.__module__ for klass in type(lm).__mro__} & _PATCHES.keys():
            _PATCHES[module]()
        self.whole_images = bidirectional_images(config)
        if self.whole_images:
            _BIDIRECTIONAL[self.family]()
        self.whole_images = self.whole_images or spec.both_ways is not None or spec.prefix_lm  # vlm_bothways.py
        # PaliGemma's whole prompt attends both ways (models/vlm_prefix.py): prefilled to its end in one pass.
        self.prompt_both_ways = spec.prefix_lm
        self.needs_image = NEEDS_IMAGE if spec.prefix_lm else None
        super().__init__(model, config, processor_config, tokenizer)
        if spec.both_ways is not None or spec.positions in POSITIONS:  # their mask and positions, per pass
            self.text_model = BlockTextModel(lm, self.mrope, spec.positions)
        if spec.prefix_lm:
            self.text_model = PrefixTextModel(lm, self.mrope)
        owned = {**MARKED, **BLOCK_IMAGES, **PREFIX_IMAGES}
        if spec.processor in owned:  # stand-ins; models/vlm_bothways.py, models/vlm_prefix.py
            from mlxserve.models.chat import hf_of

            self.images = owned[spec.processor](config, processor_config, hf_of(tokenizer))
        elif spec.own is not None:
            from mlxserve.models.chat import hf_of

            self.images = ProcessorSpans(spec.processor, spec.own, config, processor_config, hf_of(tokenizer),
                                         spec.image_processor, spec.placeholder)
        elif spec.image_processor is None:
            self.images = image_processor(spec.processor, config, processor_config)
        else:
            from mlxserve.models.chat import hf_of

            self.images = OwnLayout(spec.processor, spec.image_processor, config, processor_config,
                                    hf_of(tokenizer), spec.placeholder)
        if self.family in MODEL_FIXES:  # mlx-vlm's model mended (models/vlm_layouts.py)
            MODEL_FIXES[self.family](model, self.images)
        self.text_model.positions_last = spec.positions == "last"
        if spec.processor in MARKED or hasattr(self.images, "stand_in"):
            self.image_token_id = self.images.stand_in
        elif spec.own is not None and spec.own.image_token:  # a token the config does not name (Molmo's)
            self.image_token_id = self.images.token_id()
        else:
            self.image_token_id = self._token_id(config, spec.image_token)
        self.expands = self._token_id(config, (spec.expands,)) if spec.expands else None
        self._wrap = (self._wrap_text(config, spec.wrap[0]), self.token_text(self.image_token_id),
                      self._wrap_text(config, spec.wrap[1]))
        if spec.prefix_lm:  # PaliGemma's processor writes BOS after the image (models/vlm_prefix.py)
            from mlxserve.models.chat import hf_of

            hf = hf_of(tokenizer)
            self._wrap = (*self._wrap[:2], self._wrap[2] + (hf.bos_token or ""))
            if hf.chat_template is None:  # its checkpoints have none: mlx-vlm's prompt for it
                hf.chat_template = PREFIX_TEMPLATE
        self._deltas: OrderedDict[tuple, int] = OrderedDict()  # image grids -> M-RoPE delta
        self.videos = VIDEOS[spec.video](config, processor_config) if spec.video else None
        if self.videos is not None:
            self.video_token_id = config.get("video_token_id")
            if self.video_token_id is None:
                raise ValueError(f"{self.family}: config.json lacks video_token_id")
            self.video_processor = self.videos.processor  # VisionAdapter.pixels makes a video's pixels with it
        if getattr(self.images, "expands", False):  # how many rows the marker gives: read once, off a probe image
            self.images.rows = int(self.encode(self.images.probe()).shape[0])

    def _token_id(self, config: dict, keys: tuple[str, ...]) -> int:
        """The first of the config's `keys` it sets (config.json's, else mlx-vlm's default for the family),
        or a literal token text ("<unk>") for a family whose config names none."""
        for key in keys:
            if key.startswith("<"):
                return self.tokenizer.convert_tokens_to_ids(key)
            value = config.get(key, getattr(self.model.config, key, None))
            if isinstance(value, int):
                return value
        raise ValueError(f"{self.family}: config.json lacks the image token id ({' or '.join(keys)})")

    def _wrap_text(self, config: dict, key: str | None) -> str:
        """A token around an image's run: none, a literal text, or the token a config key names."""
        if key is None:
            return ""
        if key.startswith("<"):
            return key
        return self.token_text(self._token_id(config, (key,)))

    def tower_blocks(self) -> list:
        return tower_blocks(vision_tower(self.model))

    def _layout(self, image) -> ImageInput:
        inp = self.images.layout(image)
        if self.expands is not None:  # the tower is given the one id its merge expands (Phi-4-MM's -200)
            inp.tower_ids = (self.expands,)
        return inp

    def _pixels(self, image) -> np.ndarray:
        return self.images.pixels(image)

    def _breaks(self) -> tuple[int, int]:
        """Pixtral's row-break and end token ids (its processor's texts, or the config's ids)."""
        return tuple(self._token_id(self.config, (key,)) if key in self.config else
                     self.tokenizer.convert_tokens_to_ids(text)
                     for key, text in (("image_break_token_id", self.images.break_text),
                                       ("image_end_token_id", self.images.end_text)))

    def image_span_ids(self) -> set[int]:
        if hasattr(self.images, "span_ids"):  # Falcon OCR's image markers (models/vlm_bothways.py)
            return self.images.span_ids()
        return {self.image_token_id, *self._breaks()} if hasattr(self.images, "token_ids") else {self.image_token_id}

    def _image_ids(self, image: ImageInput) -> list[int]:
        """The ids of an image's placeholder inside its wrap: its image tokens (and row breaks), or
        the span its family's own processor laid out."""
        if image.ids is not None:
            return list(image.ids)
        if hasattr(self.images, "token_ids"):
            return self.images.token_ids(image, self.image_token_id, *self._breaks())
        return [self.image_token_id] * image.num_tokens

    def placeholder(self, image: ImageInput) -> str:
        if image.ids is not None:  # checked to tokenize back to these ids (OwnLayout.layout)
            return self.images.tokenizer.decode(image.ids, clean_up_tokenization_spaces=False)
        start, _, end = self._wrap
        return start + "".join(self.tokenizer.convert_ids_to_tokens(self._image_ids(image))) + end

    def image_prefix(self, index: int) -> str:
        """Text the prompt puts before its image `index` (from 0), outside the image's span: its number,
        where the family's processor writes one (MiniCPM-V's <image_id>k</image_id>)."""
        return self.images.image_prefix(index) if hasattr(self.images, "image_prefix") else ""

    def preprocess_video(self, frames: list, video: int) -> list[ImageInput]:
        if self.videos is None:
            return super().preprocess_video(frames, video)
        return self.videos.groups(frames, video)

    def video_placeholder(self, groups: list[ImageInput]) -> str:
        start, _, end = self._wrap
        return self.videos.placeholder(groups, start, self.token_text(self.video_token_id), end)

    def encode(self, image: ImageInput):
        """The image's (or video frame group's) rows as mlx-vlm's own merge places them: [n, D], or
        [n, 1 + k, D] with Qwen3-VL's k deepstack rows beside each token's embedding."""
        import mlx.core as mx

        pixels = self.tower_pixels(image)
        if image.video is None:
            ids = mx.array([list(image.tower_ids) if image.tower_ids is not None else self._image_ids(image)])
            kwargs = {"pixel_values": pixels, **self.images.image_kwargs(image)}
        else:
            ids = mx.array([[self.video_token_id] * image.num_tokens])
            kwargs = self.videos.tower_kwargs(image, pixels)
        # An integer mask where the processor's attention_mask is one the model reads (FastVLM's merge
        # slices the ids by its sums).
        mask = mx.ones(ids.shape, dtype=mx.int32 if getattr(self.images, "int_mask", False) else mx.float32)
        f = self.model.get_input_embeddings(ids, mask=mask, **kwargs)
        extra = {k for k, v in f.to_dict().items() if v is not None} - _KNOWN_FEATURES
        if extra:
            raise ValueError(f"{self.family}: mlx-vlm's get_input_embeddings also gives {sorted(extra)}, "
                             "which this adapter does not pass to the language model")
        rows = f.inputs_embeds[0]
        if self.deepstack:  # a list of rows a layer, or Cohere Compass's wrapper of it (and its mask)
            deep = f.deepstack_visual_embeds
            if isinstance(deep, mx.array) and deep.ndim == 4:  # [batch, tokens, layers, D] (Qwen3-Omni's)
                deep = layer_rows(deep)
            rows = mx.stack([rows, *getattr(deep, "embeddings", deep)], axis=1)
        return rows

    def tower_pixels(self, image: ImageInput):
        """The image's pixels as mlx-vlm's get_input_embeddings takes them: one array, or (a family whose
        crops differ in size: MiniCPM-V 4.6's) the one prompt's list of arrays."""
        import mlx.core as mx

        pixels = self.pixels(image)
        if hasattr(self.images, "tower_pixels"):  # DeepSeek-OCR's [crops, global view] (models/vlm_ocr.py)
            return self.images.tower_pixels(pixels)
        return [[mx.array(p) for p in pixels]] if isinstance(pixels, tuple) else mx.array(pixels)

    def _media(self, ids):
        """Which of `ids` are image (or video) tokens."""
        media = ids == self.image_token_id
        return media if self.video_token_id is None else media | (ids == self.video_token_id)

    def mlx_vlm_lm_kwargs(self, token_ids, image_inputs: dict) -> dict:
        """What mlx-vlm's Model.__call__ gives its language model beside the input embeddings, for
        a family whose get_input_embeddings does not give it all (tests compare with its pass)."""
        import mlx.core as mx

        if FAMILIES[self.family].prefix_lm:  # none: the whole prompt both ways (PaliGemma's mask of ones)
            return {}
        if FAMILIES[self.family].both_ways is not None:  # its mask, both ways over the image's rows
            return {"mask": self.model.get_input_embeddings(mx.array([token_ids]), **image_inputs).attention_mask_4d}
        name = FAMILIES[self.family].media_mask
        if name is None:
            return {}
        media = self._media(mx.array([token_ids]))
        return {**image_inputs, name: media.astype(mx.int32) if name == "token_type_ids" else media}

    def mlx_vlm_ids(self, token_ids, images) -> list[int]:
        """The prompt as mlx-vlm's processor gives it (tests compare with its pass): a family whose
        merge expands one id into an image's rows has that id where each image's run is."""
        out = list(token_ids)
        for im in sorted(images, key=lambda im: im.start, reverse=True):
            if im.pixels.tower_ids is not None:  # the processor's own marks, or the one id its merge expands
                out[im.start: im.start + im.num_tokens] = im.pixels.tower_ids
        return out

    def inputs(self, token_ids, spans) -> dict:
        """Embeddings of a prompt chunk (the family's own text rows, image rows spliced in at
        `spans`) and the chunk's extras: its deepstack rows, its per-layer inputs."""
        import mlx.core as mx

        ids = mx.array(token_ids)[None]
        # MiniCPM-V 4.7's merge refuses image tokens without their crops' grids: its text rows are read with
        # them as id 0 (the image's spliced rows take their place).
        canvas = FAMILIES[self.family].positions == "canvas"
        text = self.model.get_input_embeddings(mx.where(self._media(ids), 0, ids) if canvas else ids)
        emb = text.inputs_embeds[0]
        pieces, deep, pos = [], [], 0
        for start, rows in sorted(spans, key=lambda s: s[0]):
            if start > pos:
                pieces.append(emb[pos:start])
            pieces.append((rows[:, 0] if rows.ndim == 3 else rows).astype(emb.dtype))
            if rows.ndim == 3:
                deep.append(rows[:, 1:])
            pos = start + rows.shape[0]
        if pos < emb.shape[0]:
            pieces.append(emb[pos:])
        out = {"inputs_embeds": mx.concatenate(pieces)[None] if spans else emb[None]}
        if deep:
            rows = mx.concatenate(deep).astype(emb.dtype)  # the chunk's image tokens, in prompt order
            media = ids == self.image_token_id
            out["visual_pos_masks"] = media if self.video_token_id is None else media | (ids == self.video_token_id)
            out["deepstack_visual_embeds"] = [rows[:, j] for j in range(rows.shape[1])]
            features = LAYER_FEATURES | THINKER_FEATURES  # (Qwen3-Omni's: models/vlm_thinker.py)
            if self.family in features:
                out = features[self.family](out, media, rows)
        if getattr(text, "per_layer_inputs", None) is not None:
            out["per_layer_inputs"] = text.per_layer_inputs
        name = FAMILIES[self.family].media_mask
        if name is not None:
            out[name] = self._media(ids).astype(mx.int32) if name == "token_type_ids" else self._media(ids)
        both_ways = FAMILIES[self.family].both_ways
        if FAMILIES[self.family].prefix_lm:  # its merge's zero rows for the pad token; its mask: none (all)
            out["inputs_embeds"] = zero_padding(out["inputs_embeds"], ids, self.model.config.pad_token_id)
        elif both_ways is not None and spans:  # the spans the chunk's mask lets attend to themselves both ways
            out["image_blocks"] = image_blocks(len(token_ids), spans, both_ways)
        elif self.whole_images:  # which tokens are media: mlx-vlm's mask lets each run attend to itself both ways
            types = (ids == self.image_token_id).astype(mx.int32)
            if self.video_token_id is not None:
                types = types + 2 * (ids == self.video_token_id)
            out["mm_token_type_ids"] = types
        return out

    def embed(self, token_ids, spans):
        return self.inputs(token_ids, spans)["inputs_embeds"]

    def positions(self, token_ids, images):
        if not self.mrope:
            return None, 0
        import mlx.core as mx

        if FAMILIES[self.family].positions == "index":
            return mx.broadcast_to(mx.arange(len(token_ids))[None, None], (3, 1, len(token_ids))), 0
        if FAMILIES[self.family].positions == "canvas":  # MiniCPM-V 4.7's
            from mlxserve.models.vlm_minicpm import canvas_positions

            return canvas_positions(self.model, token_ids, images)
        if FAMILIES[self.family].positions in POSITIONS:  # Falcon OCR's, HunyuanVL's (models/vlm_bothways.py)
            pos, delta = POSITIONS[FAMILIES[self.family].positions](self, token_ids, images)
        else:
            # A video's groups go as video grids of (1, h, w) each: mlx-vlm cuts a video's (t, h, w)
            # into those rows itself, one per vision block.
            grids = [im.grid_thw for im in images if im.video is None]
            videos = [im.grid_thw for im in images if im.video is not None]
            # By name: Cohere Compass's takes no video grids.
            pos, delta = self.model.language_model.get_rope_index(
                mx.array([token_ids]), image_grid_thw=mx.array(grids) if grids else None,
                **({"video_grid_thw": mx.array(videos)} if videos else {}))
            if self.text_model.positions_last:
                pos = pos.transpose(2, 0, 1)
            delta = int(delta.reshape(-1)[0].item())
        self._deltas[tuple(im.grid_thw for im in images)] = delta
        while len(self._deltas) > 1024:
            self._deltas.popitem(last=False)
        return pos, delta

    def rope_delta(self, token_ids, images) -> int:
        if FAMILIES[self.family].positions == "canvas":  # its crops' grids (not image grids) and the marks decide
            return self.positions(token_ids, images)[1]
        # As for Qwen2.5-VL: the delta is a function of the image grids alone (a video
        # group's block is placed as an image's of its grid).
        key = tuple(im.grid_thw for im in images)
        delta = self._deltas.get(key)
        if delta is None:
            return self.positions(token_ids, images)[1]
        self._deltas.move_to_end(key)
        return delta


def make_adapter(model, config: dict, processor_config: dict, tokenizer) -> VisionAdapter:
    """The family's hand-written adapter (models/vlm.py ADAPTERS), else the generic one."""
    from mlxserve.models.vlm import ADAPTERS

    return ADAPTERS.get(config["model_type"], GenericVLM)(model, config, processor_config, tokenizer)
