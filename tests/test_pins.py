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



def test_a_hybrid_pin_keeps_the_state_a_later_prompt_restores_from(tiny):
    """A recurrent state exists only where a prefill pass stopped. A batch's prefill stops a
    token short of a prompt that fills its blocks, and keeps the state there, in a tail under
    the block before the last: a pin holds that tail too, so what goes on from the pinned
    prompt still restores all but its last token after everything unpinned is gone."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = tiny("qwen3.5-tiny")
    pc = PrefixCache(BlockPool(64 << 20), 8, loaded.fingerprint, model=loaded.model, checkpoint_interval=0)
    prompt = list(range(100, 124))  # 3 full blocks
    cache = make_prompt_cache(loaded.model)
    for a, b in ((0, 23), (23, 24)):  # the prefill, then the first decode step's token
        loaded.model(mx.array(prompt[a:b])[None], cache=cache)
        mx.eval([c.state for c in cache])
        pc.store_from_cache(cache, prompt, b, finished=b == 23, state=b == 23)
    blocks, n = pc.pin(prompt)
    assert n == 24 and len(blocks) == 4 and blocks[-1].num_tokens == 7
    pc.reset()
    match = pc.match(prompt + [5, 5])
    assert match.num_tokens == 23 and all(b.pins == 1 for b in match.blocks)
    pc.release(match)
    pc.unpin(blocks)
    pc.reset()
    assert pc.pool.stats()["blocks"] == 0

# ---- over HTTP: POST /v1/cache/pin, --pin at start ----

SYSTEM = "You are the build agent. Follow the repository's rules, run the tests, report briefly."
BLOCK = 8
BUDGET = 128 * 1024  # 32 blocks of qwen3-tiny's 8 tokens (512 bytes a token)


@pytest.fixture(scope="module")
def pinned_server(tmp_path_factory):
    import json

    from conftest import LiveServer
    from mlxserve.api.cache_routes import read_pin_file
    from mlxserve.config import EngineConfig, ModelConfig
    from mlxserve.engine.pool import ModelPool, ModelSpec

    pin_file = tmp_path_factory.mktemp("pins") / "pins.json"
    pin_file.write_text(json.dumps([{"messages": [{"role": "system", "content": SYSTEM}]}]))
    engine = EngineConfig(block_size=BLOCK, cache_memory=str(BUDGET))
    pool = ModelPool([ModelSpec("qwen3-tiny", ModelConfig(model="qwen3-tiny", load_format="dummy"), engine)])
    pool.preload()
    live = LiveServer(None, pool=pool, pins=read_pin_file(str(pin_file)), pin_file=str(pin_file))
    yield live
    live.close()


@pytest.fixture(scope="module")
def http(pinned_server):
    import httpx

    with httpx.Client(base_url=pinned_server.url, timeout=120) as c:
        yield c


def cached(http, prompt) -> int:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def flood(http, seed, n=12, length=40):
    """Other prompts, together several times the cache's budget."""
    rng = random.Random(seed)
    for _ in range(n):
        cached(http, [rng.randrange(1000, 50000) for _ in range(length)])


def system_chat_cached(http) -> int:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {random.random()}"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0})
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_pin_file_pins_at_start(http):
    (pin,) = http.get("/v1/cache/pins").json()["data"]
    assert pin["active"] and pin["model"] == "qwen3-tiny" and pin["tokens"] == pin["prompt_tokens"] > BLOCK
    stats = http.get("/v1/cache/stats").json()["prefix_cache"]
    assert stats["pinned_tokens"] == pin["tokens"] and 0 < stats["pinned_bytes"] == pin["bytes"] <= BUDGET
    assert stats["pins"] == [{k: pin[k] for k in ("id", "tokens", "prompt_tokens", "blocks", "bytes")}]
    # A conversation under that system prompt restores all of it.
    assert system_chat_cached(http) >= pin["tokens"]


def test_a_pinned_prefix_survives_a_flood_and_goes_once_unpinned(http):
    prompt = list(range(2000, 2040))  # 5 blocks
    pin = http.post("/v1/cache/pin", json={"prompt": prompt}).json()
    assert pin["object"] == "cache.pin" and pin["id"].startswith("pin_") and pin["tokens"] == 40
    again = http.post("/v1/cache/pin", json={"prompt": prompt, "model": "qwen3-tiny"}).json()
    assert again["id"] == pin["id"] and len(http.get("/v1/cache/pins").json()["data"]) == 2  # the same pin
    before = http.get("/v1/cache/stats").json()["prefix_cache"]["evictions"]
    flood(http, seed=1)
    stats = http.get("/v1/cache/stats").json()["prefix_cache"]
    assert stats["evictions"] > before + 20 and stats["bytes"] <= BUDGET
    assert cached(http, prompt + [7, 8, 9]) == 40
    assert system_chat_cached(http) > BLOCK  # the pin made at start too
    r = http.delete(f"/v1/cache/pin/{pin['id']}")
    assert r.json() == {"id": pin["id"], "object": "cache.pin.deleted", "model": "qwen3-tiny", "deleted": True}
    assert http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 404
    flood(http, seed=2)
    assert cached(http, prompt + [7, 8, 9]) == 0  # evicted like any other prompt


def test_pins_take_tools(http):
    tools = [{"type": "function", "function": {"name": "run_tests", "description": "Run the tests.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    system = [{"role": "system", "content": SYSTEM}]
    plain = http.post("/v1/cache/pin", json={"messages": system}).json()  # the pin made at start
    pin = http.post("/v1/cache/pin", json={"messages": system, "tools": tools}).json()
    assert pin["id"] != plain["id"] and pin["tokens"] > plain["tokens"] + 50  # the template lists the tools
    flood(http, seed=3)
    r = http.post("/v1/chat/completions", json={"messages": system + [{"role": "user", "content": "go"}],
                                                "tools": tools, "max_tokens": 1, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin["tokens"]
    http.delete(f"/v1/cache/pin/{pin['id']}")


def test_reset_keeps_pinned_prefixes(http):
    stats = http.post("/v1/cache/reset").json()["prefix_cache"]
    assert stats["blocks"] == stats["pinned_blocks"] > 0 and stats["bytes"] == stats["pinned_bytes"]
    assert system_chat_cached(http) > BLOCK


def test_pin_refusals_say_why(http):
    r = http.post("/v1/cache/pin", json={"prompt": list(range(3000, 3300))})  # 300 tokens: over the budget
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "cache_budget_exceeded" and f"budget is {BUDGET} bytes" in err["message"]
    assert "pinned already" in err["message"] and f"about {300 * 512} bytes" in err["message"], err
    bad = [
        ({"prompt": [1, 2], "messages": [{"role": "system", "content": "x"}]}, "either messages"),
        ({}, "either messages"),
        ({"prompt": [1, 10**9]}, "outside the vocabulary"),
        ({"prompt": [1, 2], "tools": [{"type": "function", "function": {"name": "f"}}]}, "go with messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "text only"),
        ({"promt": [1, 2]}, "promt"),
    ]
    for body, why in bad:
        r = http.post("/v1/cache/pin", json=body)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)
    r = http.post("/v1/cache/pin", json={"model": "nope", "prompt": [1, 2]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/cache/pin", json={"prompt": list(range(5000))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_pin_files_are_checked(tmp_path, pinned_server):
    import asyncio

    from mlxserve.api.cache_routes import PinRequest, pin_at_start, read_pin_file

    for text, why in (("{", "cannot read it as JSON"), ("{}", "a JSON list"),
                      ('[{"prompt": [1]}, {"prompt": "x", "colour": 1}]', "[1].colour")):
        path = tmp_path / "pins.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=why.replace("[", r"\[")):
            read_pin_file(str(path))
    with pytest.raises(ValueError, match=r"--pin f\.json: \[0\]: The model 'nope' does not exist"):
        asyncio.run(pin_at_start(pinned_server.state, [PinRequest(model="nope", prompt=[1])], "f.json"))


def test_a_stopped_engine_is_freed_without_the_collector(tiny):
    """No reference cycle through the engine's pins: a cycle kept a stopped engine (and its
    model's arrays) until the collector ran, at interpreter exit, where MLX aborts."""
    import gc
    import weakref

    from mlxserve.engine.engine import AsyncEngine

    engine = AsyncEngine(tiny("qwen3-tiny")).start()
    engine.stop()
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()
