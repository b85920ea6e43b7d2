"""DeepSeek-OCR and DeepSeek-OCR 2: an image is one run of image tokens (a global view padded to
1024 px, and local crops of the image), over two pixel arrays its model takes as one list.

mlx-vlm's processors lay an image out in code, whatever the checkpoint's files say (only the
mean and std are read): DeepSeek-OCR's global view is 1024 px, 16 x 16 rows, each row ended by a
newline row, then a separator row; an image wider or taller than 640 px is also cut into 2 to 9
crops of 640 px (the grid closest to its aspect), 10 x 10 rows each, the crops' rows ended by a
newline row. DeepSeek-OCR 2's image is always cut into 1 to 6 crops of 768 px (144 rows each),
then its 1024 px global view (256 rows) and a separator row. Every row is the image token in
the prompt; mlx-vlm's merge fills them in order from images_seq_mask.

Here those steps run as its processors run them (their crop and pad functions, their transform
in numpy: ToTensor and the mean/std), off the engine thread, without the MLX arrays its
processors make there; the pixels become bfloat16 on the engine thread as its processors make
them (`tower_pixels`). tests/test_vlm_ocr.py compares both with mlx-vlm's processors.
"""

from __future__ import annotations

import math

import numpy as np

from mlxserve.models.vlm import ImageInput
from mlxserve.models.vlm_images import image_settings

BASE = 1024  # the global view's size (its processors' base_size)
PATCH, DOWNSAMPLE = 16, 4  # SAM's patch, and its two stride-2 convolutions: 64 px a row


class DeepSeekOCRImages:
    """An image as DeepSeek-OCR's (or OCR 2's) processor lays it out."""

    def __init__(self, config: dict, pc: dict):
        import importlib

        self.ocr2 = config["model_type"] == "deepseekocr_2"
        name = "deepseekocr_2" if self.ocr2 else "deepseekocr"
        self.module = importlib.import_module(f"mlx_vlm.models.{name}.processing_deepseekocr")
        settings = image_settings(pc) | pc.get("processor_config", {})
        self.mean = np.asarray(settings.get("image_mean", (0.5, 0.5, 0.5)), np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(settings.get("image_std", (0.5, 0.5, 0.5)), np.float32).reshape(-1, 1, 1)
        self.normalize = settings.get("normalize", True)
        self.crop = 768 if self.ocr2 else 640  # its processor's image_size

    def _crops(self, image) -> tuple[list, tuple[int, int]]:
        """The local crops and their grid (columns, rows), as its processor cuts them."""
        if self.ocr2:  # min_patches=1, max_patches=6: always at least one crop
            return self.module.dynamic_preprocess(image, min_num=1, max_num=6, image_size=self.crop)
        if image.width <= self.crop and image.height <= self.crop:
            return [], (1, 1)
        return self.module.dynamic_preprocess(image)  # 2 to 9 crops of 640 px

    def _tokens(self, grid: tuple[int, int]) -> int:
        if self.ocr2:  # 144 rows a crop, 256 the global view, the separator
            return grid[0] * grid[1] * 144 + 256 + 1
        side = math.ceil(BASE // PATCH / DOWNSAMPLE)
        out = side * (side + 1) + 1
        if grid[0] > 1 or grid[1] > 1:
            q = math.ceil(self.crop // PATCH / DOWNSAMPLE)
            out += (q * grid[0] + 1) * (q * grid[1])
        return out

    def layout(self, image) -> ImageInput:
        _, grid = self._crops(image.convert("RGB"))
        n = self._tokens(grid)
        return ImageInput(None, None, n, extras={"images_spatial_crop": np.asarray([grid]),
                                                 "images_seq_mask": np.ones((1, n), bool)})

    def _transform(self, image) -> np.ndarray:
        """Its ImageTransform, in numpy: the same float32 steps, so the same values."""
        x = (np.asarray(image, np.float32) / np.float32(255.0)).transpose(2, 0, 1)
        return (x - self.mean) / self.std if self.normalize else x

    def pixels(self, image) -> tuple[np.ndarray, np.ndarray]:
        """(its crops, or a placeholder its model never reads when there are none; its global view)."""
        from PIL import ImageOps

        image = image.convert("RGB")
        crops, _ = self._crops(image)
        view = ImageOps.pad(image, (BASE, BASE), color=tuple(int(x * 255) for x in self.mean.reshape(-1)))
        local = np.stack([self._transform(c) for c in crops]) if crops else np.zeros((1, 3, 1, 1), np.float32)
        return local, self._transform(view)[None]

    @staticmethod
    def tower_pixels(pixels) -> list:
        """[crops, global view] in bfloat16, as its processors give them to its model."""
        import mlx.core as mx

        return [mx.array(p).astype(mx.bfloat16) for p in pixels]

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {k: mx.array(v) for k, v in (inp.extras or {}).items()}

    @staticmethod
    def prompt_kwargs(inp: ImageInput, start: int, length: int) -> dict:
        """image_kwargs for mlx-vlm's own pass over a whole prompt (tests compare with it)."""
        import mlx.core as mx

        mask = np.zeros((1, length), bool)
        mask[0, start: start + inp.num_tokens] = True
        return {"images_spatial_crop": mx.array(inp.extras["images_spatial_crop"]), "images_seq_mask": mx.array(mask)}
