"""Vision-language models: image caches never change a token, the engine matches mlx-vlm. (HTTP: test_vlm_http.py.)"""

import asyncio
import base64
import copy
import io
import json

import numpy as np
import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.shapes import SHAPES
from mlxserve.models.load import load
from mlxserve.models.vlm_generic import FAMILIES as GENERIC_FAMILIES
from mlxserve.multimodal.prompt import chat_prompt

VLMS = ["qwen2.5-vl-tiny", "gemma3-vl-tiny", "llava-tiny"]
GENERIC_VLMS = ["qwen3-vl-tiny", "qwen3.5-vl-tiny", "gemma4-vl-tiny"]  # mlxserve/models/vlm_generic.py


def picture(seed, size=(100, 120)):
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image, compress_level=6) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=compress_level)
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def chat_request(loaded, turns, max_tokens=6) -> Request:
    """turns: [(role, [str or PIL image, ...])] -> an engine Request with its images."""
    messages = [{"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str)
                                           else {"type": "image", "image": p} for p in parts]}
                for role, parts in turns]
    ids, images = chat_prompt(loaded, messages)
    return Request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), images=images)


async def generate(engine, request):
    tokens, last = [], None
    async for step in engine.submit(request):
        tokens += step.new_token_ids
        last = step
    return tokens, last.cached_tokens


def run(engine, *requests):
    async def go():
        return await asyncio.gather(*(generate(engine, r) for r in requests))
    return asyncio.run(go())


def fresh(req: Request) -> Request:
    return Request(req.prompt_token_ids, req.params, images=req.images)


@pytest.mark.parametrize("shape", VLMS + GENERIC_VLMS + ["gemma4-vl-bidi-tiny"])  # the last: test_vlm_bidirectional.py
def test_image_caches_never_change_tokens(tiny, shape):
    check_image_caches_never_change_tokens(tiny(shape))


@pytest.fixture(scope="module")
def quantizable_vlm(tmp_path_factory):
    """qwen2.5-vl-tiny with 64-wide attention heads (256 wide, 4 heads), so its KV quantizes in groups of 64."""
    config = copy.deepcopy(SHAPES["qwen2.5-vl-tiny"])
    config.update(hidden_size=256, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    config["vision_config"]["out_hidden_size"] = 256
    folder = tmp_path_factory.mktemp("qwen2.5-vl-tiny-64")
    (folder / "config.json").write_text(json.dumps(config))
    return load(str(folder), load_format="dummy", progress=False)


@pytest.mark.parametrize("attention", ["quantized", "dequantized"])
def test_image_caches_never_change_tokens_with_quantized_kv(quantizable_vlm, attention, quantized_attention_calls):
    check_image_caches_never_change_tokens(quantizable_vlm, kv_bits=8, kv_attention=attention)
    # The mode reaches attention on every path the check takes (images, hits, batches).
    assert bool(quantized_attention_calls) == (attention == "quantized")


def check_image_caches_never_change_tokens(loaded, **engine_settings):
    a, b = picture(1), picture(2, (90, 80))
    turn1 = [("user", [a, "What is in this picture?"])]
    turn2 = turn1 + [("assistant", ["A lighthouse on a cliff."]), ("user", [b, "And in this one, compared to the first?"])]
    text_only = [("user", ["No picture here, just a question about lighthouses."])]
    r1, r2, rt = (chat_request(loaded, t) for t in (turn1, turn2, text_only))
    assert len(r1.images) == 1 and len(r2.images) == 2 and r2.images[0].start == r1.images[0].start
    settings = dict(block_size=16, prefill_chunk_size=24, **engine_settings)

    def engine(**kw):
        return AsyncEngine(loaded, EngineConfig(**settings, **kw)).start()

    off = engine(prefix_cache=False, vision_cache_memory="0")
    try:
        ref1, ref2, reft = ([t for t, _ in run(off, fresh(r))][0] for r in (r1, r2, rt))
    finally:
        off.stop()

    embeddings_only = engine(prefix_cache=False)
    try:
        assert run(embeddings_only, fresh(r1))[0][0] == ref1
        assert run(embeddings_only, fresh(r1))[0][0] == ref1  # image A's embeddings from the cache
        assert run(embeddings_only, fresh(r2))[0][0] == ref2  # A from the cache, B encoded
        vstats = asyncio.run(embeddings_only.cache_stats())["vision_cache"]
        assert (vstats["hits"], vstats["misses"], vstats["entries"]) == (2, 2, 2)
    finally:
        embeddings_only.stop()

    both = engine()
    try:
        (cold, cold_cached), = run(both, fresh(r1))
        (hit, hit_cached), = run(both, fresh(r1))
        (partial, partial_cached), = run(both, fresh(r2))  # turn 2 adds image B
        batch = run(both, fresh(r1), fresh(r2), fresh(rt))  # image and text requests in one batch
    finally:
        both.stop()
    end_of_a = r1.images[0].start + r1.images[0].num_tokens
    assert cold == ref1 and cold_cached == 0
    assert hit == ref1 and hit_cached == len(r1.prompt_token_ids) - 1  # to the token, image included
    assert partial == ref2 and partial_cached >= end_of_a // 16 * 16
    assert [t for t, _ in batch] == [ref1, ref2, reft]


def test_different_images_never_share_blocks(tiny):
    loaded = tiny("qwen2.5-vl-tiny")
    ra = chat_request(loaded, [("user", [picture(1), "Describe it."])])
    rb = chat_request(loaded, [("user", [picture(3), "Describe it."])])
    assert ra.prompt_token_ids == rb.prompt_token_ids  # same tokens: only the pixels differ
    engine = AsyncEngine(loaded, EngineConfig(block_size=8)).start()
    try:
        run(engine, ra)
        (_, cached), = run(engine, rb)
        (_, again), = run(engine, fresh(ra))
    finally:
        engine.stop()
    assert cached == ra.images[0].start  # only the text before the image is shared
    assert again > ra.images[0].start + ra.images[0].num_tokens - 8


@pytest.mark.parametrize("keep", [False, True])
def test_embeddings_dropped_once_kv_is_cached_and_remade_when_needed(tiny, keep):
    """By default an image's embeddings leave the vision cache once its KV blocks are cached (an
    image then costs its KV alone); the same picture under another prefix still gets the right
    tokens: its pixels are made on the engine thread and the tower runs again."""
    loaded = tiny("qwen2.5-vl-tiny")
    image = picture(5)
    first = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]
    other_prefix = [{"role": "system", "content": "You are terse."}] + first
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_cache_memory="0")).start()
    try:
        ref1, ref2 = (run(off, Request(ids, params, images=images))[0][0]
                      for ids, images in (chat_prompt(loaded, m) for m in (first, other_prefix)))
    finally:
        off.stop()
    engine = AsyncEngine(loaded, EngineConfig(block_size=8, keep_image_embeddings=keep)).start()
    try:
        ids, images = chat_prompt(loaded, first, is_cached=engine.image_is_cached)
        (got1, _), = run(engine, Request(ids, params, images=images))
        after_first = asyncio.run(engine.cache_stats())["vision_cache"]
        ids, images = chat_prompt(loaded, other_prefix, is_cached=engine.image_is_cached)
        assert images[0].pixels.pixel_values is None  # known to the caches: no pixel array made up front
        (got2, cached), = run(engine, Request(ids, params, images=images))
        after_second = asyncio.run(engine.cache_stats())["vision_cache"]
    finally:
        engine.stop()
    assert (got1, got2) == (ref1, ref2)
    assert cached < images[0].start + images[0].num_tokens  # another prefix: the image's KV is not reused
    if keep:
        assert (after_first["entries"], after_first["released"]) == (1, 0)
        assert (after_second["hits"], after_second["misses"]) == (1, 1)
    else:
        assert (after_first["entries"], after_first["bytes"], after_first["released"]) == (0, 0, 1)
        assert after_second["misses"] == 2  # the tower ran again
        assert after_second["released"] == 2  # and its embeddings went once that KV was cached too


def test_concurrent_questions_about_one_image_encode_it_once(tiny):
    """Requests admitted together all need the image's embeddings (none matched its KV yet): the
    first to finish must not drop them while the others still have to read them."""
    loaded = tiny("qwen2.5-vl-tiny")
    req = chat_request(loaded, [("user", [picture(6), "Describe it."])], max_tokens=2)
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_cache_memory="0")).start()
    try:
        (ref, _), = run(off, fresh(req))
    finally:
        off.stop()
    engine = AsyncEngine(loaded, EngineConfig(block_size=8)).start()
    try:
        outs = run(engine, *(fresh(req) for _ in range(6)))
        vstats = asyncio.run(engine.cache_stats())["vision_cache"]
    finally:
        engine.stop()
    assert [t for t, _ in outs] == [ref] * 6
    assert vstats["misses"] == 1 and vstats["released"] == 1 and vstats["entries"] == 0


def test_image_and_text_rows_join_each_others_batches(tiny):
    """An image request joins a batch of text-only rows, then two text rows join it: each row's
    M-RoPE delta must stay with its row (text rows hold none until one is needed; found by
    `bench soak`: the batch lost rows' deltas and every step of it failed)."""
    loaded = tiny("qwen2.5-vl-tiny")
    # Prompts of different lengths: a batch prefilled with padding drops its padding state after,
    # and with it the only record of its size a text row's empty delta had.
    first = [chat_request(loaded, [("user", ["Count to ten, slowly" + ", please" * i])], max_tokens=40)
             for i in range(3)]
    image = chat_request(loaded, [("user", [picture(7), "Describe it."])], max_tokens=24)
    late = [chat_request(loaded, [("user", ["Name rivers" + " and lakes" * i])], max_tokens=4) for i in range(2)]
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_cache_memory="0")).start()
    try:
        refs = [run(off, fresh(r))[0][0] for r in first + [image] + late]
    finally:
        off.stop()

    async def go(engine):
        progress = []

        async def tokens(req, tag):
            out = []
            async for step in engine.submit(fresh(req)):
                out += step.new_token_ids
                progress.append(tag)
            return out

        async def once(tag, n, tasks):  # until `tag` rows have streamed n tokens: they are in the decode batch
            while progress.count(tag) < n and not any(t.done() for t in tasks):  # (done early: failed)
                await asyncio.sleep(0.002)

        texts = [asyncio.create_task(tokens(r, "text")) for r in first]
        await once("text", 6, texts)
        pictured = asyncio.create_task(tokens(image, "image"))
        await once("image", 2, texts + [pictured])
        later = [asyncio.create_task(tokens(r, "late")) for r in late]
        return await asyncio.gather(*texts, pictured, *later)

    engine = AsyncEngine(loaded, EngineConfig(prefix_cache=False)).start()
    try:
        outs = asyncio.run(go(engine))
    finally:
        engine.stop()
    assert outs == refs


def test_embeddings_stay_when_the_kv_was_not_cached(tiny):
    loaded = tiny("qwen2.5-vl-tiny")
    req = chat_request(loaded, [("user", [picture(6), "Describe it."])], max_tokens=2)
    engine = AsyncEngine(loaded, EngineConfig(block_size=8, cache_memory="1KB")).start()  # no block fits
    try:
        run(engine, fresh(req))
        stats = asyncio.run(engine.cache_stats())
    finally:
        engine.stop()
    assert stats["prefix_cache"]["blocks"] == 0
    assert (stats["vision_cache"]["entries"], stats["vision_cache"]["released"]) == (1, 0)


def test_rope_delta_depends_on_the_image_grids_alone(tiny):
    """A turn whose image tokens are all cached takes its M-RoPE delta from a memo keyed
    by the image grids: it must be what a full pass gives, whatever text is around."""
    loaded = tiny("qwen2.5-vl-tiny")
    vision = loaded.vision
    one = chat_request(loaded, [("user", [picture(1), "Describe it."])])
    other = chat_request(loaded, [("user", ["Some words first. " * 6, picture(2), "Then a question?"]),
                                  ("assistant", ["An answer."]), ("user", ["And more."])])
    two = chat_request(loaded, [("user", [picture(3), "and", picture(4, size=(60, 200))])])
    pixels = {name: [im.pixels for im in r.images] for name, r in (("one", one), ("other", other), ("two", two))}
    full = {name: vision.positions(r.prompt_token_ids, pixels[name])[1]
            for name, r in (("one", one), ("other", other), ("two", two))}
    assert full["one"] == full["other"] != 0 and full["two"] != full["one"]
    vision._deltas.clear()
    vision.positions(one.prompt_token_ids, pixels["one"])
    with pytest.MonkeyPatch.context() as mp:  # from the memo: no pass over the prompt
        mp.setattr(vision, "positions", lambda *a: pytest.fail("positions recomputed"))
        assert vision.rope_delta(other.prompt_token_ids, pixels["other"]) == full["other"]
    assert vision.rope_delta(two.prompt_token_ids, pixels["two"]) == full["two"]  # other grids: computed


def test_qwen_vision_tower_survives_window_aligned_images(tiny):
    # mlx-vlm's Qwen2.5-VL tower leaves repeated window bounds (empty windows)
    # for image sides that are multiples of 112 px; on MLX-CUDA that killed
    # the process. The adapter drops the repeats: the tower's output must be
    # finite and the window bounds strictly increasing.
    import mlx.core as mx
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    from mlxserve.models.vlm import ImageInput

    vision = tiny("qwen2.5-vl-tiny").vision
    proc = Qwen3VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                 min_pixels=3136, max_pixels=448 * 448)
    out = proc(images=[picture(5, (448, 448))])
    grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
    assert grid == (1, 32, 32)
    _, bounds = vision.model.vision_tower.get_window_index(mx.array([grid]))
    assert all(x < y for x, y in zip(bounds.tolist(), bounds.tolist()[1:]))
    feats = vision.encode(ImageInput(np.asarray(out["pixel_values"]), grid, 256))
    assert feats.shape[0] == 256 and mx.all(mx.isfinite(feats)).item()


@pytest.mark.parametrize("shape", VLMS + GENERIC_VLMS)
def test_tower_run_in_slices_gives_the_same_tokens(tiny, shape):
    """vision_step_ms tiny: the tower pauses after every block, between decode steps of a text request."""
    loaded = tiny(shape)
    r1 = chat_request(loaded, [("user", [picture(11), "What is this?"])])
    text = chat_request(loaded, [("user", ["Tell me about lighthouses."])], max_tokens=30)
    whole = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_step_ms=0)).start()
    try:
        ref, ref_text = (t for t, _ in run(whole, fresh(r1), fresh(text)))
    finally:
        whole.stop()
    sliced = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_step_ms=1e-6)).start()
    try:
        got, got_text = (t for t, _ in run(sliced, fresh(r1), fresh(text)))

        async def abandon():  # leave while the tower is mid-way: the helper must be freed for the next image
            stream = sliced.submit(fresh(chat_request(loaded, [("user", [picture(12), "Hi"])])))
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            task.cancel()
        asyncio.run(abandon())
        assert run(sliced, fresh(r1))[0][0] == ref
    finally:
        sliced.stop()
    assert got == ref and got_text == ref_text


def mlx_vlm_forward(vision, ids: list[int], **image_inputs):
    """mlx-vlm's own whole-prompt pass: its get_input_embeddings over the prompt with all its
    images, then its language model with everything that gives beside the embeddings (M-RoPE
    positions, deepstack rows, per-layer inputs), with the model's own caches. (Model.__call__
    is not used: Gemma 3's and LLaVA's attend both ways.) Returns (last logits, lm, cache)."""
    import mlx.core as mx
    from mlx_vlm.models.cache import KVCache

    ids = mx.array([ids])
    # An integer mask for a family whose model reads it as its processor's attention_mask (FastVLM's).
    mask = mx.ones(ids.shape, dtype=mx.int32 if getattr(getattr(vision, "images", None), "int_mask", False) else mx.float32)
    emb = vision.model.get_input_embeddings(ids, mask=mask, **image_inputs)
    extra = {k: v for k, v in emb.to_dict().items()
             if v is not None and k not in ("inputs_embeds", "attention_mask_4d")}
    lm = vision.model.language_model
    if vision.family in GENERIC_FAMILIES:  # mlx-vlm's own cache classes, not mlxserve's
        cache = lm.make_cache() if hasattr(lm, "make_cache") else [KVCache() for _ in lm.layers]
    else:
        cache = vision.text_model.make_cache()[: vision.text_model.n_layers]
    if hasattr(vision, "mlx_vlm_lm_kwargs"):  # what its Model.__call__ adds (ERNIE 4.5 VL's token types)
        extra |= vision.mlx_vlm_lm_kwargs(ids[0].tolist(), image_inputs)
    return lm(ids, inputs_embeds=emb.inputs_embeds, cache=cache, **extra).logits[0, -1], lm, cache


def mlx_vlm_greedy(vision, ids: list[int], n: int, **image_inputs) -> list[int]:
    """Greedy tokens of `mlx_vlm_forward`, decoded on by mlx-vlm's language model."""
    import mlx.core as mx

    logits, lm, cache = mlx_vlm_forward(vision, ids, **image_inputs)
    want = [mx.argmax(logits).item()]
    while len(want) < n:
        want.append(mx.argmax(lm(mx.array([[want[-1]]]), cache=cache).logits[0, -1]).item())
    return want


@pytest.mark.parametrize("shape", VLMS + GENERIC_VLMS)
def test_engine_matches_mlx_vlms_own_forward_pass(tiny, shape):
    """The adapters' split (tower alone, embeddings per chunk, text tail on the text path,
    M-RoPE from cache offset + delta) gives mlx-vlm's own whole-prompt greedy tokens."""
    import mlx.core as mx

    loaded = tiny(shape)
    vision = loaded.vision
    req = chat_request(loaded, [("user", [picture(1), "What is in this picture? Tell me all you see."])], max_tokens=8)
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=7)).start()  # chunks cut through the image
    try:
        (got, _), = run(engine, req)
    finally:
        engine.stop()
    image = req.images[0].pixels
    extra = {"image_grid_thw": mx.array([image.grid_thw])} if image.grid_thw else {}
    assert got == mlx_vlm_greedy(vision, req.prompt_token_ids, 8, pixel_values=mx.array(vision.pixels(image)), **extra)


def image_inputs(vision, images) -> dict:
    """mlx-vlm's image inputs for a prompt's images (PromptImages), as its processors give them."""
    import mlx.core as mx

    pixels = [vision.pixels(im.pixels) for im in images]
    if images[0].pixels.grid_thw is None:  # Gemma 4: a list of differently sized images, one by one
        return {"pixel_values": [mx.array(p) for p in pixels] if len(pixels) > 1 else mx.array(pixels[0])}
    return {"pixel_values": mx.array(np.concatenate(pixels)),
            "image_grid_thw": mx.array([im.pixels.grid_thw for im in images])}


@pytest.mark.parametrize("shape", GENERIC_VLMS)
def test_generic_chunks_give_mlx_vlms_logits(tiny, shape):
    """The generic adapter's chunk inputs (text rows, image rows spliced in, deepstack rows,
    per-layer inputs) over chunks cut through both images give mlx-vlm's whole-prompt logits.
    (Closer than greedy tokens: Gemma 4's per-layer inputs move the dummy model's logits by ~0.01.)"""
    import mlx.core as mx

    loaded = tiny(shape)
    vision = loaded.vision
    req = chat_request(loaded, [("user", [picture(31), "and", picture(32, (30, 30)), "Compare them."])])
    ids, images = req.prompt_token_ids, req.images
    feats = [vision.encode(im.pixels) for im in images]
    if shape == "qwen3-vl-tiny":  # each image token's embedding and its 2 deepstack rows
        assert feats[0].shape == (images[0].num_tokens, 3, 64)
    positions = vision.positions(ids, [im.pixels for im in images])[0]
    cache = vision.text_model.make_cache()
    for a in range(0, len(ids), 5):
        b = min(a + 5, len(ids))
        spans = [(max(a, im.start) - a, f[max(a, im.start) - im.start : min(b, im.start + im.num_tokens) - im.start])
                 for im, f in zip(images, feats) if im.start < b and im.start + im.num_tokens > a]
        logits = vision.text_model(mx.array([ids[a:b]]), cache=cache, **vision.inputs(ids[a:b], spans),
                                   positions=None if positions is None else positions[..., a:b])
    want, _, _ = mlx_vlm_forward(vision, ids, **image_inputs(vision, images))
    assert mx.abs(logits[0, -1] - want).max().item() < 1e-3


@pytest.mark.parametrize("shape", GENERIC_VLMS)
def test_generic_two_images_in_one_message_match_mlx_vlm(tiny, shape):
    loaded = tiny(shape)
    req = chat_request(loaded, [("user", [picture(31), "and", picture(32, (30, 30)), "Compare them."])], max_tokens=8)
    assert len(req.images) == 2 and req.images[0].num_tokens != req.images[1].num_tokens
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5)).start()
    try:
        (got, _), = run(engine, req)
    finally:
        engine.stop()
    assert got == mlx_vlm_greedy(loaded.vision, req.prompt_token_ids, 8, **image_inputs(loaded.vision, req.images))


@pytest.mark.parametrize("shape", GENERIC_VLMS)
def test_generic_text_prompts_batch_through_mlx_vlms_language_model(tiny, shape):
    """Text prompts of different lengths prefilled in one batch (right-padded), and a prefix-cache
    hit beside a new prompt, give each prompt's tokens alone (mlx-vlm's Qwen3.5 takes padding into
    its recurrent state: its prompts are prefilled one at a time)."""
    loaded = tiny(shape)
    long = chat_request(loaded, [("user", ["A long question about the sea, lighthouses and ships at night. " * 4])])
    short = chat_request(loaded, [("user", ["No picture here, just a question about lighthouses."])])
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False)).start()
    try:
        alone = [run(off, fresh(r))[0][0] for r in (long, short)]
        together = [t for t, _ in run(off, fresh(long), fresh(short))]
    finally:
        off.stop()
    cached = AsyncEngine(loaded, EngineConfig(block_size=16)).start()
    try:
        run(cached, fresh(long))
        (hit, hit_cached), (new, _) = run(cached, fresh(long), fresh(short))
    finally:
        cached.stop()
    assert together == alone and [hit, new] == alone and hit_cached > 0


def test_bidirectional_image_attention_is_refused_where_it_is_not_mended(tmp_path):
    """Gemma 4's mask is mended after cached tokens (test_vlm_bidirectional.py); another family's is not."""
    from mlxserve.models.files import ModelLoadError

    config = copy.deepcopy(SHAPES["qwen3-vl-tiny"])
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention='vision'.*Gemma 4 only"):
        load(str(tmp_path / "config.json"), load_format="dummy", progress=False)
    with pytest.raises(ModelLoadError, match="not supported"):  # a folder: refused before its weights are read
        load(str(tmp_path), progress=False)


def test_qwen3_vl_reads_its_preprocessor_size_bounds():
    """Qwen3-VL's preprocessor_config.json gives `size: {shortest_edge, longest_edge}` in pixels
    (no min/max_pixels): 65536 px at least, so a 224 px image is upscaled to 256 px, 64 tokens."""
    from mlxserve.models.vlm_images import QwenImages

    config = SHAPES["qwen3-vl-4b"]
    images = QwenImages(config, config["preprocessor_config"])
    assert images.layout(picture(0, (224, 224))).num_tokens == 64
    assert images.layout(picture(0, (1024, 1024))).num_tokens == 1024
    assert images.layout(picture(0, (768, 1024))).num_tokens == 768


# ---- video ----


def mp4_bytes(n=8, size=(96, 80), fps=4, seed=0) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        rng = np.random.default_rng(seed)
        for _ in range(n):
            pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_url(seed=0) -> str:
    return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(seed=seed)).decode()


def test_video_matches_mlx_vlm_and_its_frames_are_reused(tiny):
    import mlx.core as mx

    from mlxserve.multimodal.media import MediaLimits, decode_video

    loaded = tiny("qwen2.5-vl-tiny")
    vision = loaded.vision
    url = video_url()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens in this video?"}]}]
    ids, groups = chat_prompt(loaded, messages)
    assert len(groups) == 2 and all(g.pixels.video == 0 for g in groups)  # 4 frames at 2 fps: 2 groups of 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=7, block_size=16)).start()
    try:
        (got, cold), = run(engine, Request(ids, params, images=groups))
        # The same video again, as a new turn of text after it: its groups come from the caches.
        turn2 = messages + [{"role": "assistant", "content": "Noise."}, {"role": "user", "content": "And then?"}]
        ids2, groups2 = chat_prompt(loaded, turn2, is_cached=engine.image_is_cached)
        assert all(g.pixels.pixel_values is None for g in groups2)  # cached: no pixel arrays made
        (turn2_tokens, warm), = run(engine, Request(ids2, params, images=groups2))
        vstats = asyncio.run(engine.cache_stats())["vision_cache"]
    finally:
        engine.stop()
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, vision_cache_memory="0")).start()
    try:  # the same turn from scratch, its pixels made on demand from the kept frames
        (uncached_turn2, _), = run(off, Request(ids2, params, images=chat_prompt(loaded, turn2)[1]))
        lazy = chat_prompt(loaded, turn2, is_cached=lambda _: True)[1]
        (lazy_turn2, _), = run(off, Request(ids2, params, images=lazy))
    finally:
        off.stop()
    assert turn2_tokens == uncached_turn2 == lazy_turn2
    assert cold == 0 and warm >= groups[-1].start + groups[-1].num_tokens - 16
    # Each group encoded once, its embeddings dropped once the prefix cache held its KV.
    assert (vstats["misses"], vstats["entries"], vstats["released"]) == (2, 0, 2)
    # mlx-vlm's own path over the whole video.
    frames = decode_video(base64.b64decode(url.split(",", 1)[1]), MediaLimits())
    out = vision.video_processor(videos=[frames])
    emb = vision.model.get_input_embeddings(
        mx.array([ids]), pixel_values_videos=mx.array(np.asarray(out["pixel_values_videos"])),
        video_grid_thw=mx.array(np.asarray(out["video_grid_thw"])), mask=mx.ones((1, len(ids))))
    lm = vision.model.language_model
    cache = vision.text_model.make_cache()[: vision.text_model.n_layers]
    logits = lm(mx.array([ids]), inputs_embeds=emb.inputs_embeds, cache=cache, position_ids=emb.position_ids,
                rope_deltas=emb.rope_deltas).logits
    want = [mx.argmax(logits[0, -1]).item()]
    while len(want) < 8:
        want.append(mx.argmax(lm(mx.array([[want[-1]]]), cache=cache).logits[0, -1]).item())
    assert got == want


def test_python_api_takes_images(tiny):
    from mlxserve.llm import LLM

    image = picture(4)
    req = chat_request(tiny("qwen2.5-vl-tiny"), [("user", [image, "What is in this picture?"])], max_tokens=6)
    engine = AsyncEngine(tiny("qwen2.5-vl-tiny"), EngineConfig()).start()
    try:
        (want, _), = run(engine, req)
    finally:
        engine.stop()
    with LLM("qwen2.5-vl-tiny", load_format="dummy") as llm:
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out[0].token_ids == want


def test_two_images_in_one_message_match_mlx_vlm(tiny):
    import mlx.core as mx

    loaded = tiny("qwen2.5-vl-tiny")
    vision = loaded.vision
    req = chat_request(loaded, [("user", [picture(31), "and", picture(32, (60, 90)), "Compare them."])], max_tokens=8)
    assert len(req.images) == 2 and req.images[1].start > req.images[0].start + req.images[0].num_tokens
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5)).start()
    try:
        (got, _), = run(engine, req)
    finally:
        engine.stop()
    ids = mx.array([req.prompt_token_ids])
    pixels = mx.array(np.concatenate([vision.pixels(im.pixels) for im in req.images]))
    grids = mx.array([im.pixels.grid_thw for im in req.images])
    emb = vision.model.get_input_embeddings(ids, pixels, image_grid_thw=grids, mask=mx.ones(ids.shape))
    lm = vision.model.language_model
    cache = vision.text_model.make_cache()[: vision.text_model.n_layers]
    logits = lm(ids, inputs_embeds=emb.inputs_embeds, cache=cache, position_ids=emb.position_ids,
                rope_deltas=emb.rope_deltas).logits
    want = [mx.argmax(logits[0, -1]).item()]
    while len(want) < 8:
        want.append(mx.argmax(lm(mx.array([[want[-1]]]), cache=cache).logits[0, -1]).item())
    assert got == want
