"""Omni models (audio and image towers) served with images through the generic adapter
(models/vlm_generic.py): what their mlx-vlm processors need to run on images alone. Audio is
not served: a request's parts are text and images (and video where the family takes it)."""

from __future__ import annotations

import math

import numpy as np
from mlx_vlm.models.minicpmo.processing_minicpmo import MiniCPMOProcessor

from mlxserve.models.vlm import ImageInput


class MiniCPMOImages(MiniCPMOProcessor):
    """mlx-vlm's MiniCPM-o processor over images. It takes no audio feature extractor when
    given no audio, but transformers' ProcessorMixin refuses it one that is None (a type
    check of each attribute); a default Whisper extractor stands in, and no audio reaches it."""

    # (transformers reads the processor's parts off this signature: it is mlx-vlm's.)
    def __init__(self, image_processor=None, audio_processor=None, tokenizer=None, **kwargs):
        from transformers import WhisperFeatureExtractor

        super().__init__(image_processor=image_processor, audio_processor=audio_processor or WhisperFeatureExtractor(),
                         tokenizer=tokenizer, **kwargs)


def _bicubic_aa_taps(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, taps) source indices and weights of an antialiased bicubic resize (Keys' a=-0.5,
    the kernel stretched when shrinking, each output pixel's weights normalized): mlx-vlm's
    `_bicubic_aa_weights_1d` (PyTorch's `_upsample_bicubic2d_aa`), in numpy."""
    scale = size / out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out, dtype=np.float32) + 0.5)
    lo = np.maximum(np.floor(center - support + 0.5), 0.0)
    hi = np.minimum(np.floor(center + support + 0.5), float(size))
    pos = lo[:, None] + np.arange(taps, dtype=np.float32)[None]
    t = np.abs((pos - center[:, None] + 0.5) * inv)
    a = -0.5
    w = np.where(t <= 1.0, (a + 2) * t**3 - (a + 3) * t**2 + 1,
                 np.where(t < 2.0, a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a, 0.0)).astype(np.float32)
    w = np.where(pos - lo[:, None] < np.clip(hi - lo, 0, taps)[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total > 0, w / np.maximum(total, 1e-30), w)
    return np.minimum(pos, size - 1).astype(np.int64), w.astype(np.float32)


def resize_bicubic_aa(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """An (H, W, C) float32 image resized as mlx-vlm's `resize_bicubic_nhwc(antialias=True)`
    does it with MLX (the width's taps summed inside each row's), in numpy: an image processor
    runs off the engine thread, where MLX may not."""
    if x.shape[:2] == (height, width):
        return x
    iy, wy = _bicubic_aa_taps(x.shape[0], height)
    ix, wx = _bicubic_aa_taps(x.shape[1], width)
    rows = (x[:, ix] * wx[None, :, :, None]).sum(axis=2)  # (H, width, C)
    return (rows[iy] * wy[:, :, None, None]).sum(axis=1).astype(np.float32)


class NemotronOmniImages:
    """Nemotron-3 Nano Omni: the image resized to a patch grid under its budget (whole, no tiles:
    mlx-vlm's NemotronHNanoOmniImageProcessor, whose sizes it reads), one run of image tokens
    between <img> and </img>, the grid over the pixel shuffle's factor squared. Resized and
    normalized in numpy (that processor resizes with MLX)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.nemotron_h_nano_omni.image_processing_nemotron_h_nano_omni import (
            NemotronHNanoOmniImageProcessor,
        )

        from mlxserve.models.vlm_images import image_settings

        self.proc = NemotronHNanoOmniImageProcessor(**image_settings(pc))

    def _size(self, image) -> tuple[int, int]:
        """(width, height) in patches, as the processor's _preprocess sizes one image."""
        p, f = self.proc, self.proc._downsample_factor
        budget = max((p.max_model_len - 4) * f * f, p.min_num_patches)
        cap = p.max_num_patches if p.max_num_patches and p.max_num_patches > 0 else float("inf")
        return p._compute_target_patches(image, max(min(budget, cap), p.min_num_patches))

    def layout(self, image) -> ImageInput:
        wp, hp = self._size(image)
        return ImageInput(None, None, wp * hp // self.proc._downsample_factor**2)

    def pixels(self, image) -> np.ndarray:
        wp, hp = self._size(image)
        x = resize_bicubic_aa(np.asarray(image.convert("RGB"), np.float32), hp * self.proc.patch_size,
                              wp * self.proc.patch_size)
        mean = np.asarray(self.proc.norm_mean, np.float32)
        std = np.asarray(self.proc.norm_std, np.float32)
        return np.ascontiguousarray(((x / 255.0 - mean) / std).transpose(2, 0, 1)[None])

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


class Phi4MMImages:
    """Phi-4-multimodal: SigLIP-2 NaFlex patches of the image resized to a patch grid under its
    patch budget (at least min_num_patches; small images are not upscaled past it), padded to
    max_num_patches with a mask, one token a patch; as mlx-vlm's Phi4MMImageProcessor, whose
    numpy steps these are (it returns MLX arrays, made off the engine thread)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.phi4mm.processing_phi4mm import Phi4MMImageProcessor

        from mlxserve.models.vlm_images import image_settings

        self.proc = Phi4MMImageProcessor(**image_settings(pc))

    def _size(self, image) -> tuple[int, int]:
        """(height, width) in pixels, as the processor's preprocess picks them."""
        from mlx_vlm.models.phi4mm.processing_phi4mm import get_image_size_for_max_num_patches

        p = self.proc
        patches = max((image.height // p.patch_size) * (image.width // p.patch_size), 1)
        budget = min(max(patches, p.min_num_patches), p.max_num_patches)
        return get_image_size_for_max_num_patches(image.height, image.width, p.patch_size, budget)

    def layout(self, image) -> ImageInput:
        h, w = self._size(image)
        grid = (1, h // self.proc.patch_size, w // self.proc.patch_size)
        return ImageInput(None, grid, grid[1] * grid[2])

    def pixels(self, image) -> np.ndarray:
        from mlx_vlm.models.phi4mm.processing_phi4mm import convert_image_to_patches, pad_along_first_dim
        from PIL import Image

        h, w = self._size(image)
        x = np.array(image.convert("RGB").resize((w, h), Image.Resampling.BILINEAR)).astype(np.float32) / 255.0
        x = (x - np.array(self.proc.image_mean, np.float32)) / np.array(self.proc.image_std, np.float32)
        patches, _ = pad_along_first_dim(convert_image_to_patches(x, self.proc.patch_size), self.proc.max_num_patches)
        return patches[None]

    def image_kwargs(self, inp: ImageInput) -> dict:
        import mlx.core as mx

        _, h, w = inp.grid_thw
        mask = np.arange(self.proc.max_num_patches) < h * w
        return {"pixel_attention_mask": mx.array(mask[None]), "spatial_shapes": mx.array([[h, w]])}


class InklingImages:
    """Inkling: the image cut into patch x patch tiles (ceil(H / patch) rows, W // patch + 1
    columns, edge tiles padded), each one image token, its frame doubled on the temporal axis;
    mlx-vlm's InklingImageProcessor's own numpy steps (its preprocess returns an MLX array)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.inkling.processing_inkling import InklingImageProcessor

        from mlxserve.models.vlm_images import image_settings

        self.proc = InklingImageProcessor(**image_settings(pc))

    def layout(self, image) -> ImageInput:
        """Its tile count, from the size _preprocess_one gives the image (after its rescale, if set)."""
        p, (height, width) = self.proc, (image.height, image.width)
        if p.rescale_image_frac is not None:
            long_edge = max(height, width)
            target = long_edge * p.rescale_image_frac
            if p.rescale_image_max_upscaled_long_edge is not None:
                target = min(target, max(p.rescale_image_max_upscaled_long_edge, long_edge))
            if target != long_edge:
                ratio = target / long_edge
                height, width = math.floor(height * ratio + 0.5), math.floor(width * ratio + 0.5)
        return ImageInput(None, None, -(-height // p.patch_size) * (width // p.patch_size + 1))

    def pixels(self, image) -> np.ndarray:
        return self.proc._preprocess_one(image)

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}
