"""Image processors of generic-adapter families whose image is several tower inputs (tiles,
crops) laid out as one run of image tokens between the family's marks: how the image is cut
(numpy and PIL, off the engine thread), how many tokens it takes. Each follows mlx-vlm's own
processor for the family, read from the files that processor reads. (vlm_images.py holds the
single-input families' processors; vlm_images.OwnLayout the families whose processor puts
text between the tiles.)"""

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
