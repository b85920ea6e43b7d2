"""A heavy request never stalls the others: prompts are rendered and tokenized off the event
loop, and a prompt whose length alone proves it cannot fit is refused before tokenizing."""

import json
import threading

import httpx
import openai
import pytest

from mlxserve.models import chat

BIG = 100_000  # characters: texts longer than this are the "heavy" prompts below


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def encodes(monkeypatch):
    """(thread name, characters) of each big text the prefix encoder tokenizes; a test may set
    `hold` to keep big encodes waiting until it is set again."""
    seen, entered, hold = [], threading.Event(), threading.Event()
    hold.set()
    original = chat.PrefixEncoder.encode

    def encode(self, text, *args):
        if len(text) > BIG:
            seen.append((threading.current_thread().name, len(text)))
            entered.set()
            hold.wait(60)
        return original(self, text, *args)

    monkeypatch.setattr(chat.PrefixEncoder, "encode", encode)
    return seen, entered, hold


def test_a_prompt_that_cannot_fit_by_its_length_is_refused_before_tokenizing(server, http, encodes):
    limit = server.state.engine.max_model_len
    text = "All work and no play. " * (limit * 130 // 22)  # more bytes than `limit` tokens can hold
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text}),
                       ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": text}]}),
                       ("/v1/responses", {"input": text})]:
        r = http.post(path, json={"model": server.state.model_name, **body})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert "at least" in error["message"] and f"{limit} tokens" in error["message"]
        if path != "/v1/messages":  # Anthropic's errors carry no code
            assert error["code"] == "context_length_exceeded"
    assert encodes[0] == []  # not one of them was tokenized


def test_streams_go_on_while_a_big_prompt_is_tokenized(server, http, encodes):
    seen, entered, hold = encodes
    hold.clear()  # the big prompt's tokenizing waits until the streams are done
    big = {"model": server.state.model_name, "max_tokens": 4,
           "messages": [{"role": "user", "content": "A long read. " * (2 * BIG // 13)}]}
    answer = {}
    poster = threading.Thread(target=lambda: answer.update(r=http.post("/v1/chat/completions", json=big)))
    poster.start()
    try:
        assert entered.wait(30)
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=20)
        for _ in range(2):  # on the event loop, this would wait for the big prompt's tokens
            stream = client.chat.completions.create(
                model=server.state.model_name, messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8, stream=True, extra_body={"ignore_eos": True})
            chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
            assert len(chunks) >= 1
        assert poster.is_alive()  # still tokenizing
    finally:
        hold.set()
        poster.join(60)
    # Tokenized on the prompt worker, then found too long for the tiny model's context.
    assert seen and seen[0][0].startswith("mlxserve-prompts")
    assert answer["r"].status_code == 400 and answer["r"].json()["error"]["code"] == "context_length_exceeded"


def test_bench_stall_measures_the_gaps_around_a_big_prompt(server, tmp_path):
    """`mlxserve bench stall` against a live server: the streams' gaps before and while a big
    prompt is served, and that prompt's answer."""
    import argparse

    from mlxserve.bench import stall

    parser = argparse.ArgumentParser()
    stall.add_parser(parser.add_subparsers())
    args = parser.parse_args(["stall", "--url", server.base_url, "--streams", "2", "--max-tokens", "48",
                              "--big-mb", "0.6", "--lead", "0.5", "--out-dir", str(tmp_path)])
    args.func(args)  # exit status: the verdict, which a shared 2-core machine may fail
    (md,) = tmp_path.glob("stall-*.md")
    (js,) = tmp_path.glob("stall-*.json")
    result = json.loads(js.read_text())["results"]
    assert result["big_status"] == 400 and result["big_code"] == "context_length_exceeded"
    assert result["gaps_before"] > 0 and result["median_gap_ms"] > 0 and "largest gap" in md.read_text()
