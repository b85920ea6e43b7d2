"""Video through the generic VLM path (Qwen3-VL, Qwen3.5): the prompt mlx-vlm's processor writes,
mlx-vlm's own whole-prompt tokens, with chunks cut through frame groups and with cache hits.
(Qwen2.5-VL's video: test_vlm.py; video over HTTP: test_vlm_http.py.)"""

import asyncio
import base64

import numpy as np
import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.multimodal.media import MediaLimits, decode_video
from mlxserve.multimodal.prompt import chat_prompt
from tests.test_vlm import mlx_vlm_greedy, mp4_bytes, picture, run

VIDEO_VLMS = ["qwen3-vl-tiny", "qwen3.5-vl-tiny"]


def clip_url(fps=3, n=8, seed=0) -> str:
    # At 3 fps, sampling at 2 fps takes frames 0, 2, 4, 6 (at 0, 0.67, 1.33, 2 s): the groups' times
    # (0.33 s, 1.67 s) are not those of evenly spaced frames at 2 fps (0.25 s, 1.25 s).
    return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(n=n, fps=fps, seed=seed)).decode()


def video_message(url, text="What happens in this video?"):
    return {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def frames_of(url):
    return decode_video(base64.b64decode(url.split(",", 1)[1]), MediaLimits())


def mlx_vlm_video_inputs(vision, frames) -> dict:
    """mlx-vlm's video inputs: its processor over the whole video at once (all groups together)."""
    import mlx.core as mx

    out = vision.video_processor(videos=[frames])
    return {"pixel_values_videos": mx.array(np.asarray(out["pixel_values_videos"])),
            "video_grid_thw": mx.array(np.asarray(out["video_grid_thw"]))}


def test_video_prompt_is_the_one_mlx_vlms_processor_writes(tiny):
    """Each frame group after its time, from the decoded frames' times (as mlx-vlm's Qwen3VLProcessor
    with the clip's metadata), or at the processor's fps for frames given as a list (as without)."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    loaded = tiny("qwen3-vl-tiny")
    vision = loaded.vision
    url = clip_url()
    frames = frames_of(url)
    assert frames.times == pytest.approx([0, 2 / 3, 4 / 3, 2])
    hf = loaded.tokenizer._tokenizer
    proc = Qwen3VLProcessor(image_processor=vision.images.proc, tokenizer=hf, video_processor=vision.video_processor)
    text = hf.apply_chat_template([{"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>Hi"}],
                                  tokenize=False, add_generation_prompt=True)

    def theirs(**kw):
        return np.asarray(proc(text=[text], videos=[list(frames)], **kw)["input_ids"])[0].tolist()

    ids, groups = chat_prompt(loaded, [video_message(url, "Hi")])
    assert [g.pixels.seconds for g in groups] == pytest.approx([1 / 3, 5 / 3])
    assert ids == theirs(video_metadata=[{"frames_indices": [0, 2, 4, 6], "fps": 3.0}])
    as_list = [{"role": "user", "content": [{"type": "video", "video": list(frames)}, {"type": "text", "text": "Hi"}]}]
    ids, groups = chat_prompt(loaded, as_list)
    assert [g.pixels.seconds for g in groups] == [0.25, 1.25]
    assert ids == theirs()


@pytest.mark.parametrize("shape", VIDEO_VLMS)
def test_video_matches_mlx_vlm_with_chunks_and_cache_hits(tiny, shape):
    """Chunks of 5 tokens cut through the frame groups (6 tokens each); a repeat restores all but the
    last token; a later turn takes the groups from the caches: mlx-vlm's whole-prompt tokens each time."""
    loaded = tiny(shape)
    vision = loaded.vision
    url = clip_url()
    messages = [video_message(url)]
    ids, groups = chat_prompt(loaded, messages)
    assert len(groups) == 2 and groups[0].num_tokens == 6 and groups[1].start > groups[0].start + 6
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    turn2 = messages + [{"role": "assistant", "content": "Noise."}, {"role": "user", "content": "And then?"}]
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5, block_size=16)).start()
    try:
        (got, cold), = run(engine, Request(ids, params, images=groups))
        (again, hit), = run(engine, Request(ids, params, images=chat_prompt(loaded, messages)[1]))
        ids2, groups2 = chat_prompt(loaded, turn2, is_cached=engine.image_is_cached)
        assert all(g.pixels.pixel_values is None for g in groups2)  # known to the caches: no pixels made
        (turn2_tokens, warm), = run(engine, Request(ids2, params, images=groups2))
        vstats = asyncio.run(engine.cache_stats())["vision_cache"]
    finally:
        engine.stop()
    inputs = mlx_vlm_video_inputs(vision, frames_of(url))
    want = mlx_vlm_greedy(vision, ids, 8, **inputs)
    assert got == again == want
    assert cold == 0 and hit == len(ids) - 1 and warm >= groups[-1].start + groups[-1].num_tokens - 16
    assert turn2_tokens == mlx_vlm_greedy(vision, ids2, 8, **inputs)
    assert vstats["misses"] == 2  # each group through the tower once


def test_video_and_image_in_one_prompt_match_mlx_vlm(tiny):
    """Qwen3-VL places image and video blocks in prompt order (positions, deepstack rows); mlx-vlm's
    Qwen3.5 cannot take both at once (it runs its tower on the image pixels for both kinds of tokens)."""
    import mlx.core as mx

    loaded = tiny("qwen3-vl-tiny")
    vision = loaded.vision
    url = clip_url(seed=4)
    image = picture(3)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "then"},
                                             {"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "Same place?"}]}]
    ids, media = chat_prompt(loaded, messages)
    assert [m.pixels.video for m in media] == [None, 0, 0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=7)).start()
    try:
        (got, _), = run(engine, Request(ids, params, images=media))
    finally:
        engine.stop()
    want = mlx_vlm_greedy(vision, ids, 8, pixel_values=mx.array(vision.pixels(media[0].pixels)),
                          image_grid_thw=mx.array([media[0].pixels.grid_thw]),
                          **mlx_vlm_video_inputs(vision, frames_of(url)))
    assert got == want


def test_video_beside_text_in_a_batch(tiny):
    """A video prompt prefilled while a text request decodes (it joins the batch) keeps its tokens."""
    loaded = tiny("qwen3.5-vl-tiny")
    url = clip_url(seed=5)
    ids, groups = chat_prompt(loaded, [video_message(url)])
    text_ids, _ = chat_prompt(loaded, [{"role": "user", "content": "Tell me about lighthouses."}])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    # No caches: the second time the video goes through the tower and its chunks again, beside the text.
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5, prefix_cache=False,
                                              vision_cache_memory="0")).start()
    try:
        (alone, _), = run(engine, Request(ids, params, images=groups))
        (text_alone, _), = run(engine, Request(text_ids, long))
        (video, _), (text, _) = run(engine, Request(ids, params, images=chat_prompt(loaded, [video_message(url)])[1]),
                                    Request(text_ids, long))
    finally:
        engine.stop()
    assert (video, text) == (alone, text_alone)
    assert alone == mlx_vlm_greedy(loaded.vision, ids, 8, **mlx_vlm_video_inputs(loaded.vision, frames_of(url)))


def test_gemma4_refuses_video(tiny):
    from mlxserve.multimodal.prompt import ImagePartError, prepare_images

    with pytest.raises(ImagePartError, match="not video"):
        prepare_images(tiny("gemma4-vl-tiny").vision, [("part", clip_url(), "video")], MediaLimits())


def test_video_settings_come_from_video_preprocessor_config(tmp_path):
    """A Qwen3-VL folder keeps its video bounds in video_preprocessor_config.json; without it,
    mlx-vlm takes the image settings (preprocessor_config.json)."""
    import json

    from mlxserve.models.shapes import SHAPES
    from mlxserve.models.vlm import processor_config
    from mlxserve.models.vlm_images import QwenVideo

    config = SHAPES["qwen3-vl-4b"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config["preprocessor_config"]))
    images_only = QwenVideo(config, processor_config(tmp_path)).processor
    assert (images_only.min_pixels, images_only.max_pixels, images_only.fps) == (65536, 16777216, 2.0)
    video = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 1, "patch_size": 16}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video))
    vp = QwenVideo(config, processor_config(tmp_path)).processor
    assert (vp.min_pixels, vp.max_pixels, vp.fps, vp.patch_size, vp.merge_size) == (4096, 25165824, 1, 16, 2)
