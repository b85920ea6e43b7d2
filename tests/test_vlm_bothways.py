"""Images attended both ways and positions in several axes (models/vlm_bothways.py): a chunk's mask,
how Moondream's and Falcon OCR's images are found in a prompt (text holding Moondream's id 0 stays
text; text holding Falcon's image marks is refused), and HunyuanVL's positions for a prompt of two
images, as mlx-vlm's processor builds them. (Each type served end to end, alone, batched and cached,
against mlx-vlm's own pass: tests/test_vlm_architectures.py.)"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.models.chat import hf_of
from mlxserve.models.load import default_tokenizer
from mlxserve.models.tiny_vlm import tiny_vlm_config
from mlxserve.models.vlm_bothways import (FalconImages, HunyuanImages, MoondreamImages, both_ways_mask,
                                          image_blocks, xdrope_positions)
from mlxserve.multimodal.media import MediaError
from mlxserve.multimodal.prompt import PreparedImage, image_spans

from test_vlm import picture


def test_chunk_mask_is_causal_but_within_each_image():
    """A chunk of 8 after 3 cached tokens: text, an image of 3 rows (its last, an end token, causal),
    text, another such image."""
    blocks = image_blocks(8, [(1, mx.zeros((3, 4))), (5, mx.zeros((3, 4)))], tail=1)
    assert blocks.tolist() == [[-1, 0, 0, -1, -1, 1, 1, -1]]
    mask = np.array(both_ways_mask(blocks, 3))[0, 0]
    want = np.tril(np.ones((8, 11), bool), k=3)  # every cached token, the chunk causally
    want[1, 3 + 2] = want[5, 3 + 6] = True  # each image's first row sees its second
    assert mask.shape == (8, 11) and (mask == want).all()


def _prepared(inp) -> PreparedImage:
    return PreparedImage("messages[0].content[0]", "h", inp, "")


def _vision(images, **kw):
    return SimpleNamespace(image_span_ids=lambda: images.span_ids() if hasattr(images, "span_ids") else
                           {images.stand_in}, whole_images=True, **kw)


def test_moondream_image_is_its_stand_ins_and_text_holding_id_0_stays_text():
    """Moondream's processor writes the image as copies of id 0, a text token ("!" here): the prompt
    holds stand-ins instead, so text of "!" is never read as an image, and the stand-in in text is
    refused, as is a prompt ending on its image (nothing to sample from after it)."""
    tokenizer = hf_of(default_tokenizer())
    images = MoondreamImages(tiny_vlm_config("moondream2"), {}, tokenizer)
    inp = images.layout(picture(1))
    assert inp.num_tokens == 1 + 36 and inp.tower_ids == (images.bos,) + (0,) * 36
    assert images.stand_in not in (0, None) and set(inp.ids) == {images.stand_in}
    vision = _vision(images)
    assert tokenizer("!", add_special_tokens=False)["input_ids"] == [0]
    bang = [0, 0] + tokenizer(" What is this?", add_special_tokens=False)["input_ids"] + [0]
    (found,) = image_spans(list(inp.ids) + bang, vision, [_prepared(inp)])
    assert (found.start, found.num_tokens) == (0, 37)
    with pytest.raises(MediaError, match="image token outside its images"):
        image_spans(list(inp.ids) + bang + [images.stand_in], vision, [_prepared(inp)])
    with pytest.raises(MediaError, match="ends with an image"):
        image_spans(bang + list(inp.ids), vision, [_prepared(inp)])


def test_falcon_prompt_text_holding_its_image_marks_is_refused():
    """Falcon OCR's image is its CLS, four registers, a token a patch and its end token; mlx-vlm reads
    its mask and positions off those ids, so text holding one of them is refused."""
    config = tiny_vlm_config("falcon_ocr")
    images = FalconImages(config, {}, hf_of(default_tokenizer()))
    inp = images.layout(picture(1))
    assert inp.ids[:5] == images.head and inp.ids[-1] == images.end and inp.grid_thw == (1, 6, 8)
    vision = _vision(images)
    prompt = [10, 11, *inp.ids, 12, 13]
    assert image_spans(prompt, vision, [_prepared(inp)])[0].start == 2
    for mark in (config["image_cls_token_id"], config["image_reg_3_token_id"], config["img_end_id"]):
        with pytest.raises(MediaError, match="image token outside its images"):
            image_spans([10, mark, *inp.ids, 12, 13], vision, [_prepared(inp)])


def test_hunyuan_positions_of_two_images_are_its_processors():
    """mlx-vlm's own pass takes one image (the generated test compares with it); a prompt of two is
    placed as mlx-vlm's HunYuanVLProcessor places it: each image's rows and columns, text by index."""
    from mlx_vlm.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLProcessor

    config = tiny_vlm_config("hunyuan_vl")
    tokenizer = hf_of(default_tokenizer())
    images = HunyuanImages(config, config["preprocessor_config"], tokenizer)
    pictures = [picture(1), picture(2, (90, 80))]
    proc = HunYuanVLProcessor(image_processor=images.proc, tokenizer=tokenizer)
    proc.image_token_id, proc.image_token = config["image_token_id"], "<|image_pad|>"
    text = "Look: <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>?"
    out = proc(images=pictures, text=[text])
    inputs = [images.layout(p) for p in pictures]
    assert [i.grid_thw for i in inputs] == [tuple(g) for g in np.asarray(out["image_grid_thw"]).tolist()]
    vlm = SimpleNamespace(image_token_id=config["image_token_id"], images=images)
    ids = np.asarray(out["input_ids"])[0].tolist()
    positions, delta = xdrope_positions(vlm, ids, inputs)
    assert delta == 0 and sum(i.num_tokens for i in inputs) == ids.count(config["image_token_id"])
    assert np.array_equal(np.asarray(positions.transpose(1, 0, 2)), np.asarray(out["position_ids"]))
