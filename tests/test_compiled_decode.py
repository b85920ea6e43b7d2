"""The lone path's compiled decode step (engine/compiled.py) gives the tokens of the eager one,
across KV-buffer growth, into a batch hand-over, and leaves the prefix cache blocks it can hit."""

import asyncio
import random

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler


def greedy(n, logprobs=False):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def run_runner(loaded, prompts, n, *, compiled, join_after=None, logprobs=None):
    """Greedy tokens per prompt through a Runner: the first alone (the solo path), the others
    added once it has `join_after` tokens (moving it into the batch). Also whether the solo
    path decoded through the compiled step. With a list as `logprobs`, the first prompt's
    tokens' logprobs are appended to it."""
    runner = Runner(loaded.model, max_num_seqs=4, prefill_chunk_size=64, prefill_batch_size=4,
                    compile_decode=compiled)
    scheduler = Scheduler(runner, eos_token_ids=[], vocab_size=loaded.config["vocab_size"], max_num_seqs=4)
    got = {i: [] for i in range(len(prompts))}
    later = list(range(1, len(prompts)))
    used_compiled = False
    scheduler.add(Request(prompts[0], greedy(n, logprobs is not None), request_id="0"), n)
    while scheduler.has_work() or later:
        if later and len(got[0]) == join_after:
            for i in later:
                scheduler.add(Request(prompts[i], greedy(n), request_id=str(i)), n)
            later = []
        for e in scheduler.step():
            got[int(e.seq.request_id)].append(e.token)
            if logprobs is not None and e.seq.request_id == "0":
                logprobs.append(e.logprob)
        used_compiled |= runner.solo is not None and runner.solo.compiled is not None
    return [got[i] for i in range(len(prompts))], used_compiled


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_compiled_step_gives_the_eager_tokens_across_buffer_growth(tiny, shape):
    loaded = tiny(shape)
    prompt = prompt_of(230, 1)  # 230 + 60 tokens: the KV buffer grows past its first bucket (256)
    eager_lp, compiled_lp = [], []
    (eager,), used = run_runner(loaded, [prompt], 60, compiled=False, logprobs=eager_lp)
    assert not used
    (compiled,), used = run_runner(loaded, [prompt], 60, compiled=True, logprobs=compiled_lp)
    assert used
    assert compiled == eager and len(eager) == 60
    # Random weights make greedy tokens robust to small errors (a wrongly attended position
    # moves logits by ~0.1): the logprobs show them.
    assert compiled_lp == pytest.approx(eager_lp, abs=1e-4)


def test_compiled_solo_moves_into_the_batch_without_changing_tokens(tiny):
    loaded = tiny("qwen3-tiny")
    prompts = [prompt_of(40, 2), prompt_of(33, 3), prompt_of(50, 4)]
    alone = [run_runner(loaded, [p], 16, compiled=False)[0][0] for p in prompts]
    joined, used = run_runner(loaded, prompts, 16, compiled=True, join_after=5)
    assert used and joined == alone


def test_models_the_step_does_not_fit_decode_as_before(tiny):
    loaded = tiny("gemma3-tiny")  # sliding-window layers
    prompt = prompt_of(40, 5)
    (compiled,), used = run_runner(loaded, [prompt], 12, compiled=True)
    assert not used
    assert compiled == run_runner(loaded, [prompt], 12, compiled=False)[0][0]


async def _generate(engine, prompt, n):
    tokens, last = [], None
    async for step in engine.submit(Request(list(prompt), greedy(n))):
        tokens += step.new_token_ids
        last = step
    return tokens, last.cached_tokens


def test_prefix_cache_hits_the_blocks_a_compiled_run_stored(tiny):
    """A follow-up turn restores the blocks of the first turn's prompt and output, written by the
    compiled step, and continues with the tokens of an engine without cache or compiling."""
    loaded = tiny("qwen3-tiny")
    first = prompt_of(50, 6)
    settings = dict(prefill_chunk_size=64, block_size=16)
    eager = AsyncEngine(loaded, EngineConfig(prefix_cache=False, compile_decode="off", **settings)).start()
    cached = AsyncEngine(loaded, EngineConfig(compile_decode="on", **settings)).start()
    try:
        reply, _ = asyncio.run(_generate(eager, first, 40))
        follow_up = first + reply + prompt_of(7, 7)
        reference, _ = asyncio.run(_generate(eager, follow_up, 20))
        got_reply, _ = asyncio.run(_generate(cached, first, 40))
        got, hit = asyncio.run(_generate(cached, follow_up, 20))
    finally:
        eager.stop()
        cached.stop()
    assert got_reply == reply
    assert hit >= (len(first) + 39) // 16 * 16 > len(first)  # blocks of the output, not only the prompt
    assert got == reference


def test_default_model_greedy_tokens_match():
    from mlxserve.models.load import load

    loaded = load(None, progress=False)  # the embedded Qwen2.5-Coder-0.5B-Instruct
    prompt = loaded.tokenizer.encode("def quicksort(items):\n    ")
    (eager,), _ = run_runner(loaded, [prompt], 32, compiled=False)
    (compiled,), used = run_runner(loaded, [prompt], 32, compiled=True)
    assert used and compiled == eager
