"""Recorded sessions of the real harnesses (tests/agents/*.json: Claude Code on /v1/messages,
Codex CLI on /v1/responses, their prose replaced by filler of the same token length) replayed
against a live server: every request is answered (200), its stream parses as the official SDK's
event types in the order the harnesses read, and each turn reads from the prefix cache what it
shares with the turn before.

qwen3-tiny (random weights) stands in for the model: the prompts are the harnesses' own, token
for token (the default tokenizer's), and its answers are cut after a few tokens.
"""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from mlxserve.bench.agent import capped, prompt_tokens
from mlxserve.config import EngineConfig
from mlxserve.models.chat import common_prefix_length

MODEL = "qwen3-tiny"
FIXTURES = sorted((Path(__file__).parent / "agents").glob("*.json"))
ANTHROPIC_EVENTS = TypeAdapter(RawMessageStreamEvent)
OPENAI_EVENTS = TypeAdapter(ResponseStreamEvent)
OUTPUT_TOKENS = 4


@pytest.fixture(scope="module")
def replay_server(tiny):
    from conftest import LiveServer

    live = LiveServer(tiny(MODEL), EngineConfig(max_model_len=40960, max_num_seqs=4, max_queue=16))
    live.pool.add_alias("*", MODEL)  # the harnesses' own model names
    yield live
    live.close()


def test_the_fixtures_are_there():
    names = {json.loads(f.read_text())["harness"].split()[0] for f in FIXTURES}
    assert {"claude-code", "codex"} <= names


def events_of(path: str, response: httpx.Response) -> list:
    """The stream's events as the SDK's types; Anthropic's pings are skipped, as its SDK does."""
    data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    if path.startswith("/v1/messages"):
        return [ANTHROPIC_EVENTS.validate_python(d) for d in data if d["type"] != "ping"]
    return [OPENAI_EVENTS.validate_python(d) for d in data]


def usage(path: str, events: list) -> tuple[int, int]:
    """(prompt tokens, cached tokens) from a stream's last usage."""
    if path.startswith("/v1/messages"):
        start = events[0]
        assert start.type == "message_start" and events[-1].type == "message_stop"
        (delta,) = [e for e in events if e.type == "message_delta"]
        assert delta.delta.stop_reason in ("max_tokens", "end_turn", "tool_use")
        u = delta.usage
        return u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens
    assert events[0].type == "response.created"
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete") and last.response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    u = last.response.usage
    return u.input_tokens, u.input_tokens_details.cached_tokens


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.stem)
def test_a_recorded_session_replays(replay_server, fixture):
    session = json.loads(fixture.read_text())
    previous = None
    for i, request in enumerate(session["requests"]):
        path, body = request["path"], capped(request["path"], request["body"], OUTPUT_TOKENS)
        prompt = asyncio.run(prompt_tokens(replay_server.state.default, path, body))
        url = replay_server.url + path + (f"?{request['query']}" if request["query"] else "")
        if body.get("stream"):
            with httpx.stream("POST", url, json=body, timeout=300) as r:
                assert r.status_code == 200, (i, r.read())
                total, cached = usage(path, events_of(path, r))
        else:
            r = httpx.post(url, json=body, timeout=300)
            assert r.status_code == 200, (i, r.text)
            u = r.json()["usage"]
            total, cached = (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]) \
                if path.startswith("/v1/messages") else (u["input_tokens"], u["input_tokens_details"]["cached_tokens"])
        assert total == len(prompt), (i, total, len(prompt))
        if previous is not None:
            possible = common_prefix_length(previous, prompt)
            assert cached >= 0.9 * possible, (i, cached, possible)
        previous = prompt


def test_agent_prompts_are_encoded_from_where_they_part(tiny):
    """Each turn's prompt is encoded from where it parts from the last one (at a special token),
    and the ids are exactly those of encoding its whole text."""
    from mlxserve.bench.agent import tokenizer_state
    from mlxserve.models.chat import MIN_REUSE, PrefixEncoder, encoder_of

    tokenizer = tiny(MODEL).tokenizer
    hf = tokenizer._tokenizer
    state = tokenizer_state(tokenizer)
    encoder = encoder_of(tokenizer)
    encoder.recent.clear()
    calls = []
    fast = encoder.fast

    class Counting:  # the characters the Rust tokenizer is asked to encode
        def encode_batch(self, texts, **kw):
            calls.extend(len(t) for t in texts)
            return fast.encode_batch(texts, **kw)

    encoder.fast = Counting()
    try:
        for fixture in FIXTURES:
            for request in json.loads(fixture.read_text())["requests"]:
                asyncio.run(prompt_tokens(state, request["path"], request["body"]))
    finally:
        encoder.fast = fast
    texts = list(encoder.recent)
    assert len(texts) >= 6 and all(encoder.recent[t][0] == hf.encode(t, add_special_tokens=False) for t in texts)
    assert sum(calls) < 0.5 * sum(len(t) for t in texts)  # later turns encode their new part only

    # Texts that part inside a segment, at a special token, and before any cut point.
    fresh = PrefixEncoder(hf)
    head = "<|im_start|>system\n" + "All work and no play. " * 300 + "<|im_end|>\n"
    variants = [head + "<|im_start|>user\nhello there<|im_end|>\n",
                head + "<|im_start|>user\nhello therefore<|im_end|>\n<|im_start|>assistant\n",
                head + "<|im_start|>user\nhello<|im_end|>",
                head[:MIN_REUSE // 2] + "changed early " + head,
                "no special tokens at all " * 400,
                # characters past ASCII: cuts are in characters, not bytes
                "<|im_start|>system\n" + "Grüße, 世界 ✓ " * 400 + "<|im_end|>\n<|im_start|>user\nnä<|im_end|>\n",
                "<|im_start|>system\n" + "Grüße, 世界 ✓ " * 400 + "<|im_end|>\n<|im_start|>user\nnämlich<|im_end|>\n"]
    for text in variants:
        assert fresh.encode(text) == hf.encode(text, add_special_tokens=False)
