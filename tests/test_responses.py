"""The OpenAI Responses API: the official openai client against a live server, raw HTTP
for bad input, and tool-call output replayed through the route's own stream code.

qwen3-tiny has random weights: its text is gibberish and it never stops by
itself nor writes a tool call, so live answers are cut by max_output_tokens
(status "incomplete"), and completed answers with calls are replayed.
"""

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mlxserve.api.responses_input import ResponseStore, Stored
from mlxserve.api.responses_routes import Head, Output, response_events
from mlxserve.api.responses_schema import ResponsesRequest
from mlxserve.api.tool_calls import ToolCallStream, tool_syntax
from mlxserve.engine.request import RequestOutput
from mlxserve.models.chat import render_chat

MODEL = "qwen3-tiny"
# Long enough that a first turn fills whole prefix-cache blocks (32 tokens on the CPU).
INSTRUCTIONS = "You are a terse assistant. Answer in one short sentence, without any preamble. " * 3
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def create(client, **kw):
    kw.setdefault("max_output_tokens", 4)
    return client.responses.create(model=MODEL, temperature=0, **kw)


def prompt_len(server, messages, **kw) -> int:
    return len(render_chat(server.state.tokenizer, messages, **kw))


def raw(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/responses", json={"model": MODEL, **body}, timeout=60)


# ---- create ----

def test_create_from_a_string(server, client):
    r = create(client, input="Say something.")
    Response.model_validate(r.to_dict())  # every field the official types require is there
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.output_tokens == 4
    assert r.usage.input_tokens == prompt_len(server, [{"role": "user", "content": "Say something."}])
    assert r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.store is True and r.tool_choice == "auto" and r.max_output_tokens == 4
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # Greedy decoding is deterministic: the same input gives the same text.
    assert create(client, input="Say something.").output_text == r.output_text


def test_items_instructions_and_tool_turns_reach_the_template(server, client):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks."},
    ]
    r = create(client, input=items, instructions="Be brief.", tools=[TOOL])
    assert r.instructions == "Be brief." and r.tools[0].name == "get_weather"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    as_chat = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
               {"role": "user", "content": "Weather in\nParis?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
               {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}]
    assert r.usage.input_tokens == prompt_len(server, as_chat, tools=[CHAT_TOOL])
    # tool_choice 'none': the template is not told of the tools.
    r = create(client, input=items, instructions="Be brief.", tools=[TOOL], tool_choice="none")
    assert r.usage.input_tokens == prompt_len(server, as_chat)
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "reasoning", "function_call",
                                             "function_call_output", "message", "message"]


# ---- streaming ----

def test_stream_event_order(server, client):
    whole = create(client, input="Count.", max_output_tokens=5)
    events = list(create(client, input="Count.", max_output_tokens=5, stream=True))
    for e in events:
        EVENTS.validate_python(e.to_dict())
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert len({e.response.id for e in (events[0], events[1], events[-1])}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    item_id = events[2].item.id
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {item_id}
    assert final.output[0].id == item_id and final.usage.output_tokens == 5
    assert client.responses.retrieve(final.id).output_text == text


def test_stream_helper_parses_every_event(server, client):
    with client.responses.stream(model=MODEL, input="Count.", max_output_tokens=3, temperature=0) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == events[-1].response.output_text


# ---- tool calls (replayed: the random model writes none) ----

class Replay:
    """What Run yields: (choice index, output) pairs, one per token of `text`."""

    def __init__(self, tokenizer, text):
        ids = tokenizer.encode(text)
        self.outs = [RequestOutput("r", [t], tokenizer.decode([t]), prompt_tokens=7, completion_tokens=i + 1)
                     for i, t in enumerate(ids)]
        self.outs[-1].finish_reason, self.outs[-1].stop_reason = "stop", 151645
        self.closed = False

    async def __aiter__(self):
        for out in self.outs:
            yield 0, out

    def close(self):
        self.closed = True


class FakeState:
    model_name = MODEL


def replay_events(tokenizer, text) -> tuple[list[dict], list[dict]]:
    """(events, stored responses) of a streamed answer `text` to a request offering TOOL."""
    stored = []
    head = Head(FakeState(), ResponsesRequest(input="x", tools=[TOOL]), "resp_test")
    output = Output(ToolCallStream(tool_syntax(tokenizer), [CHAT_TOOL]))
    run = Replay(tokenizer, text)

    async def drain():
        return [e async for e in response_events(run, head, output, stored.append)]

    chunks = asyncio.run(drain())
    events = []
    for chunk in chunks:
        name, data = chunk.decode().split("\n")[:2]
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
        EVENTS.validate_python(events[-1])
    assert run.closed
    return events, stored


def test_stream_text_then_function_call(tiny):
    tokenizer = tiny(MODEL).tokenizer
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events, stored = replay_events(tokenizer, text)
    types = [e["type"] for e in events]
    call_at = types.index("response.output_item.added", 3)
    assert types[call_at:] == ["response.output_item.added", "response.function_call_arguments.delta",
                               "response.function_call_arguments.done", "response.output_item.done",
                               "response.completed"]
    assert types[call_at - 3:call_at] == ["response.output_text.done", "response.content_part.done",
                                          "response.output_item.done"]
    added = events[call_at]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert events[call_at]["output_index"] == 1 and added["id"].startswith("fc_")
    assert added["call_id"].startswith("call_")
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.incomplete_details is None
    message, call = final.output
    assert message.content[0].text == "Let me check." and final.output_text == "Let me check."
    assert (call.name, json.loads(call.arguments), call.call_id) == ("get_weather", {"city": "Paris"},
                                                                      added["call_id"])
    assert stored == [events[-1]["response"]]


def test_stream_bare_json_call_without_text(tiny):
    # What the real default model writes: the call as bare JSON, no markup, no text.
    events, _ = replay_events(tiny(MODEL).tokenizer, '{"name": "get_weather", "arguments": {"city": "Rome"}}')
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call"]
    assert json.loads(final["output"][0]["arguments"]) == {"city": "Rome"}


def test_error_mid_stream_is_an_error_event(tiny):
    from mlxserve.api.errors import APIError

    class Failing(Replay):
        async def __aiter__(self):
            yield 0, self.outs[0]
            raise APIError(503, "The server is shutting down; this request was ended.", code="shutting_down")

    tokenizer = tiny(MODEL).tokenizer
    run, stored = Failing(tokenizer, "Hello there"), []
    head = Head(FakeState(), ResponsesRequest(input="x"), "resp_test")

    async def drain():
        return [e async for e in response_events(run, head, Output(None), stored.append)]

    events = [json.loads(c.decode().split("data: ", 1)[1]) for c in asyncio.run(drain())]
    for e in events:
        EVENTS.validate_python(e)
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["code"] == "shutting_down" and events[-1]["sequence_number"] == len(events) - 1
    assert run.closed and stored == []  # a failed response is not kept


def test_empty_answer_is_one_empty_message(tiny):
    output = Output(None)
    output.finish("completed")
    assert [(i["type"], i["content"][0]["text"], i["status"]) for i in output.items] == [
        ("message", "", "completed")]


# ---- previous_response_id and the store ----

def test_previous_response_continues_the_conversation(server, client):
    first = create(client, input="Name a colour.", instructions=INSTRUCTIONS)
    second = create(client, input="And another?", instructions=INSTRUCTIONS, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And another?"}]
    assert second.usage.input_tokens == prompt_len(server, conversation)
    # The first turn's prompt is served from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= 32
    third = create(client, input="Last one.", instructions=INSTRUCTIONS, previous_response_id=second.id)
    conversation += [{"role": "assistant", "content": second.output_text},
                     {"role": "user", "content": "Last one."}]
    assert third.usage.input_tokens == prompt_len(server, conversation)
    # Each response lists its own input items only.
    assert [i.content[0].text for i in client.responses.input_items.list(third.id).data] == ["Last one."]


def test_store_false_get_and_delete(server, client):
    r = create(client, input="Hi.", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="Hi.", previous_response_id=r.id)
    kept = create(client, input="Hi.")
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    deleted = httpx.delete(f"{server.base_url}/responses/{create(client, input='Hi.').id}")
    assert deleted.status_code == 200 and deleted.json()["object"] == "response.deleted"
    assert deleted.json()["deleted"] is True


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for n in "abc":
        if n == "c":
            assert store.get("a") is not None  # touched: "b" is now the oldest
        store.put(Stored({"id": n}, [], []))
    assert store.get("b") is None and store.get("a") and store.get("c")
    empty = ResponseStore(0)
    empty.put(Stored({"id": "a"}, [], []))
    assert empty.get("a") is None


# ---- bad input ----

@pytest.mark.parametrize("body,status,param", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"content": "no role or type"}]}, 400, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user"}]}, 400, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     400, "input[0].content[0].type"),  # qwen3-tiny takes text only
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, 400,
     "input[0].content[0].image_url"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, 400,
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400,
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400, "input[0].name"),
    ({"input": "x", "tools": [{"type": "custom", "name": "f", "format": {"type": "grammar"}}]}, 400,
     "tools[0].format"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, 400,
     "tools[0].tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}]}, 400,
     "tools[1].name"),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}}, 400,
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 3},
                                        "strict": True}}}, 400, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": []}, 400, "input"),
    ({}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "model": "gpt-5"}, 404, "model"),
])
def test_bad_input(server, body, status, param):
    r = raw(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    if param == "previous_response_id":
        assert error["message"] == "Previous response with id 'resp_nope' not found."


def test_unknown_ids_are_404(server):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.base_url}/responses/resp_nope", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    r = httpx.get(f"{server.base_url}/responses/resp_nope/input_items", timeout=10)
    assert r.status_code == 404


# ---- images ----

@pytest.fixture(scope="module")
def vlm_server(tiny):
    from conftest import LiveServer

    from mlxserve.config import EngineConfig

    live = LiveServer(tiny("qwen2.5-vl-tiny"), EngineConfig(block_size=16))
    yield live
    live.close()


def png_data_url(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((64, 80, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_input_image_matches_chat_completions(vlm_server):
    client = openai.OpenAI(base_url=vlm_server.base_url, api_key="none", max_retries=0, timeout=60)
    url = png_data_url(3)
    model = "qwen2.5-vl-tiny"
    r = client.responses.create(model=model, temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                     {"type": "input_text", "text": "What is this?"}]}])
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is this?"}]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens > 20  # the image's tokens are in
    assert r.output_text == chat.choices[0].message.content
    # The next turn re-reads the image from the stored conversation; its KV comes from the cache.
    again = client.responses.create(model=model, temperature=0, max_output_tokens=4, input="And now?",
                                    previous_response_id=r.id)
    assert again.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert again.usage.input_tokens_details.cached_tokens >= 16


def test_forced_tool_call_and_json_schema(client):
    """Constrained decoding through the Responses API: a forced call always parses, text.format holds."""
    import jsonschema

    tool = {**TOOL, "parameters": {**TOOL["parameters"], "additionalProperties": False,
                                   "properties": {"city": {"type": "string", "maxLength": 8}}}}
    r = create(client, input="Weather?", tools=[tool], tool_choice="required", max_output_tokens=80)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and len(json.loads(call.arguments)["city"]) <= 8
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = create(client, input="Answer in JSON.", max_output_tokens=40,
               text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
