"""Constrained decoding: JSON schemas, forced tool calls, vLLM's guided_* fields.

The tiny model has random weights, so without a grammar it writes noise; every
output here must still parse and match its schema, because the grammar masks
every token that would break it. Schemas bound their strings and numbers so a
random model finishes inside max_tokens.
"""

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_json_schema_holds_for_every_seed_streamed_or_not(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=seed,
                                           response_format=PERSON_FORMAT)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=9,
                                            response_format=PERSON_FORMAT, stream=True)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3  # token by token, not one buffered piece
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_json_object_and_guided_fields(server, client):
    # Any object will do; a bias towards "{}" makes the random model finish one (it is
    # one token, which the grammar allows only as a whole object).
    (empty,) = server.state.tokenizer.encode("{}")
    bias = {str(empty): 100}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, seed=1,
                                       response_format={"type": "json_object"}, logit_bias=bias)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=4,
                                       extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe so"}
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, n=2,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert all(len(c.text) == 6 and c.text[:3].isdigit() and c.text[3] == "-" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=20,
                                  extra_body={"guided_grammar": 'start: "ok " NUM\nNUM: /[1-9]/'})
    assert r.choices[0].text[:3] == "ok " and r.choices[0].text[3] in "123456789"
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "hi" | "ho"'})  # GBNF
    assert r.choices[0].text in ("hi", "ho")
    r = client.completions.create(model=MODEL, prompt="Person:", max_tokens=80, seed=3,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_forced_tool_calls_always_parse(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, seed=seed,
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert r.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, seed=5,
                                            tools=TOOLS, tool_choice=named, stream=True)
    calls, finish = [], None
    for c in chunks:
        calls += c.choices[0].delta.tool_calls or []
        finish = c.choices[0].finish_reason or finish
    assert [c.function.name for c in calls] == ["get_time"] and finish == "tool_calls"
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_anthropic_tool_choice_and_output_format(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    m = client.messages.create(model=MODEL, max_tokens=120, messages=MESSAGES, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"] and m.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])
    with client.messages.stream(model=MODEL, max_tokens=120, messages=MESSAGES, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        final = s.get_final_message()
    (use,) = final.content  # the tool_use block alone: no empty text block before it
    assert use.type == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 80, "messages": MESSAGES,
        "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), PERSON)


def test_constrained_and_free_rows_share_a_batch(server, client, aclient):
    """A free greedy request gives the same tokens beside constrained ones as alone; the
    constrained ones, which start first and move from the lone path into the batch, stay valid."""
    free = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24,
                temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content

    async def mixed():
        constrained = [asyncio.create_task(aclient.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=80, seed=s, response_format=PERSON_FORMAT))
            for s in range(3)]
        await asyncio.sleep(0.05)
        frees = [asyncio.create_task(aclient.chat.completions.create(**free)) for _ in range(2)]
        return await asyncio.gather(*constrained), await asyncio.gather(*frees)

    constrained, frees = asyncio.run(mixed())
    assert [f.choices[0].message.content for f in frees] == [alone, alone]
    for r in constrained:
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # Seeded constrained sampling is the same alone as it was in the batch.
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=1,
                                           response_format=PERSON_FORMAT)
    assert again.choices[0].message.content == constrained[1].choices[0].message.content
    # The prefix cache stays on for constrained requests.
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_json": {"type": "color"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3},
                                                                 "strict": True}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_bad_constraints_are_400s(server, extra, param):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("parser", ["json_tools", "qwen3_coder", None])
def test_forced_call_grammars_parse_in_each_call_format(tiny, parser):
    """Any token path the grammar allows is a call mlx-lm's parser reads and the schema accepts:
    random walks through the masks, for Hermes/Qwen2.5 JSON markup, Qwen3.5's XML markup and bare JSON."""
    import importlib
    import random

    import numpy as np
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from mlxserve.api.constraints import Grammars, tool_call_grammar
    from mlxserve.api.tool_calls import ToolSyntax, split_text

    loaded = tiny("qwen3-tiny")
    syntax = None
    if parser:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
        syntax = ToolSyntax(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size)
    grammar = tool_call_grammar(grammars, syntax, TOOLS, several=True)
    eos = sorted(loaded.tokenizer.eos_token_ids)
    if parser == "json_tools":  # the newline models write after a call may end the calls
        matcher = LLMatcher(grammars.llg_tokenizer(), grammar, log_level=0)
        one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
        assert matcher.consume_tokens(loaded.tokenizer.encode(one)) and matcher.is_accepting()
    rng = random.Random(0)
    mask = allocate_token_bitmask(1, loaded.vocab_size)
    for _ in range(6):
        matcher, out = LLMatcher(grammars.llg_tokenizer(), grammar, log_level=0), []
        while not matcher.is_stopped() and len(out) < 400:
            fill_next_token_bitmask(matcher, mask)
            allowed = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:loaded.vocab_size])[0]
            if matcher.is_accepting() and rng.random() < 0.5:
                break
            token = int(rng.choice([t for t in allowed if t not in eos]))
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
        if len(out) == 400:
            continue  # a long free-text value: cut, as max_tokens would
        text = loaded.tokenizer.decode(out)
        rest, calls = split_text(syntax, text, TOOLS)
        assert calls and not rest, text
        for call in calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
