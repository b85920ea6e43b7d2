"""The engine: batching must never change a request's tokens, sampling is per request."""

import asyncio

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import EngineError, PromptTooLongError, Request, SamplingParams

ARCHS = ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]


def greedy(n=10):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def tokens_of(engine, prompt, params):
    out = []
    async for step in engine.submit(Request(list(prompt), params)):
        out += step.new_token_ids
        last = step
    return out, last


async def run_all(engine, prompts, params):
    return await asyncio.gather(*(tokens_of(engine, p, sp) for p, sp in zip(prompts, params)))


def prompts_for(n, base_len=40, step=5):
    # Longer than gemma3-tiny's 16-token window, different lengths (padding in the batch).
    return [[(17 * i + 31 * j) % 5000 + 100 for j in range(base_len + step * i)] for i in range(n)]


@pytest.fixture(scope="module", params=ARCHS)
def engines(request, tiny):
    loaded = tiny(request.param)
    solo = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=16)).start()
    batched = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=16, solo_fast_path=False)).start()
    yield solo, batched
    solo.stop()
    batched.stop()


def test_greedy_alone_equals_in_mixed_batch(engines):
    solo, batched = engines
    prompts = prompts_for(8)
    others = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=6 + i,
                             presence_penalty=0.5, ignore_eos=True) for i in range(7)]
    alone, _ = asyncio.run(tokens_of(solo, prompts[0], greedy()))
    in_batch = asyncio.run(run_all(solo, prompts, [greedy()] + others))
    via_batch_path, _ = asyncio.run(tokens_of(batched, prompts[0], greedy()))
    assert len(alone) == 10
    assert in_batch[0][0] == alone
    assert via_batch_path == alone
    assert all(len(t) == 6 + i for i, (t, _) in enumerate(in_batch[1:]))


def test_seeded_sampling_reproducible_whatever_the_batch(engines):
    solo, _ = engines
    prompts = prompts_for(6)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    alone, _ = asyncio.run(tokens_of(solo, prompts[0], seeded))
    mates = [SamplingParams(temperature=1.2, seed=None, max_tokens=5, ignore_eos=True)] * 5
    in_batch = asyncio.run(run_all(solo, prompts, [seeded] + mates))
    reordered = asyncio.run(run_all(solo, prompts[::-1], mates + [seeded]))
    assert in_batch[0][0] == alone
    assert reordered[-1][0] == alone
    other_seed, _ = asyncio.run(tokens_of(solo, prompts[0], SamplingParams(
        temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)))
    assert other_seed != alone


def test_lone_request_moves_into_batch_without_changing_tokens(engines):
    solo, _ = engines
    prompts = prompts_for(4)
    reference, _ = asyncio.run(tokens_of(solo, prompts[0], greedy(16)))
    refs = [asyncio.run(tokens_of(solo, p, greedy(6)))[0] for p in prompts[1:]]

    async def scenario():
        got = []
        late = []
        async for step in solo.submit(Request(prompts[0], greedy(16))):
            got += step.new_token_ids
            if len(got) == 4:  # others join while the first decodes alone
                late = [asyncio.create_task(tokens_of(solo, p, greedy(6))) for p in prompts[1:]]
        return got, [(await t)[0] for t in late]

    got, others = asyncio.run(scenario())
    assert got == reference
    assert others == refs


@pytest.mark.parametrize("join_after", [1, 2])
def test_request_joining_right_after_the_first_token_changes_nothing(tiny, join_after):
    """The solo path hands out its first token before it queues the next step; a
    request arriving in that gap moves the first one into the batch mid-way."""
    from mlxserve.engine.runner import Runner
    from mlxserve.engine.scheduler import Scheduler

    loaded = tiny("qwen3-tiny")
    prompts = dict(zip("ab", prompts_for(2)))

    def run(order, join_after=0):
        """Tokens per request: order[0] alone, order[1] added once order[0] has `join_after` tokens."""
        runner = Runner(loaded.model, max_num_seqs=4, prefill_chunk_size=16, prefill_batch_size=4)
        scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.config["vocab_size"], max_num_seqs=4)
        got = {name: [] for name in order}
        later = list(order[1:])
        scheduler.add(Request(prompts[order[0]], greedy(8), request_id=order[0]), 8)
        while scheduler.has_work() or later:
            if later and len(got[order[0]]) == join_after:
                if join_after == 1:  # the gap: first token out, the next step not yet queued
                    assert runner.solo is not None and runner.solo.unfed is not None
                scheduler.add(Request(prompts[later[0]], greedy(8), request_id=later.pop()), 8)
            for e in scheduler.step():
                got[e.seq.request_id].append(e.token)
        return got

    alone = {**run("a"), **run("b")}
    assert run("ab", join_after) == alone
    assert all(len(t) == 8 for t in alone.values())


def test_arrivals_while_decoding_are_admitted_together(tiny):
    """--admission-window-ms: while a request decodes, new ones wait until a prefill batch of them
    is there or the oldest has waited the window, then join in one step; tokens are unchanged."""
    import time

    from mlxserve.engine.runner import Runner
    from mlxserve.engine.scheduler import Scheduler

    loaded = tiny("qwen3-tiny")
    prompts = prompts_for(5)

    def run(window_s):
        runner = Runner(loaded.model, max_num_seqs=8, prefill_chunk_size=16, prefill_batch_size=3)
        scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.config["vocab_size"], max_num_seqs=8,
                              admission_window_s=window_s)
        got = {f"r{i}": [] for i in range(5)}

        def step():
            for e in scheduler.step():
                got[e.seq.request_id].append(e.token)

        def add(i):
            scheduler.add(Request(prompts[i], greedy(12), request_id=f"r{i}"), 12)

        add(0)
        step()  # an idle engine admits at once
        running = [len(runner)]
        add(1), add(2)
        step(), step()
        running.append(len(runner))  # two waiting, fewer than a prefill batch: still waiting
        add(3)
        step()
        running.append(len(runner))  # a prefill batch: all three join
        add(4)
        step()
        running.append(len(runner))
        time.sleep(window_s)
        step()
        running.append(len(runner))  # the window is over: it joins alone
        while scheduler.has_work():
            step()
        return running, got

    running, got = run(1.0)  # far longer than a tiny model's steps on a loaded CI machine
    assert running == [1, 1, 4, 4, 5]
    assert got == run(0.0)[1]  # as if each had joined at once
    assert all(len(t) == 12 for t in got.values())


def test_batched_first_token_comes_out_of_the_step_that_ends_its_prefill(tiny):
    """Requests joining a running batch: each one's first token comes out of the step that prefills
    its prompt's last chunk (engine/batch_generator.py), two steps sooner than with mlx-lm's own
    BatchGenerator (which feeds the prompt's last token a step later, and decodes before it
    prefills); tokens unchanged."""
    from mlx_lm.generate import BatchGenerator as MlxLmBatchGenerator

    from mlxserve.engine.runner import Runner
    from mlxserve.engine.scheduler import Scheduler

    loaded = tiny("qwen3-tiny")
    prompts = prompts_for(3)  # 40, 45, 50 tokens

    def run(mlx_lm_own):
        runner = Runner(loaded.model, max_num_seqs=4, prefill_chunk_size=16, prefill_batch_size=4,
                        solo_fast_path=False)
        if mlx_lm_own:
            runner.generator = MlxLmBatchGenerator(loaded.model, completion_batch_size=4, prefill_batch_size=4,
                                                   prefill_step_size=16)
        scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.config["vocab_size"], max_num_seqs=4)
        scheduler.add(Request(prompts[0], greedy(16), request_id="r0"), 16)
        got, first, steps = {f"r{i}": [] for i in range(3)}, {}, 0
        while scheduler.has_work():
            steps += 1
            if steps == 6:  # r0 decodes by now; both are admitted in this step
                for i in (1, 2):
                    scheduler.add(Request(prompts[i], greedy(8), request_id=f"r{i}"), 8)
            for e in scheduler.step():
                first.setdefault(e.seq.request_id, steps - (1 if e.seq.request_id == "r0" else 6) + 1)
                got[e.seq.request_id].append(e.token)
        return got, first  # first: the steps from admission to the first token, admission's included

    got, first = run(False)
    got_mlx_lm, first_mlx_lm = run(True)
    assert got == got_mlx_lm and [len(t) for t in got.values()] == [16, 8, 8]
    # The prefill of all but the last prompt token, in chunks of 16: r0 3 steps, r1 3, r2 4.
    assert first == {"r0": 3, "r1": 3, "r2": 4}
    assert first_mlx_lm == {"r0": 3 + 2, "r1": 3 + 2, "r2": 4 + 2}


def test_batch_generator_copy_matches_installed_mlx_lm():
    """engine/batch_generator.py copies mlx-lm's BatchGenerator._next: an mlx-lm whose _next changed
    must be read against the copy (and the hash moved) before it is used."""
    import hashlib
    import inspect

    from mlx_lm.generate import BatchGenerator as MlxLmBatchGenerator

    from mlxserve.engine.batch_generator import MLX_LM_NEXT_SHA256

    source = inspect.getsource(MlxLmBatchGenerator._next)
    assert hashlib.sha256(source.encode()).hexdigest() == MLX_LM_NEXT_SHA256, (
        "mlx-lm's BatchGenerator._next changed: review mlxserve/engine/batch_generator.py against it")


def test_abort_frees_the_slot(tiny):
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig()).start()
    try:
        async def scenario():
            stream = engine.submit(Request(prompts_for(1)[0], greedy(2000)))
            async for step in stream:
                if step.completion_tokens >= 3:
                    break
            await stream.aclose()
            for _ in range(100):
                if engine.num_running == 0:
                    return True
                await asyncio.sleep(0.05)
            return False

        assert asyncio.run(scenario())
    finally:
        engine.stop()


def test_abort_ends_the_stream_of_a_waiting_reader(tiny):
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig()).start()
    try:
        async def scenario():
            request = Request(prompts_for(1)[0], greedy(2000))
            steps = []
            async for step in engine.submit(request):
                steps.append(step)
                if len(steps) == 2:
                    engine.abort(request.request_id)
            return steps

        steps = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert steps[-1].finish_reason == "abort"
        assert len(steps) < 50
    finally:
        engine.stop()


def test_logprobs_are_consistent_with_the_chosen_tokens(tiny):
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig()).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=5)
        tokens, _ = asyncio.run(tokens_of(engine, prompts_for(1)[0], params))

        async def collect():
            return [s async for s in engine.submit(Request(prompts_for(1)[0], params))]

        steps = asyncio.run(collect())
        for step in steps:
            (lp,) = step.logprobs
            assert lp.token_id == step.new_token_ids[0]
            assert len(lp.top) == 5
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
            assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-5)
            assert lp.logprob <= 0
        assert [s.new_token_ids[0] for s in steps] == tokens
    finally:
        engine.stop()


def test_logprobs_of_a_request_joining_a_batch_that_asks_for_none(tiny):
    # The batch step hands out per-row logprobs only while some row wants them: a request
    # that asks must get them on every token, whenever it joins, equal to its logprobs alone.
    loaded = tiny("qwen3-tiny")
    solo = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=16)).start()
    batched = AsyncEngine(loaded, EngineConfig(prefill_chunk_size=16, solo_fast_path=False)).start()
    try:
        prompts = prompts_for(4)
        wants = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)

        async def collect(engine, prompt, params, delay=0.0):
            await asyncio.sleep(delay)
            return [s async for s in engine.submit(Request(list(prompt), params))]

        alone = asyncio.run(collect(solo, prompts[0], wants))

        async def mixed():
            return await asyncio.gather(collect(batched, prompts[1], greedy(30)), collect(batched, prompts[2], greedy(30)),
                                        collect(batched, prompts[0], wants, delay=0.05),
                                        collect(batched, prompts[3], greedy(4), delay=0.1))

        _, _, joined, _ = asyncio.run(mixed())
        assert [s.new_token_ids for s in joined] == [s.new_token_ids for s in alone]
        for got, ref in zip(joined, alone):
            (lp,), (ref_lp,) = got.logprobs, ref.logprobs
            assert lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-3)
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
    finally:
        solo.stop()
        batched.stop()


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_logprobs", 21),
    ("max_tokens", 0), ("min_p", 1.0), ("top_k", -1), ("presence_penalty", 3.0),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_prompt_over_context_is_refused_before_compute(tiny):
    # strict_max_tokens: prompt + max_tokens past the context is refused too (capped by default).
    engine = AsyncEngine(tiny("qwen3-tiny"), EngineConfig(max_model_len=64, strict_max_tokens=True)).start()
    try:
        async def submit(prompt, n):
            return engine.submit(Request(prompt, SamplingParams(max_tokens=n)))

        with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
            asyncio.run(submit(list(range(100, 200)), 4))
        with pytest.raises(PromptTooLongError):
            asyncio.run(submit(list(range(100, 150)), 20))
        assert engine.steps == 0
    finally:
        engine.stop()


def test_engine_error_fails_the_batch_and_keeps_serving(tiny):
    loaded = tiny("llama-tiny")

    class Flaky:
        """The model, but its next call raises once."""

        def __init__(self, model):
            self.model, self.fail = model, False

        def __call__(self, *args, **kwargs):
            if self.fail:
                self.fail = False
                raise RuntimeError("injected failure")
            return self.model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    flaky = Flaky(loaded.model)
    engine = AsyncEngine(type(loaded)(**{**loaded.__dict__, "model": flaky}), EngineConfig()).start()
    try:
        assert engine.warmed.wait(60)  # the warm-up calls the model too
        flaky.fail = True
        with pytest.raises(EngineError, match="injected failure"):
            asyncio.run(tokens_of(engine, prompts_for(1)[0], greedy(4)))
        tokens, last = asyncio.run(tokens_of(engine, prompts_for(1)[0], greedy(4)))
        assert len(tokens) == 4 and last.finish_reason == "length"
        assert engine.alive
    finally:
        engine.stop()


def test_a_call_its_caller_gave_up_on_leaves_the_engine_running(tiny):
    """A caller that stops waiting for engine.call (its task cancelled: a client gone, a
    timeout, a shutdown) cancels the future; the MLX thread must skip it, not die setting
    the result of a cancelled future."""
    import threading

    engine = AsyncEngine(tiny("qwen3-tiny")).start()
    release = threading.Event()
    try:
        engine.call(lambda: release.wait(10))  # holds the MLX thread, so the next call waits

        async def give_up():
            task = asyncio.ensure_future(engine.cache_stats())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(give_up())
        release.set()
        out, last = asyncio.run(tokens_of(engine, [5, 6, 7], greedy(3)))
        assert len(out) == 3 and last.finish_reason == "length"
        assert engine.alive and asyncio.run(engine.cache_stats())["prefix_cache"]["enabled"]
    finally:
        release.set()
        engine.stop()
