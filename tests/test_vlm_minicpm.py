"""MiniCPM-V 4.6: what its generated test (tests/test_vlm_architectures.py) meets only when the
engine's steps happen to fall one way (they follow the vision tower's time slices)."""

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
def minicpm(tmp_path_factory):
    from mlxserve.models.tiny_vlm import tiny_vlm_config

    return load_config(tiny_vlm_config("minicpmv4_6"), tmp_path_factory.mktemp("minicpmv4_6"))


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


def test_images_are_numbered_as_mlx_vlms_processor_numbers_them(minicpm):
    """Each image's number (<image_id>k</image_id>) goes before it in the prompt, outside its span
    (the same wherever the image sits): the prompt is the one mlx-vlm's processor makes of the text
    with both images, and the engine's greedy tokens are its own pass's over that prompt."""
    import mlx.core as mx

    vision, images = minicpm.vision, [picture(31), picture(32, (50, 70))]
    ids, spans = chat_prompt(minicpm, user(images[0], "and", images[1], "Compare them."))
    assert [vision.image_prefix(k) for k in range(2)] == ["<image_id>0</image_id>", "<image_id>1</image_id>"]
    layout = vision.images
    text = layout.tokenizer.decode(ids)
    for k, im in enumerate(spans):  # the processor's own marker where each image and its number stand
        text = text.replace(vision.image_prefix(k) + layout.tokenizer.decode(im.pixels.ids), "<|image_pad|>", 1)
    out = layout.proc(text=[text], images=images)
    assert out["input_ids"][0].tolist() == ids

    engine = AsyncEngine(minicpm, EngineConfig(prefill_chunk_size=5)).start()  # chunks cut through the images
    try:
        (got, _), = run(engine, [(ids, spans)], greedy(6))
    finally:
        engine.stop()
    inputs = {"pixel_values": [[mx.array(p) for p in out["pixel_values"][0]]],
              "tgt_sizes": [mx.array(out["tgt_sizes"][0])], "image_bound": [mx.array(out["image_bound"][0])]}
    assert got == mlx_vlm_greedy(vision, ids, 6, **inputs)
