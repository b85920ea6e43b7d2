"""DeepSeek-OCR's and DeepSeek-OCR 2's images (models/vlm_ocr.py) are laid out as mlx-vlm's own
processors lay them out: the same number of image tokens, crop grid and pixels, for an image
small enough for the global view alone and one cut into crops."""

import copy
import functools

import pytest


@functools.lru_cache(maxsize=None)
def processor(model_type):
    from mlx_vlm.models.deepseekocr.processing_deepseekocr import DeepseekOCRProcessor
    from mlx_vlm.models.deepseekocr_2.processing_deepseekocr import DeepseekOCR2Processor

    from mlxserve.models.chat import hf_of
    from mlxserve.models.load import default_tokenizer

    cls = DeepseekOCR2Processor if model_type == "deepseekocr_2" else DeepseekOCRProcessor
    return cls(tokenizer=copy.deepcopy(hf_of(default_tokenizer())), candidate_resolutions=[[1024, 1024]],
               patch_size=16, downsample_ratio=4)


@pytest.mark.parametrize("model_type", ["deepseekocr", "deepseekocr_2"])
@pytest.mark.parametrize("size", [(90, 70), (1000, 700)])
def test_layout_and_pixels_are_its_processors(model_type, size):
    import mlx.core as mx
    import numpy as np
    from PIL import Image

    from mlxserve.models.vlm_ocr import DeepSeekOCRImages

    image = Image.fromarray(np.random.default_rng(sum(size)).integers(0, 255, (size[1], size[0], 3), np.uint8))
    proc = processor(model_type)
    ids, (crops, view), mask, grid, _ = proc.tokenize_with_images(proc.image_token, [image])
    ours = DeepSeekOCRImages({"model_type": model_type}, {})
    inp = ours.layout(image)
    assert inp.num_tokens == ids.count(proc.image_token_id) == int(np.asarray(mask).sum())
    assert np.array_equal(inp.extras["images_spatial_crop"], np.asarray(grid))
    got = ours.tower_pixels(ours.pixels(image))
    assert got[1].dtype == view.dtype == mx.bfloat16 and mx.array_equal(got[1], view).item()
    if model_type == "deepseekocr_2" or max(size) > 640:  # crops (OCR 2 always has one)
        assert crops.shape[0] > 1 or model_type == "deepseekocr_2"
        assert mx.array_equal(got[0], crops).item()
