"""Reasoning split from the answer: think tags, harmony channels, and the routes' reasoning fields.

The tiny models share Qwen2.5's tokenizer, which has no think tags. Qwen3's
tokenizer is Qwen2.5's with `<tool_response>`, `</tool_response>`, `<think>` and
`</think>` added at ids 151665-151668, where the embedded GGUF vocabulary holds
padding tokens; `think_tokenizer` builds it that way, with a Qwen3-style template
(the model opens `<think>` itself; `enable_thinking: false` writes an empty block)
or a Qwen3.5/DeepSeek-R1-style one (the generation prompt ends with `<think>`).
A harmony tokenizer is built the same way, its markers as special tokens.
Random weights write no reasoning of their own, so live tests restrict the
output to a few tokens with `logit_bias` and compare with the raw completion.
"""

import asyncio
import json
from dataclasses import replace

import anthropic
import httpx
import openai
import pytest

from mlxserve.api.anthropic_routes import message_events, response_content
from mlxserve.api.generate import Choice
from mlxserve.api.openai_routes import ToolCalls, chat_events
from mlxserve.api.reasoning import detect, split
from mlxserve.api.tool_calls import tool_syntax
from mlxserve.engine.detokenize import IncrementalDetokenizer
from mlxserve.engine.request import RequestOutput
from mlxserve.models.chat import render_chat
from tests.conftest import LiveServer

THINK, END = 151667, 151668
CHATML = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    # Qwen3's templates drop the reasoning of past turns.
    "{{- '<|im_start|>assistant\\n' + (m.content or '').split('</think>')[-1].lstrip('\\n') }}"
    "{%- for tool_call in m.tool_calls or [] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\"}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
QWEN3 = CHATML + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
QWEN35 = CHATML + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")
HARMONY = (
    "{%- if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}"
    "<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]


def build_tokenizer(folder, template, added: dict[int, str], special: bool):
    """The default tokenizer with padding tokens renamed to `added`, and `template`."""
    from mlx_lm.utils import load_tokenizer

    from mlxserve.models.embedded import default_tokenizer_dir

    src = default_tokenizer_dir()
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for token_id, text in added.items():
        del vocab[f"[PAD{token_id}]"]
        vocab[text] = token_id
        tok["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": special})
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(folder)


QWEN3_ADDED = {151665: "<tool_response>", 151666: "</tool_response>", THINK: "<think>", END: "</think>"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "qwen3", QWEN3, QWEN3_ADDED, False)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "qwen35", QWEN35, QWEN3_ADDED, False)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    added = {151665 + k: t for k, t in enumerate(HARMONY_TOKENS)}
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "harmony", HARMONY, added, True)


def outputs(tokenizer, text, finish="stop"):
    """The engine's stream for `text`: one output per token, decoded as the engine does
    (special tokens left out), the last one finished."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    outs = [RequestOutput("r", [t], detok.add([t])) for t in ids]
    outs[-1].new_text += detok.flush()
    outs[-1].finish_reason = finish
    return outs


def feed_all(splitter, outs):
    parts = [splitter.feed(o.new_text, o.new_token_ids, o.finished) for o in outs]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def pieces(text, size):
    return [text[k:k + size] for k in range(0, len(text), size)]


# ---- detection ----

def test_detect(qwen3, harmony, tiny):
    think = detect(qwen3)
    assert (think.kind, think.start, think.end, think.special_ids) == ("think", "<think>", "</think>", {})
    h = detect(harmony)
    assert h.kind == "harmony" and set(h.special_ids.values()) == set(HARMONY_TOKENS)
    assert detect(tiny("qwen3-tiny").tokenizer) is None  # Qwen2.5's tokenizer: no reasoning


def test_prompt_tail_decides_the_start(qwen3, qwen35):
    messages = [{"role": "user", "content": "Hi"}]
    on = render_chat(qwen35, messages)
    off = render_chat(qwen35, messages, chat_template_kwargs={"enable_thinking": False})
    assert detect(qwen35).opens_in_prompt(on) and not detect(qwen35).opens_in_prompt(off)
    assert not detect(qwen3).opens_in_prompt(render_chat(qwen3, messages))  # the model opens it


# ---- the splitter ----

ANSWER = "<think>\nThe user greets. 2 < 3, and </thin is not the tag.\n</think>\n\nHello! <b>Hi</b>"
REASONING, CONTENT = "The user greets. 2 < 3, and </thin is not the tag.", "Hello! <b>Hi</b>"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_think_tags_split_across_pieces(qwen3, size):
    """However the text is cut, the same split: no piece of a tag leaks into either part."""
    splitter = detect(qwen3).splitter()
    parts = [splitter.feed(p) for p in pieces(ANSWER, size)] + [splitter.feed("", finished=True)]
    assert "".join(r for r, _ in parts) == REASONING
    assert "".join(c for _, c in parts) == CONTENT


def test_tag_held_until_decided(qwen3):
    splitter = detect(qwen3).splitter()
    assert splitter.feed("<thi") == ("", "")  # could be the start tag
    assert splitter.feed("nk>Plan") == ("Plan", "")
    assert splitter.feed(" more </th") == (" more", "")  # the space waits: it may end the reasoning
    assert splitter.feed("ink>\n\nDone") == ("", "Done")


def test_prompt_opened_reasoning(qwen35):
    """The template wrote `<think>`: the answer starts inside the reasoning, only `</think>` comes."""
    prompt = render_chat(qwen35, [{"role": "user", "content": "Hi"}])
    outs = outputs(qwen35, "Let me think.\n</think>\n\nHello.")
    assert feed_all(detect(qwen35).splitter(prompt), outs) == ("Let me think.", "Hello.")


def test_cut_before_the_end_tag_is_all_reasoning(qwen35):
    prompt = render_chat(qwen35, [{"role": "user", "content": "Hi"}])
    outs = outputs(qwen35, "Step one, then step two </th", finish="length")
    assert feed_all(detect(qwen35).splitter(prompt), outs) == ("Step one, then step two </th", "")


def test_no_reasoning_is_unchanged(qwen3, qwen35):
    """Thinking off (an empty block in the prompt), or an answer without tags: content as is."""
    off = render_chat(qwen35, [{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
    text = "  Hello <thinking> is a word\n"
    assert feed_all(detect(qwen35).splitter(off), outputs(qwen35, text)) == ("", text)
    assert split(detect(qwen3), text) == (None, text)
    assert split(None, ANSWER) == (None, ANSWER)  # a model without reasoning syntax


HARMONY_ANSWER = ("<|channel|>analysis<|message|>User says hi. Reply briefly.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")


def test_harmony_channels_from_token_ids(harmony):
    """The markers are special tokens, left out of the engine's text; the splitter puts them back by id."""
    outs = outputs(harmony, HARMONY_ANSWER)
    assert "<|channel|>" not in "".join(o.new_text for o in outs)
    assert feed_all(detect(harmony).splitter(), outs) == ("User says hi. Reply briefly.", "Hello there!")


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_harmony_channels_in_text(harmony, size):
    splitter = detect(harmony).splitter()
    parts = [splitter.feed(p) for p in pieces(HARMONY_ANSWER, size)] + [splitter.feed("", finished=True)]
    assert "".join(r for r, _ in parts) == "User says hi. Reply briefly."
    assert "".join(c for _, c in parts) == "Hello there!"


# ---- the routes' messages and streams (fake outputs) ----

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
WITH_CALL = ('<think>\nThe user wants weather. I could write <tool_call> here.\n</think>\n\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def choice_of(outs):
    c = Choice()
    for o in outs:
        c.add(o)
    return c


def test_openai_message_reasoning_and_calls(qwen3):
    """Calls are read from the answer only: markup inside the reasoning is no call."""
    calls = ToolCalls(tool_syntax(qwen3), TOOLS, detect(qwen3), render_chat(qwen3, [{"role": "user", "content": "?"}]))
    assert tool_syntax(qwen3) is not None
    out = calls.message(choice_of(outputs(qwen3, WITH_CALL)))
    message = out["message"]
    assert message["reasoning_content"] == message["reasoning"] == \
        "The user wants weather. I could write <tool_call> here."
    assert message["content"] is None and out["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = ToolCalls(tool_syntax(qwen3), None, detect(qwen3)).message(choice_of(outputs(qwen3, "Hi there")))
    assert plain["message"]["content"] == "Hi there" and plain["message"]["reasoning_content"] is None


class Replay:
    def __init__(self, outs):
        self.outs = outs

    async def __aiter__(self):
        for out in self.outs:
            yield 0, out

    def close(self):
        pass


def drain(agen):
    async def run():
        return [e async for e in agen]
    events = asyncio.run(run())
    return [json.loads(line[6:]) for e in events for line in e.decode().split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_openai_stream_reasoning_deltas(qwen3):
    calls = ToolCalls(tool_syntax(qwen3), TOOLS, detect(qwen3), ())
    head = {"id": "chatcmpl-x", "created": 0, "model": "m", "system_fingerprint": "f"}
    data = drain(chat_events(None, Replay(outputs(qwen3, WITH_CALL)), head, 1, False, False, calls))
    deltas = [d["choices"][0]["delta"] for d in data]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "The user wants weather. I could write <tool_call> here."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == ""
    first_reasoning = next(k for k, d in enumerate(deltas) if d.get("reasoning_content"))
    first_call = next(k for k, d in enumerate(deltas) if d.get("tool_calls"))
    assert first_reasoning < first_call
    assert data[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_anthropic_thinking_blocks(qwen3):
    splitter = detect(qwen3).splitter()
    content, called = response_content(choice_of(outputs(qwen3, ANSWER)), None, None, splitter)
    assert not called
    thinking, text = content
    assert thinking["type"] == "thinking" and thinking["thinking"] == REASONING and thinking["signature"]
    assert text == {"type": "text", "text": CONTENT}


def test_anthropic_stream_thinking_then_text(qwen3):
    head = {"id": "msg_x", "type": "message", "role": "assistant", "model": "m"}
    data = drain(message_events(Replay(outputs(qwen3, ANSWER)), head, 10, None, detect(qwen3).splitter()))
    kinds = [(d["type"], d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type"))
             for d in data if d["type"].startswith("content_block")]
    blocks = [k for k in kinds if k[2] != "thinking_delta" and k[2] != "text_delta"]
    assert blocks == [("content_block_start", 0, "thinking"), ("content_block_delta", 0, "signature_delta"),
                      ("content_block_stop", 0, None), ("content_block_start", 1, "text"),
                      ("content_block_stop", 1, None)]
    assert "".join(d["delta"].get("thinking", "") for d in data if d["type"] == "content_block_delta") \
        == REASONING
    assert "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta") == CONTENT


# ---- live: a Qwen3.5-style tokenizer on the tiny model ----

@pytest.fixture(scope="module")
def think_server(tiny, qwen35):
    from mlxserve.config import EngineConfig

    live = LiveServer(replace(tiny("qwen3-tiny"), tokenizer=qwen35), EngineConfig(max_num_seqs=4))
    yield live
    live.close()


def restricted(tokenizer):
    """logit_bias that keeps the random model to "a", " b" and `</think>`.

    The tiny model's logits are peaked (`</think>` 11-25 below the top), so the
    end tag gets a head start: it writes `</think>` and "a b".
    """
    a, b = tokenizer.encode("a")[0], tokenizer.encode(" b")[0]
    return {str(a): 88, str(b): 88, str(END): 100}


def test_live_chat_reasoning_matches_raw_completion(think_server, qwen35):
    """The same tokens through /v1/completions (raw) and chat: reasoning + `</think>` + answer."""
    messages = [{"role": "user", "content": "Hi"}]
    # Greedy over " s" and `</think>` 25 below it: the random model never writes " s" twice in a
    # row (38 below `</think>` after one) and is 6-15 above it after `</think>` (measured: every
    # step's choice wins by 6 or more), so " s" is the reasoning, then " s</think>" repeats.
    s = qwen35.encode(" s")[0]
    fields = {"max_tokens": 12, "temperature": 0, "logit_bias": {str(s): 100, str(END): 75}}
    prompt = render_chat(qwen35, messages)
    raw = httpx.post(think_server.base_url + "/completions",
                     json={"prompt": prompt, **fields}, timeout=60).json()["choices"][0]["text"]
    reasoning, answer = raw.split("</think>", 1)
    assert reasoning.strip() and answer.strip(), raw  # both parts to check
    client = openai.OpenAI(base_url=think_server.base_url, api_key="x")
    message = client.chat.completions.create(model="qwen3-tiny", messages=messages, extra_body=fields
                                             ).choices[0].message
    assert message.reasoning_content == (reasoning.strip() or None)
    assert message.content == answer.lstrip()
    stream = client.chat.completions.create(model="qwen3-tiny", messages=messages, stream=True,
                                            extra_body=fields)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning.strip())
    assert "".join(d.content or "" for d in deltas) == answer.lstrip()


def test_live_thinking_off_is_unchanged(think_server, qwen35):
    messages = [{"role": "user", "content": "Hi"}]
    fields = {"max_tokens": 12, "seed": 0, "logit_bias": restricted(qwen35)}
    off = {"enable_thinking": False}
    prompt = render_chat(qwen35, messages, chat_template_kwargs=off)
    raw = httpx.post(think_server.base_url + "/completions",
                     json={"prompt": prompt, **fields}, timeout=60).json()["choices"][0]["text"]
    body = {"messages": messages, **fields, "chat_template_kwargs": off}
    message = httpx.post(think_server.base_url + "/chat/completions", json=body,
                         timeout=60).json()["choices"][0]["message"]
    assert "</think>" in raw and message["reasoning_content"] is None and message["content"] == raw


def cached_tokens(live) -> float:
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    return float(next(line.split()[1] for line in metrics.splitlines()
                      if line.startswith("mlxserve_cached_prompt_tokens_total")))


def test_live_anthropic_budget_ends_the_reasoning(think_server):
    """The random model never closes its reasoning: it is cut at budget_tokens, then answered."""
    client = anthropic.Anthropic(base_url=think_server.url, api_key="x")
    kwargs = dict(model="qwen3-tiny", max_tokens=1040, messages=[{"role": "user", "content": "Hi"}],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    before = cached_tokens(think_server)
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    # The answer's prompt (prompt + reasoning + `</think>`) came from the prefix cache, all but
    # the end tag and the last reasoning token (sampled, never run through the model).
    assert cached_tokens(think_server) - before >= msg.usage.input_tokens + 1023
    assert msg.content[0].thinking and msg.content[0].signature
    # 1024 tokens of reasoning, then the answer's (up to 16): both count as output.
    assert 1024 < msg.usage.output_tokens <= 1040 and msg.stop_reason == "max_tokens"
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream if e.type.startswith("content_block")]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == msg.content[0].thinking  # greedy: the same tokens
    assert events[0] == "content_block_start" and events.count("content_block_stop") == 2


def test_live_disabled_thinking_has_no_blocks(think_server):
    client = anthropic.Anthropic(base_url=think_server.url, api_key="x")
    msg = client.messages.create(model="qwen3-tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                 thinking={"type": "disabled"})
    assert [b.type for b in msg.content] == ["text"]


# ---- live: validation (the shared server; its model does not reason) ----

def test_reasoning_effort_validated_and_model_without_reasoning_unchanged(server):
    url = server.base_url + "/chat/completions"
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 0}
    r = httpx.post(url, json={**base, "reasoning_effort": "extreme"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    plain = httpx.post(url, json=base, timeout=60).json()["choices"][0]["message"]
    assert "reasoning_content" not in plain and "reasoning" not in plain
    effort = httpx.post(url, json={**base, "reasoning_effort": "low"}, timeout=60).json()
    assert effort["choices"][0]["message"]["content"] == plain["content"]


@pytest.mark.parametrize("thinking, max_tokens, param", [
    ({"type": "enabled", "budget_tokens": 512}, 2048, "budget_tokens"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "max_tokens"),
    ({"type": "enabled"}, 2048, "budget_tokens"),
    ({"type": "sometimes"}, 2048, "thinking.type"),
    ("yes", 2048, "thinking.type"),
])
def test_anthropic_thinking_validated(server, thinking, max_tokens, param):
    r = httpx.post(server.url + "/v1/messages", json={
        "model": "qwen3-tiny", "max_tokens": max_tokens, "thinking": thinking,
        "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param.split(".")[-1] in body["error"]["message"]


def test_anthropic_past_thinking_blocks_accepted(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x")
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "They greet.", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Hello."}]},
                {"role": "user", "content": "Again"}]
    with_thinking = client.messages.count_tokens(model="qwen3-tiny", messages=messages).input_tokens
    messages[1]["content"] = messages[1]["content"][2:]
    assert client.messages.count_tokens(model="qwen3-tiny", messages=messages).input_tokens == with_thinking
    msg = client.messages.create(model="qwen3-tiny", max_tokens=4, messages=messages,
                                 thinking={"type": "disabled"})
    assert msg.content[0].type == "text"


def test_live_responses_reasoning_item(think_server):
    """The Responses API puts the reasoning in a `reasoning` item before the message, streamed or not."""
    client = openai.OpenAI(base_url=think_server.base_url, api_key="x")
    chat = client.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0).choices[0].message
    assert chat.reasoning_content  # the template opened <think>: the output starts as reasoning
    r = client.responses.create(model="qwen3-tiny", input="Hi", max_output_tokens=8, temperature=0)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.reasoning_content and r.output_text == (chat.content or "")
    events = list(client.responses.create(model="qwen3-tiny", input="Hi", max_output_tokens=8, temperature=0,
                                          stream=True))
    final = events[-1].response  # response.incomplete: cut at max_output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == chat.reasoning_content == final.output[0].content[0].text
