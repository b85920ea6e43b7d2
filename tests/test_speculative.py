"""Speculative decoding on the lone path: it may change the speed, never the tokens.

Random tiny models never repeat their prompt, so n-gram proposals would never
be accepted. `copier` scales a tiny model's attention and MLP outputs down:
its next token then depends mostly on the last token, a little on the rest
of the context, and a prompt holding its own greedy output gets proposals
that are partly accepted and partly rejected (the cache still matters: a
wrongly rewound cache changes its tokens). The draft-model mode uses the
model itself as its draft (everything accepted) and a perturbed copy (some
rejected).
"""

import asyncio
import dataclasses
import functools
import json
import logging
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from prometheus_client.parser import text_string_to_metric_families

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.files import ModelLoadError


@functools.lru_cache(maxsize=None)
def copier(head_dim=None, scale=0.1, seed=1):
    """qwen3-tiny, scaled (see the module doc); head_dim 64 quantizes its KV in mlx's groups of 64.

    Seed 1, with the dummy weights of INIT_VERSION 6: for its echo prompt's first 40 tokens n-gram
    lookup drafts 8 tokens in 2 passes, the second keeping 1 of its 4, then misses (from the 9th
    token on it decodes one token at a time). Seed 3 repeated its prompt for 25 tokens: no rejection."""
    from mlxserve.models.load import load
    from mlxserve.models.shapes import SHAPES

    source = "qwen3-tiny"
    if head_dim is not None:
        source = str(Path(tempfile.mkdtemp()) / "config.json")
        Path(source).write_text(json.dumps(dict(SHAPES["qwen3-tiny"], head_dim=head_dim)))
    loaded = load(source, load_format="dummy", seed=seed, progress=False)
    for layer in loaded.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
    mx.eval(loaded.model.parameters())
    return loaded


@functools.lru_cache(maxsize=None)
def echo_prompt(head_dim=None, start=20, n=60):
    """A prompt holding the copier's own greedy output, then the start of that output again."""
    head = [100 + (7 * j) % 50 for j in range(start)]
    out = [t for t, _ in generate_step(mx.array(head), copier(head_dim).model, max_tokens=n)]
    return tuple(head + out + [5, 6, 7] + out[:4])


def greedy(n=40, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def outputs(engine, prompt, params):
    return [step async for step in engine.submit(Request(list(prompt), params))]


def tokens(steps):
    return [t for s in steps for t in s.new_token_ids]


def run(engine, prompt, params):
    return tokens(asyncio.run(outputs(engine, prompt, params)))


def assert_same(engine, plain, prompt, params):
    """The same tokens, and the same logprobs: a cache or context that is off changes
    them even where the argmax survives (the copier's tokens depend little on the cache)."""
    params = dataclasses.replace(params, logprobs=True, top_logprobs=2)
    got, want = (asyncio.run(outputs(e, prompt, params)) for e in (engine, plain))
    assert tokens(got) == tokens(want)
    assert [s.logprobs[0].logprob for s in got] == pytest.approx([s.logprobs[0].logprob for s in want], abs=1e-4)


def with_draft(loaded, draft):
    return dataclasses.replace(loaded, draft=draft)


@functools.lru_cache(maxsize=None)
def perturbed(scale=3.0):
    """A draft that mostly agrees with the copier: a fresh copier, its last layer's MLP output scaled."""
    draft = copier.__wrapped__()
    last = draft.model.layers[-1].mlp.down_proj
    last.weight = last.weight * scale
    mx.eval(draft.model.parameters())
    return draft


MODES = ["ngram", "draft-self", "draft-perturbed"]


def spec_engine(mode, loaded, **cfg):
    if mode == "ngram":
        return AsyncEngine(loaded, EngineConfig(speculative="ngram", ngram_size=2, **cfg)).start()
    draft = loaded if mode == "draft-self" else perturbed()
    return AsyncEngine(with_draft(loaded, draft), EngineConfig(**cfg)).start()


@pytest.fixture(scope="module")
def plain():
    engine = AsyncEngine(copier(), EngineConfig(prefill_chunk_size=16)).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module", params=MODES)
def spec(request):
    engine = spec_engine(request.param, copier(), prefill_chunk_size=16)
    yield request.param, engine
    engine.stop()


def test_greedy_tokens_are_unchanged(plain, spec):
    mode, engine = spec
    stats = engine.speculation.stats
    before = stats.as_dict()
    for n in (40, 7, 1):
        assert_same(engine, plain, echo_prompt(), greedy(n))
    drafted = stats.drafted - before["draft_tokens"]
    accepted = stats.accepted - before["accepted_tokens"]
    assert stats.passes > before["verify_passes"] and accepted > 0
    if mode == "draft-self":
        assert accepted == drafted  # the model drafting for itself: every draft is its own token
    else:
        assert accepted < drafted  # some proposals were rejected and rewound


def test_seeded_sampling_draws_the_same_tokens(plain, spec):
    _, engine = spec
    for temperature, top_k in ((0.3, 0), (0.7, 40)):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=11, max_tokens=30, ignore_eos=True)
        assert_same(engine, plain, echo_prompt(), params)
    before = engine.speculation.stats.passes
    run(engine, echo_prompt(), SamplingParams(temperature=0.3, seed=11, max_tokens=30, ignore_eos=True))
    assert engine.speculation.stats.passes > before  # sampled requests speculate too


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={17: 3.0}),
    # A reward for repeating the last 4 tokens (the output loops): each position of a verify
    # pass must see the drafts before it.
    dict(repetition_penalty=0.5, penalty_context_size=4),
])
def test_penalties_see_the_same_context(plain, spec, penalties):
    _, engine = spec
    assert_same(engine, plain, echo_prompt(), greedy(30, **penalties))


def test_logprobs_are_those_of_the_model(plain, spec):
    _, engine = spec
    params = greedy(25, logprobs=True, top_logprobs=3)
    got = asyncio.run(outputs(engine, echo_prompt(), params))
    ref = asyncio.run(outputs(plain, echo_prompt(), params))
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        (x,), (y,) = a.logprobs, b.logprobs
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


def test_max_tokens_and_stops_are_exact(plain, spec):
    mode, engine = spec
    ref = run(plain, echo_prompt(), greedy(40))
    stats = engine.speculation.stats
    before = stats.drafted - stats.accepted
    for n in range(1, 12):  # every cut inside a verify pass
        steps = asyncio.run(outputs(engine, echo_prompt(), greedy(n)))
        assert tokens(steps) == ref[:n] and steps[-1].finish_reason == "length"
        assert steps[-1].completion_tokens == n
    if mode == "draft-self":  # nothing drafted past max_tokens (the model would accept it, unused)
        assert stats.drafted - stats.accepted == before
    # A stop token inside an accepted run ends the output at it.
    for j in (3, 9, 14):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[j]])
        steps = asyncio.run(outputs(engine, echo_prompt(), params))
        first = ref.index(ref[j])
        assert tokens(steps) == ref[:first + 1] and steps[-1].finish_reason == "stop"
    # A stop string: the same text, tokens and finish as without speculation.
    text = "".join(s.new_text for s in asyncio.run(outputs(plain, echo_prompt(), greedy(40))))
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = greedy(40, stop=[stop])
    got, want = (asyncio.run(outputs(e, echo_prompt(), params)) for e in (engine, plain))
    assert "".join(s.new_text for s in got) == "".join(s.new_text for s in want)
    assert tokens(got) == tokens(want) and got[-1].finish_reason == want[-1].finish_reason == "stop"
    assert got[-1].completion_tokens == want[-1].completion_tokens


JOINING = {
    "greedy": greedy(30),
    "seeded": SamplingParams(temperature=0.5, seed=5, max_tokens=30, ignore_eos=True),
    # The batch takes the tokens in the cache as the penalties' context.
    "penalized": greedy(30, repetition_penalty=0.5, penalty_context_size=4),
}


# Each mode once and each sampling once, plus penalties under a draft's rejections (every
# pair of the 3 x 3 took 110 s of CI for little more).
@pytest.mark.parametrize("mode, params", [("ngram", "greedy"), ("draft-self", "penalized"),
                                          ("draft-perturbed", "seeded"), ("draft-perturbed", "penalized")])
def test_a_second_request_joining_changes_no_tokens(mode, params):
    """The speculating solo sequence moves into the batch at every possible point: between
    verify passes, in pipelined one-token steps, right after the first token. A join is tried
    once the first request has emitted n tokens, n = 1..19; several n fall in one verify pass
    (up to 5), and those are one scenario, run once: each step boundary of the first request
    alone that some n reaches (14-16 runs a case, not 19)."""
    from mlxserve.engine.runner import Runner
    from mlxserve.engine.scheduler import Scheduler
    from mlxserve.engine.speculative import make_speculation

    loaded = copier()
    if mode != "ngram":
        loaded = with_draft(loaded, loaded if mode == "draft-self" else perturbed())
    cfg = EngineConfig(speculative="ngram" if mode == "ngram" else None, ngram_size=2, prefill_chunk_size=16)
    requests = {"a": (list(echo_prompt()), JOINING[params]), "b": ([200 + (11 * j) % 90 for j in range(30)], greedy(12))}

    def tokens_of(order, join_after=None, speculate=True):
        spec = make_speculation(cfg, loaded, solo_path=True) if speculate else None
        runner = Runner(loaded.model, max_num_seqs=4, prefill_chunk_size=16, prefill_batch_size=4, speculation=spec)
        scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.vocab_size, max_num_seqs=4)
        got = {name: [] for name in order}
        later = list(order[1:])
        states = set()
        emitted = []  # the first request's tokens so far, at each step boundary

        def add(name):
            prompt, p = requests[name]
            scheduler.add(Request(prompt, p, request_id=name), p.max_tokens)

        add(order[0])
        while scheduler.has_work() or later:
            emitted.append(len(got[order[0]]))
            if later and len(got[order[0]]) >= join_after:
                solo = runner.solo
                states.add("unfed" if solo.unfed is not None else "pending")
                add(later.pop())
            for e in scheduler.step():
                got[e.seq.request_id].append(e.token)
        return got, spec, states, emitted

    alone = {**tokens_of("a", speculate=False)[0], **tokens_of("b", speculate=False)[0]}
    got, _, _, emitted = tokens_of("a")
    assert got == {"a": alone["a"]}
    # Until the join, the first request runs as alone: a join after n tokens happens at the first
    # boundary holding n or more.
    points = sorted({min(e for e in emitted if e >= n) for n in range(1, 20)})
    seen = set()
    for join_after in points:
        got, spec, states, _ = tokens_of("ab", join_after)
        assert got == alone, join_after
        seen |= states
    assert seen == {"unfed", "pending"}
    assert spec.stats.passes > 0


@pytest.mark.parametrize("mode", MODES)
def test_the_runner_emits_nothing_past_a_finish(mode):
    """At the runner: a stop token or max_tokens inside an accepted run is the last event, and the
    lone slot is free at once (the caller's side would hide extra tokens, not the wasted work)."""
    from mlxserve.engine.runner import Runner
    from mlxserve.engine.scheduler import Scheduler
    from mlxserve.engine.speculative import make_speculation

    loaded = copier()
    if mode != "ngram":
        loaded = with_draft(loaded, loaded if mode == "draft-self" else perturbed())
    cfg = EngineConfig(speculative="ngram" if mode == "ngram" else None, ngram_size=2, prefill_chunk_size=16)
    spec = make_speculation(cfg, loaded, solo_path=True)
    runner = Runner(loaded.model, max_num_seqs=4, prefill_chunk_size=16, prefill_batch_size=4, speculation=spec)
    scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.vocab_size, max_num_seqs=4)

    def events_of(params, max_tokens):
        scheduler.add(Request(list(echo_prompt()), params), max_tokens)
        events = []
        while scheduler.has_work():
            events += scheduler.step()
        return events

    ref = [e.token for e in events_of(greedy(40), 40)]
    passes = spec.stats.passes
    for j in range(8, 30, 3):
        stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[j]])
        for params, n in ((stop, 40), (greedy(j + 1), j + 1)):
            events = events_of(params, n)
            assert [e.token for e in events] == ref[:ref.index(ref[j]) + 1]
            assert [e.finish_reason for e in events][-1] in ("stop", "length")
            assert not any(e.finish_reason for e in events[:-1])
            assert runner.solo is None and not runner.batch
    assert spec.stats.passes > passes


def test_prefix_cache_gets_the_right_blocks(plain, spec):
    """Blocks stored from a speculating request hold the tokens' true KV: a repeat hits and gives the
    same tokens, and so does a next turn that continues prompt + answer, against a fresh run."""
    _, engine = spec
    asyncio.run(engine.reset_cache())  # only this test's blocks: other tests ran this prompt longer
    prompt = list(echo_prompt())
    first = asyncio.run(outputs(engine, prompt, greedy(30)))
    again = asyncio.run(outputs(engine, prompt, greedy(30)))
    assert tokens(again) == tokens(first) == run(plain, prompt, greedy(30))
    assert again[-1].cached_tokens >= len(prompt) - 16
    turn = prompt + tokens(first) + [300, 301, 302]
    nxt = asyncio.run(outputs(engine, turn, greedy(20)))
    # Every token but the last one generated (never fed) is cached, under its own id.
    assert nxt[-1].cached_tokens == len(prompt) + len(tokens(first)) - 1
    fresh = AsyncEngine(copier(), EngineConfig(prefix_cache=False)).start()
    try:
        assert tokens(nxt) == run(fresh, turn, greedy(20))
    finally:
        fresh.stop()


def test_grammar_requests_do_not_speculate(spec):
    from mlxserve.api.constraints import Grammars, json_grammar

    _, engine = spec
    loaded = copier()
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size)
    (matcher,) = grammars.new_matchers(json_grammar({"type": "object"}, "schema"), 1)
    before = engine.speculation.stats.passes
    steps = asyncio.run(outputs(engine, echo_prompt(), SamplingParams(temperature=0, max_tokens=20,
                                                                       grammar=matcher)))
    assert tokens(steps) and engine.speculation.stats.passes == before
    assert not matcher.is_error()


def test_metrics_report_the_counters(spec):
    from mlxserve.metrics import Metrics

    _, engine = spec
    run(engine, echo_prompt(), greedy(20))
    s = engine.speculation.stats
    values = {sample.name: sample.value for f in text_string_to_metric_families(Metrics(lambda: [engine]).render().decode())
              for sample in f.samples}
    assert values["spec_decode_draft_tokens_total"] == s.drafted > 0
    assert values["spec_decode_accepted_tokens_total"] == s.accepted
    assert values["spec_decode_verify_passes_total"] == s.passes
    assert values["spec_decode_acceptance_rate"] == pytest.approx(s.accepted / s.drafted)


def test_quantized_kv_rewinds_too():
    """--kv-bits: the quantized cache (cache/quantized.py) is trimmed like mlx-lm's."""
    plain = AsyncEngine(copier(64), EngineConfig(kv_bits=8, prefix_cache=False)).start()
    engine = spec_engine("ngram", copier(64), kv_bits=8, prefix_cache=False)
    try:
        assert_same(engine, plain, echo_prompt(64), greedy(30))
        s = engine.speculation.stats
        assert s.accepted < s.drafted and s.accepted > 0
    finally:
        engine.stop()
        plain.stop()


@pytest.mark.parametrize("shape", ["qwen3.5-tiny", "lfm2-tiny"])
def test_recurrent_models_turn_it_off_and_say_so(tiny, shape, caplog):
    loaded = tiny(shape)
    with caplog.at_level(logging.WARNING, logger="mlxserve.engine"):
        engine = AsyncEngine(loaded, EngineConfig(speculative="ngram")).start()
    try:
        assert engine.speculation is None
        assert any("speculative decoding off" in r.message and "ArraysCache" in r.message for r in caplog.records)
        plain = AsyncEngine(loaded, EngineConfig()).start()
        try:
            prompt = [100 + (7 * j) % 50 for j in range(40)]
            assert run(engine, prompt, greedy(10)) == run(plain, prompt, greedy(10))
        finally:
            plain.stop()
    finally:
        engine.stop()


def test_vision_language_models_turn_it_off_and_say_so(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="mlxserve.engine"):
        engine = AsyncEngine(tiny("llava-tiny"), EngineConfig(speculative="ngram")).start()
    try:
        assert engine.speculation is None
        assert any("speculative decoding off: vision-language" in r.message for r in caplog.records)
    finally:
        engine.stop()


def test_sliding_window_models_speculate_inside_the_window(tiny):
    """gemma3-tiny's window is 16 tokens: a short prompt speculates until the window is full,
    then decodes one token at a time; the tokens are those of decoding without it."""
    loaded = tiny("gemma3-tiny")
    prompt = [100, 101, 102]
    plain = AsyncEngine(loaded, EngineConfig()).start()
    engine = AsyncEngine(with_draft(loaded, loaded), EngineConfig(num_draft_tokens=3)).start()
    try:
        assert run(engine, prompt, greedy(30)) == run(plain, prompt, greedy(30))
        s = engine.speculation.stats
        assert 0 < s.emitted < 16 and s.accepted == s.drafted
    finally:
        engine.stop()
        plain.stop()


def test_a_sliding_window_draft_stops_when_its_window_is_full(tiny):
    """A draft whose window (16) fills first stops proposing (its cache could not be rewound any
    more); the model goes on decoding, with the same tokens."""
    loaded = tiny("qwen3-tiny")
    prompt = [100, 101, 102]
    plain = AsyncEngine(loaded, EngineConfig()).start()
    engine = AsyncEngine(with_draft(loaded, tiny("gemma3-tiny")), EngineConfig(num_draft_tokens=3)).start()
    try:
        assert run(engine, prompt, greedy(40)) == run(plain, prompt, greedy(40))
        s = engine.speculation.stats
        assert 0 < s.passes <= 16 - len(prompt)  # each pass emits at least one token of the 16 it may hold
    finally:
        engine.stop()
        plain.stop()


def test_settings_that_cannot_work_are_refused(tiny):
    from mlxserve.engine.engine import EngineDeadError

    loaded = tiny("qwen3-tiny")
    for cfg, match in [(EngineConfig(speculative="draft"), "needs --draft-model"),
                       (EngineConfig(speculative="ngram", num_draft_tokens=0), "num-draft-tokens")]:
        with pytest.raises(EngineDeadError, match=match):
            AsyncEngine(loaded, cfg).start()
    with pytest.raises(EngineDeadError, match="exclude each other"):
        AsyncEngine(with_draft(loaded, loaded), EngineConfig(speculative="ngram")).start()
    with pytest.raises(EngineDeadError, match="lfm2-tiny: its ArraysCache layers cannot be rewound"):
        AsyncEngine(with_draft(loaded, tiny("lfm2-tiny")), EngineConfig()).start()



def test_a_draft_with_another_vocabulary_is_refused(tiny):
    from mlxserve.models.load import check_same_vocabulary

    target = tiny("qwen3-tiny")

    class OtherTokenizer:
        def get_vocab(self):
            vocab = dict(target.tokenizer.get_vocab())
            vocab["<extra>"] = len(vocab)
            return vocab

    other = dataclasses.replace(target, tokenizer=OtherTokenizer(), source="other-model")
    check_same_vocabulary(target, target)
    with pytest.raises(ModelLoadError, match="--draft-model other-model: its vocabulary") as e:
        check_same_vocabulary(target, other)
    assert "\n" not in str(e.value)


def test_draft_model_loads_like_the_model(tiny):
    from mlxserve.models.load import load, load_draft

    target = load("qwen3-tiny", load_format="dummy", progress=False)
    draft = load_draft(target, "llama-tiny", load_format="dummy", progress=False)
    assert target.draft is draft and draft.name == "llama-tiny"


def test_the_python_api_takes_a_draft_model():
    from mlxserve import LLM

    with LLM("qwen3-tiny", load_format="dummy", draft_model="qwen3-tiny", prefix_cache=False) as llm:
        out = llm.generate([list(range(100, 140))], greedy(20))[0]
        stats = llm.engine.speculation.stats
    assert len(out.token_ids) == 20 and stats.accepted == stats.drafted > 0  # the same weights: all accepted


def test_bench_spec_runs_and_reports(tmp_path):
    import argparse

    from mlxserve.bench import spec as bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["spec", "--model", "dummy:qwen3-tiny", "--draft-model", "dummy:qwen3-tiny",
                              "--max-tokens", "12", "--out-dir", str(tmp_path)])
    assert args.func(args) == 0
    (md,) = tmp_path.glob("*.md")
    text = md.read_text()
    assert "commit:" in text and "load_average:" in text
    rows = [line for line in text.splitlines() if line.startswith("| edit/") or line.startswith("| free/")]
    assert len(rows) == 5 and all(line.count("| yes |") == 2 for line in rows)  # ngram and draft: same tokens
    # The draft equals the model (same shape and seed): every draft accepted.
    assert all(line.split("|")[-3].strip() == "100%" for line in rows)
    date = next(line for line in text.splitlines() if line.startswith("- date:"))
    args = parser.parse_args(["spec", "--rerender", str(md.with_suffix(".json"))])
    args.func(args)
    assert md.read_text() == text and date in md.read_text()
