"""Image processors of generic-adapter families whose image is one square tower input of a fixed
number of tokens, made by mlx-vlm's own image processor for the family (numpy and PIL, off the
engine thread)."""

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
