"""Tool calls: parsing the model's markup, OpenAI tool_calls and Anthropic tool_use.

The random tiny model never writes a tool call, so answers are built as the
engine would stream them (one RequestOutput per token of a realistic Qwen
answer) and fed through the routes' own response and SSE code; live-server
tests check that tool conversations render and complete through both SDKs.
"""

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from mlxserve.api.anthropic_routes import message_events, response_content, with_calls
from mlxserve.api.generate import Choice
from mlxserve.api.openai_routes import ToolCalls, chat_events
from mlxserve.api.tool_calls import ToolCall, ToolCallStream, split_text, tool_syntax
from mlxserve.engine.request import RequestOutput
from mlxserve.models.chat import render_chat

MODEL = "qwen3-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ONE_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>')
MALFORMED = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}\n</tool_call>'
NO_NAME = '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'
UNFINISHED = 'Hmm <tool_call>\n{"name": "get_weather", "argum'
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # what the real default model writes
BARE_UNKNOWN = '{"name": "get_time", "arguments": {}}'  # names no offered tool: plain JSON text
FENCED = "```json\n" + BARE + "\n```"  # what it writes for openai-agents' function tools
BAD_ARGS = '{"name": "get_weather", "arguments": {"town": "Paris"}}'  # its schema requires "city"
CODE = "```python\nprint({'a': 1})\n```"
PLAIN = "It is sunny in Paris. 2 < 3 and <tool is not a call.\n"


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny("qwen3-tiny").tokenizer  # Qwen2.5's tokenizer and Hermes-style template


@pytest.fixture(scope="module")
def syntax(tokenizer):
    return tool_syntax(tokenizer)


def outputs(tokenizer, text, finish="stop"):
    """The engine's stream for `text`: one output per token, the last one finished."""
    ids = tokenizer.encode(text)
    outs = [RequestOutput("r", [t], tokenizer.decode([t])) for t in ids]
    assert "".join(o.new_text for o in outs) == text
    outs[-1].finish_reason = finish
    outs[-1].stop_reason = 151645 if finish == "stop" else None
    return outs


def choice_of(tokenizer, text, finish="stop"):
    c = Choice()
    for out in outputs(tokenizer, text, finish):
        c.add(out)
    return c


class Replay:
    """What the routes iterate: (choice index, output) pairs, as Run yields them."""

    def __init__(self, outs):
        self.outs = outs
        self.closed = False

    async def __aiter__(self):
        for out in self.outs:
            yield 0, out

    def close(self):
        self.closed = True


def collect_events(agen):
    async def drain():
        return [e async for e in agen]
    return asyncio.run(drain())


def sse_payloads(events):
    out = []
    for e in events:
        data = [line[6:] for line in e.decode().split("\n") if line.startswith("data: ")][0]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- parsing ----

def test_inferred_syntax_is_hermes(syntax):
    assert (syntax.start, syntax.end) == ("<tool_call>", "</tool_call>")


@pytest.mark.parametrize("text,content,calls", [
    (ONE_CALL, "Let me check.", [ToolCall("get_weather", {"city": "Paris"})]),
    (TWO_CALLS, "", [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome"})]),
    (MALFORMED, MALFORMED, []),
    (NO_NAME, NO_NAME, []),
    (UNFINISHED, UNFINISHED, []),
    (BARE, "", [ToolCall("get_weather", {"city": "Paris"})]),
    ("[" + BARE + ", " + BARE + "]", "", [ToolCall("get_weather", {"city": "Paris"})] * 2),
    (BARE_UNKNOWN, BARE_UNKNOWN, []),
    (FENCED, "", [ToolCall("get_weather", {"city": "Paris"})]),
    (BAD_ARGS, BAD_ARGS, []),
    (CODE, CODE, []),
    ('{"city": "Paris"}\n', '{"city": "Paris"}\n', []),
    (PLAIN, PLAIN, []),
])
@pytest.mark.parametrize("markup", [True, False])
def test_split_text(syntax, text, content, calls, markup):
    if not markup and "<tool_call>" in text:
        return  # a model without markup writes none
    assert split_text(syntax if markup else None, text, TOOLS) == (content, calls)


def test_forced_calls_drop_what_is_not_a_call(syntax):
    """Under a forced call the grammar allows calls only: the rest is a cut-off call or whitespace."""
    cut = ONE_CALL.removeprefix("Let me check.") + "\n" + UNFINISHED.removeprefix("Hmm ")
    assert split_text(syntax, cut, TOOLS, forced=True) == ("", [ToolCall("get_weather", {"city": "Paris"})])
    assert split_text(syntax, cut, TOOLS)[0].endswith(UNFINISHED.removeprefix("Hmm "))
    # Cut before its first call ended: no markup as the answer, whole or streamed.
    unfinished = UNFINISHED.removeprefix("Hmm ")
    assert split_text(syntax, unfinished, TOOLS, forced=True) == ("", [])
    stream = ToolCallStream(syntax, TOOLS, forced=True)
    assert stream.feed(unfinished) + stream.finish() == []


@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS, MALFORMED, UNFINISHED, BARE, BARE_UNKNOWN, FENCED,
                                  BAD_ARGS, CODE, PLAIN])
def test_stream_token_by_token_matches_whole(syntax, tokenizer, text):
    stream = ToolCallStream(syntax, TOOLS)
    pieces = []
    for out in outputs(tokenizer, text):
        pieces += stream.feed(out.new_text)
    pieces += stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    streamed = "".join(p for p in pieces if isinstance(p, str))
    content, expected = split_text(syntax, text, TOOLS)
    assert calls == expected
    assert "<tool_call>" not in streamed or not calls  # markup of a parsed call never leaks
    # Without a call the streamed text is the model's text exactly, whitespace included.
    assert streamed == (content if calls else text)


# ---- OpenAI ----

def test_openai_message_with_calls(tokenizer):
    r = ToolCalls(tool_syntax(tokenizer), TOOLS).message(choice_of(tokenizer, TWO_CALLS))
    assert r["finish_reason"] == "tool_calls"
    msg = r["message"]
    assert msg["content"] is None
    assert [c["id"][:5] for c in msg["tool_calls"]] == ["call_", "call_"]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("function", "get_weather", {"city": "Paris"}),
                                            ("function", "get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("tools,text,finish", [
    (TOOLS, MALFORMED, "stop"),       # unparseable: plain content, no 500
    (None, ONE_CALL, "stop"),         # no tools offered: markup is just text
    (TOOLS, ONE_CALL, "length"),      # cut off after the call: still says length
])
def test_openai_message_without_tool_calls_or_cut(tokenizer, tools, text, finish):
    r = ToolCalls(tool_syntax(tokenizer), tools).message(choice_of(tokenizer, text, finish))
    if finish == "length":
        assert r["finish_reason"] == "length" and r["message"]["content"] == "Let me check."
        assert len(r["message"]["tool_calls"]) == 1
    else:
        assert r == {"message": {"role": "assistant", "content": text, "refusal": None},
                     "finish_reason": "stop"}


def openai_stream(tokenizer, text, tools=TOOLS):
    run = Replay(outputs(tokenizer, text))
    head = {"id": "chatcmpl-x", "created": 0, "model": MODEL, "system_fingerprint": "f"}
    data = sse_payloads(collect_events(chat_events(None, run, head, 1, False, False,
                                                   ToolCalls(tool_syntax(tokenizer), tools))))
    assert data[-1] == "[DONE]" and run.closed
    return [d["choices"][0] for d in data[:-1]]


def test_openai_stream_text_then_call(tokenizer):
    choices = openai_stream(tokenizer, ONE_CALL)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == "Let me check."
    calls = [c["delta"]["tool_calls"] for c in choices if "tool_calls" in c["delta"]]
    assert len(calls) == 1 and len(calls[0]) == 1
    call = calls[0][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    assert choices[-1]["delta"] == {}


def test_openai_stream_two_calls_and_malformed(tokenizer):
    calls = [c["delta"]["tool_calls"][0] for c in openai_stream(tokenizer, TWO_CALLS)
             if "tool_calls" in c["delta"]]
    assert [c["index"] for c in calls] == [0, 1]
    choices = openai_stream(tokenizer, MALFORMED)
    assert "".join(c["delta"].get("content") or "" for c in choices) == MALFORMED
    assert choices[-1]["finish_reason"] == "stop"


# ---- Anthropic ----

def test_anthropic_content_blocks(tokenizer, syntax):
    content, called = response_content(choice_of(tokenizer, ONE_CALL), syntax, TOOLS)
    assert called
    text, use = content
    assert text == {"type": "text", "text": "Let me check."}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert (use["name"], use["input"]) == ("get_weather", {"city": "Paris"})
    assert with_calls(("end_turn", None), True) == ("tool_use", None)
    assert with_calls(("max_tokens", None), True) == ("max_tokens", None)
    assert response_content(choice_of(tokenizer, MALFORMED), syntax, TOOLS) == (
        [{"type": "text", "text": MALFORMED}], False)


def test_anthropic_stream_tool_use(tokenizer, syntax):
    run = Replay(outputs(tokenizer, ONE_CALL))
    head = {"id": "msg_x", "type": "message", "role": "assistant", "model": MODEL}
    data = sse_payloads(collect_events(message_events(run, head, 10, ToolCallStream(syntax, TOOLS))))
    blocks = [(d["type"], d["index"]) for d in data if d["type"].startswith("content_block_")
              and d["type"] != "content_block_delta"]
    assert blocks == [("content_block_start", 0), ("content_block_stop", 0),
                      ("content_block_start", 1), ("content_block_stop", 1)]
    text = "".join(d["delta"]["text"] for d in data if d.get("delta", {}).get("type") == "text_delta")
    assert text == "Let me check."
    start = [d for d in data if d["type"] == "content_block_start"][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    (partial,) = [d["delta"]["partial_json"] for d in data
                  if d.get("delta", {}).get("type") == "input_json_delta"]
    assert json.loads(partial) == {"city": "Paris"}
    assert [d["delta"]["stop_reason"] for d in data if d["type"] == "message_delta"] == ["tool_use"]
    assert data[-1]["type"] == "message_stop" and run.closed


def test_anthropic_stream_call_without_text_has_no_empty_block(tokenizer, syntax):
    run = Replay(outputs(tokenizer, BARE))
    head = {"id": "msg_x", "type": "message", "role": "assistant", "model": MODEL}
    data = sse_payloads(collect_events(message_events(run, head, 10, ToolCallStream(syntax, TOOLS))))
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["tool_use"]


# ---- live server: tool conversations render and complete ----

def test_openai_client_tool_conversation(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    # The call (arguments as a dict) and its result reached the template.
    as_template = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
    assert r.usage.prompt_tokens == len(render_chat(server.state.tokenizer, as_template, tools=TOOLS))
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


def test_anthropic_client_tools_and_results(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather of a city.",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                    {"type": "text", "text": "Thanks."}]}]
    m = client.messages.create(model=MODEL, max_tokens=3, tools=tools, messages=messages,
                               extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.content[0].type == "text"
    counted = client.messages.count_tokens(model=MODEL, tools=tools, messages=messages).input_tokens
    as_openai = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     {"id": "toolu_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
                 {"role": "user", "content": "Thanks."}]
    assert counted == len(render_chat(server.state.tokenizer, as_openai, tools=TOOLS))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    none = client.messages.count_tokens(model=MODEL, tools=tools, tool_choice={"type": "none"},
                                        messages=messages[:1]).input_tokens
    assert none == client.messages.count_tokens(model=MODEL, messages=messages[:1]).input_tokens < \
        client.messages.count_tokens(model=MODEL, tools=tools, messages=messages[:1]).input_tokens


@pytest.mark.parametrize("extra,where", [
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
])
def test_anthropic_refuses_bad_tool_choice_and_forced_server_tools(server, extra, where):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], **extra}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(where + ":")
