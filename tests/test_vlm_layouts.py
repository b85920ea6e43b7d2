"""The mends of mlx-vlm models in mlxserve/models/vlm_layouts.py, against references of their own.

LLaVA-NeXT (and Granite Vision): mlx-vlm 0.7.10's merge gives rows that are not its processor's
image tokens; the mend packs an image as transformers does. Checked here against mlx-vlm's
LLaVA-OneVision packing (the same algorithm, written apart, with a downscale that never applies to
these sizes) and against the count the processor lays out, for wide, tall and square images.
(tests/test_vlm_architectures.py checks that the served tokens are the mended mlx-vlm pass's.)
"""

import types

import numpy as np
import pytest


@pytest.fixture(scope="module")
def llava_next():
    """A tiny LLaVA-NeXT (random weights) and its image processor's settings."""
    import transformers

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm import build_vlm

    config = tiny_vlm_config("llava_next")
    pc = config.pop("preprocessor_config")
    images = transformers.LlavaNextImageProcessorPil.from_dict({k: v for k, v in pc.items() if k != "processor_config"})
    return build_vlm(config), images, pc


@pytest.mark.parametrize("size", [(120, 100), (100, 40), (30, 90), (64, 64)])
def test_llava_next_image_rows_are_packed_as_transformers_packs_them(llava_next, size):
    import mlx.core as mx
    from mlx_vlm.models.llava_next.processing_llava_next import LlavaNextProcessor
    from mlx_vlm.models.llava_onevision.llava_onevision import Model as OneVision
    from PIL import Image

    from mlxserve.models.vlm_layouts import _anyres_rows

    model, images, pc = llava_next
    rng = np.random.default_rng(0)
    out = images([Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))], return_tensors="np")
    tiles, image_size = mx.array(out["pixel_values"][0]), out["image_sizes"][0].tolist()

    rows = _anyres_rows(model, tiles, image_size, pc["image_grid_pinpoints"])

    vc = model.config.vision_config
    *_, hidden = model.vision_tower(tiles.transpose(0, 2, 3, 1), output_hidden_states=True)
    feats = model.multi_modal_projector(hidden[model.config.vision_feature_layer][:, 1:])
    same_grid = types.SimpleNamespace(  # OneVision's packing, its downscale off (anyres_max_ a billion tiles)
        patches_per_side=vc.image_size // vc.patch_size, max_num_patches=10**9, image_newline=model.image_newline,
        config=types.SimpleNamespace(image_grid_pinpoints=pc["image_grid_pinpoints"], vision_config=vc))
    want = OneVision.pack_image_features(same_grid, [feats], [image_size])[0]
    assert rows.shape == want.shape and mx.array_equal(rows, want)

    counter = LlavaNextProcessor.__new__(LlavaNextProcessor)  # its token count alone: no tokenizer needed
    counter.image_processor, counter.num_additional_image_tokens = images, 1
    counter.patch_size = pc["processor_config"]["patch_size"]
    tokens = counter._get_number_of_features(*image_size, *tiles.shape[-2:]) - 1  # the CLS row dropped
    assert rows.shape[0] == tokens
