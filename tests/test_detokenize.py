"""Streaming text: never half a character, pieces add up to the whole, stop strings trimmed."""

import asyncio

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.detokenize import IncrementalDetokenizer, StopStringMatcher
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams

TEXTS = [
    "Hello, world! The café serves crème brûlée.",
    "Emoji: 🌍🚀👩‍👩‍👧 and CJK: 世界你好, Ελληνικά, עברית.",
    "def f(x):\n    return x ** 2  # ∑ ≤ ∞\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny("qwen3-tiny").tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_whole_characters_and_add_up(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    # An emoji spans several byte-level tokens: some pieces must have been held back.
    if "🌍" in text:
        assert any(p == "" for p in pieces[:-1])


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("a🌍")
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add([t]) for t in ids[:-1])
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids[:-1])


def test_stop_string_across_pieces_is_trimmed():
    m = StopStringMatcher(["STOP", "\n\n"])
    out = []
    for piece in ["Hello S", "T", "x then ST", "O", "P and more"]:
        text, found = m.feed(piece)
        out.append(text)
        if found:
            break
    assert "".join(out) == "Hello STx then "
    assert found == "STOP"


def test_held_back_text_is_released_when_it_is_no_stop():
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", None)
    assert m.feed("x") == ("</ex", None)
    assert m.feed("</en") == ("", None)
    assert m.flush() == "</en"


def test_engine_trims_a_stop_string_spanning_tokens(tiny):
    loaded = tiny("qwen3-tiny")
    tok = loaded.tokenizer
    engine = AsyncEngine(loaded, EngineConfig()).start()
    prompt = tok.encode("Once upon a time")
    try:
        async def run(params):
            steps = [s async for s in engine.submit(Request(prompt, params))]
            return "".join(s.new_text for s in steps), [t for s in steps for t in s.new_token_ids], steps[-1]

        full, ids, _ = asyncio.run(run(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
        # A stop string made of the last 2 characters of one token and the first 2 of the next.
        k = next(k for k in range(1, len(ids) - 1)
                 if len(tok.decode(ids[k - 1:k]).strip()) >= 2 and len(tok.decode(ids[k:k + 1]).strip()) >= 2
                 and full.startswith(tok.decode(ids[:k])) and not tok.decode(ids[:k]).endswith(" "))
        boundary = len(tok.decode(ids[:k]))
        stop = full[boundary - 2: boundary + 2]
        text, _, last = asyncio.run(run(SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])))
        assert last.finish_reason == "stop" and last.stop_reason == stop
        assert text == full[: full.index(stop)]
    finally:
        engine.stop()
