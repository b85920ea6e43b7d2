"""Image processors of generic-adapter families whose image is one run of image tokens (between
the family's marks) over square tower inputs of a fixed number of tokens each: one input, or
tiles. Made by mlx-vlm's own image processing for the family (numpy and PIL, off the engine
thread)."""

from __future__ import annotations

import numpy as np

from mlxserve.models.vlm import ImageInput
from mlxserve.models.vlm_images import image_settings


class DeepSeekVLImages:
    """DeepSeek-VL / Janus (multi_modality): the image resized to fit the tower's square and padded
    to it with the mean colour (mlx-vlm's multi_modality ImageProcessor, which reads the tower's
    config: a hybrid SAM + SigLIP tower's high-resolution size and normalization); its tokens: the
    config's num_image_tokens, which mlx-vlm's merge expands one image token into."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.multi_modality.multi_modality import ImageProcessor

        vc = config["vision_config"]
        # As its processor's from_pretrained reads preprocessor_config.json (the settings it takes).
        keys = ("image_size", "min_size", "image_mean", "image_std", "rescale_factor", "do_normalize")
        settings = {"image_size": vc.get("image_size", 384)} | {k: v for k, v in image_settings(pc).items() if k in keys}
        self.proc = ImageProcessor({"vision_config": {"params": vc.get("params") or {}}}, **settings)
        self.tokens = config.get("num_image_tokens", 576)

    def layout(self, image) -> ImageInput:
        return ImageInput(None, None, self.tokens)

    def pixels(self, image) -> np.ndarray:
        return np.stack(self.proc.preprocess([image.convert("RGB")])).astype(np.float32)

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


class PlamoTiles:
    """PLaMo 2 VL: Eagle-2 tiles (the grid closest to the image's aspect, fewer while the image's
    tokens would pass tile_context_length) and a thumbnail, each a SigLIP input of
    (size / patch)^2 tokens, all one run between <siglip2:img> and </siglip2:img>; cut by mlx-vlm's
    Plamo2VLProcessor (its tiling alone: that processor renders whole prompts in its own template),
    normalized by its SigLIP image processor, from preprocessor_config.json."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.plamo2vl.processing import Plamo2VLProcessor, SiglipImageProcessor

        self.proc = Plamo2VLProcessor(image_processor=SiglipImageProcessor.from_dict(image_settings(pc)), tokenizer=None)
        self.mark = self.proc._dummy_image_token

    def _tiles(self, image) -> tuple[int, list]:
        text, tiles = self.proc._split_images_into_tiles(self.mark, [image.convert("RGB")])
        return text.count(self.mark), tiles

    def layout(self, image) -> ImageInput:
        return ImageInput(None, None, self._tiles(image)[0])

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self.proc.image_processor(images=self._tiles(image)[1], return_tensors="np")["pixel_values"])

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}
