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
    """`prompt`: token ids, or (token ids, PromptImages) for a vision-language model."""
    ids, images = prompt if isinstance(prompt, tuple) else (prompt, [])
    tokens, last = [], None
    async for step in engine.submit(Request(list(ids), params, images=list(images))):
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


def hit_prompts():
    """check_hits_give_the_same_tokens' prompts: first, other (sharing its first 70 tokens) and
    partial (sharing 40)."""
    shared = prompt_of(70, 1)  # longer than gemma3-tiny's window
    return shared + prompt_of(5, 2), shared + prompt_of(9, 3), shared[:40] + prompt_of(20, 4)


def check_hits_give_the_same_tokens(loaded, settings, block_granular=False):
    """Greedy tokens with the cache off, cold, on a full hit, a partial hit and in a batch are identical.

    Hits reach the exact token where prompts part (block ends only if `block_granular`,
    except a repeat, which restores the prompt's tail)."""
    bs = settings["block_size"]

    def cached(n):
        return n // bs * bs if block_granular else n

    first, other, partial = hit_prompts()
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
            all_stats = asyncio.run(on.cache_stats())
            stats = all_stats["prefix_cache"]
        finally:
            on.stop()
        assert cold_cached == 0 and cold == reference[0]
        # A repeat restores all but the last token, recurrent layers too (from the prompt's tail).
        assert hit == reference[0] and hit_cached == len(first) - 1
        assert again == reference[1] and other_cached == cached(70)
        assert part == reference[2] and part_cached == cached(40)
        assert [t for t, _ in batch[:3]] == reference
        assert all(c > 0 for _, c in batch[:3])
        if settings.get("kv_layout") == "paged":  # the finished rows' blocks: the prefix cache's now, no others
            paged = all_stats["paged_kv"]
            assert paged["used_blocks"] == paged["cached_blocks"]
    return stats, reference


def check_restart_from_disk(loaded, settings, folder, prompt=None, ref=None):
    """Blocks written to a disk tier come back in a new engine (a restart) with the same tokens.

    `prompt` (70 tokens or more) and `ref`, its greedy tokens with the cache off, if known
    (check_hits_give_the_same_tokens' first prompt and reference): no engine is started for them."""
    bs = settings["block_size"]
    if prompt is None:
        prompt = prompt_of(70, 11)
    if ref is None:
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
        everything = asyncio.run(second.cache_stats())
        stats = everything["prefix_cache"]
    finally:
        second.stop()
    assert cold == warm == ref
    # All but the last token, as from memory: the finished prompt's partial last block is on disk too.
    assert cold_cached == 0 and warm_cached == len(prompt) - 1
    assert stats["disk"]["reads"] >= 64 // bs
    if settings.get("kv_layout") == "paged":  # blocks read back keep their KV in the batch's pool, for hits by reference
        assert everything["paged_kv"]["cached_blocks"] >= stats["disk"]["reads"]


def _ids(prompt):
    return prompt[0] if isinstance(prompt, tuple) else prompt


def check_served_alike(loaded, settings, folder, block_granular=False, tokens=4, prompts=None, expected=None,
                       unlike=None):
    """The generated architecture test's check, in three engine starts and nine requests:
    greedy tokens of three prompts (75, 79 and 60 tokens, sharing 70 and 40) are the same
    alone and in a batch of 3 with the cache off, in a batch of 2 cold, on a full hit, on a
    partial hit and in a batch of hits with the cache on, and after a restart from the
    disk tier. A model the engine says it cannot cache (`serving["caches"]`) must hit
    nothing, with the same tokens. Returns (the engine's `serving`, the cache's stats).

    `prompts`: other prompts (a, b, c, shared), b sharing a's first `shared` tokens and c
    fewer; each token ids or (token ids, PromptImages) (tests/test_vlm_architectures.py).
    `expected`: the tokens a must give (another implementation's).
    `unlike`: a prompt that must give other tokens than a (a's words with another image of a's
    size: unless the image changes the tokens, image rows put in the wrong place would pass)."""
    bs = settings["block_size"]
    params = greedy(tokens)
    if prompts is None:
        shared, base = 70, prompt_of(70, 1)
        a, b, c = base + prompt_of(5, 2), base + prompt_of(9, 3), base[:40] + prompt_of(20, 4)
    else:
        a, b, c, shared = prompts
    off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, **settings)).start()
    try:
        reference = [run(off, [p], params)[0][0] for p in (a, b, c)]
        three = run(off, [a, b, c], params)
        other = run(off, [unlike], params)[0][0] if unlike is not None else None
    finally:
        off.stop()
    assert other != reference[0], f"another image gave a's tokens {other}: the image does not change them"
    assert [t for t, _ in three] == reference, f"a batch of 3: {three} != alone {reference}"
    assert expected is None or reference[0] == expected, f"{reference[0]} != {expected} expected"

    disk = dict(disk_cache_dir=str(folder), **settings)
    on = AsyncEngine(loaded, EngineConfig(**disk)).start()
    try:
        serving = on.serving
        two = run(on, [a, c], params)
        (hit, hit_cached), = run(on, [a], params)  # the whole prompt but its last token
        (part, part_cached), = run(on, [b], params)  # shares the first 70 tokens
        batch = run(on, [a, b, c], params)  # hits inside a batch
        stats = asyncio.run(on.cache_stats())["prefix_cache"]
    finally:
        on.stop()  # writes what is queued to the disk tier
    caches = serving["caches"]
    assert [t for t, _ in two] == [reference[0], reference[2]], f"a batch of 2: {two} != alone {reference}"
    full = len(_ids(a)) - 1 if caches else 0
    assert (hit, hit_cached) == (reference[0], full), f"a full hit: {hit, hit_cached} != {reference[0]}"
    partial = (shared // bs * bs if block_granular else shared) if caches else 0
    assert (part, part_cached) == (reference[1], partial), f"a partial hit: {part, part_cached} != {reference[1]}"
    assert [t for t, _ in batch] == reference and all((n > 0) == caches for _, n in batch), f"a batch of hits: {batch}"

    restarted = AsyncEngine(loaded, EngineConfig(**disk)).start()  # an empty hot tier: a restart
    try:
        (warm, warm_cached), = run(restarted, [a], params)
        disk_stats = asyncio.run(restarted.cache_stats())["prefix_cache"]["disk"]
    finally:
        restarted.stop()
    assert (warm, warm_cached) == (reference[0], full), f"after a restart: {warm, warm_cached}"
    assert serving["survives_restart"] == caches and (disk_stats["reads"] >= 64 // bs) == caches
    return serving, stats


def check_causal(model):
    """A later token never changes an earlier one's logits: a model that let a prompt's
    tokens see later ones would give tokens that depend on where prefill chunks and cache
    hits cut the prompt, often too little to flip a greedy token in a short test."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = prompt_of(20, 21)
    first = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, :-1]
    other = model(mx.array([tokens[:-1] + [tokens[-1] + 1]]), cache=make_prompt_cache(model))[0, :-1]
    assert mx.allclose(first, other, rtol=1e-4, atol=1e-4).item(), "a later token changed earlier logits"
