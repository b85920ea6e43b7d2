"""The OpenAI API end to end: a live uvicorn server, the official openai client, raw HTTP.

The model is qwen3-tiny with random weights: its text is gibberish, but greedy
decoding is deterministic, so texts can be compared across requests.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mlxserve
from mlxserve.bench.local import ChildServer, checkout_env, free_port
from mlxserve.models.chat import render_chat

MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    return client.chat.completions.create(model=MODEL, **kw)


def sse_data(response_or_lines) -> list:
    """The `data:` payloads of an SSE response (or its remaining lines), JSON-decoded except [DONE]."""
    lines = response_or_lines
    if isinstance(lines, httpx.Response):
        lines = lines.iter_lines()
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_idle(engine, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_running == 0 and engine.num_waiting == 0:
            return True
        time.sleep(0.02)
    return False


def prompt_len(server, messages, **kw) -> int:
    return len(render_chat(server.state.tokenizer, messages, **kw))


def eos(server) -> int:
    return next(iter(server.state.tokenizer.eos_token_ids))


# ---- models, health, version ----

def test_models_health_version(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    assert http.get("/health").json()["status"] == "ok"
    info = http.get("/version").json()
    assert info["version"] == mlxserve.__version__
    assert info["model"] == MODEL and info["backend"] in ("cpu", "metal", "cuda")


def test_served_model_name_overrides(tiny):
    """A second app in the same process: its own name, and its own metrics registry."""
    from mlxserve.api.server import create_app
    from mlxserve.config import ServerConfig
    from mlxserve.engine.engine import AsyncEngine

    loaded = tiny("qwen3-tiny")
    app = create_app(AsyncEngine(loaded), loaded, ServerConfig(served_model_name="my-model"))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            models = (await c.get("/v1/models")).json()
            wrong = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
            metrics = (await c.get("/metrics")).text
        return models, wrong, metrics

    models, wrong, metrics = asyncio.run(scenario())
    assert [m["id"] for m in models["data"]] == ["my-model"]
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"
    assert wrong.json()["error"]["param"] == "model"
    # Only this app's two requests are counted, not the shared server's.
    counts = metric_values(metrics, "mlxserve_requests_total")
    assert sum(counts.values()) == 2


# ---- chat ----

def test_chat_non_streaming_with_usage(server, client):
    r = chat(client, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.system_fingerprint
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == prompt_len(server, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)


def test_chat_stream_is_openai_shaped_and_equals_non_streamed(client, http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    full = chat(client, max_tokens=8, temperature=0)
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk, finish_chunk = chunks[-1], chunks[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full.usage.model_dump(exclude_none=True)
    assert finish_chunk["choices"][0]["finish_reason"] == "length"
    assert finish_chunk["choices"][0]["delta"] == {}
    content = chunks[1:-2]
    assert content and all(c["choices"][0]["finish_reason"] is None for c in content)
    assert all(c["usage"] is None for c in chunks[:-1])  # null until the usage chunk
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == full.choices[0].message.content

    # And through the SDK, without include_usage: no usage chunk at all.
    stream = chat(client, max_tokens=8, temperature=0, stream=True)
    parts = list(stream)
    assert all(p.usage is None for p in parts)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full.choices[0].message.content


def test_finish_reason_stop_on_eos_and_ignore_eos(server, client):
    bias = {str(eos(server)): 100}  # EOS dominates every other token
    r = chat(client, max_tokens=5, temperature=0, logit_bias=bias, logprobs=True)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 1
    assert r.choices[0].logprobs.content == []  # the EOS token has no text, so no entry
    r = chat(client, max_tokens=5, temperature=0, logit_bias=bias, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_stop_strings_and_stop_token_ids(server, client):
    text = chat(client, max_tokens=12, temperature=0).choices[0].message.content
    k = next(k for k in range(1, len(text) - 2) if text.find(text[k:k + 2]) == k and text[k:k + 2].strip())
    for stop in (text[k:k + 2], [text[k:k + 2], "\x00never"]):
        r = chat(client, max_tokens=12, temperature=0, stop=stop)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == text[:k]
        streamed = chat(client, max_tokens=12, temperature=0, stop=stop, stream=True)
        assert "".join(p.choices[0].delta.content or "" for p in streamed) == text[:k]

    token = server.state.tokenizer.encode(" hello")[0]
    r = chat(client, max_tokens=5, temperature=0, logit_bias={str(token): 100},
             extra_body={"stop_token_ids": [token]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1 and r.choices[0].message.content == ""


def test_chat_logprobs(client):
    r = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy picks the best
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    stream = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for p in stream if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert chat(client, max_tokens=2, temperature=0).choices[0].logprobs is None


def test_seed_reproducibility_and_n(client, http):
    def sample(seed, n=1):
        r = chat(client, max_tokens=12, temperature=1.0, seed=seed, n=n)
        return [c.message.content for c in r.choices]

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(99)
    three = sample(7, n=3)
    assert len(three) == 3 and len(set(three)) == 3  # choice j samples with seed + j
    assert sample(7, n=3) == three

    r = chat(client, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    assert r.usage.completion_tokens == 8

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        chunks = [c for c in sse_data(resp) if c != "[DONE]"]
    by_index = {0: [], 1: []}
    for c in chunks[:-1]:
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_sampling_fields_are_honoured(server, client):
    greedy = chat(client, max_tokens=10, temperature=0).choices[0].message.content
    # Each of these leaves only the most likely token, so sampling at temperature 1 is greedy.
    assert chat(client, max_tokens=10, temperature=1.0,
                extra_body={"top_k": 1}).choices[0].message.content == greedy
    assert chat(client, max_tokens=10, temperature=1.0, top_p=1e-9).choices[0].message.content == greedy
    assert chat(client, max_tokens=10, temperature=1.0,
                extra_body={"min_p": 0.999}).choices[0].message.content == greedy

    # A +100 bias makes one token win every step; penalties on repeats must break that.
    hello = server.state.tokenizer.encode(" hello")
    assert len(hello) == 1
    bias = {str(hello[0]): 100}
    assert chat(client, max_tokens=10, temperature=0, logit_bias=bias).choices[0].message.content == " hello" * 10
    # Dividing the biased logit (~100) by 3 drops it below the best unbiased one (~50).
    rep = chat(client, max_tokens=10, temperature=0, logit_bias=bias, extra_body={"repetition_penalty": 3.0})
    assert rep.choices[0].message.content.startswith(" hello")
    assert rep.choices[0].message.content != " hello" * 10
    # -2 per earlier occurrence: after ~25 repeats another token wins.
    freq = chat(client, max_tokens=40, temperature=0, logit_bias=bias, frequency_penalty=2.0)
    assert freq.choices[0].message.content != " hello" * 40
    # Presence penalty is a flat -2, not enough to beat the bias.
    pres = chat(client, max_tokens=10, temperature=0, logit_bias=bias, presence_penalty=2.0)
    assert pres.choices[0].message.content == " hello" * 10
    # All of them at once, plus `user`, are accepted together.
    r = chat(client, max_tokens=4, temperature=0.7, top_p=0.9, seed=3, stop=["\x00"], user="u-1",
             presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"5": 1.0}, logprobs=True,
             top_logprobs=2, extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1,
                                         "stop_token_ids": [7], "ignore_eos": False})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("top_k", -2, "top_k"),
    ("min_p", 1.0, "min_p"),
    ("presence_penalty", 3, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("logit_bias", {"abc": 1}, "logit_bias"),
    ("logit_bias", {"999999999": 1}, "logit_bias"),
    ("logit_bias", {"5": 200}, "logit_bias"),
    ("n", 0, "n"),
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", 0, "max_completion_tokens"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("max_tokens", "many", "max_tokens"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", [], "messages"),
])
def test_invalid_fields_are_400_naming_the_field(http, field, value, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_max_tokens_and_max_completion_tokens(client):
    assert chat(client, max_completion_tokens=3, temperature=0).usage.completion_tokens == 3
    # max_completion_tokens replaces the deprecated max_tokens when both are given.
    assert chat(client, max_tokens=2, max_completion_tokens=4, temperature=0).usage.completion_tokens == 4


def test_roles_content_parts_tools_and_template_kwargs(server, client, http):
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    r = chat(client, messages=developer, max_tokens=1)
    assert r.usage.prompt_tokens == prompt_len(server, system)

    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]}]
    r = chat(client, messages=parts, max_tokens=1)
    assert r.usage.prompt_tokens == prompt_len(server, [{"role": "user", "content": "Say\nsomething."}])

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with_tools = chat(client, max_tokens=1, tools=tools).usage.prompt_tokens
    assert with_tools == prompt_len(server, MESSAGES, tools=tools) > prompt_len(server, MESSAGES)
    assert chat(client, max_tokens=1, tools=tools, tool_choice="none").usage.prompt_tokens == prompt_len(server, MESSAGES)
    assert chat(client, max_tokens=1, tools=tools, tool_choice="auto").usage.prompt_tokens == with_tools

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat(client, messages=conversation, tools=tools, max_tokens=1)
    as_template = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert r.usage.prompt_tokens == prompt_len(server, as_template, tools=tools)

    r = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.usage.prompt_tokens == len(render_chat(server.state.tokenizer, MESSAGES)) - 3  # <|im_start|>assistant\n
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"

    # Tool-call arguments must be JSON (templates get them parsed): a 400, not a 500.
    r = http.post("/v1/chat/completions", json={"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---- legacy completions ----

def test_completions_prompt_forms_echo_and_n(server, client):
    tok = server.state.tokenizer
    text_prompt = "The capital of France is"
    ids = tok.encode(text_prompt)
    r = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    text = r.choices[0].text
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0).choices[0].text == text

    r = client.completions.create(model=MODEL, prompt=[text_prompt, "Hello"], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == text
    assert r.choices[2].text == r.choices[3].text != text
    assert r.usage.prompt_tokens == len(ids) + len(tok.encode("Hello"))
    assert r.usage.completion_tokens == 20

    r = client.completions.create(model=MODEL, prompt=[ids, tok.encode("Hello")], max_tokens=5, temperature=0)
    assert r.choices[0].text == text and len(r.choices) == 2

    r = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == text_prompt + text
    stream = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=5, temperature=0,
                                       echo=True, stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts if p.choices) == text_prompt + text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 5
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"


def test_completions_legacy_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] - lp.text_offset[i] == len(lp.tokens[i]) for i in range(5))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(logprob) and len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logprobs=2, stream=True)
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


# ---- refusals and errors ----

TOOL_F = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOL_F, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[1].type"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": [5, -1]}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
])
def test_unsupported_fields_are_refused_clearly(http, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {}), **extra}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_error_shapes(server, client, http):
    def error(r, status):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return err

    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert error(r, 400)["code"] == "invalid_json"
    r = http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    error(r, 400)
    r = http.post("/v1/chat/completions", content=json.dumps({"messages": MESSAGES}))  # no content type
    assert "application/json" in error(r, 400)["message"]
    assert error(http.post("/v1/chat/completions", json={"model": MODEL}), 400)["param"] == "messages"
    assert error(http.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"}), 404)["code"] == "model_not_found"
    assert error(http.get("/v1/nothing-here"), 404)
    assert error(http.get("/v1/chat/completions"), 405)
    # A body over the limit is refused from its Content-Length, before it is read.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        sock.settimeout(10)
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b'"error"' in answer
    # Unknown fields are ignored, as OpenAI does.
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "frobnicate": 3})
    assert r.status_code == 200

    ctx = server.engine.max_model_len
    server.engine.config.strict_max_tokens = True  # by default such a max_tokens is capped
    try:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, max_tokens=ctx)
    finally:
        server.engine.config.strict_max_tokens = False
    assert e.value.code == "context_length_exceeded" and str(ctx) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * ctx, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found"


# ---- load and lifetime ----

def test_32_concurrent_streams_equal_non_streamed(server):
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(32)]
    sync = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    expected = [chat(sync, messages=p, max_tokens=16, temperature=0).choices[0].message.content for p in prompts]

    async def one(client, messages):
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                      temperature=0, stream=True)
        texts, finish = [], None
        async for part in stream:
            texts.append(part.choices[0].delta.content or "")
            finish = part.choices[0].finish_reason or finish
        return "".join(texts), finish

    async def scenario():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(scenario())
    assert [t for t, _ in results] == expected
    assert all(f == "length" for _, f in results)
    assert wait_idle(server.engine)


def test_stream_behind_the_engine_keeps_every_event(server, http):
    """When the server's event loop stalls, tokens pile up and are sent several events per
    write: the client still gets one well-formed chunk per token, in order."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        # Stall the server's loop while the engine runs on: the rest of the tokens wait for it.
        server.state.loop.call_soon_threadsafe(time.sleep, 1.0)
        events = [json.loads(first[5:])] + sse_data(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    # One chunk per token (a token whose bytes end mid-character waits for the next one's).
    assert 20 <= len(chunks) <= 24


def test_client_disconnect_frees_its_slot(server, http):
    aborted = lambda: metric_values(http.get("/metrics").text, "mlxserve_request_finished_total").get(
        (("reason", "abort"),), 0)
    before = aborted()
    long = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert server.engine.num_running == 1
    assert wait_idle(server.engine), "the aborted stream still holds its slot"

    # A non-streamed request whose client times out is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", json=long, timeout=0.5)
    assert wait_idle(server.engine)
    assert aborted() == before + 2


def test_metrics(server, client, http):
    before = text_string_to_metric_families(http.get("/metrics").text)
    before = {s.name + str(sorted(s.labels.items())): s.value for f in before for s in f.samples}
    r = chat(client, max_tokens=5, temperature=0)
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    values = {s.name + str(sorted(s.labels.items())): s.value
              for f in text_string_to_metric_families(after.text) for s in f.samples}

    def delta(key):
        return values.get(key, 0) - before.get(key, 0)

    assert delta("mlxserve_requests_total[('endpoint', '/v1/chat/completions'), ('status', '200')]") == 1
    assert delta("mlxserve_prompt_tokens_total[]") == r.usage.prompt_tokens
    assert delta("mlxserve_generation_tokens_total[]") == 5
    assert delta("mlxserve_time_to_first_token_seconds_count[]") == 1
    assert delta("mlxserve_inter_token_latency_seconds_count[]") == 4
    assert delta("mlxserve_e2e_request_latency_seconds_count[]") == 1
    assert values["mlxserve_num_requests_running[]"] == 0
    assert values["mlxserve_num_requests_waiting[]"] == 0
    assert values["mlxserve_engine_alive[]"] == 1
    http.post("/v1/chat/completions", json={"messages": []})
    assert metric_values(http.get("/metrics").text, "mlxserve_requests_total")[
        (("endpoint", "/v1/chat/completions"), ("status", "400"))] >= 1


def test_first_token_phases_add_up_and_show_queueing(server, client, http):
    """Where the first token's time goes: each request's queue, prefill and first step add up to its
    time to first token; requests beyond --max-num-seqs (16 here) wait in the queue until a slot
    frees; /metrics and /v1/stats carry them."""
    from mlxserve.engine.request import Request, SamplingParams

    engine = server.engine
    n = engine.config.max_num_seqs + 4

    async def burst():
        arrival = time.perf_counter()  # one arrival for all, so their clocks compare
        streams = [engine.submit(Request([1 + i, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0),
                                         request_id=f"phases-{i}", arrival_time=arrival))
                   for i in range(n)]

        async def first(stream):
            outs = [out async for out in stream]
            return outs[0]

        return await asyncio.gather(*(first(s) for s in streams))

    firsts = asyncio.run(burst())
    phases = [out.first_token_phases for out in firsts]
    for out, p in zip(firsts, phases):
        assert min(p.queue, p.prefill, p.first_step) >= 0
        assert p.queue + p.prefill + p.first_step == pytest.approx(out.first_token_time, abs=1e-3)
    # A request is admitted only once another has finished, after that one's first token: the
    # 4 beyond the running batch's slots waited longer than the quickest first token took.
    quickest = min(out.first_token_time for out in firsts)
    assert sum(p.queue > quickest for p in phases) >= 4

    def values():
        return {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}

    before = values()
    chat(client, max_tokens=2, temperature=0, n=3)
    after = values()
    delta = {k: after[k] - before.get(k, 0) for k in after if k.endswith(("_seconds_sum", "_seconds_count"))}
    names = ("mlxserve_queue_seconds", "mlxserve_prefill_seconds", "mlxserve_first_step_seconds")
    assert all(delta[f"{name}_count"] == 3 for name in names)
    assert sum(delta[f"{name}_sum"] for name in names) == pytest.approx(
        delta["mlxserve_time_to_first_token_seconds_sum"], abs=3e-3)
    requests = http.get("/v1/stats").json()["requests"]
    assert all(requests[key] >= 0 for key in ("mean_queue_s", "mean_prefill_s", "mean_first_step_s"))


def metric_values(text: str, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_api_key(server, api_key, http):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert e.value.code == "invalid_api_key"
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # Refused before the body is even parsed: no key, no hint about what is wrong with it.
    assert http.post("/v1/chat/completions", content=b"{bad").status_code == 401
    good = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0)
    assert good.models.list().data[0].id == MODEL
    assert http.get("/v1/models", headers={"x-api-key": api_key}).status_code == 200
    assert http.get("/health").status_code == 200  # stays open
    metrics = http.get("/metrics", headers={"x-api-key": api_key})
    refused = metric_values(metrics.text, "mlxserve_requests_total")
    assert refused[(("endpoint", "/v1/chat/completions"), ("status", "401"))] >= 2


@pytest.mark.parametrize("path", ["/metrics", "/version", "/openapi.json", "/docs", "/redoc", "/v1/stats",
                                  "/v1/cache/stats", "/no/such/route"])
def test_the_api_key_guards_every_route_but_health_and_the_page(server, api_key, http, path):
    """What a route tells (counters, versions, the device, the model and its fingerprint, the
    schema) is for the key's holders; a scraper gets /metrics with --metrics-public."""
    r = http.get(path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "mlxserve" not in r.text and MODEL not in r.text
    ok = http.get(path, headers={"Authorization": f"Bearer {api_key}"}).status_code
    assert ok == (404 if path == "/no/such/route" else 200)
    for open_path in ["/health", "/", "/web/app.js", "/api/hello"]:
        assert http.get(open_path).status_code == 200
    server.state.server_cfg.metrics_public = True
    try:
        assert http.get("/metrics").status_code == 200
        assert (http.get(path).status_code == 200) == (path == "/metrics")
    finally:
        server.state.server_cfg.metrics_public = False


# ---- a second server whose engine we can break ----

class FlakyModel:
    """The real model, except that calls raise while `fail` is set."""

    def __init__(self, model):
        self._model = model
        self.fail = False

    def __call__(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("injected failure")
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def fragile(tiny):
    """One running slot and one queue slot, over a model that fails on demand."""
    import dataclasses

    from conftest import LiveServer

    from mlxserve.config import EngineConfig

    loaded = tiny("qwen3-tiny")
    flaky = FlakyModel(loaded.model)
    live = LiveServer(dataclasses.replace(loaded, model=flaky), EngineConfig(max_num_seqs=1, max_queue=1))
    live.flaky = flaky
    yield live
    live.close()


LONG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True, "stream": True}


def test_queue_full_is_429_with_retry_after(fragile):
    with httpx.Client(base_url=fragile.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=LONG) as running, \
                c.stream("POST", "/v1/chat/completions", json=LONG) as queued:
            assert running.status_code == queued.status_code == 200
            r = c.post("/v1/chat/completions", json={**LONG, "stream": False})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=fragile.base_url, api_key="x", max_retries=0).completions.create(
                    model=MODEL, prompt="x")
    assert wait_idle(fragile.engine)


def test_engine_step_failure_fails_the_request_not_the_server(fragile):
    fragile.flaky.fail = True
    try:
        with httpx.Client(base_url=fragile.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 3})
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected failure" in err["message"]
            assert "Traceback" not in r.text
            with c.stream("POST", "/v1/chat/completions", json=LONG) as s:
                events = sse_data(s)
            assert events[-1] == "[DONE]"
            assert "injected failure" in events[-2]["error"]["message"]
    finally:
        fragile.flaky.fail = False
    r = httpx.post(fragile.base_url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.get(fragile.url + "/health").status_code == 200


def test_dead_engine_ends_streams_and_fails_health(fragile):
    """Runs last on `fragile`: the engine loop itself crashes (a bug outside the model step)."""
    publish = fragile.engine._publish

    def crash(outbox):  # fails once, then delivery works again (for the failure notices)
        fragile.engine._publish = publish
        raise RuntimeError("loop bug")

    with httpx.Client(base_url=fragile.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=LONG) as s:
            lines = s.iter_lines()
            next(lines)
            fragile.engine._publish = crash  # called by the loop, outside the step's guard
            events = sse_data(lines)
        assert events[-1] == "[DONE]" and "crashed" in events[-2]["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "dead" and "crashed" in health.json()["reason"]
        assert "Traceback" not in health.text
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


# ---- shutdown ----

def test_an_engine_that_cannot_start_exits_1_with_the_reason(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = subprocess.run([sys.executable, "-m", "mlxserve.cli", "serve", "--load-format", "dummy", "llama-tiny",
                          "--disk-cache-dir", str(tmp_path / "a-file" / "kv")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr  # not an abort in teardown (134)
    assert "cannot be written" in out.stderr


def test_sigterm_ends_streams_cleanly_and_exits_0():
    port = free_port()
    # As a user runs it: `mlxserve serve` (the CLI entry point).
    args = ["serve", "qwen3-tiny", "--load-format", "dummy", "--port", str(port), "--log-level", "warning",
            "--shutdown-timeout", "1"]
    server = ChildServer([sys.executable, "-m", "mlxserve.cli", *args], port, checkout_env(), "serve")
    proc, url = server.proc, server.base_url
    try:
        server.wait_healthy(90)
        with httpx.Client(base_url=url, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json=LONG) as s:
                lines = s.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                events = sse_data(lines)
        # The stream ran on during the drain, then was ended with an error event and [DONE].
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "shutting_down"
        assert any("choices" in e and e["choices"][0]["delta"].get("content") for e in events[:-2])
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        server.kill()


# ---- README examples and the benchmark ----

def test_docs_examples(server):
    env = {**os.environ, "MLXSERVE_BASE_URL": server.base_url}
    out = subprocess.run(["sh", str(ROOT / "docs/examples/curl_chat.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    out = subprocess.run([sys.executable, str(ROOT / "docs/examples/openai_chat.py")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "generated tokens]" in out.stdout
    model = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
    out = subprocess.run([sys.executable, str(ROOT / "docs/examples/anthropic_messages.py")],
                         env={**env, "MLXSERVE_MODEL": model}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "output tokens, stop: " in out.stdout


def test_bench_serve(server, tmp_path):
    from mlxserve.bench import serve as bench

    import argparse

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", server.base_url, "--concurrency", "1,4", "--requests", "8",
                              "--input-len", "32", "--output-len", "8", "--out-dir", str(tmp_path)])
    assert args.func(args) == 0
    (md,) = tmp_path.glob("*.md")
    (png,) = tmp_path.glob("*.png")
    text = md.read_text()
    assert "commit:" in text and "backend:" in text and MODEL in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 4  # the level's numbers, and where its first tokens' time went
    assert "Where the first token's time goes" in text
    # Each level's phases, from the server's histograms between its first and last request, add up
    # to its mean TTFT by the server's clock (below the client's, which adds HTTP on both ends).
    (result,) = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    for row in result["rows"]:
        phases = row["queue_mean_ms"] + row["prefill_mean_ms"] + row["first_step_mean_ms"]
        assert min(row["queue_mean_ms"], row["prefill_mean_ms"], row["first_step_mean_ms"]) >= 0
        assert phases == pytest.approx(row["server_ttft_mean_ms"], abs=0.5)
        assert 0 < row["server_ttft_mean_ms"] <= row["ttft_p99_ms"]
    assert png.stat().st_size > 1000


# ---- prefix cache ----

def test_prefix_cache_is_visible_in_usage_stats_and_metrics(client, http):
    system = {"role": "system", "content": "You answer questions about lighthouses. " * 60}
    first = chat(client, messages=[system, {"role": "user", "content": "Who keeps it?"}], max_tokens=2, temperature=0)
    second = chat(client, messages=[system, {"role": "user", "content": "How tall is it?"}], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 400
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 256 <= cached < second.usage.prompt_tokens  # the shared system prompt (in whole blocks), not the question

    all_stats = http.get("/v1/cache/stats").json()
    memory, stats = all_stats["mlx_memory"], all_stats["prefix_cache"]
    # The weights and the cached blocks are MLX arrays, so MLX holds at least their bytes.
    assert memory["peak_bytes"] >= memory["active_bytes"] > stats["bytes"] > 0 and memory["cache_bytes"] >= 0
    assert stats["enabled"] and stats["blocks"] > 0 and 0 < stats["bytes"] <= stats["budget"]
    assert stats["hit_tokens"] >= cached and set(stats["misses"]) >= {"no_match", "evicted", "model_mismatch", "too_short"}

    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    hits = families["prefix_cache_hits_tokens"].samples[0].value
    queried = families["prefix_cache_queries_tokens"].samples[0].value
    assert hits >= cached and queried >= first.usage.prompt_tokens + second.usage.prompt_tokens
    assert families["prefix_cache_bytes"].samples[0].value == stats["bytes"]

    reset = http.post("/v1/cache/reset").json()["prefix_cache"]
    assert reset["blocks"] == 0
    third = chat(client, messages=[system, {"role": "user", "content": "How tall is it?"}], max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].message.content == second.choices[0].message.content


def test_cache_reset_needs_the_api_key(http, api_key):
    r = http.post("/v1/cache/reset")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = http.post("/v1/cache/reset", headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 200
