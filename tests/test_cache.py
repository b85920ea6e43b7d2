"""Paged prefix cache: a hit gives the same greedy tokens as a miss, for every layer kind.

Models are tiny random-weight ones (peaked logits), so a wrong or shifted KV
entry changes the tokens; the block pool is checked for its budget, ref
counts and eviction order under random use.
"""

import copy
import gc
import hashlib
import random
import struct

import pytest

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache  # noqa: E402

from mlxserve.cache import BlockPool, PrefixCache, hash_blocks, parse_size  # noqa: E402
from mlxserve.cache.blocks import content_key  # noqa: E402
from mlxserve.cache.layers import (  # noqa: E402
    KV,
    QuantizedKV,
    State,
    extract_blocks,
    extract_blocks_from_batch,
    payload_nbytes,
)
from mlxserve.cache.restore import restore_cache  # noqa: E402
from mlxserve.cache.sizes import memory_limit  # noqa: E402

MB = 1 << 20


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def greedy(model, prompt, n=8, cache=None, **kw):
    return [tok for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, **kw)]


def batch_greedy(model, prompt, cache, n=8):
    """Greedy tokens through mlx-lm's BatchGenerator, starting from `cache` (merged into the batch)."""
    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=16)
    try:
        (uid,) = gen.insert([prompt], caches=[cache] if cache is not None else None)
        out = []
        while len(out) < n:
            out += [r.token for r in gen.next_generated() if r.uid == uid]
        return out
    finally:
        gen.close()


def prefill(model, prompt, chunk, store=None):
    """Prefill in chunks as the runner does, storing after each chunk if asked."""
    cache = make_prompt_cache(model)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        model(mx.array(prompt[done : done + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if store is not None:
            store(cache, done)
    return cache


def new_cache(loaded, block_size, budget=64 * MB):
    return PrefixCache(BlockPool(budget), block_size, loaded.fingerprint, model=loaded.model)


def hit(pc, model, prompt, expect):
    """Match, restore, release; the restored cache and its token count."""
    m = pc.match(prompt)
    assert m.num_tokens == expect
    cache = pc.restore(model, m)
    pc.release(m)
    assert cache is not None, pc.stats()["faults"]
    return cache


def assert_no_refs(pc):
    s = pc.pool.stats()
    assert s["in_use_blocks"] == 0
    assert all(b.ref_count == 0 for b in pc.pool.blocks())
    assert s["free_bytes"] == s["bytes"]


# ---- keys ----


def test_hash_blocks_chain_full_blocks_only_and_stable():
    toks = list(range(100, 140))  # 40 tokens: 2 full blocks of 16, a partial tail
    keys = hash_blocks(toks, 16, fingerprint="fp")
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    # Keys name files on disk across restarts: the byte layout must not drift.
    layout = (
        b"mlxserve-kv-block-v1\0" + struct.pack("<I", 2) + b"fp"  # version, fingerprint
        + bytes(32)  # the root's parent
        + np.array(toks[:16], dtype="<i8").tobytes()
        + b"(" + struct.pack("<I", 0) + b")"  # no extra keys
    )
    assert keys[0] == hashlib.sha256(layout).digest()
    assert keys[0].hex()[:16] == "ddba80141a1c2309"
    # Chained: a change in block 0 changes block 1's key; one in block 1 leaves block 0's.
    assert hash_blocks([1] + toks[1:], 16, fingerprint="fp")[1] != keys[1]
    changed = hash_blocks(toks[:20] + [7] + toks[21:], 16, fingerprint="fp")
    assert changed[0] == keys[0] and changed[1] != keys[1]
    # A chain continues from a parent key.
    assert hash_blocks(toks[16:], 16, fingerprint="fp", parent=keys[0]) == keys[1:]
    # Fingerprint and extra keys are part of every key.
    assert hash_blocks(toks, 16, fingerprint="other") != keys
    with_media = hash_blocks(toks, 16, fingerprint="fp", extra_keys=[(), (("img", 3),)])
    assert with_media[0] == keys[0] and with_media[1] != keys[1]
    assert hash_blocks(toks, 16, fingerprint="fp", extra_keys=[(), (("img", 4),)])[1] != with_media[1]
    with pytest.raises(TypeError):
        hash_blocks(toks, 16, fingerprint="fp", extra_keys=[(object(),)])


# ---- hits give the same tokens as misses ----


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3-tiny"])
def test_full_and_partial_hits_match_uncached(tiny, shape):
    loaded = tiny(shape)
    model = loaded.model
    pc = new_cache(loaded, 16)
    prompt = prompt_of(70, 1)
    prefill(model, prompt, 32, lambda c, n: pc.store_from_cache(c, prompt, n))
    assert pc.stats()["blocks"] == 4  # 64 of 70 tokens: only full blocks

    # Full hit: all but the partial tail.
    assert greedy(model, prompt[64:], cache=hit(pc, model, prompt, 64)) == greedy(model, prompt)
    # A prompt that is an exact multiple of the block size: one token is left to prefill.
    p64 = prompt[:64]
    assert greedy(model, p64[63:], cache=hit(pc, model, p64, 63)) == greedy(model, p64)
    # Partial hit: shares 40 tokens, 2 whole blocks and the first 8 tokens of the third.
    other = prompt[:40] + prompt_of(30, 2)
    assert greedy(model, other[40:], cache=hit(pc, model, other, 40)) == greedy(model, other)
    # The restored cache also feeds mlx-lm's BatchGenerator (BatchKVCache.merge).
    assert batch_greedy(model, other[40:], hit(pc, model, other, 40)) == greedy(model, other)
    # A finished sequence leaves its last, partial block too: a prompt continuing
    # all 70 tokens hits all of them.
    pc.store_from_cache(prefill(model, prompt, 32), prompt, 70, finished=True)
    assert pc.stats()["blocks"] == 5 and pc.stats()["tokens"] == 70
    longer = prompt + prompt_of(5, 3)
    assert greedy(model, longer[70:], cache=hit(pc, model, longer, 70)) == greedy(model, longer)

    s = pc.stats()
    assert s["hits"] == 5 and s["hit_tokens"] == 64 + 63 + 40 + 40 + 70 and s["partial_hits"] == 3
    assert_no_refs(pc)


def test_sliding_window_prompt_longer_than_window(tiny):
    loaded = tiny("gemma3-tiny")  # window 16 on layers 0-2
    model = loaded.model
    pc = new_cache(loaded, 8)
    prompt = prompt_of(70, 3)
    prefill(model, prompt, 16, lambda c, n: pc.store_from_cache(c, prompt, n))
    longer = prompt + prompt_of(10, 4)
    cache = hit(pc, model, longer, 64)
    rot = cache[0]
    assert isinstance(rot, RotatingKVCache) and isinstance(cache[3], KVCache)
    assert (rot.offset, rot._idx, rot.keys.shape[2]) == (64, 16, 16)
    assert greedy(model, longer[64:], cache=cache) == greedy(model, longer)
    # ... and through BatchGenerator (BatchRotatingKVCache.merge at p > window).
    assert batch_greedy(model, longer[64:], hit(pc, model, longer, 64)) == greedy(model, longer)

    # A restore at 64 reads only the window's blocks: drop the rest and it still works.
    m = pc.match(longer)
    payloads = [list(b.payload) for b in m.blocks]
    pc.release(m)
    for p in payloads[:6]:  # blocks 0-5 (tokens 0-47) are outside the window of 64
        p[0] = p[1] = p[2] = None
    cache = restore_cache(model, payloads, 64, block_size=8)
    assert greedy(model, longer[64:], cache=cache) == greedy(model, longer)
    # A restore that steps one block further back, though, needs block 5.
    with pytest.raises(ValueError):
        restore_cache(model, payloads[:7], 56, block_size=8)
    assert_no_refs(pc)


def test_sliding_window_gaps_walk_back_then_fill(tiny):
    loaded = tiny("gemma3-tiny")
    model = loaded.model
    pc = new_cache(loaded, 8)
    prompt = prompt_of(70, 5)
    # Stored once, at the end: the window layers then hold only tokens 49-69.
    cache = prefill(model, prompt, 32)
    assert pc.store_from_cache(cache, prompt, 70) == 8
    m = pc.match(prompt)
    assert m.num_tokens == 0 and not m.blocks
    assert pc.stats()["misses"]["unrestorable"] == 1
    # The same prompt prefilled again (uncached), storing after every chunk,
    # completes the blocks' window payloads; then it hits.
    prefill(model, prompt, 16, lambda c, n: pc.store_from_cache(c, prompt, n))
    assert pc.stats()["blocks"] == 8
    assert greedy(model, prompt[64:], cache=hit(pc, model, prompt, 64)) == greedy(model, prompt)
    assert_no_refs(pc)


def test_recurrent_state_restored_at_block_boundary(tiny):
    loaded = tiny("lfm2-tiny")  # 3 short-conv layers (ArraysCache) + 1 attention
    model = loaded.model
    pc = new_cache(loaded, 8)
    prompt = prompt_of(45, 6)
    prefill(model, prompt, 16, lambda c, n: pc.store_from_cache(c, prompt, n))
    # States exist at the chunk ends 16 and 32 (45 is not a block end), so the
    # hit walks back from 40 to 32.
    cache = hit(pc, model, prompt, 32)
    assert greedy(model, prompt[32:], cache=cache) == greedy(model, prompt)
    other = prompt[:20] + prompt_of(20, 7)
    assert greedy(model, other[16:], cache=hit(pc, model, other, 16)) == greedy(model, other)
    assert batch_greedy(model, other[16:], hit(pc, model, other, 16)) == greedy(model, other)
    assert_no_refs(pc)


def test_pure_recurrent_model(tiny):
    """Mamba: no attention layer tells the token count; the caller's upto_tokens does."""
    from mlxserve.models.dummy import build_dummy

    config = {
        "model_type": "mamba",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
        "tie_word_embeddings": True,
    }
    model, _ = build_dummy(config, dtype="float32")
    pc = PrefixCache(BlockPool(16 * MB), 8, "mamba-test", model=model)
    prompt = [t % 1024 for t in prompt_of(30, 8)]
    prefill(model, prompt, 8, lambda c, n: pc.store_from_cache(c, prompt, n))
    cache = hit(pc, model, prompt, 24)
    assert greedy(model, prompt[24:], cache=cache) == greedy(model, prompt)


def test_a_finished_batch_rows_cache_is_mlx_lms_without_the_copies(tiny, monkeypatch):
    """The engine's batches hand a finished row's KV over as views of the batch, located from the
    row's token count: exactly what mlx-lm's extract copies, for rows of different lengths that
    joined and left at different steps."""
    from mlxserve.engine import grammar

    model = tiny("llama-tiny").model
    grammar.install()
    seen = []
    views = grammar.ConstrainedGenerationBatch.extract_cache

    def both(self, idx):
        seen.append((views(self, idx), [c.extract(idx) for c in self.prompt_cache]))
        return seen[-1][0]

    monkeypatch.setattr(grammar.ConstrainedGenerationBatch, "extract_cache", both)
    gen = BatchGenerator(model, prefill_step_size=16)
    try:
        gen.insert([prompt_of(40, 26), prompt_of(5, 27)], max_tokens=[9, 3])
        finished = 0
        for step in range(40):
            if step == 2:
                gen.insert([prompt_of(23, 28)], max_tokens=[6])
            finished += sum(r.finish_reason is not None for r in gen.next_generated())
            if finished == 3:
                break
    finally:
        gen.close()
    assert len(seen) == 3
    for got, ref in seen:
        for g, r in zip(got, ref):
            assert g.offset == r.offset and g.keys.shape == r.keys.shape
            assert np.array_equal(np.array(g.keys), np.array(r.keys))
            assert np.array_equal(np.array(g.values), np.array(r.values))


@pytest.mark.parametrize("shape", ["llama-tiny", "gemma3-tiny", "lfm2-tiny"])
def test_blocks_from_a_batched_cache_row(tiny, shape):
    loaded = tiny(shape)
    model = loaded.model
    pc = new_cache(loaded, 8)
    prompts = [prompt_of(37, 10), prompt_of(50, 11), prompt_of(23, 12)]
    gen = BatchGenerator(model, max_tokens=3, prefill_step_size=16)
    gen.insert(prompts)
    stored = [0, 0, 0]
    try:
        for _ in range(20):
            gen.next()
            # Between steps, every row of the prompt batch (left-padded, chunked)
            # stores what its cache holds.
            batch = gen._prompt_batch
            for row, uid in enumerate(batch.uids):
                toks = batch.tokens[row]
                stored[uid] += pc.store_from_batch(batch.prompt_cache, row, toks, len(toks))
            if not gen._unprocessed_sequences and not len(gen._prompt_batch):
                break
    finally:
        gen.close()
    assert all(stored), (stored, pc.stats()["faults"])
    assert not pc.stats()["faults"]

    # Row payloads equal single-sequence ones (same tokens, up to float noise).
    single = prefill(model, prompts[1], 16)
    m = pc.match(prompts[1])
    assert m.num_tokens > 0
    ref = extract_blocks(single, 0, 8, len(m.blocks), num_tokens=50)
    for b, block in enumerate(m.blocks):
        for e, r in zip(block.payload, ref[b]):
            if isinstance(e, KV) and isinstance(r, KV):
                assert np.allclose(np.array(e.keys), np.array(r.keys), atol=1e-4)
                assert np.allclose(np.array(e.values), np.array(r.values), atol=1e-4)
    pc.release(m)

    for p in prompts:
        m = pc.match(p)
        assert m.num_tokens >= 16, (len(p), m.num_tokens)
        cache = pc.restore(model, m)
        pc.release(m)
        assert greedy(model, p[m.num_tokens :], cache=cache) == greedy(model, p)
    assert_no_refs(pc)


def test_batch_extraction_reads_row_padding_and_rotation(tiny):
    """Direct check of one row's slots: left padding (BatchKVCache) and rotation (BatchRotatingKVCache)."""
    model = tiny("gemma3-tiny").model
    a, b = prompt_of(12, 13), prompt_of(40, 14)
    caches = [make_prompt_cache(model), make_prompt_cache(model)]
    model(mx.array(a)[None], cache=caches[0])
    model(mx.array(b)[None], cache=caches[1])
    batch = [c.merge([x[i] for x in caches]) for i, c in enumerate(caches[0])]
    mx.eval([c.state for c in batch])
    # Row 0 is left-padded in the full-attention layer.
    assert batch[3].left_padding.tolist() == [28, 0]
    # The merged window layers hold each row's last 16 tokens: blocks 0 of
    # row 0 (12 tokens) and 3-4 of row 1 (40 tokens) are there, 0-1 of row 1 are not.
    for row, toks, held in ((0, a, [0]), (1, b, [3, 4])):
        got = extract_blocks_from_batch(batch, row, 0, 8, len(toks) // 8)
        ref = extract_blocks(caches[row], 0, 8, len(toks) // 8)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert [e is None for e in g] == [i not in held] * 3 + [False]
            for ge, re_ in zip(g, r):
                if ge is not None:
                    assert mx.array_equal(ge.keys, re_.keys) and mx.array_equal(ge.values, re_.values)
    # Decode steps rotate the window layers' rings (batched and single); every
    # 8-token span still held reads right, wherever it wraps around the ring.
    single = make_prompt_cache(model)
    model(mx.array(b)[None], cache=single)
    # Ground truth for layer 0: its keys depend only on the token and its
    # position, so a cache that never drops anything has the same ones.
    whole = [RotatingKVCache(max_size=1000) for _ in range(3)] + [KVCache()]
    model(mx.array(b)[None], cache=whole)
    for t in range(17):
        model(mx.array([[5 + t, 6 + t]]).T, cache=batch)
        model(mx.array([[6 + t]]), cache=single)
        model(mx.array([[6 + t]]), cache=whole)
        n = 41 + t
        for start in range(n - 16, n - 7):
            got = extract_blocks_from_batch(batch, 1, start, 8, 1)[0]
            ref = extract_blocks(single, start, 8, 1)[0]
            truth = extract_blocks(whole, start, 8, 1)[0][0]
            assert all(isinstance(e, KV) for e in got + ref)
            assert mx.array_equal(ref[0].keys, truth.keys) and mx.array_equal(ref[0].values, truth.values)
            for ge, re_ in zip(got, ref):
                assert np.allclose(np.array(ge.keys), np.array(re_.keys), atol=1e-4)
                assert np.allclose(np.array(ge.values), np.array(re_.values), atol=1e-4)
        # The token just before the window is gone from both.
        assert extract_blocks_from_batch(batch, 1, n - 17, 8, 1)[0][0] is None
        assert extract_blocks(single, n - 17, 8, 1)[0][0] is None
    assert batch[0].rotated and single[0]._idx < single[0].offset


# ---- payloads ----


def test_quantized_kv_round_trips(tiny):
    from mlxserve.models.dummy import build_dummy

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,  # quantization groups are >= 32
        "rms_norm_eps": 1e-5,
        "vocab_size": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    model, _ = build_dummy(config, dtype="float32")
    prompt = [t % 1024 for t in prompt_of(50, 15)]
    cache = prefill(model, prompt, 50)
    cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
    mx.eval([c.state for c in cache])
    held = mx.get_active_memory()
    payloads = extract_blocks(cache, 0, 16, 3)
    mx.eval([a for p in payloads for e in p for a in (*e.keys, *e.values)])
    assert mx.get_active_memory() - held <= 1.5 * sum(map(payload_nbytes, payloads))  # views, not copies
    assert all(isinstance(e, QuantizedKV) and e.bits == 8 for p in payloads for e in p)
    restored = restore_cache(model, payloads, 40)
    assert isinstance(restored[0], QuantizedKVCache) and restored[0].offset == 40
    for r, c in zip(restored, cache):
        assert (r.group_size, r.bits) == (32, 8)
        for x, y in zip(r.keys + r.values, c.keys + c.values):  # restored caches have room past 40
            assert mx.array_equal(x[..., :40, :], y[..., :40, :])
    trimmed = copy.deepcopy(cache)
    for c in trimmed:
        c.trim(c.offset - 40)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    assert greedy(model, prompt[40:], cache=restored, **kw) == greedy(model, prompt[40:], cache=trimmed, **kw)


def test_cache_list_layers_round_trip():
    """A CacheList layer pairing a recurrent state with KV (as Falcon-H1's) keeps
    its KV in blocks without a state, and restores at a block end with both."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    from mlxserve.cache.layers import Nested

    class Stub:  # restore_cache needs only make_cache
        def make_cache(self):
            return [CacheList(ArraysCache(size=1), KVCache()), KVCache()]

    def run(cache, x, step):
        cache[0][1].update_and_fetch(x, -x)
        cache[1].update_and_fetch(2 * x, x)
        cache[0][0][0] = mx.full((1, 3, 4), step, mx.float32)  # "state after this step"

    x = mx.random.normal((1, 2, 24, 8))
    pool = BlockPool(MB)
    pc = PrefixCache(pool, 8, "stub", model=Stub())
    live = Stub().make_cache()
    run(live, x[:, :, :16], 16)
    assert pc.store_from_cache(live, list(range(24)), 16) == 2
    run(live, x[:, :, 16:], 24)
    assert pc.store_from_cache(live, list(range(24)), 24) == 1
    blocks = pool.lookup(hash_blocks(range(24), 8, fingerprint="stub"))
    assert [type(p) for p in blocks[0].payload[0].parts] == [type(None), KV]  # no state at 8
    assert isinstance(blocks[1].payload[0], Nested) and isinstance(blocks[1].payload[0].parts[0], State)
    pool.release(blocks)
    for n, step in ((25, 24), (20, 16)):  # restores walk back to a block end with a state
        m = pc.match(list(range(24)) + [99] * (n - 24) if n > 24 else list(range(n)))
        assert m.num_tokens == step
        restored = pc.restore(Stub(), m)
        pc.release(m)
        assert restored[0][0][0].tolist() == mx.full((1, 3, 4), step, mx.float32).tolist()
        assert mx.array_equal(restored[0][1].keys, x[:, :, :step])
        assert mx.array_equal(restored[1].keys, 2 * x[:, :, :step])
        assert restored[0][1].offset == restored[1].offset == step


def test_payloads_do_not_pin_cache_buffers_or_alias_restores(tiny):
    model = tiny("llama-tiny").model
    prompt = prompt_of(20, 16)
    cache = prefill(model, prompt, 20)
    assert cache[0].keys.shape[2] == 256  # mlx-lm allocates in steps of 256 tokens
    held = mx.get_active_memory()
    payloads = extract_blocks(cache, 0, 8, 2)
    mx.eval([a for p in payloads for e in p for a in e])
    assert payload_nbytes(payloads[0]) == 2 * 2 * (1 * 2 * 8 * 16 * 4)  # 2 layers x (K, V)
    # What the pool counts is what the blocks hold: their per-layer entries are views of
    # the block's stacked copy, not second copies.
    # (Was 2.4x before; small buffers leave some allocator slack.)
    assert mx.get_active_memory() - held <= 1.5 * sum(map(payload_nbytes, payloads))
    before = mx.get_active_memory()
    live = sum(c.nbytes for c in cache)
    del cache
    gc.collect()
    assert before - mx.get_active_memory() >= live * 0.9  # the payloads kept no buffer alive

    # Running on a restored cache leaves the blocks it came from unchanged.
    saved = [np.array(e.keys) for e in payloads[0]]
    restored = restore_cache(model, payloads, 16)
    greedy(model, prompt[16:], cache=restored)
    assert all(np.array_equal(s, np.array(e.keys)) for s, e in zip(saved, payloads[0]))


def test_lone_block_payload_layout(tiny):
    model = tiny("lfm2-tiny").model
    cache = prefill(model, prompt_of(16, 17), 16)
    (p0, p1) = extract_blocks(cache, 0, 8, 2)
    # Recurrent layers: a state only for the block ending where the cache ends.
    assert [type(e) for e in p0] == [type(None), KV, type(None), type(None)]
    assert [type(e) for e in p1] == [State, KV, State, State]
    # A caller that claims more tokens than the attention layers hold gets no state.
    assert extract_blocks(cache, 8, 8, 1, num_tokens=24)[0][0] is None


# ---- the pool ----


def _payload(nbytes=1024):
    return [KV(mx.zeros((nbytes // 8,), mx.float32), mx.zeros((nbytes // 8,), mx.float32))]


def _check_invariants(pool, held):
    blocks = {b.hash: b for b in pool.blocks()}
    assert pool.nbytes <= pool.budget
    assert pool.nbytes == sum(b.nbytes for b in blocks.values()) + sum(
        b.nbytes for b in held if not b.cached
    )
    for b in blocks.values():
        # Leaf-first eviction: no cached block is ever an orphan.
        assert b.parent is None or b.parent in blocks
        assert b.children == sum(1 for c in blocks.values() if c.parent == b.hash)
    for b in held:
        assert b.cached and b.ref_count > 0  # in use: never evicted


def test_pool_keeps_budget_and_never_evicts_blocks_in_use():
    rng = random.Random(0)
    pool = BlockPool(40 * 1024)
    keys = iter(range(10**9))
    held = []  # lists of acquired blocks
    for step in range(1000):
        cached = pool.blocks()
        parent = rng.choice(cached).hash if cached and rng.random() < 0.8 else None
        pool.store(next(keys).to_bytes(32, "big"), parent, _payload(), num_tokens=16)
        if cached and rng.random() < 0.3:  # a request acquires a chain
            leaf = rng.choice(cached)
            if leaf.cached:
                chain = [leaf.hash]
                while pool.get(chain[-1]).parent is not None:
                    chain.append(pool.get(chain[-1]).parent)
                held.append(pool.lookup(chain[::-1]))
        if held and rng.random() < 0.3:
            pool.release(held.pop(rng.randrange(len(held))))
        _check_invariants(pool, [b for h in held for b in h])
    s = pool.stats()
    assert s["evictions"] > 500 and s["blocks"] <= 40
    for h in held:
        pool.release(h)
    # No leak: every block is free, and refs are all 0.
    s = pool.stats()
    assert s["in_use_blocks"] == 0 and s["free_bytes"] == s["bytes"]
    assert all(b.ref_count == 0 for b in pool.blocks())
    with pytest.raises(ValueError):
        pool.release(pool.blocks()[:1])


def test_pool_eviction_order_and_refusals():
    pool = BlockPool(4 * 1024)
    a = pool.store(b"a" * 32, None, _payload())
    b = pool.store(b"b" * 32, a.hash, _payload())
    c = pool.store(b"c" * 32, None, _payload())
    d = pool.store(b"d" * 32, c.hash, _payload())
    assert pool.store(b"a" * 32, None, _payload()) is a  # present: a no-op
    # The chain a-b is used again: c-d is now the least recently used; its leaf goes first.
    pool.release(pool.lookup([a.hash, b.hash]))
    pool.store(b"e" * 32, None, _payload())
    assert d.hash not in pool and c.hash in pool
    pool.store(b"f" * 32, None, _payload())
    assert c.hash not in pool and pool.was_evicted(c.hash)
    # Everything in use: a store is refused, nothing is evicted.
    held = pool.lookup([a.hash, b.hash]) + pool.lookup([b"e" * 32]) + pool.lookup([b"f" * 32])
    assert pool.store(b"g" * 32, None, _payload()) is None
    assert pool.store(b"h" * 32, None, _payload(8192)) is None  # alone over budget
    assert pool.store(b"i" * 32, b"zz" * 16, _payload()) is None  # parent not cached
    assert pool.stats()["refused"] == {"no_room": 1, "too_big": 1, "orphan": 1}
    pool.release(held)
    # Reset drops free blocks; a block in use leaves the index and goes when released.
    held = pool.lookup([a.hash])
    pool.reset()
    assert len(pool) == 0 and a.hash not in pool and pool.nbytes == 1024
    pool.release(held)
    assert pool.nbytes == 0 and pool.stats()["in_use_blocks"] == 0


def test_small_budget_still_serves_and_caches_less(tiny):
    loaded = tiny("llama-tiny")
    model = loaded.model
    prompt = prompt_of(90, 18)
    block_bytes = payload_nbytes(extract_blocks(prefill(model, prompt[:16], 16), 0, 16, 1)[0])
    pc = new_cache(loaded, 16, budget=3 * block_bytes)  # 3 blocks; the prompt has 5
    prefill(model, prompt, 32, lambda c, n: pc.store_from_cache(c, prompt, n))
    s = pc.stats()
    assert s["blocks"] == 3 and s["bytes"] <= s["budget"] and s["refused"]
    assert greedy(model, prompt[48:], cache=hit(pc, model, prompt, 48)) == greedy(model, prompt)
    # A new prompt evicts the old one's tail first, never a chain's inner block.
    other = prompt_of(40, 19)
    prefill(model, other, 40, lambda c, n: pc.store_from_cache(c, other, n))
    assert pc.stats()["evictions"] == 2
    m = pc.match(prompt)
    assert m.num_tokens == 16
    pc.release(m)
    assert_no_refs(pc)


def test_miss_reasons_and_fingerprints(tiny):
    loaded = tiny("llama-tiny")
    model = loaded.model
    pool = BlockPool(64 * MB)
    a = PrefixCache(pool, 16, loaded.fingerprint, model=model)
    b = PrefixCache(pool, 16, "another model", model=model)
    prompt = prompt_of(40, 20)
    prefill(model, prompt, 40, lambda c, n: a.store_from_cache(c, prompt, n))
    assert a.match(prompt_of(10, 30)).num_tokens == 0  # no full block, nothing cached continues it
    short = a.match(prompt[:10])  # no full block, but the first cached block continues it
    assert short.num_tokens == 9
    a.release(short)
    assert b.match(prompt).num_tokens == 0  # different fingerprints never match
    assert a.match(prompt_of(40, 21)).num_tokens == 0
    assert a.stats()["misses"] == {
        "no_match": 1, "evicted": 0, "model_mismatch": 0, "too_short": 1, "unrestorable": 0, "unsupported": 0,
        "damaged": 0,
    }
    assert b.stats()["misses"]["model_mismatch"] == 1
    small = PrefixCache(BlockPool(0), 16, "x", model=model)
    small.store_from_cache(prefill(model, prompt, 40), prompt, 40)
    assert small.match(prompt).num_tokens == 0 and small.stats()["misses"]["no_match"] == 1
    # Evicted: a second prompt pushes the first one's blocks out.
    block_bytes = payload_nbytes(next(iter(pool.blocks())).payload)
    c = PrefixCache(BlockPool(2 * block_bytes), 16, loaded.fingerprint, model=model)
    c.store_from_cache(prefill(model, prompt, 40), prompt, 40)
    other = prompt_of(40, 22)
    c.store_from_cache(prefill(model, other, 40), other, 40)
    assert c.match(prompt).num_tokens == 0 and c.stats()["misses"]["evicted"] == 1
    assert content_key(prompt, 16) == content_key(prompt[:16], 16) != content_key(other, 16)


def test_cache_faults_never_raise(tiny):
    llama, gemma = tiny("llama-tiny"), tiny("gemma3-tiny")
    pc = new_cache(llama, 16)
    prompt = prompt_of(40, 23)
    cache = prefill(llama.model, prompt, 40, lambda c, n: pc.store_from_cache(c, prompt, n))
    m = pc.match(prompt)
    assert m.num_tokens == 32
    assert pc.restore(gemma.model, m) is None  # wrong model: layer kinds differ
    pc.release(m)
    pc.release(m)  # idempotent
    assert pc.store_from_cache(cache[:1], prompt, 40) == 0  # a layer short of the model's
    assert pc.store_from_cache(cache, prompt + prompt_of(20, 24), 60) == 0  # claims tokens it lacks
    assert pc.match(prompt, extra_keys=[(object(),)]).num_tokens == 0  # unhashable extra key
    faults = pc.stats()["faults"]
    assert faults.keys() == {"restore: ValueError", "store: ValueError", "match: TypeError"}
    assert faults["store: ValueError"] == 2
    assert pc.stats()["hit_tokens"] == 0  # the failed restore served nothing
    assert_no_refs(pc)
    # A model whose cache blocks cannot hold (mlx-lm's ConcatenateKVCache) is served uncached.
    from mlx_lm.models.cache import ConcatenateKVCache

    class Concatenating:
        def make_cache(self):
            return [ConcatenateKVCache()]

    off = PrefixCache(BlockPool(MB), 16, "concatenating", model=Concatenating())
    assert off.disabled and "ConcatenateKVCache in cache layers 0" in off.disabled
    assert off.match(prompt).num_tokens == 0
    assert off.store_from_cache([ConcatenateKVCache()], prompt, 40) == 0
    assert off.stats()["misses"]["unsupported"] == 1 and not off.stats()["faults"]


def test_parse_size():
    assert parse_size("4GB") == 4 << 30
    assert parse_size("512MB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("100") == parse_size(100) == 100
    assert parse_size("20%") == int(memory_limit() * 0.2) > 0
    for bad in ("lots", "-1GB", "120%", "4XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_share_of_memory_is_of_the_devices_memory(monkeypatch):
    """On a CUDA GPU a percentage is of the GPU's memory (its arrays live there), not of the
    host's RAM: 10% of a 540 GB host once left a 45B model's ranks no room for running requests."""
    gpu = {"total_memory": 80 << 30, "free_memory": 79 << 30, "architecture": "sm_90"}
    monkeypatch.setattr(mx, "device_info", lambda: gpu)
    assert memory_limit() == 80 << 30
    assert parse_size("10%") == 8 << 30
    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 64 << 30, "max_recommended_working_set_size": 48 << 30})
    assert memory_limit() == 48 << 30  # Metal: the recommended working set
