"""Pinned prefixes: blocks that eviction and reset pass over until unpinned.

The block pool first (pins are references eviction respects, reset keeps
them, stats count them), then PrefixCache.pin on a tiny model, then the
engine and HTTP: POST /v1/cache/pin prefills and pins, a flood of other
prompts does not evict a pinned prefix, and an unpinned one goes.
"""

import random

import pytest

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX

import mlx.core as mx  # noqa: E402

from mlxserve.cache import BlockPool, PrefixCache  # noqa: E402
from mlxserve.cache.layers import KV  # noqa: E402


def _payload(nbytes=1024):
    return [KV(mx.zeros((nbytes // 8,), mx.float32), mx.zeros((nbytes // 8,), mx.float32))]


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _chain(pool, n, start, parent=None):
    blocks = []
    for i in range(start, start + n):
        blocks.append(pool.store(_key(i), parent, _payload(), num_tokens=16))
        parent = blocks[-1].hash
    return blocks


# ---- the block pool ----

def test_pinned_blocks_survive_a_flood_and_go_once_unpinned():
    pool = BlockPool(16 * 1024)
    pinned = _chain(pool, 3, 0)
    pool.release(pool.lookup([b.hash for b in pinned]))  # used, then free: evictable but for the pin
    pool.pin(pinned)
    s = pool.stats()
    assert (s["pinned_blocks"], s["pinned_tokens"], s["pinned_bytes"]) == (3, 48, 3 * 1024)
    rng = random.Random(0)
    for i in range(100, 400):  # a flood of other chains, 5x the budget
        cached = [b for b in pool.blocks() if b.pins == 0]
        parent = rng.choice(cached).hash if cached and rng.random() < 0.5 else None
        pool.store(_key(i), parent, _payload(), num_tokens=16)
        assert pool.nbytes <= pool.budget
    assert all(b.hash in pool for b in pinned)
    assert pool.stats()["evictions"] > 200
    pool.unpin(pinned)
    assert pool.stats()["pinned_blocks"] == 0 and all(b.ref_count == 0 for b in pinned)
    for i in range(1000, 1020):
        pool.store(_key(i), None, _payload(), num_tokens=16)
    assert not any(b.hash in pool for b in pinned)
    assert pool.stats()["in_use_blocks"] == 0
    with pytest.raises(ValueError):
        pool.unpin(pinned[:1])


def test_pins_count_against_the_budget_and_nest():
    pool = BlockPool(4 * 1024)
    a = _chain(pool, 2, 0)
    pool.pin(a)
    pool.pin(a[:1])  # a second pin of the first block
    b = _chain(pool, 2, 10)
    assert b[1] is not None and pool.stats()["bytes"] == 4 * 1024
    assert pool.store(_key(20), None, _payload(3 * 1024)) is None  # only b's 2 KB can go
    assert pool.stats()["refused"] == {"no_room": 1}
    pool.unpin(a)
    assert a[0].pins == 1 and a[1].pins == 0 and pool.stats()["pinned_blocks"] == 1
    assert pool.store(_key(21), None, _payload(3 * 1024)) is not None  # a[1] may go now, a[0] not
    assert a[0].hash in pool and a[1].hash not in pool and pool.nbytes == 4 * 1024


def test_reset_keeps_pinned_chains_and_their_bookkeeping():
    pool = BlockPool(64 * 1024)
    a = _chain(pool, 3, 0)
    tail = pool.store(_key(50), a[1].hash, _payload(), num_tokens=5)  # a sibling of a[2]
    other = _chain(pool, 2, 10)
    held = pool.lookup([other[0].hash])  # in use, not pinned: leaves the index at reset
    pool.pin(a[:2])
    pool.reset()
    assert [b.hash in pool for b in (*a, tail, *other)] == [True, True, False, False, False, False]
    assert a[0].children == 1 and a[1].children == 0
    assert pool.children(a[0].hash, 4) == [a[1]]
    assert pool.nbytes == 3 * 1024  # the two pinned blocks and the held one until released
    pool.release(held)
    assert pool.nbytes == 2 * 1024
    pool.unpin(a[:2])
    assert pool.stats()["free_bytes"] == 2 * 1024
    for i in range(100, 200):  # evictable again, leaf first
        pool.store(_key(i), None, _payload(), num_tokens=16)
    assert a[0].hash not in pool and pool.nbytes <= pool.budget


# ---- PrefixCache.pin ----

def _store_prompt(pc, model, prompt):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    pc.store_from_cache(cache, prompt, len(prompt), finished=True)


def test_prefix_cache_pins_full_blocks_and_the_tail(tiny):
    loaded = tiny("qwen3-tiny")
    pc = PrefixCache(BlockPool(64 << 20), 8, loaded.fingerprint, model=loaded.model)
    prompt = list(range(100, 120))  # 2 full blocks and a 4-token tail
    blocks, n = pc.pin(prompt)
    assert (blocks, n) == ([], 0)  # nothing cached yet
    _store_prompt(pc, loaded.model, prompt)
    blocks, n = pc.pin(prompt)
    assert n == 20 and len(blocks) == 3 and all(b.pins == 1 for b in blocks)
    assert blocks[-1].num_tokens == 4
    # A prompt that parts from the pinned one inside the tail pins what they share.
    blocks2, n2 = pc.pin(prompt[:18] + [7, 7])
    assert n2 == 18 and blocks2 == blocks and blocks[0].pins == 2
    pc.unpin(blocks2)
    pc.unpin(blocks)
    assert pc.pool.stats()["pinned_blocks"] == 0 and pc.pool.stats()["in_use_blocks"] == 0
