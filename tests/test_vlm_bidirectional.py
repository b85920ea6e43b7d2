"""Gemma 4 with use_bidirectional_attention='vision' (26B-A4B / 31B): an image's tokens attend to each
other both ways. Prefill passes never split an image, prefix hits back off to an image's start, and a
pass after cached tokens gets the both-ways mask mlx-vlm drops there: greedy tokens equal mlx-vlm's
own whole-prompt pass (its generate prefills such a prompt in one pass)."""

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.runner import Sequence
from tests.test_vlm import chat_request, fresh, image_inputs, picture, run

SHAPE = "gemma4-vl-bidi-tiny"  # window 8: an image (12 tokens here) reaches past it


def two_images(loaded, max_tokens=8):
    return chat_request(loaded, [("user", [picture(1), "What is in this picture? Tell me.",
                                           picture(2, (60, 90)), "And this one?"])], max_tokens=max_tokens)


def mlx_vlm_greedy(vision, req, n):
    """mlx-vlm's Model.__call__ over the whole prompt with the media token types its processor gives,
    and mlx-vlm's own mask overlay (not mlxserve's), then decoded on with its language model."""
    import mlx.core as mx
    from mlx_vlm.models.gemma4.language import Gemma4TextModel

    ids = mx.array([req.prompt_token_ids])
    lm = vision.model.language_model
    patched = Gemma4TextModel._apply_blockwise_bidirectional_overlay
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gemma4TextModel, "_apply_blockwise_bidirectional_overlay", patched.original)
        cache = lm.make_cache()
        logits = vision.model(ids, cache=cache, mm_token_type_ids=(ids == vision.image_token_id).astype(mx.int32),
                              **image_inputs(vision, req.images)).logits
        want = [mx.argmax(logits[0, -1]).item()]
        while len(want) < n:
            want.append(mx.argmax(lm(mx.array([[want[-1]]]), cache=cache).logits[0, -1]).item())
    return want


def test_both_ways_attention_changes_the_tokens(tiny):
    """The check below means something: mlx-vlm's causal-only pass (no token types) gives other tokens."""
    import mlx.core as mx

    loaded = tiny(SHAPE)
    vision, req = loaded.vision, two_images(loaded)
    assert vision.whole_images and [im.num_tokens for im in req.images] == [12, 12]
    lm = vision.model.language_model
    cache = lm.make_cache()
    logits = vision.model(mx.array([req.prompt_token_ids]), cache=cache, **image_inputs(vision, req.images)).logits
    assert mx.argmax(logits[0, -1]).item() != mlx_vlm_greedy(vision, req, 1)[0]


@pytest.mark.parametrize("solo", [True, False])
@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_chunks_and_hits_give_mlx_vlms_tokens(tiny, chunk, solo):
    """Chunks of 3 or 7 tokens (images kept whole, after cached tokens), or one pass; the solo path or
    the image prefill that hands over to the batch; then a repeat, restored to its last token."""
    loaded = tiny(SHAPE)
    req = two_images(loaded)
    want = mlx_vlm_greedy(loaded.vision, req, 8)
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=chunk, block_size=8, solo_fast_path=solo)).start()
    try:
        (cold, cold_cached), = run(engine, fresh(req))
        (hit, hit_cached), = run(engine, fresh(req))
    finally:
        engine.stop()
    assert cold == hit == want
    assert cold_cached == 0 and hit_cached == len(req.prompt_token_ids) - 1


def test_image_prompts_beside_text_in_a_batch(tiny):
    loaded = tiny(SHAPE)
    a, b = two_images(loaded, max_tokens=6), chat_request(loaded, [("user", ["Look:", picture(3), "What now?"])])
    text = chat_request(loaded, [("user", ["Tell me about lighthouses."])], max_tokens=20)
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=5, prefix_cache=False)).start()
    try:
        (text_alone, _), = run(engine, fresh(text))
        (got_a, _), (got_b, _), (got_text, _) = run(engine, fresh(a), fresh(b), fresh(text))
    finally:
        engine.stop()
    assert got_a == mlx_vlm_greedy(loaded.vision, a, 6)
    assert got_b == mlx_vlm_greedy(loaded.vision, b, 6) and got_text == text_alone


def test_a_hit_inside_an_image_backs_off_to_its_start(tiny):
    """Blocks past the middle of the first image evicted: a repeat may restore up to its start only.
    (Restored mid-image, the rest of the image would attend to its cached start causally, and
    sliding-window layers not at all past the window.)"""
    from mlxserve.cache.blocks import hash_blocks

    loaded = tiny(SHAPE)
    req = two_images(loaded)
    first = req.images[0]
    bs = 4
    assert first.start % bs and (first.start + first.num_tokens) // bs * bs > first.start + bs  # blocks end inside
    engine = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=64, block_size=bs)).start()
    try:
        run(engine, fresh(req))
        pc = engine.prefix_cache
        keep = set(hash_blocks(req.prompt_token_ids, bs, fingerprint=pc.fingerprint,
                               extra_keys=req.block_extra_keys(bs))[: first.start // bs + 2])
        while victims := [b for b in pc.pool.blocks() if b.hash not in keep and pc.pool._evictable(b)]:
            for block in victims:
                pc.pool._evict(block)
        assert pc.covered_tokens(req.prompt_token_ids, req.block_extra_keys(bs)) == (first.start // bs + 2) * bs
        (again, cached), = run(engine, fresh(req))
    finally:
        engine.stop()
    assert cached == first.start
    assert again == mlx_vlm_greedy(loaded.vision, req, 8)


def test_cut_never_ends_inside_a_whole_range():
    seq = Sequence(request=None, max_tokens=1, sampler=None, processors=[], stop_ids=set(), stop_sequences=None,
                   whole=[(10, 22), (30, 34)])
    assert seq.cut(0, 8) == 8
    assert seq.cut(8, 8) == 2  # ends before the image
    assert seq.cut(10, 8) == 12  # starts at it: all of it, past the chunk size
    assert seq.cut(22, 8) == 8 and seq.cut(22, 10) == 8  # 30: the next one's start
    assert seq.cut(30, 2) == 4 and seq.cut(34, 8) == 8
    seq.checkpoints = [16]
    assert seq.cut(10, 8) == 12  # an image outweighs a checkpoint inside it
