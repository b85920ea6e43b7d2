"""Several models in one server (engine/pool.py, api/models.py) over HTTP.

One server for the module: three tiny dummy models of different families and
a fourth whose source does not exist, at most two loaded at once. Requests
get the model they name (the same greedy tokens as the model served alone),
loaded on demand; the least recently used idle model makes room, never one
serving a request; unknown names are a 404 listing the models.
"""

import asyncio
import threading
import time

import httpx
import pytest

from conftest import LiveServer

MODELS = ("qwen3-tiny", "llama-tiny", "gemma3-tiny")
PROMPT = list(range(1000, 1024))
MAX_TOKENS = 8
RESIDENT = ("loading", "loaded", "unloading")
# A stream long enough to still run while a test does a few quick requests beside it
# (closed early, which aborts it): 4000 tokens take seconds even on a fast machine.
LONG = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def multi():
    from mlxserve.config import EngineConfig, ModelConfig
    from mlxserve.engine.pool import ModelPool, ModelSpec

    specs = [ModelSpec(n, ModelConfig(model=n, load_format="dummy"), EngineConfig(block_size=8))
             for n in MODELS]
    specs.append(ModelSpec("broken", ModelConfig(model="/nonexistent/model-folder"), EngineConfig()))
    pool = ModelPool(specs, max_loaded=2, wait_s=60)
    pool.preload()
    live = LiveServer(None, pool=pool)
    yield live
    live.close()


@pytest.fixture(scope="module")
def http(multi):
    with httpx.Client(base_url=multi.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def alone(tiny):
    """Each model's greedy text for PROMPT from an engine serving it alone."""
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.engine.request import Request, SamplingParams

    async def text(engine):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        return "".join([o.new_text async for o in engine.submit(Request(list(PROMPT), params))])

    out = {}
    for name in MODELS:
        engine = AsyncEngine(tiny(name)).start()
        try:
            out[name] = asyncio.run(text(engine))
        finally:
            engine.stop()
    assert len(set(out.values())) == 3  # the models differ, so a mixed-up model would show
    return out


def states(http) -> dict:
    return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def wait_until(condition, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def complete(http, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return http.post("/v1/completions", json=body)


def test_models_are_listed_with_their_state(http):
    data = http.get("/v1/models").json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [*MODELS, "broken"]
    first = data["data"][0]
    assert first["object"] == "model" and first["owned_by"] == "mlxserve"
    assert first["state"] == "loaded" and first["max_model_len"] > 0 and first["pinned"] is False
    assert http.get("/v1/models/llama-tiny").json()["id"] == "llama-tiny"


def test_unknown_model_is_a_404_listing_the_models(http):
    listed = "'qwen3-tiny', 'llama-tiny', 'gemma3-tiny', 'broken'"
    r = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and listed in err["message"]
    r = http.post("/v1/messages", json={"model": "claude-3", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error" and listed in r.json()["error"]["message"]
    for method, path in (("GET", "/v1/models/nope"), ("POST", "/v1/models/nope/load"),
                         ("POST", "/v1/models/nope/unload"), ("POST", "/v1/models/nope/pin")):
        r = http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", path


def test_administration_needs_the_api_key(multi, http):
    multi.state.server_cfg.api_key = "sk-admin"  # read per request
    try:
        for method, path in (("POST", "/v1/models/qwen3-tiny/unload"), ("POST", "/v1/models/llama-tiny/pin"),
                             ("POST", "/v1/cache/pin"), ("DELETE", "/v1/cache/pin/pin_x")):
            assert http.request(method, path, json={"prompt": [1, 2]}).status_code == 401, path
        ok = http.post("/v1/models/qwen3-tiny/load", headers={"Authorization": "Bearer sk-admin"})
        assert ok.status_code == 200 and ok.json()["state"] == "loaded"
    finally:
        multi.state.server_cfg.api_key = None


def test_requests_interleave_and_each_gets_its_model(multi, http, alone):
    """Two requests per model at once, with room for two models: each answer is its model's
    own greedy text, and no more than two models are ever resident."""
    seen = []

    async def scenario():
        async with httpx.AsyncClient(base_url=multi.url, timeout=300) as c:
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    models = (await c.get("/v1/models")).json()["data"]
                    seen.append(sum(m["state"] in RESIDENT for m in models))
                    await asyncio.sleep(0.02)

            async def ask(model):
                body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
                return model, await c.post("/v1/completions", json=body)

            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(ask(m) for m in MODELS + MODELS))
            done.set()
            await watcher
            return results

    for model, r in asyncio.run(scenario()):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == alone[model], model
    assert seen and max(seen) <= 2
    # The default model serves a request that names none.
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.json()["model"] == "qwen3-tiny" and r.json()["choices"][0]["text"] == alone["qwen3-tiny"]


def test_the_idle_model_makes_room_never_the_one_mid_request(multi, http, alone):
    assert http.post("/v1/models/qwen3-tiny/load").json()["state"] == "loaded"
    assert http.post("/v1/models/llama-tiny/load").json()["state"] == "loaded"
    with httpx.Client(base_url=multi.url, timeout=120) as streaming:
        with streaming.stream("POST", "/v1/completions", json={"model": "qwen3-tiny", **LONG}) as stream:
            lines = (line for line in stream.iter_lines() if line)  # events, without the blank lines
            assert next(lines).startswith("data: ")
            assert states(http)["qwen3-tiny"]["requests"] == 1  # held while its response is sent
            # llama is used after qwen3's request began: qwen3 is the least recently used,
            # but it is serving, so gemma's load takes llama's place.
            assert complete(http, "llama-tiny").json()["choices"][0]["text"] == alone["llama-tiny"]
            r = complete(http, "gemma3-tiny")
            assert r.json()["choices"][0]["text"] == alone["gemma3-tiny"]
            now = states(http)
            assert (now["qwen3-tiny"]["state"], now["llama-tiny"]["state"], now["gemma3-tiny"]["state"]) == \
                ("loaded", "unloaded", "loaded")
            # Unloading a model that serves a request is refused.
            r = http.post("/v1/models/qwen3-tiny/unload")
            assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
            assert next(lines).startswith("data: ")  # and its stream goes on
            stream.close()
    # Closed: the server sees it at its next write, ends the request and releases the model.
    assert wait_until(lambda: states(http)["qwen3-tiny"]["requests"] == 0)


def test_a_load_waits_for_a_busy_model_or_gives_up_after_model_wait(multi, http, alone):
    """Both loaded models serving: a request for the third waits (503 once --model-wait has
    passed); as soon as one of them is idle, it is unloaded and the third one loads."""
    for name in ("qwen3-tiny", "gemma3-tiny"):
        http.post(f"/v1/models/{name}/load")
    with httpx.Client(base_url=multi.url, timeout=120) as a, httpx.Client(base_url=multi.url, timeout=120) as b:
        with a.stream("POST", "/v1/completions", json={"model": "qwen3-tiny", **LONG}) as s1, \
                b.stream("POST", "/v1/completions", json={"model": "gemma3-tiny", **LONG}) as s2:
            # (Keep the line iterators: one dropped closes its stream.)
            lines = [(line for line in s.iter_lines() if line) for s in (s1, s2)]
            assert all(next(it).startswith("data: ") for it in lines)
            assert [states(http)[m]["requests"] for m in ("qwen3-tiny", "gemma3-tiny")] == [1, 1]
            multi.pool.wait_s = 0.3
            try:
                r = complete(http, "llama-tiny")
            finally:
                multi.pool.wait_s = 60
            assert r.status_code == 503 and r.headers["retry-after"]
            err = r.json()["error"]
            assert err["code"] == "model_unavailable" and "in use" in err["message"], err
            answer = {}
            waiting = threading.Thread(target=lambda: answer.update(r=complete(http, "llama-tiny")))
            waiting.start()
            waiting.join(1.0)
            assert waiting.is_alive()  # waiting for room
            s2.close()  # gemma's request ends: it is idle now
        waiting.join(120)
    assert answer["r"].status_code == 200
    assert answer["r"].json()["choices"][0]["text"] == alone["llama-tiny"]
    assert states(http)["gemma3-tiny"]["state"] == "unloaded"


def test_a_model_that_fails_to_load_is_a_503_and_the_others_serve_on(http, alone):
    r = complete(http, "broken")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "model_unavailable" and "could not be loaded" in err["message"]
    assert "/nonexistent/model-folder" in err["message"]
    r = http.post("/v1/messages", json={"model": "broken", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    assert states(http)["broken"]["state"] == "unloaded" and states(http)["broken"]["error"]
    assert complete(http, "qwen3-tiny").json()["choices"][0]["text"] == alone["qwen3-tiny"]


def test_pinned_models_stay_and_bound_what_else_can_load(http):
    assert http.post("/v1/models/qwen3-tiny/pin").json()["pinned"] is True
    assert http.post("/v1/models/llama-tiny/pin").json()["state"] == "loaded"
    r = http.post("/v1/models/gemma3-tiny/pin")
    assert r.status_code == 400 and "--max-loaded-models is 2" in r.json()["error"]["message"]
    r = complete(http, "gemma3-tiny")  # no room can ever be made beside two pinned models
    assert r.status_code == 503 and "pinned" in r.json()["error"]["message"]
    r = http.post("/v1/models/llama-tiny/unload")
    assert r.status_code == 409 and "unpin it first" in r.json()["error"]["message"]
    http.delete("/v1/models/llama-tiny/pin")
    assert complete(http, "gemma3-tiny").status_code == 200  # llama, unpinned and idle, made room
    now = states(http)
    assert now["llama-tiny"]["state"] == "unloaded" and now["qwen3-tiny"]["pinned"]
    http.delete("/v1/models/qwen3-tiny/pin")
    assert http.post("/v1/models/qwen3-tiny/unload").json()["state"] == "unloaded"


def test_prefix_pins_come_back_when_their_model_is_loaded_again(http):
    http.post("/v1/models/llama-tiny/load")
    pin = http.post("/v1/cache/pin", json={"model": "llama-tiny", "prompt": PROMPT}).json()
    assert pin["model"] == "llama-tiny" and pin["tokens"] == len(PROMPT)
    stats = http.get("/v1/cache/stats", params={"model": "llama-tiny"}).json()
    assert stats["prefix_cache"]["pinned_tokens"] == len(PROMPT)
    assert http.post("/v1/models/llama-tiny/unload").json()["state"] == "unloaded"
    assert http.get("/v1/cache/stats", params={"model": "llama-tiny"}).json() == \
        {"model": "llama-tiny", "state": "unloaded"}
    (listed,) = [p for p in http.get("/v1/cache/pins").json()["data"] if p["id"] == pin["id"]]
    assert listed["active"] is False
    http.post("/v1/models/llama-tiny/load")
    (listed,) = [p for p in http.get("/v1/cache/pins").json()["data"] if p["id"] == pin["id"]]
    assert listed["active"] is True and listed["tokens"] == len(PROMPT)
    r = complete(http, "llama-tiny", prompt=PROMPT + [5, 6, 7])
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert http.delete(f"/v1/cache/pin/{pin['id']}").json()["deleted"] is True
    assert http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 404
