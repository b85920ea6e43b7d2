"""Bad requests, as one table: each gets the right 4xx in its API's own error shape (Anthropic's
on /v1/messages*, OpenAI's elsewhere), naming what is wrong, and leaves the server healthy with
no prefix-cache block held and no image embedding kept.

One live server for the whole module: a tiny vision-language model (so image cases are decoded
for real) with a short context, a 1 MB body limit and small media limits. tests/test_fuzz.py
covers what a schema-driven generator finds; this table covers the cases a person would try.
"""

import asyncio
import base64
import io
import socket
import types
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from mlxserve.api.errors import ANTHROPIC_TYPES, OPENAI_TYPES
from mlxserve.config import EngineConfig, ServerConfig
from tests.test_vlm import picture, png_bytes

MODEL = "qwen2.5-vl-tiny"
CONTEXT = 256  # max_model_len: long prompts are quick to make and to refuse
BODY_LIMIT = 1_000_000
CAPACITY = 4 + 4  # max_num_seqs + max_queue
CHAT, CMPL, MSG, RESP = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """What the cases point at: an allowed media folder, a file outside it, and a listening
    socket on 127.0.0.1 that must never see a connection."""
    root = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    outside.write_bytes(png_bytes(picture(2)))
    (root / "ok.png").write_bytes(png_bytes(picture(3)))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield {"root": root, "outside": outside, "listener": listener, "port": listener.getsockname()[1]}
    listener.close()


@pytest.fixture(scope="module")
def bad_server(tiny, site):
    from conftest import LiveServer

    # strict_max_tokens: a max_tokens past the context is refused here (capped by default).
    live = LiveServer(tiny(MODEL), EngineConfig(block_size=16, max_model_len=CONTEXT, max_num_seqs=4, max_queue=4,
                                                default_max_tokens=4, strict_max_tokens=True),
                      ServerConfig(max_request_bytes=BODY_LIMIT, allowed_local_media_path=str(site["root"]),
                                   max_media_bytes=300_000, max_image_pixels=1_000_000))
    yield live
    live.close()


# ---- what the cases send ----

def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_data_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def encoded(image, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def bomb() -> bytes:
    """A 48 kB PNG that decodes to 400 million pixels (PIL's own bomb check stops it)."""
    from PIL import Image

    return encoded(Image.new("1", (20000, 20000)))


def too_many_pixels() -> bytes:
    """3000x3000: under PIL's bomb limit, over this server's --max-image-pixels."""
    from PIL import Image

    return encoded(Image.new("L", (3000, 3000)))


def truncated() -> bytes:
    data = png_bytes(picture(1))
    return data[: len(data) // 2]


def chat_image(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is this?"}]}],
            "max_tokens": 2}


def messages_image(source: dict) -> dict:
    return {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source},
                                                      {"type": "text", "text": "What is this?"}]}]}


def responses_image(url: str) -> dict:
    return {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                   {"type": "input_text", "text": "What is this?"}]}],
            "max_output_tokens": 2}


def anthropic(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": USER, **fields}


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
LONG_TEXT = "hello " * (CONTEXT * 2)  # more tokens than the context


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


@dataclass
class Case:
    id: str
    path: str
    body: Any  # a JSON value, bytes (sent raw), or a function of the `site` fixture giving either
    status: int
    says: str  # a piece of the error message: the case fails for the reason it is meant to
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    param: str | None = None  # OpenAI's `param`, where it should name the field

    def build(self, site):
        return self.body(site) if callable(self.body) else self.body


CASES = [
    # -- the body itself --
    Case("invalid-json", CHAT, b"{not json", 400, "not valid JSON"),
    Case("empty-body", CHAT, b"", 400, "JSON object"),
    Case("array-body", CHAT, [1, 2, 3], 400, "JSON object"),
    Case("not-utf8", CHAT, b'{"messages": "\xff\xc0"}', 400, "UTF-8"),
    Case("text-plain", CHAT, b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "Content-Type",
         headers={"content-type": "text/plain"}),
    Case("nested-100k", CHAT, nested(100_000), 400, "nested too deeply"),
    Case("over-limit", CHAT, b'{"messages": "' + b"x" * BODY_LIMIT + b'"}', 413, "larger than"),
    Case("over-limit-chunked", CHAT, lambda site: (b" " * 65536 for _ in range(20)), 413, "larger than"),
    # -- wrong types --
    Case("messages-string", CHAT, {"messages": "hi"}, 400, "valid list", param="messages"),
    Case("max-tokens-string", CHAT, {"messages": USER, "max_tokens": "5"}, 400, "valid integer", param="max_tokens"),
    Case("max-tokens-fraction", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5.5}', 400,
         "integer", param="max_tokens"),
    Case("stream-yes", CHAT, {"messages": USER, "stream": "yes"}, 400, "valid boolean", param="stream"),
    Case("temperature-word", CHAT, {"messages": USER, "temperature": "hot"}, 400, "number", param="temperature"),
    Case("stop-number", CHAT, {"messages": USER, "stop": 5}, 400, "string", param="stop"),
    Case("echo-yes", CMPL, {"prompt": "hi", "echo": "yes"}, 400, "valid boolean", param="echo"),
    Case("prompt-floats", CMPL, {"prompt": [1.5, 2.5]}, 400, "prompt", param="prompt"),
    Case("input-number", RESP, {"input": 5}, 400, "input", param="input"),
    Case("stream-yes-responses", RESP, {"input": "hi", "stream": "yes"}, 400, "valid boolean", param="stream"),
    Case("max-tokens-string-anthropic", MSG, anthropic(max_tokens="5"), 400, "valid integer"),
    Case("stop-sequences-string", MSG, anthropic(stop_sequences="x"), 400, "valid list"),
    Case("system-number", MSG, anthropic(system=5), 400, "system"),
    # -- huge, negative and out-of-range numbers --
    Case("max-tokens-negative", CHAT, {"messages": USER, "max_tokens": -1}, 400, "positive", param="max_tokens"),
    Case("max-tokens-huge", CHAT, {"messages": USER, "max_tokens": 10**30}, 400, "maximum context length",
         param="messages"),
    Case("temperature-infinite", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
         400, "finite", param="temperature"),
    Case("temperature-nan", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "finite", param="temperature"),
    Case("top-p-2", CHAT, {"messages": USER, "top_p": 2}, 400, "top_p", param="top_p"),
    Case("n-zero", CHAT, {"messages": USER, "n": 0}, 400, "greater than", param="n"),
    Case("seed-2-70", CHAT, {"messages": USER, "seed": 2**70}, 400, "less than", param="seed"),
    Case("top-logprobs-50", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "20",
         param="top_logprobs"),
    Case("max-output-tokens-negative", RESP, {"input": "hi", "max_output_tokens": -1}, 400, "positive",
         param="max_output_tokens"),
    Case("max-tokens-zero-anthropic", MSG, anthropic(max_tokens=0), 400, "greater than or equal to 1"),
    Case("max-tokens-huge-anthropic", MSG, anthropic(max_tokens=10**20), 400, "maximum context length"),
    Case("temperature-3-anthropic", MSG, anthropic(temperature=3), 400, "less than or equal to 1"),
    Case("completions-over-capacity", CMPL, {"prompt": ["hi"] * 3, "n": CAPACITY, "max_tokens": 1}, 400,
         "completions", param="n"),
    # -- roles and empty content --
    Case("empty-messages", CHAT, {"messages": []}, 400, "at least 1", param="messages"),
    Case("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role",
         param="messages[0].role"),
    Case("empty-role", CHAT, {"messages": [{"role": "", "content": "x"}]}, 400, "role", param="messages[0].role"),
    Case("no-role", CHAT, {"messages": [{"content": "x"}]}, 400, "required", param="messages[0].role"),
    Case("user-content-null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "required",
         param="messages[0].content"),
    Case("tool-role-anthropic", MSG, anthropic(messages=[{"role": "tool", "content": "x"}]), 400, "role"),
    Case("empty-content-anthropic", MSG, anthropic(messages=[{"role": "user", "content": []}]), 400,
         "non-empty content"),
    Case("empty-string-anthropic", MSG, anthropic(messages=[{"role": "user", "content": ""}]), 400,
         "non-empty content"),
    Case("unknown-role-responses", RESP, {"input": [{"role": "wizard", "content": "x"}]}, 400, "role",
         param="input[0].role"),
    Case("empty-input-responses", RESP, {"input": []}, 400, "input", param="input"),
    Case("unknown-item-responses", RESP, {"input": [{"type": "nonsense"}]}, 400, "nonsense", param="input[0].type"),
    Case("orphan-call-output", RESP, {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
         400, "call_id", param="input[0].call_id"),
    Case("unknown-part-type", CHAT, {"messages": [{"role": "user", "content": [{"type": "audio", "text": "x"}]}]},
         400, "audio", param="messages[0].content[0].type"),
    Case("call-arguments-not-json", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad json"}}]}]}, 400, "not valid JSON",
        param="messages[0].tool_calls"),
    # -- prompts longer than the context --
    Case("long-chat", CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "maximum context length",
         param="messages"),
    Case("long-token-prompt", CMPL, {"prompt": [1] * (CONTEXT + 1)}, 400, "maximum context length", param="prompt"),
    Case("long-anthropic", MSG, anthropic(messages=[{"role": "user", "content": LONG_TEXT}]), 400,
         "maximum context length"),
    Case("long-responses", RESP, {"input": LONG_TEXT}, 400, "maximum context length"),
    # -- stop strings, token ids, logit_bias --
    Case("100-stop-strings", CHAT, {"messages": USER, "stop": [f"s{i}" for i in range(100)]}, 400, "at most 64",
         param="stop"),
    Case("long-stop-string", CMPL, {"prompt": "hi", "stop": ["y" * 5000]}, 400, "characters", param="stop"),
    Case("100-stop-sequences", MSG, anthropic(stop_sequences=[f"s{i}" for i in range(100)]), 400, "stop_sequences"),
    Case("logit-bias-past-vocab", CHAT, {"messages": USER, "logit_bias": {"99999999": 1}}, 400, "vocabulary",
         param="logit_bias"),
    Case("logit-bias-negative-id", CHAT, {"messages": USER, "logit_bias": {"-5": 1}}, 400, "vocabulary",
         param="logit_bias"),
    Case("logit-bias-not-an-id", CMPL, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "token ids",
         param="logit_bias"),
    Case("logit-bias-1000", CHAT, {"messages": USER, "logit_bias": {"1": 1000}}, 400, "[-100, 100]",
         param="logit_bias"),
    Case("stop-token-past-vocab", CHAT, {"messages": USER, "stop_token_ids": [10**9]}, 400, "token ids",
         param="stop_token_ids"),
    Case("prompt-id-past-vocab", CMPL, {"prompt": [10**9]}, 400, "vocabulary", param="prompt"),
    Case("empty-prompt", CMPL, {"prompt": ""}, 400, "at least one token", param="prompt"),
    # -- tools and schemas --
    Case("tool-without-function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "required",
         param="tools[0].function"),
    Case("tool-parameters-string", CHAT, {"messages": USER, "tools": [tool("x")]}, 400, "dictionary",
         param="tools[0].function.parameters"),
    Case("tool-schema-malformed", CHAT, {"messages": USER, "tools": [tool(BAD_SCHEMA)]}, 400,
         "not a valid JSON schema", param="tools[0].function.parameters"),
    Case("forced-call-without-tools", CHAT, {"messages": USER, "tool_choice": {"type": "function",
                                                                               "function": {"name": "f"}}},
         400, "needs tools", param="tool_choice"),
    Case("response-format-bad-schema", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400, "bogus"),
    Case("guided-regex-unclosed", CHAT, {"messages": USER, "guided_regex": "(unclosed"}, 400, "regex",
         param="guided_regex"),
    Case("tool-schema-malformed-anthropic", MSG, anthropic(tools=[{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": 5}}}}]), 400, "not a valid JSON schema"),
    Case("tool-schema-not-object-anthropic", MSG, anthropic(tools=[{"name": "f", "input_schema": {"type": "string"}}]),
         400, "type 'object'"),
    Case("tool-choice-bogus-anthropic", MSG, anthropic(tool_choice={"type": "bogus"}), 400, "tool_choice"),
    Case("tool-schema-malformed-responses", RESP, {"input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": BAD_SCHEMA}]}, 400, "not a valid JSON schema",
        param="tools[0].parameters"),
    # A hosted tool is left out of the prompt (agents send web_search); forcing one is refused.
    Case("server-tool-forced-responses", RESP, {"input": "hi", "tools": [{"type": "web_search"}],
                                                "tool_choice": {"type": "web_search"}}, 400, "web_search",
         param="tool_choice"),
    # -- images that are not images, bombs, truncated files --
    Case("image-not-an-image", CHAT, chat_image(png_data_url(b"hello, not a picture")), 400, "not an image",
         param="messages[0].content[0]"),
    Case("image-truncated", CHAT, lambda site: chat_image(png_data_url(truncated())), 400, "truncated"),
    Case("image-bomb", CHAT, lambda site: chat_image(png_data_url(bomb())), 400, "decompression bomb"),
    Case("image-too-many-pixels", CHAT, lambda site: chat_image(png_data_url(too_many_pixels())), 400, "pixels"),
    Case("image-bad-base64", CHAT, chat_image("data:image/png;base64,@@@"), 400, "base64"),
    Case("image-svg", CHAT, chat_image("data:image/svg+xml;base64," + b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>")),
         400, "not an image"),
    Case("video-not-a-video", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(b"not a video")}}]}]}, 400,
         "not a video"),
    Case("image-bomb-anthropic", MSG, lambda site: messages_image(
        {"type": "base64", "media_type": "image/png", "data": b64(bomb())}), 400, "decompression bomb"),
    Case("image-source-without-data", MSG, messages_image({"type": "base64"}), 400, "image source"),
    Case("image-truncated-responses", RESP, lambda site: responses_image(png_data_url(truncated())), 400,
         "truncated"),
    # -- URLs to private and link-local addresses: refused before any connection --
    Case("url-private-10", CHAT, chat_image("http://10.0.0.1/a.png"), 400, "non-public address"),
    Case("url-link-local-metadata", CHAT, chat_image("http://169.254.169.254/latest/meta-data/"), 400,
         "non-public address"),
    Case("url-loopback-listening", CHAT, lambda site: chat_image(f"http://127.0.0.1:{site['port']}/a.png"), 400,
         "non-public address"),
    Case("url-localhost-name", CHAT, lambda site: chat_image(f"http://localhost:{site['port']}/a.png"), 400,
         "non-public address"),
    Case("url-ipv6-loopback", CHAT, chat_image("http://[::1]/a.png"), 400, "non-public address"),
    Case("url-ipv6-link-local", CHAT, chat_image("http://[fe80::1]/a.png"), 400, "non-public address"),
    Case("url-unspecified", CHAT, chat_image("http://0.0.0.0/a.png"), 400, "non-public address"),
    Case("url-link-local-anthropic", MSG, messages_image({"type": "url", "url": "http://169.254.169.254/x.png"}),
         400, "non-public address"),
    Case("url-private-responses", RESP, responses_image("http://192.168.1.1/x.png"), 400, "non-public address"),
    Case("url-scheme-gopher", CHAT, chat_image("gopher://example.com/a.png"), 400, "scheme"),
    # -- file:// outside the allowed folders, and with .. --
    Case("file-etc-passwd", CHAT, chat_image("file:///etc/passwd"), 400, "outside the directories"),
    Case("file-outside", CHAT, lambda site: chat_image(site["outside"].as_uri()), 400, "outside the directories"),
    Case("file-dot-dot", CHAT, lambda site: chat_image(
        f"file://{site['root']}/../{site['outside'].parent.name}/secret.png"), 400, "outside the directories"),
    Case("file-dot-dot-anthropic", MSG, lambda site: messages_image(
        {"type": "url", "url": f"file://{site['root']}/../../../etc/passwd"}), 400, "outside the directories"),
    Case("file-remote-host", RESP, lambda site: responses_image(f"file://example.com{site['root']}/ok.png"), 400,
         "local path"),
    # -- the model and the route --
    Case("unknown-model", CHAT, {"model": "gpt-5", "messages": USER}, 404, "does not exist", param="model"),
    Case("unknown-model-anthropic", MSG, {**anthropic(), "model": "claude-x"}, 404, "does not exist"),
    Case("invalid-json-anthropic", MSG, b'{"model": "x"', 400, "not valid JSON"),
    Case("nested-anthropic", MSG, b'{"metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, 400, "nested too deeply"),
    Case("over-limit-anthropic", MSG, b'{"model": "' + b"x" * BODY_LIMIT + b'"}', 413, "larger than"),
    Case("count-tokens-messages-string", MSG + "/count_tokens", {"model": MODEL, "messages": "x"}, 400, "valid list"),
    Case("unknown-previous-response", RESP, {"input": "hi", "previous_response_id": "resp_nope"}, 404, "not found",
         param="previous_response_id"),
    Case("invalid-json-responses", RESP, b"[1, 2", 400, "not valid JSON"),
]


def test_the_table_is_a_catalogue():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.path for c in CASES} >= {CHAT, CMPL, MSG, RESP}


def held(server) -> tuple[int, int]:
    """(prefix-cache blocks in use, vision-cache entries)."""
    stats = httpx.get(server.base_url + "/cache/stats", timeout=30).json()
    return stats["prefix_cache"]["in_use_blocks"], stats["vision_cache"]["entries"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(bad_server, site, case):
    body = case.build(site)
    before = held(bad_server)
    with httpx.Client(base_url=bad_server.url, timeout=60) as c:
        if isinstance(body, (bytes, types.GeneratorType)):  # sent as is (a generator: chunked)
            r = c.post(case.path, content=body, headers=case.headers)
        else:
            r = c.post(case.path, json=body)
        with pytest.raises(BlockingIOError):  # nothing ever connected to the loopback listener
            site["listener"].accept()
        assert r.status_code == case.status, r.text[:500]
        error = r.json()
        if case.path.startswith("/v1/messages"):
            assert set(error) == {"type", "error"} and error["type"] == "error", error
            assert set(error["error"]) == {"type", "message"}, error
            assert error["error"]["type"] == ANTHROPIC_TYPES[case.status]
        else:
            assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
            assert error["error"]["type"] == OPENAI_TYPES[case.status]
            if case.param is not None:
                assert error["error"]["param"] == case.param, error
        message = error["error"]["message"]
        assert case.says.lower() in message.lower(), message
        assert "Traceback" not in message
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert held(bad_server) == (0, before[1])  # no block in use, no embedding kept


def test_the_server_still_serves(bad_server, site):
    """After every bad request: text, an image by data URL and one from the allowed folder."""
    with httpx.Client(base_url=bad_server.url, timeout=60) as c:
        assert c.post(CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200
        assert c.post(CHAT, json=chat_image(png_data_url(png_bytes(picture(5))))).status_code == 200
        assert c.post(CHAT, json=chat_image((site["root"] / "ok.png").as_uri())).status_code == 200
        assert c.post(MSG, json=anthropic()).status_code == 200
        assert c.post(RESP, json={"input": "hi", "max_output_tokens": 2}).status_code == 200
    assert held(bad_server)[0] == 0


def test_engine_refuses_ids_past_the_vocabulary(bad_server):
    """The Python API reaches the engine without the routes' checks: an id past the vocabulary
    in logit_bias crashed the process (an out-of-bounds write in MLX), so the engine checks too."""
    from mlxserve.engine.request import Request, SamplingParams

    engine = bad_server.engine

    async def submit(params):
        async for _ in engine.submit(Request([1, 2, 3], params)):
            pass

    for params, field_name in ((SamplingParams(max_tokens=2, logit_bias={10**9: 5.0}), "logit_bias"),
                               (SamplingParams(max_tokens=2, logit_bias={-1: 5.0}), "logit_bias"),
                               (SamplingParams(max_tokens=2, stop_token_ids=[10**9]), "stop_token_ids")):
        with pytest.raises(ValueError, match=field_name):
            asyncio.run(submit(params))
    asyncio.run(submit(SamplingParams(max_tokens=2)))
