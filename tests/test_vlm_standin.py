"""Images marked with ids outside the vocabulary (LLaVA-Bunny's and FastVLM's -200, Phi-3-vision's
run of -1) stand in the prompt as runs of one special token (models/vlm_standin.py): the token
chosen tokenizes back to itself, and a prompt whose text holds it outside an image is refused
rather than read as image rows. (Each family served end to end: tests/test_vlm_architectures.py.)"""

import copy
from types import SimpleNamespace

import pytest

from mlxserve.models.chat import hf_of
from mlxserve.models.load import default_tokenizer
from mlxserve.models.vlm import ImageInput
from mlxserve.models.vlm_standin import stand_in
from mlxserve.multimodal.media import MediaError
from mlxserve.multimodal.prompt import PreparedImage, image_spans


def test_stand_in_is_a_special_token_apart_from_bos_and_eos():
    tokenizer = hf_of(default_tokenizer())  # Qwen's: no unk, <|endoftext|> its pad, <|im_end|> its eos
    s = stand_in(tokenizer)
    assert s == tokenizer.pad_token_id != tokenizer.eos_token_id
    text = tokenizer.decode([s] * 5, clean_up_tokenization_spaces=False)
    assert tokenizer("a" + text + "b", add_special_tokens=False)["input_ids"][1:-1] == [s] * 5
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = no_pad.eos_token  # a tokenizer padding with its eos has no stand-in to give
    with pytest.raises(ValueError, match="no unk or pad token"):
        stand_in(no_pad)


def _image(n: int, s: int, h: str) -> PreparedImage:
    return PreparedImage("messages[0].content[0]", h, ImageInput(None, None, n, ids=(s,) * n, tower_ids=(-200,)), "")


def test_prompt_text_holding_the_stand_in_outside_an_image_is_refused():
    s = 7
    vision = SimpleNamespace(image_token_id=s, image_span_ids=lambda: {s})
    images = [_image(3, s, "a"), _image(2, s, "b")]
    prompt = [1, 2, s, s, s, 4, s, s, 5]
    spans = image_spans(prompt, vision, images)
    assert [(im.start, im.num_tokens, im.content_hash) for im in spans] == [(2, 3, "a"), (6, 2, "b")]
    for bad in ([1, s, 2, s, s, s, 4, s, s, 5],  # before the images
                [1, 2, s, s, s, 4, s, s, 5, s],  # after them
                [1, 2, s, s, s, s, 4, s, s, 5]):  # one more beside an image's run
        with pytest.raises(MediaError, match="image token outside its images"):
            image_spans(bad, vision, images)
