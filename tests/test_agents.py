"""What agent harnesses send (Codex CLI on the Responses API, Claude Code on the Messages API),
checked piece by piece against a live server with the official clients; tests/test_agent_replay.py
replays their recorded sessions whole.

qwen3-tiny has random weights and never writes a tool call by itself, so calls are forced
with tool_choice (a grammar over the model's own call markup) to see each call's output form;
string arguments are bounded (maxLength), or random weights would fill them until max_tokens.
"""

import json
import re

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from mlxserve.config import EngineConfig

MODEL = "qwen3-tiny"
CONTEXT = 40960  # agents' prompts run to 10-20k tokens; qwen3-tiny's own context is 4k
SYSTEM = "You are a coding agent. Use the tools to read, run and edit files. " * 8
# additionalProperties false as Claude Code sends it (tests/agents/claude_code.json): without it
# a forced call may add properties of unbounded names, and random weights fill one until max_tokens.
BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string", "maxLength": 16}},
                         "required": ["command"], "additionalProperties": False}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 16}},
                       "required": ["cmd"]}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string", "maxLength": 16}},
                    "required": ["task"]}}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark",
                    "definition": 'start: "*** Begin Patch\\n" /(.|\\n)*/ "*** End Patch"'}}
DIGITS = {"type": "custom", "name": "dial", "description": "Dial a number.",
          "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[0-9]{4}"}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": []},
          {"type": "code_interpreter", "container": {"type": "auto"}}]
ANTHROPIC_EVENTS = TypeAdapter(RawMessageStreamEvent)
OPENAI_EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def agent_server(tiny):
    from conftest import LiveServer

    live = LiveServer(tiny(MODEL), EngineConfig(max_model_len=CONTEXT, max_num_seqs=4, max_queue=16))
    live.pool.add_alias("claude-*", MODEL)
    live.pool.add_alias("gpt-5*", MODEL)
    yield live
    live.close()


@pytest.fixture
def claude(agent_server):
    return anthropic.Anthropic(base_url=agent_server.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def codex(agent_server):
    return openai.OpenAI(base_url=agent_server.base_url, api_key="none", max_retries=0, timeout=120)


def messages_body(**kw) -> dict:
    body = {"model": "claude-haiku-4-5", "max_tokens": 4, "system": SYSTEM,
            "messages": [{"role": "user", "content": "List the files."}]}
    return {**body, **kw}


def post_messages(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/messages?beta=true", json={**body, "temperature": 0}, timeout=120)


def anthropic_events(lines) -> list:
    """A stream's events as the anthropic SDK's types (which, like the SDK, skip pings)."""
    data = (json.loads(line[6:]) for line in lines if line.startswith("data: "))
    return [ANTHROPIC_EVENTS.validate_python(d) for d in data if d["type"] != "ping"]


def create(claude, **body) -> Message:
    return claude.messages.create(**messages_body(**body), extra_body={"temperature": 0})


# ---- model names ----

def test_aliases_serve_the_names_harnesses_ask_for(agent_server, claude, codex):
    """Claude Code asks for claude-* (its main and its background model), Codex for gpt-5*:
    --alias serves them; any other unknown name is still a 404 naming the models."""
    msg = create(claude, model="claude-opus-5-5")
    assert msg.model == MODEL and msg.stop_reason == "max_tokens"
    r = codex.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=2, temperature=0)
    assert r.model == MODEL
    with pytest.raises(anthropic.NotFoundError, match="--alias"):
        create(claude, model="gemini-3")
    card = httpx.get(agent_server.base_url + "/models").json()["data"][0]
    assert card["aliases"] == ["claude-*", "gpt-5*"]


def test_alias_settings_are_checked():
    from mlxserve.engine.pool import ModelPool, ModelSpec
    from mlxserve.config import ModelConfig

    spec = ModelSpec("qwen", ModelConfig(model="qwen", load_format="dummy"), EngineConfig(),
                     aliases=("claude-*",))
    pool = ModelPool([spec], aliases="gpt-5*, o3=qwen")
    assert pool.get("claude-sonnet-4").name == pool.get("gpt-5.1").name == pool.get("o3").name == "qwen"
    assert pool.get("o4") is None and pool.get("qwen").name == "qwen"
    with pytest.raises(ValueError, match="no model is named 'other'"):
        ModelPool([spec], aliases="claude-*=other")
    with pytest.raises(ValueError, match="already named"):
        ModelPool([spec], aliases="qwen")


def test_aliases_in_the_config_file(tmp_path):
    from mlxserve.config import EngineConfig as E, ModelConfig, PoolConfig, ServerConfig, served_models
    from mlxserve.engine.pool import ModelPool, ModelSpec

    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nmodel = "qwen3-tiny"\nload_format = "dummy"\naliases = ["claude-*", "gpt-5*"]\n')
    models = served_models([], ModelConfig(), E(), ServerConfig(), PoolConfig(config=str(path)))
    pool = ModelPool([ModelSpec.of(m) for m in models])
    assert pool.get("claude-haiku-4-5").name == pool.get("gpt-5").name == "qwen3-tiny"


# ---- max_tokens past the context ----

def test_max_tokens_past_the_context_is_capped(agent_server, claude):
    """Claude Code always asks for 32000-128000 tokens: the answer gets what the context leaves
    and ends with max_tokens there (llama.cpp's behaviour); --strict-max-tokens refuses it."""
    engine = agent_server.engine
    prompt = "word " * 300
    body = messages_body(messages=[{"role": "user", "content": prompt}], max_tokens=10**9)
    count = claude.messages.count_tokens(model="claude-x", system=SYSTEM,
                                         messages=body["messages"]).input_tokens
    engine.max_model_len = count + 5  # the room left is 5 tokens
    try:
        msg = Message.model_validate(post_messages(agent_server, body).json())
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
        engine.config.strict_max_tokens = True
        r = post_messages(agent_server, body)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    finally:
        engine.config.strict_max_tokens = False
        engine.max_model_len = CONTEXT


# ---- Anthropic: what Claude Code sends ----

def test_a_system_message_among_the_messages_is_system_content_at_its_place(agent_server, claude):
    """Claude Code puts its environment in a `system`-role message after the first user turn."""
    from mlxserve.models.chat import render_chat

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello."}]},
                {"role": "system", "content": [{"type": "text", "text": "Today is Friday.",
                                                "cache_control": {"type": "ephemeral"}}],
                 "output_config": {"effort": "medium"}}]
    body = messages_body(messages=messages, thinking={"type": "adaptive", "display": "omitted"},
                         context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                         output_config={"effort": "medium"}, metadata={"user_id": "{}"})
    r = post_messages(agent_server, body)
    assert r.status_code == 200, r.text
    expected = render_chat(agent_server.state.tokenizer, [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello."},
        {"role": "system", "content": "Today is Friday."}], add_generation_prompt=True)
    count = claude.messages.count_tokens(model="claude-x", system=SYSTEM, messages=messages).input_tokens
    usage = r.json()["usage"]
    assert count == usage["input_tokens"] + usage["cache_read_input_tokens"] == len(expected)


def test_server_tools_are_left_out_and_deferred_tools_accepted(agent_server):
    tools = [{**BASH, "cache_control": {"type": "ephemeral"}},
             {"name": "Later", "description": "Loaded on demand.", "defer_loading": True,
              "input_schema": {"type": "object", "properties": {}}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
    r = post_messages(agent_server, messages_body(tools=tools))
    assert r.status_code == 200, r.text
    forced = post_messages(agent_server, messages_body(tools=tools, tool_choice={"type": "tool", "name": "web_search"}))
    assert forced.status_code == 400 and forced.json()["error"]["type"] == "invalid_request_error"
    assert "server tool" in forced.json()["error"]["message"]


def test_forced_bash_call_streams_as_tool_use(agent_server, claude):
    body = messages_body(tools=[BASH], tool_choice={"type": "tool", "name": "Bash"}, max_tokens=200, stream=True,
                         temperature=0)
    with httpx.stream("POST", agent_server.url + "/v1/messages", json=body, timeout=120) as r:
        events = anthropic_events(r.iter_lines())
    assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
    (start,) = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert start.content_block.name == "Bash"
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert isinstance(json.loads(partial)["command"], str)
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "tool_use"


def test_prompt_caching_usage_reports_what_the_cache_did(agent_server, claude):
    body = {"system": "Session 7. " + SYSTEM, "max_tokens": 2}  # a prefix no other test sent
    first = create(claude, **body)
    u = first.usage
    assert u.cache_read_input_tokens < 8 and u.cache_creation_input_tokens == u.input_tokens > 100
    second = create(claude, **body)
    u2 = second.usage
    assert u2.cache_read_input_tokens >= u.input_tokens - 1
    assert u2.cache_creation_input_tokens == u2.input_tokens <= 1


# ---- Responses: what Codex sends ----

def codex_body(**kw) -> dict:
    body = {"model": "gpt-5-codex", "stream": True, "store": False, "temperature": 0,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run ls."}]}],
            "tools": [EXEC, NAMESPACE, PATCH, DIGITS, *HOSTED], "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
            "client_metadata": {"session_id": "thread-1"}, "max_output_tokens": 4}
    return {**body, **kw}


def stream_response(server, body: dict) -> list:
    with httpx.stream("POST", server.base_url + "/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [OPENAI_EVENTS.validate_python(json.loads(line[6:]))
                for line in r.iter_lines() if line.startswith("data: ")]


def completed(events):
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete") and last.response.id
    return last.response


def test_codex_first_request_is_answered(agent_server):
    """Namespace, custom and hosted tools, developer messages and Codex's bookkeeping fields."""
    events = stream_response(agent_server, codex_body())
    assert events[0].type == "response.created"
    response = completed(events)
    assert response.usage.input_tokens > 0 and response.usage.input_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("tool_choice, item_type, check", [
    ({"type": "function", "name": "spawn_agent"}, "function_call",
     lambda item: item.namespace == "multi_agent_v1" and "task" in json.loads(item.arguments)),
    ({"type": "custom", "name": "dial"}, "custom_tool_call",
     lambda item: re.fullmatch("[0-9]{3}-[0-9]{4}", item.input)),
    ({"type": "function", "name": "exec_command"}, "function_call",
     lambda item: getattr(item, "namespace", None) is None and "cmd" in json.loads(item.arguments)),
])
def test_forced_calls_come_back_in_codex_form(agent_server, tool_choice, item_type, check):
    events = stream_response(agent_server, codex_body(tool_choice=tool_choice, max_output_tokens=120,
                                                      parallel_tool_calls=False))
    response = completed(events)
    calls = [item for item in response.output if item.type == item_type]
    assert calls and check(calls[0]), response.output
    done = [e for e in events if e.type == "response.output_item.done" and e.item.type == item_type]
    assert done and done[0].item.call_id == calls[0].call_id


def test_codex_later_turns_replay_calls_and_outputs(agent_server):
    turn = codex_body()["input"] + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": "{\"task\": \"look\"}", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "started"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch", "status": "completed"},
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_2", "output": "Done!"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now test it."}]}]
    response = completed(stream_response(agent_server, codex_body(input=turn)))
    assert response.usage.input_tokens > 0


def test_hosted_tool_choice_is_refused(agent_server):
    r = httpx.post(agent_server.base_url + "/responses", timeout=60,
                   json=codex_body(stream=False, tool_choice={"type": "web_search"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_long_prefill_keeps_the_stream_alive(agent_server, monkeypatch):
    """Agents give up on a silent stream (Claude Code fell back to a second, non-streamed request
    after minutes of prefill): while no token has come, the stream sends keep-alive events."""
    import asyncio

    from mlxserve.api import sse

    monkeypatch.setattr(sse, "HEARTBEAT_S", 0.05)
    engine = agent_server.engine
    submit = engine.submit

    def slow_submit(request):
        stream = submit(request)

        async def delayed():
            await asyncio.sleep(0.5)
            async for out in stream:
                yield out
        return delayed()

    monkeypatch.setattr(engine, "submit", slow_submit)
    with httpx.stream("POST", agent_server.url + "/v1/messages", json={**messages_body(), "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: ")]
    assert events.count("ping") >= 4 and events[-1] == "message_stop"
    events = stream_response(agent_server, codex_body())
    assert sum(e.type == "response.in_progress" for e in events) >= 4 and events[-1].response.id


def test_a_tool_added_mid_session_keeps_the_cached_prefix(agent_server, claude):
    """Claude Code loads deferred tools mid-session (12 tools, then 21, inserted among the
    others): within a session (metadata.user_id) tools keep the order first sent, so the system
    prompt and the known tools stay a cached prefix; without one, tools render as sent."""
    def tool(name):
        return {"name": name, "description": f"The {name} tool. " * 20,
                "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}

    first, later = [tool("Agent"), tool("Bash"), tool("Write")], [tool("Agent"), tool("Bash"), tool("Cron"), tool("Write")]
    turn = [{"role": "user", "content": "Schedule a job. " * 30}]

    def cached(tools, user_id):
        body = {"system": "Session %s. " % user_id + SYSTEM, "tools": tools, "max_tokens": 1, "messages": turn}
        if user_id:
            body["metadata"] = {"user_id": user_id}
        return create(claude, **body).usage.cache_read_input_tokens

    cached(first, "s-1"), cached(first, None)  # the first requests of two sessions
    with_session, without = cached(later, "s-1"), cached(later, None)
    # A session keeps Agent, Bash, Write (and so all but Cron's definition and the turn) cached;
    # as sent, the prefix ends where Cron was inserted, before Write.
    assert with_session > without + 100
