"""MiniCPM-V 4.6 and 4.7: what their generated test (tests/test_vlm_architectures.py) does not
show: a request moved into a batch on one step rather than another (the steps follow the vision
tower's time slices there), prompts of two images, and 4.7's canvas positions."""

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.families import prefill_batch_size

from mlxserve.multimodal.prompt import chat_prompt

from parity import greedy, prompt_of, run
from test_vlm import mlx_vlm_greedy, picture
from test_vlm_architectures import image_prompts, load_config, user


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlxserve.models.tiny_vlm import tiny_vlm_config

    loaded = {}

    def get(model_type):
        if model_type not in loaded:
            loaded[model_type] = load_config(tiny_vlm_config(model_type), tmp_path_factory.mktemp(model_type))
        return loaded[model_type]
    return get


@pytest.fixture
def minicpm(tiny):
    return tiny("minicpmv4_6")


def scheduler(loaded):
    # The tower in one step (no time slices): which step does what is fixed.
    runner = Runner(loaded.model, max_num_seqs=8, prefill_chunk_size=16, vision=loaded.vision, vision_step_s=0,
                    prefill_batch_size=prefill_batch_size(loaded.config, 8))
    return Scheduler(runner, eos_token_ids=set(), vocab_size=loaded.vocab_size, max_num_seqs=8)


def request(prompt):
    ids, images = prompt if isinstance(prompt, tuple) else (prompt, [])
    return Request(list(ids), greedy(6), images=list(images))


def drain(s, out):
    for event in s.step():
        out[event.seq.request_id].append(event.token)


def test_request_moved_into_a_batch_mid_prompt_keeps_its_tokens(minicpm):
    """A prompt with an image runs alone, its image prefilled and its text half done, when a text
    prompt arrives: it moves into the batch, and the rest of both prompts are prefilled together,
    the shorter padded. Each gives its tokens alone. (mlx-vlm's Qwen3.5 language model keeps the
    padding as the shorter row's context: MiniCPM-V's prompts are prefilled one at a time,
    models/families.py SERIAL_PREFILL_VLM.)"""
    first, second = image_prompts(minicpm)[0], prompt_of(40, 2)
    alone = []
    for prompt in (first, second):
        s, r = scheduler(minicpm), request(prompt)
        out = {r.request_id: []}
        s.add(r, 6)
        while s.has_work():
            drain(s, out)
        alone.append(out[r.request_id])

    s, a, b = scheduler(minicpm), request(first), request(second)
    out = {a.request_id: [], b.request_id: []}
    s.add(a, 6)
    image_end = first[1][0].start + first[1][0].num_tokens
    while not (s.runner.solo is not None and image_end < len(s.runner.solo.in_cache) < len(first[0]) - 16):
        drain(s, out)  # until it runs alone, past its image, a chunk or more of its text to go
    s.add(b, 6)
    while s.has_work():
        drain(s, out)
    assert [out[a.request_id], out[b.request_id]] == alone


def two_images(loaded):
    """A prompt of two images (the first sliced, the second not) and mlx-vlm's processor's outputs
    for the same text with both images, its own image marker where each image and its number stand."""
    vision, images = loaded.vision, [picture(31), picture(32, (50, 70))]
    ids, spans = chat_prompt(loaded, user(images[0], "and", images[1], "Compare them."))
    layout = vision.images
    text = layout.tokenizer.decode(ids)
    for k, im in enumerate(spans):
        text = text.replace(vision.image_prefix(k) + layout.tokenizer.decode(im.pixels.ids), "<|image_pad|>", 1)
    return ids, spans, layout.proc(text=[text], images=images)


def mlx_vlm_inputs(out) -> dict:
    import mlx.core as mx

    return {"pixel_values": [[mx.array(p) for p in out["pixel_values"][0]]],
            "tgt_sizes": [mx.array(out["tgt_sizes"][0])], "image_bound": [mx.array(out["image_bound"][0])]}


@pytest.mark.parametrize("model_type", ["minicpmv4_6", "minicpmv4_7"])
def test_images_are_numbered_as_mlx_vlms_processor_numbers_them(tiny, model_type):
    """Each image's number (<image_id>k</image_id>) goes before it in the prompt, outside its span
    (the same wherever the image sits): the prompt is the one mlx-vlm's processor makes of the text
    with both images, and the engine's greedy tokens are its own pass's over that prompt (4.7's:
    at its canvas positions, the text after each image moved on past its canvas)."""
    loaded = tiny(model_type)
    ids, spans, out = two_images(loaded)
    assert [loaded.vision.image_prefix(k) for k in range(2)] == ["<image_id>0</image_id>", "<image_id>1</image_id>"]
    assert out["input_ids"][0].tolist() == ids and [len(out["tgt_sizes"][0]), spans[1].pixels.ids.count(
        loaded.vision.images.tokenizer.convert_tokens_to_ids("<slice>"))] == [4, 0]

    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5)).start()  # chunks cut through the images
    try:
        (got, _), = run(engine, [(ids, spans)], greedy(6))
    finally:
        engine.stop()
    assert got == mlx_vlm_greedy(loaded.vision, ids, 6, **mlx_vlm_inputs(out))


def test_canvas_positions_are_mlx_vlms(tiny):
    """MiniCPM-V 4.7 lays each image's crops on a canvas (M-RoPE rows and columns of the thumbnail
    and the slices): its chunked logits are mlx-vlm's whole-prompt ones, and are not with every
    token at its own index (4.6's positions)."""
    import mlx.core as mx
    import numpy as np

    from test_vlm import mlx_vlm_forward
    from test_vlm_families import chunked_logits

    loaded = tiny("minicpmv4_7")
    vision = loaded.vision
    ids, spans, out = two_images(loaded)
    want = np.array(mlx_vlm_forward(vision, ids, **mlx_vlm_inputs(out))[0])
    assert np.abs(chunked_logits(vision, ids, spans) - want).max() < 1e-3
    assert vision.positions(ids, [im.pixels for im in spans])[1] < 0  # the text after goes on past each canvas

    vision.positions = lambda t, images: (mx.broadcast_to(mx.arange(len(t))[None, None], (3, 1, len(t))), 0)
    try:
        assert np.abs(chunked_logits(vision, ids, spans) - want).max() > 0.1
    finally:
        del vision.positions
