"""The omni families' image processors (models/vlm_omni.py) give what mlx-vlm's own processors
give (those make MLX arrays, so mlxserve redoes their steps in numpy off the engine thread):
the same pixels and the same token counts, over images of several sizes and aspects."""

import numpy as np
import pytest

from test_vlm import picture

SIZES = [(100, 120), (90, 80), (33, 200), (300, 41), (20, 20)]


@pytest.mark.parametrize("size", SIZES)
def test_nemotron_omni_images_are_mlx_vlms(size):
    from mlx_vlm.models.nemotron_h_nano_omni.image_processing_nemotron_h_nano_omni import (
        NemotronHNanoOmniImageProcessor,
    )

    from mlxserve.models.vlm_omni import NemotronOmniImages

    settings = {"norm_mean": [0.48, 0.45, 0.4], "norm_std": [0.26, 0.26, 0.27], "patch_size": 16,
                "min_num_patches": 4, "max_num_patches": 64, "max_model_len": 64}
    image = picture(3, size)
    ours = NemotronOmniImages({}, settings)
    want = NemotronHNanoOmniImageProcessor(**settings)(images=[image])
    assert ours.layout(image).num_tokens == want["num_tokens"][0]
    np.testing.assert_allclose(ours.pixels(image), np.asarray(want["pixel_values"]), atol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_phi4mm_images_are_mlx_vlms(size):
    from mlx_vlm.models.phi4mm.processing_phi4mm import Phi4MMImageProcessor

    from mlxserve.models.vlm_omni import Phi4MMImages

    settings = {"patch_size": 16, "min_num_patches": 4, "max_num_patches": 36}
    image = picture(4, size)
    ours = Phi4MMImages({}, settings)
    want = Phi4MMImageProcessor(**settings)(image)
    inp = ours.layout(image)
    assert list(inp.grid_thw[1:]) == np.asarray(want["spatial_shapes"])[0].tolist()
    assert inp.num_tokens == int(np.asarray(want["pixel_attention_mask"]).sum())
    np.testing.assert_array_equal(ours.pixels(image), np.asarray(want["pixel_values"]))
    np.testing.assert_array_equal(np.asarray(ours.image_kwargs(inp)["pixel_attention_mask"]),
                                  np.asarray(want["pixel_attention_mask"]))


@pytest.mark.parametrize("frac", [None, 0.5, 1.7])
def test_inkling_images_are_mlx_vlms(frac):
    from mlx_vlm.models.inkling.processing_inkling import InklingImageProcessor

    from mlxserve.models.vlm_omni import InklingImages

    settings = {"patch_size": 32, "rescale_image_frac": frac, "rescale_image_max_upscaled_long_edge": 150}
    ours, theirs = InklingImages({}, settings), InklingImageProcessor(**settings)
    for size in SIZES:
        image = picture(5, size)
        want = theirs(image)
        assert ours.layout(image).num_tokens == want["num_patches"][0]
        np.testing.assert_array_equal(ours.pixels(image), np.asarray(want["pixel_values"]))
