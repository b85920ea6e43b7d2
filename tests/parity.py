"""Checks shared by the cache and model-family tests: greedy tokens never change because of a
cache hit, a batch or a restart."""

import asyncio
import random

from mlxserve.config import EngineConfig
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def generate(engine, prompt, params):
    tokens, last = [], None
    async for step in engine.submit(Request(list(prompt), params)):
        tokens += step.new_token_ids
        last = step
    return tokens, last.cached_tokens


def run(engine, prompts, params=None):
    async def go():
        return await asyncio.gather(*(generate(engine, p, params or greedy()) for p in prompts))
    return asyncio.run(go())


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def check_hits_give_the_same_tokens(loaded, settings, block_granular=False):
    """Greedy tokens with the cache off, cold, on a full hit, a partial hit and in a batch are identical.

    Hits reach the exact token where prompts part (block ends only if `block_granular`,
    except a repeat, which restores the prompt's tail)."""
    bs = settings["block_size"]

    def cached(n):
        return n // bs * bs if block_granular else n

    shared = prompt_of(70, 1)  # longer than gemma3-tiny's window
    first, other, partial = shared + prompt_of(5, 2), shared + prompt_of(9, 3), shared[:40] + prompt_of(20, 4)
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        reference = [run(off, [p])[0][0] for p in (first, other, partial)]
    finally:
        off.stop()
    for solo in (True, False):
        on = AsyncEngine(loaded, EngineConfig(solo_fast_path=solo, **settings)).start()
        try:
            (cold, cold_cached), = run(on, [first])
            (hit, hit_cached), = run(on, [first])  # the whole prompt but its last token
            (again, other_cached), = run(on, [other])  # shares the first 70 tokens
            (part, part_cached), = run(on, [partial])  # shares 40 tokens
            batch = run(on, [first, other, partial, prompt_of(30, 5)])  # hits inside a batch
            stats = asyncio.run(on.cache_stats())["prefix_cache"]
        finally:
            on.stop()
        assert cold_cached == 0 and cold == reference[0]
        # A repeat restores all but the last token, recurrent layers too (from the prompt's tail).
        assert hit == reference[0] and hit_cached == len(first) - 1
        assert again == reference[1] and other_cached == cached(70)
        assert part == reference[2] and part_cached == cached(40)
        assert [t for t, _ in batch[:3]] == reference
        assert all(c > 0 for _, c in batch[:3])
    return stats, reference


def check_restart_from_disk(loaded, settings, folder):
    """Blocks written to a disk tier come back in a new engine (a restart) with the same tokens."""
    bs = settings["block_size"]
    prompt = prompt_of(70, 11)
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        (ref, _), = run(off, [prompt])
    finally:
        off.stop()
    disk = dict(disk_cache_dir=str(folder), **settings)
    first = AsyncEngine(loaded, EngineConfig(**disk)).start()
    try:
        (cold, cold_cached), = run(first, [prompt])
    finally:
        first.stop()  # writes what is queued
    files = list(folder.glob("*.safetensors"))
    assert len(files) >= 70 // bs
    second = AsyncEngine(loaded, EngineConfig(**disk)).start()  # an empty hot tier: a restart
    try:
        (warm, warm_cached), = run(second, [prompt])
        stats = asyncio.run(second.cache_stats())["prefix_cache"]
    finally:
        second.stop()
    assert cold == warm == ref
    # All but the last token, as from memory: the finished prompt's partial last block is on disk too.
    assert cold_cached == 0 and warm_cached == len(prompt) - 1
    assert stats["disk"]["reads"] >= 64 // bs
