"""--engine-process: the engine in a child process gives what the in-process engine gives.

The shared `server` (conftest) runs qwen3-tiny's engine in the test process; `remote` serves
the same weights (the same dummy seed) with its engine in a spawned child. Every answer,
token for token, logprobs and grammars included, must be the same; the caches, pins,
/metrics and /health must work through the pipe; a dead child must give the API's errors.
"""

import json
import time

import httpx
import jsonschema
import openai
import pytest

from conftest import LiveServer

MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}]


def process_pool(*models: str, **engine):
    from mlxserve.config import EngineConfig, ModelConfig
    from mlxserve.engine.pool import ModelPool, ModelSpec

    cfg = EngineConfig(engine_process=True, max_num_seqs=16, max_queue=64, **engine)
    pool = ModelPool([ModelSpec(m, ModelConfig(model=m, load_format="dummy"), cfg) for m in models])
    pool.preload()  # spawns the default model's engine process
    return pool


@pytest.fixture(scope="module")
def remote():
    live = LiveServer(None, pool=process_pool(MODEL))
    yield live
    live.close()


def client_of(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


def answers(response) -> tuple[list[dict], list[float]]:
    """The choices, less the tool calls' random ids, and apart their logprobs: these may differ
    in the last bits with what either server's prefix cache held before (how much of the prompt
    it restored changes the float rounding of the rest, never the tokens)."""
    out, numbers = [c.model_dump() for c in response.choices], []
    for c in out:
        for call in c["message"]["tool_calls"] or []:
            call["id"] = None
        for t in (c["logprobs"] or {}).get("content") or []:
            numbers += [t.pop("logprob")] + [top.pop("logprob") for top in t["top_logprobs"]]
    return out, numbers


REQUESTS = [
    dict(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3),
    dict(max_tokens=12, temperature=0.9, seed=7, n=2),
    dict(max_tokens=40, seed=1, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "p", "schema": PERSON, "strict": True}}),
    dict(max_tokens=80, seed=2, tools=TOOLS, tool_choice="required"),
]


@pytest.mark.parametrize("kwargs", REQUESTS, ids=["greedy-logprobs", "seeded-n2", "json-schema", "forced-tool"])
def test_answers_are_those_of_the_in_process_engine(server, remote, kwargs):
    local = client_of(server).chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    there = client_of(remote).chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    (choices, logprobs), (expected, expected_logprobs) = answers(there), answers(local)
    assert choices == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-3)
    assert there.usage.completion_tokens == local.usage.completion_tokens
    if "response_format" in kwargs:
        jsonschema.validate(json.loads(there.choices[0].message.content), PERSON)
    if "tools" in kwargs:
        (call,) = there.choices[0].message.tool_calls
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_v1_models_says_how_the_model_is_served_as_in_process(server, remote):
    here, there = (httpx.get(f"{live.base_url}/models/{MODEL}").json()["serving"] for live in (server, remote))
    assert there == here and there["batches"] and there["caches"]
    assert there["layer_kinds"] == {"full attention": 2}  # qwen3-tiny's 2 layers


def test_streams_stop_strings_and_the_prefix_cache(remote):
    client = client_of(remote)
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    text = whole.choices[0].text
    stop = text[5:8]
    chunks = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                       stream=True, stop=[stop])
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text[:text.index(stop)]
    # A long prompt asked twice: its blocks come from the cache the second time.
    prompt = list(range(200, 300))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    stats = httpx.get(remote.url + "/v1/cache/stats").json()
    assert stats["prefix_cache"]["hits"] >= 1
    metrics = httpx.get(remote.url + "/metrics").text
    hits = next(line for line in metrics.splitlines() if line.startswith("prefix_cache_hits_tokens_total"))
    assert float(hits.split()[1]) >= 64
    # Each request's first-token phases crossed the pipe with its first token (its 4 requests here).
    timed = next(line for line in metrics.splitlines() if line.startswith("mlxserve_first_step_seconds_count"))
    assert float(timed.split()[1]) >= 4


def test_pins_and_bad_input_through_the_pipe(remote):
    pin = httpx.post(remote.url + "/v1/cache/pin", json={"model": MODEL, "prompt": list(range(400, 470))}).json()
    assert pin["object"] == "cache.pin" and pin["tokens"] >= 69
    (listed,) = [p for p in httpx.get(remote.url + "/v1/cache/pins").json()["data"] if p["id"] == pin["id"]]
    assert listed["active"]
    assert httpx.delete(remote.url + f"/v1/cache/pin/{pin['id']}").json()["deleted"]
    client = client_of(remote)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * (remote.pool.default.engine.max_model_len + 1),
                                  max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999999": 5})
    health = httpx.get(remote.url + "/health").json()
    assert health["status"] == "ok" and health["warmup"]["state"] in ("off", "done")


def test_a_closed_stream_frees_its_slot(remote):
    with httpx.stream("POST", remote.base_url + "/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while httpx.get(remote.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(remote.url + "/health").json()["running"] == 0


def test_a_dead_engine_process_gives_503s_and_the_server_stays_up():
    live = LiveServer(None, pool=process_pool(MODEL, prefix_cache=False))
    try:
        engine = live.pool.default.engine
        engine._process.kill()
        engine._thread.join(10)
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "dead"
        assert "engine process exited" in r.json()["reason"]
        r = httpx.post(live.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(live.base_url + "/models").status_code == 200
    finally:
        live.close()


def test_a_vision_language_model_answers_as_in_process_and_caches_its_images(tiny):
    """The server's process renders the prompt and preprocesses the image with a weightless
    adapter; the child runs the tower. Same tokens and logprobs as in-process; a second turn on
    the same image reuses the child's caches, which the parent asks before making pixels."""
    from mlxserve.config import EngineConfig
    from mlxserve.multimodal.media import pixel_hash
    from tests.test_vlm import data_url, picture, video_url

    vlm = "qwen2.5-vl-tiny"
    image = picture(3)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    local = LiveServer(tiny(vlm), EngineConfig(block_size=16))
    there = LiveServer(None, pool=process_pool(vlm, block_size=16))
    try:
        kwargs = dict(model=vlm, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        expected = client_of(local).chat.completions.create(**kwargs)
        first = client_of(there).chat.completions.create(**kwargs)
        (choices, logprobs), (want, want_logprobs) = answers(first), answers(expected)
        assert choices == want and logprobs == pytest.approx(want_logprobs, abs=1e-3)
        assert first.usage.prompt_tokens == expected.usage.prompt_tokens > 20  # the image's tokens are in it

        engine = there.pool.default.engine
        assert engine.image_is_cached(pixel_hash(image)) and not engine.image_is_cached(pixel_hash(picture(4)))
        turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And its colours?"}]
        again = client_of(there).chat.completions.create(**{**kwargs, "messages": turn2})
        assert again.usage.prompt_tokens_details.cached_tokens >= 16
        assert answers(again)[0] == answers(client_of(local).chat.completions.create(**{**kwargs, "messages": turn2}))[0]
        stats = httpx.get(there.base_url + "/cache/stats").json()
        assert stats["vision_cache"]["enabled"] and stats["prefix_cache"]["hits"] >= 1

        # A video: its frame groups cross the pipe with their pixels, then (cached) without them.
        clip = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url(5)}},
                                             {"type": "text", "text": "What happens?"}]}]
        want = client_of(local).chat.completions.create(**{**kwargs, "messages": clip})
        for turn in range(2):
            got = client_of(there).chat.completions.create(**{**kwargs, "messages": clip})
            assert answers(got)[0] == answers(want)[0] and got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.prompt_tokens_details.cached_tokens >= 16
    finally:
        there.close()
        local.close()


def test_a_failure_on_the_servers_side_of_a_launch_stops_the_child(monkeypatch):
    """The child has loaded the model when the server's process builds its side (tokenizer, a
    VLM's adapter): if that fails, the child must not stay behind holding the model's memory."""
    import multiprocessing

    from mlxserve.config import EngineConfig, ModelConfig
    from mlxserve.engine import process

    def broken(meta):
        raise RuntimeError("no tokenizer here")

    monkeypatch.setattr(process, "_parent_loaded", broken)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="no tokenizer here"):
        process.ProcessEngine.launch(ModelConfig(model=MODEL, load_format="dummy"),
                                     EngineConfig(engine_process=True, prefix_cache=False, warmup=0))
    assert set(multiprocessing.active_children()) <= before  # stopped and reaped before the error is raised


def test_step_outputs_that_do_not_pickle_fail_their_requests_instead_of_hanging():
    """The child's sender: a step's outputs that cannot cross the pipe end those requests with
    the error (their callers would otherwise wait for ever), and later messages still go."""
    import multiprocessing
    import pickle

    from mlxserve.engine.process import _Sender
    from mlxserve.engine.stream import StreamFailure, StreamToken

    here, there = multiprocessing.Pipe()
    sender = _Sender(there)
    fine = StreamToken(5, None, False, None, None, 0, 0.0)
    sender.put(("out", {"a": [fine], "b": [StreamToken(6, None, False, None, [lambda: 0], 0, 0.0)]}, 2, 0, 7))
    sender.put(("out", {"a": [fine]}, 1, 0, 8))
    sender.close()
    kind, failed, *counts = pickle.loads(here.recv_bytes())
    assert kind == "out" and counts == [2, 0, 7] and set(failed) == {"a", "b"}
    assert all(len(items) == 1 and isinstance(items[0], StreamFailure) and "pickle" in items[0].message
               for items in failed.values())
    assert pickle.loads(here.recv_bytes()) == ("out", {"a": [(5, None, False, None, None, 0, 0.0, None, None)]}, 1, 0, 8)
