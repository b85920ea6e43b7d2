"""Family inputs the generated per-type test (tests/test_vlm_architectures.py) is too coarse to
see: it compares a few greedy tokens, which a dummy model's logits may keep when an input moves
them by less than their margin. Here prompt chunks' logits are compared with mlx-vlm's own
whole-prompt pass, and the input is shown to matter."""

import numpy as np
import pytest

from test_vlm import mlx_vlm_forward, picture
from test_vlm_architectures import load_config, user


def chunked_logits(vision, ids, images, step=5):
    """The last logits of `ids` prefilled in chunks of `step` as the engine does: the adapter's
    chunk inputs, image rows spliced in, positions sliced per chunk."""
    import mlx.core as mx

    feats = [vision.encode(im.pixels) for im in images]
    positions = vision.positions(ids, [im.pixels for im in images])[0]
    cache = vision.text_model.make_cache()
    for a in range(0, len(ids), step):
        b = min(a + step, len(ids))
        spans = [(max(a, im.start) - a, f[max(a, im.start) - im.start: min(b, im.start + im.num_tokens) - im.start])
                 for im, f in zip(images, feats) if im.start < b and im.start + im.num_tokens > a]
        logits = vision.text_model(mx.array([ids[a:b]]), cache=cache, **vision.inputs(ids[a:b], spans),
                                   positions=None if positions is None else positions[..., a:b])
    return np.array(logits[0, -1])


@pytest.mark.parametrize("model_type, media_mask", [("ernie4_5_moe_vl", "token_type_ids"),
                                                     ("zaya1_vl", "visual_pos_masks")])
def test_media_tokens_are_marked_in_every_chunk(model_type, media_mask, tmp_path):
    """ERNIE 4.5 VL routes an image's tokens to its media experts (token_type_ids, at 3-D rotary
    positions kept axes-last), ZAYA1-VL applies its vision LoRA to them (visual_pos_masks), as
    their Model.__call__ marks them: chunked prefill gives mlx-vlm's whole-prompt logits, and
    without the mark it does not."""
    import mlx.core as mx

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.multimodal.prompt import chat_prompt

    loaded = load_config(tiny_vlm_config(model_type), tmp_path)
    vision = loaded.vision
    ids, images = chat_prompt(loaded, user(picture(7), "What is in this picture? Say it in a few words."))
    pixels = images[0].pixels
    inputs = {"pixel_values": mx.array(vision.pixels(pixels)), **vision.images.image_kwargs(pixels)}
    want = np.array(mlx_vlm_forward(vision, ids, **inputs)[0])
    assert np.abs(chunked_logits(vision, ids, images) - want).max() < 1e-3

    marked = vision.inputs  # no mark: every token as text (text experts, no LoRA)
    vision.inputs = lambda t, s: {k: v for k, v in marked(t, s).items() if k != media_mask}
    assert np.abs(chunked_logits(vision, ids, images) - want).max() > 0.1


def test_cohere_compass_images_are_mlx_vlms():
    """Cohere Compass's patches, made in numpy off the engine thread, are its mlx-vlm processor's
    (which returns MLX arrays), grid and token count too, over sizes and aspects."""
    from mlx_vlm.models.cohere_compass.processing_cohere_compass import CohereCompassImageProcessor

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm_images import CompassImages

    config = tiny_vlm_config("cohere_compass")
    ours = CompassImages(config, config["preprocessor_config"])
    theirs = CohereCompassImageProcessor(config={"vision_config": config["vision_config"]},
                                         **config["preprocessor_config"])
    for size in [(100, 120), (90, 80), (33, 200), (300, 41)]:
        image = picture(2, size)
        want, inp = theirs(images=[image]), ours.layout(image)
        assert [list(inp.grid_thw)] == np.asarray(want["image_grid_thw"]).tolist()
        assert inp.num_tokens == np.prod(inp.grid_thw) // 4
        np.testing.assert_allclose(ours.pixels(image), np.asarray(want["pixel_values"]), atol=1e-6)


def test_locateanything_images_are_mlx_vlms():
    """LocateAnything's MoonViT patches, cut in numpy off the engine thread (Kimi-VL's steps), are
    its mlx-vlm processor's (which cuts them with MLX), grid and token count too."""
    from mlx_vlm.models.locateanything.image_processing_locateanything import LocateAnythingImageProcessor

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm_images import PROCESSORS

    config = tiny_vlm_config("locateanything")
    ours = PROCESSORS["locateanything"](config, config["preprocessor_config"])
    theirs = LocateAnythingImageProcessor(**{k: v for k, v in config["preprocessor_config"].items()},
                                          patch_size=config["vision_config"]["patch_size"])
    for size in [(100, 120), (90, 80), (33, 200), (300, 41)]:
        image = picture(3, size)
        want, inp = theirs(image), ours.layout(image)
        assert [list(inp.grid_thw[1:])] == np.asarray(want["image_grid_hws"]).tolist()
        assert inp.num_tokens == np.prod(inp.grid_thw) // 4
        np.testing.assert_allclose(inp.pixel_values, np.asarray(want["pixel_values"]), atol=1e-5)
