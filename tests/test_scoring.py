"""Prompt logprobs: echo + logprobs on /v1/completions (lm-eval's loglikelihood) and max_tokens 0.

A prompt's logprobs must be what generation would have given: scoring P + C
reports, for C's tokens, the logprobs that decoding C greedily after P reported.
"""

import asyncio
import json

import httpx
import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import PromptTooLongError, Request, SamplingParams

MODEL = "qwen3-tiny"
# Longer than the 16-token prefill chunks and the 32-token blocks, and than gemma3-tiny's window.
PROMPT = [(7 * j) % 3000 + 100 for j in range(45)]


async def outputs(engine, prompt, params):
    return [o async for o in engine.submit(Request(list(prompt), params))]


def generate(engine, prompt, n):
    outs = asyncio.run(outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                              logprobs=True)))
    return [o.new_token_ids[0] for o in outs], [o.logprobs[0].logprob for o in outs]


def score(engine, prompt, k=2, max_tokens=0):
    outs = asyncio.run(outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              ignore_eos=True, prompt_logprobs=k)))
    return outs


@pytest.fixture(scope="module", params=["qwen3-tiny", "gemma3-tiny", "qwen3.5-tiny", "batch"])
def engine(request, tiny):
    """Solo path (attention, sliding window, hybrid recurrent) and the batch path."""
    shape = "qwen3-tiny" if request.param == "batch" else request.param
    eng = AsyncEngine(tiny(shape), EngineConfig(prefill_chunk_size=16, solo_fast_path=request.param != "batch"))
    eng.shape = shape
    yield eng.start()
    eng.stop()


def test_prompt_logprobs_equal_those_of_generation(engine):
    continuation, generated = generate(engine, PROMPT, 8)
    (out,) = score(engine, PROMPT + continuation)
    assert out.finish_reason == "length" and out.new_token_ids == [] and out.completion_tokens == 0
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) + 8 and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == (PROMPT + continuation)[1:]
    assert [lp.logprob for lp in lps[len(PROMPT):]] == pytest.approx(generated, abs=2e-3)
    for lp in lps[len(PROMPT):]:  # greedy: each continuation token is the best
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
    for lp in lps[1:]:  # the 2 best, best first: none worse than the token itself unless it is one of them
        (_, best), (second_id, second) = lp.top
        assert best >= second and (second >= lp.logprob - 1e-6 or lp.token_id == lp.top[0][0])


def test_scored_request_then_generates_the_same_tokens(engine):
    reference, _ = generate(engine, PROMPT, 6)
    outs = score(engine, PROMPT, k=0, max_tokens=6)
    assert [o.new_token_ids[0] for o in outs] == reference
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert all(lp.top == [] for lp in outs[0].prompt_logprobs[1:])  # k = 0: the token's own logprob only


def test_prompt_logprobs_are_the_same_on_a_cache_hit(engine):
    prompt = PROMPT[::-1] + PROMPT[:20]

    def plain():
        return asyncio.run(outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=1)))[0].cached_tokens

    asyncio.run(engine.reset_cache())
    plain()
    after_plain = plain()
    asyncio.run(engine.reset_cache())
    first = score(engine, prompt)[0].prompt_logprobs
    # A plain request hits the blocks the scoring pass stored as it would a plain request's
    # (gemma3-tiny: none, its 16-token window is shorter than a block).
    assert plain() == after_plain
    assert after_plain >= 32 or engine.shape == "gemma3-tiny"
    # ...and scoring again (prompt cached) still reports every position, the same.
    again = score(engine, prompt)[0].prompt_logprobs
    assert [(lp.token_id, lp.logprob, lp.top) for lp in again[1:]] == \
        pytest.approx([(lp.token_id, lp.logprob, lp.top) for lp in first[1:]])


def test_scoring_beside_other_requests(engine):
    continuation, generated = generate(engine, PROMPT, 5)

    async def together():
        others = [outputs(engine, PROMPT[i:], SamplingParams(temperature=0.7, seed=i, max_tokens=12))
                  for i in range(1, 4)]
        scored = outputs(engine, PROMPT + continuation, SamplingParams(temperature=0, max_tokens=3,
                                                                      prompt_logprobs=1))
        return await asyncio.gather(scored, *others)

    scored, *others = asyncio.run(together())
    lps = scored[0].prompt_logprobs
    assert [lp.logprob for lp in lps[len(PROMPT):]] == pytest.approx(generated, abs=2e-3)
    assert all(o[-1].finished for o in others)


def test_one_token_prompt_and_prompt_filling_the_context(tiny):
    eng = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(max_model_len=40)).start()
    try:
        (out,) = score(eng, [42])
        assert out.prompt_logprobs == [None] and out.finish_reason == "length"
        (out,) = score(eng, PROMPT[:40])  # no room to generate, none needed
        assert len(out.prompt_logprobs) == 40
        with pytest.raises(PromptTooLongError):
            score(eng, PROMPT[:40], max_tokens=1)
    finally:
        eng.stop()


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=21)


# ---- HTTP: the legacy completions shape ----


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def completion(http, **body):
    r = http.post("/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_legacy_shape(http, server):
    tokenizer = server.state.tokenizer
    text = "The capital of France is Paris"
    ids = tokenizer.encode(text)
    r = completion(http, prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=3)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + 2
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][: len(ids)]) == text and choice["text"].startswith(text)
    assert lp["text_offset"][: len(ids)] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert lp["text_offset"][len(ids)] == len(text)
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert logprob <= 0 and token in top and top[token] == logprob and 3 <= len(top) <= 4
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 2


def test_lm_eval_loglikelihood_request(http, server):
    """What lm-eval's local-completions sends for loglikelihood: token lists, max_tokens 1, echo."""
    context, continuation = [100 + i for i in range(30)], [4000, 4001, 4002]
    eos = next(iter(server.state.tokenizer.eos_token_ids))
    r = completion(http, prompt=[context + continuation, context[:10] + continuation], temperature=0,
                   max_tokens=1, logprobs=1, seed=1234, echo=True)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice, ctxlen in zip(r["choices"], (30, 10)):
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == ctxlen + 3 + 1  # one entry per prompt token, then the generated one
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert all(len(t) in (1, 2) and max(t.values()) >= lp for t, lp in zip(tops, lps[ctxlen:-1]))
    # The same scores as max_tokens 0, and as the stream's.
    zero = completion(http, prompt=context + continuation, max_tokens=0, logprobs=1, echo=True)
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == r["choices"][0]["logprobs"]["token_logprobs"][:-1]
    assert zero["choices"][0]["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    # A generated EOS keeps its entry: scorers drop the last entry as the generated one.
    forced = completion(http, prompt=context + continuation, max_tokens=1, logprobs=1, echo=True,
                        temperature=0, logit_bias={str(eos): 100})
    assert forced["choices"][0]["finish_reason"] == "stop"
    assert len(forced["choices"][0]["logprobs"]["token_logprobs"]) == 34


def test_echo_logprobs_stream(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 2}
    whole = completion(http, **body)["choices"][0]
    with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == "Once upon a time" and first["logprobs"]["token_logprobs"][0] is None
    merged = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in whole["logprobs"]}
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_max_tokens_zero_without_logprobs(http):
    r = completion(http, prompt="Hello", max_tokens=0, echo=True)
    assert r["choices"][0]["text"] == "Hello" and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 0
    r = completion(http, prompt="Hello", max_tokens=0, logprobs=2)  # nothing generated: nothing to list
    assert r["choices"][0]["text"] == "" and r["choices"][0]["logprobs"]["tokens"] == []


@pytest.mark.parametrize("prompt", [[5, -1], [2**31], [[1, 2], [3, 10**9]], [-(2**40)]])
def test_token_ids_outside_the_vocabulary(http, prompt):
    r = http.post("/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "vocabulary" in err["message"]
