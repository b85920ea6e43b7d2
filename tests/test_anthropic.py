"""The Anthropic Messages API end to end, through the official anthropic client."""

import json

import anthropic
import httpx
import pytest

from mlxserve.api.anthropic_routes import stop_reason
from mlxserve.api.generate import Choice
from mlxserve.models.chat import render_chat

MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def create(client, **kw):
    """messages.create; the SDK no longer takes sampling arguments, so they go in the body."""
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 6)
    sampling = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    return client.messages.create(model=MODEL, extra_body=sampling, **kw)


def test_message_non_streaming(server, client):
    m = create(client, temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    prompt = len(render_chat(server.state.tokenizer, MESSAGES))
    assert m.usage.output_tokens == 6
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt


def test_stream_event_sequence_and_text(server, client):
    full = create(client, temperature=0).content[0].text
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's name matches its payload
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert data[0]["message"]["content"] == [] and data[0]["message"]["stop_reason"] is None
    assert "".join(d["delta"]["text"] for d in data[3:-3]) == full
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 6

    # The SDK's own stream accumulator agrees.
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=6,
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == full
        final = stream.get_final_message()
    assert final.content[0].text == full and final.usage.output_tokens == 6
    assert final.stop_reason == "max_tokens"


def test_system_stop_sequences_and_sampling(server, client):
    tok = server.state.tokenizer
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    expected = len(render_chat(tok, with_system))
    as_string = create(client, system="Be brief.", max_tokens=1)
    as_blocks = create(client, system=[{"type": "text", "text": "Be brief."}], max_tokens=1)
    assert as_string.usage.input_tokens + as_string.usage.cache_read_input_tokens == expected
    assert as_blocks.usage.input_tokens + as_blocks.usage.cache_read_input_tokens == expected

    blocks = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    assert create(client, messages=blocks, temperature=0).content[0].text == \
        create(client, temperature=0).content[0].text

    text = create(client, max_tokens=12, temperature=0).content[0].text
    k = next(k for k in range(1, len(text) - 2) if text.find(text[k:k + 2]) == k and text[k:k + 2].strip())
    m = create(client, max_tokens=12, temperature=0, stop_sequences=[text[k:k + 2]])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == text[k:k + 2]
    assert m.content[0].text == text[:k]

    greedy = create(client, max_tokens=10, temperature=0).content[0].text
    assert create(client, max_tokens=10, temperature=1.0, top_k=1).content[0].text == greedy
    assert create(client, max_tokens=10, temperature=1.0, top_p=1e-9).content[0].text == greedy


def test_assistant_prefill_is_continued(server, client):
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    m = create(client, messages=prefill, max_tokens=3, temperature=0)
    ids = render_chat(server.state.tokenizer, prefill, add_generation_prompt=False,
                      chat_template_kwargs={"continue_final_message": True})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert server.state.tokenizer.decode(ids).endswith("Sure, here")


def test_count_tokens(server, client):
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES, system="Be brief.")
    m = create(client, system="Be brief.", max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stop_reason_mapping():
    assert stop_reason(Choice(finish_reason="length")) == ("max_tokens", None)
    assert stop_reason(Choice(finish_reason="stop", stop_reason="END")) == ("stop_sequence", "END")
    assert stop_reason(Choice(finish_reason="stop", stop_reason=151645)) == ("end_turn", None)


@pytest.mark.parametrize("body,status,kind", [
    ({"model": MODEL, "messages": MESSAGES}, 400, "invalid_request_error"),  # max_tokens is required
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": [], "max_tokens": 5}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "xx"}}]}],
      "max_tokens": 5}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "tools": [{"name": "f", "input_schema": {}}]},
     400, "invalid_request_error"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
      "output_config": {"format": {"type": "json_schema"}}}, 400, "invalid_request_error"),
    # A max_tokens past the context is capped; a prompt past it is refused.
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 10**6}, 400,
     "invalid_request_error"),
    ({"model": "claude-opus-4", "messages": MESSAGES, "max_tokens": 5}, 404, "not_found_error"),
])
def test_errors_in_anthropic_shape(server, body, status, kind):
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}
    assert r.json()["error"]["message"]


def test_malformed_json_and_sdk_errors(server, client):
    r = httpx.post(server.url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", messages=MESSAGES, max_tokens=5)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_api_key_via_x_api_key_and_bearer(server, api_key):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=MESSAGES, max_tokens=2)
    assert e.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)  # sends x-api-key
    assert good.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2).usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=api_key, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0
