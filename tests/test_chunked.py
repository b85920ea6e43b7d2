"""Llama 4's chunked attention in a batch and in cached blocks (mlxserve/cache/chunked.py).

A tiny random-weight Llama 4 (tests/families.json) with 16-token chunks: a
key kept past its chunk, or a chunk boundary put at the wrong position for a
left-padded row, changes its greedy tokens. tests/test_families.py runs the
model through the engine; these tests reach the cache directly.
"""

import functools
import json
import random
from pathlib import Path

import pytest

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache  # noqa: E402

import mlxserve.engine.runner  # noqa: E402,F401 - installs the batched chunked cache and forward pass
from mlxserve.cache.chunked import BatchChunkedKVCache  # noqa: E402
from mlxserve.cache.layers import KV, extract_blocks, extract_blocks_from_batch, layer_specs  # noqa: E402
from mlxserve.cache.restore import restore_cache  # noqa: E402

CONFIG = json.loads((Path(__file__).parent / "families.json").read_text())["llama4"]
# The no-RoPE layers scale queries by 1 + attn_scale * log(floor(position / floor_scale) + 1):
# with Llama 4's 8192 every position here would get 1. At 4 (and attn_scale 1) it changes
# every 4 positions, so a batched row scaled at other positions changes its logprobs.
CONFIG = dict(CONFIG, text_config=dict(CONFIG["text_config"], floor_scale=4, attn_scale=1.0))
C = CONFIG["text_config"]["attention_chunk_size"]


@functools.lru_cache(maxsize=None)
def llama4(folder: Path):
    from mlxserve.models.load import load

    (folder / "llama4.json").write_text(json.dumps(CONFIG))
    return load(str(folder / "llama4.json"), load_format="dummy", progress=False).model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llama4(tmp_path_factory.mktemp("llama4"))


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def prefill(model, prompt, chunk):
    cache = make_prompt_cache(model)
    for i in range(0, len(prompt), chunk):
        model(mx.array(prompt[i : i + chunk])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def greedy(model, prompt, n, cache=None):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)]


# ---- the batched cache itself: keys tagged with their positions ----


def tagged(rows):
    """(B, 1, L, 1) keys whose value is the position they stand for."""
    return mx.array(rows, mx.float32)[:, None, :, None]


def single(offset, start):
    """A ChunkedKVCache at `offset` holding positions [start, offset)."""
    c = ChunkedKVCache(C)
    c.offset, c.start_position = offset, start
    if offset > start:
        c.keys = c.values = tagged([list(range(start, offset))])
    return c


def run_pass(cache, lengths):
    """One forward pass as BatchGenerator and Llama 4 run it (right padding, trim, mask,
    update); each real query must see exactly the positions of its chunk up to itself."""
    L = max(lengths)
    pad = [L - n for n in lengths]
    if max(pad):
        cache.prepare(lengths=lengths, right_padding=pad)
    cache.maybe_trim_front()
    mask = np.array(cache.make_mask(L))[:, 0]
    offsets = cache.offset.tolist()
    new = [[o + i if i < n else -1000 for i in range(L)] for o, n in zip(offsets, lengths)]
    keys = np.array(cache.update_and_fetch(tagged(new), tagged(new))[0])[:, 0, :, 0]
    for b, (o, n) in enumerate(zip(offsets, lengths)):
        for i in range(n):
            q = o + i
            assert sorted(keys[b][mask[b, i]]) == list(range(q // C * C, q + 1)), (b, q)
    if max(pad):
        cache.finalize()
    assert cache.offset.tolist() == [o + n for o, n in zip(offsets, lengths)]
    # What the cache holds: under two chunks before the pass, plus the pass.
    assert cache._idx <= 2 * C - 2 + L


def test_batched_cache_reads_each_rows_chunk_exactly():
    """Rows at every phase of a chunk, restored (from the chunk start) or as mlx-lm's
    cache leaves them (the last C), through right-padded prefill passes, decode across
    chunk boundaries, a row leaving and new rows joining: every query reads exactly its
    chunk, and rows extract as the positions they hold."""
    rows = [single(3 * C + b, (3 * C + b) // C * C if b % 2 else 2 * C + b) for b in range(C)]
    rows += [single(0, 0), single(5, 0)]
    cache = BatchChunkedKVCache.merge(rows)
    for lengths in ([20, 3] * (C // 2) + [16, 7], [16] * (C + 2), [5, 16, 2, 9] * (C // 4) + [1, 11]):
        run_pass(cache, lengths)
    for _ in range(2 * C + 3):
        run_pass(cache, [1] * (C + 2))
    keep = [0, 2, C - 1, C + 1]
    cache.filter(keep)
    joining = BatchChunkedKVCache.merge([single(0, 0), single(2 * C + 7, 2 * C)])
    run_pass(joining, [9, 30])
    cache.extend(joining)
    for _ in range(C + 1):
        run_pass(cache, [1] * 6)
    for b in range(6):
        c = cache.extract(b)
        held = np.array(c.keys)[0, 0, :, 0].tolist()
        assert held == list(range(c.start_position, c.offset)) and c.start_position <= c.offset // C * C


def test_rows_with_history_batch_with_their_own_chunks(model):
    """Rows at different offsets (mid-chunk, at a boundary, fresh), with history from
    mlx-lm's own single-sequence cache, prefill right-padded and decode across several
    chunk boundaries in one batch: each gets its tokens (and, up to float noise, its
    logprobs) alone, and the batch drops what no row reads."""
    prompts = [prompt_of(75, 1), prompt_of(23, 2), prompt_of(50, 3), prompt_of(40, 4)]
    done = [61, 0, 48, 17]
    n = 40
    alone = [list(generate_step(mx.array(p), model, max_tokens=n)) for p in prompts]
    caches = [prefill(model, p[:k], 32) if k else make_prompt_cache(model) for p, k in zip(prompts, done)]
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=16)
    try:
        uids = gen.insert([p[k:] for p, k in zip(prompts, done)], max_tokens=[n] * 4, caches=caches,
                          all_tokens=[p[:k] for p, k in zip(prompts, done)])
        out = {u: [] for u in uids}
        widest = 0
        while any(len(t) < n for t in out.values()):
            for r in gen.next()[1]:
                out[r.uid].append((r.token, r.logprobs))
            for c in gen._generation_batch.prompt_cache[:1]:
                assert isinstance(c, BatchChunkedKVCache)
                widest = max(widest, c._idx)
    finally:
        gen.close()
    assert [[t for t, _ in out[u]] for u in uids] == [[t for t, _ in a] for a in alone]
    # Logprobs too: a small error (a query scaled at a position one off) may leave the
    # greedy tokens alone.
    for u, a in zip(uids, alone):
        for (_, got), (_, want) in zip(out[u], a):
            assert mx.abs(got - want).max().item() < 1e-3
    # 115 tokens went through the longest row; the chunked layers held at most two
    # chunks and a prefill pass (a row joining decode brings its last pass along).
    assert 0 < widest <= 2 * C + 16


@pytest.mark.parametrize("p", [5, C, 2 * C, 2 * C + 1, 3 * C - 1, 52, 4 * C, 69])
def test_restore_from_blocks_matches_uncached(model, p):
    """A cache rebuilt from blocks at p (at or inside a chunk, at or inside a block)
    continues with the uncached tokens, alone and merged into a batch."""
    prompt = prompt_of(72, 5)
    bs = 8
    whole = prefill(model, prompt, len(prompt))  # one pass: every token still held
    payloads = extract_blocks(whole, 0, bs, len(prompt) // bs, num_tokens=len(prompt))
    restored = restore_cache(model, payloads[: -(-p // bs)], p)
    chunked = [c for c in restored if isinstance(c, ChunkedKVCache)]
    assert chunked and all(c.offset == p and c.start_position == p // C * C for c in chunked)
    ref = greedy(model, prompt, 12)
    assert greedy(model, prompt[p:], 12, cache=restored) == ref

    again = restore_cache(model, payloads[: -(-p // bs)], p)
    gen = BatchGenerator(model, max_tokens=12, prefill_step_size=16)
    try:
        uids = gen.insert([prompt[p:], prompt_of(30, 6)], caches=[again, None])
        out = []
        while len(out) < 12:
            out += [r.token for r in gen.next_generated() if r.uid == uids[0]]
    finally:
        gen.close()
    assert out == ref


def test_blocks_from_batched_rows_are_the_tokens_they_hold(model):
    """A batched row's chunked entries are the tokens the row still holds, at the right
    columns (after right padding rolled to the left, and columns dropped); older blocks
    lack them while their full-attention entries stay."""
    prompts = [prompt_of(70, 7), prompt_of(60, 8)]
    bs = 8
    gen = BatchGenerator(model, max_tokens=1, prefill_step_size=16)
    try:
        gen.insert(prompts)
        for _ in range(4):  # 64 and 59 tokens: the last pass right-pads the second row
            gen.next()
        batch = gen._prompt_batch
        assert [len(t) for t in batch.tokens] == [64, 59]
        cache = batch.prompt_cache
        assert layer_specs(cache) == (("chunk", C),) * 3 + (("full",),)
        got = [extract_blocks_from_batch(cache, row, 0, bs, n // bs, num_tokens=n)
               for row, n in enumerate([64, 59])]
    finally:
        gen.close()
    for prompt, n, blocks in zip(prompts, [64, 59], got):
        ref = extract_blocks(prefill(model, prompt[:n], n), 0, bs, n // bs, num_tokens=n)
        held = [k for k, b in enumerate(blocks) if b[0] is not None]
        # Some blocks were dropped, none of the last C - 1 tokens (the next query may read them).
        assert held == list(range(held[0], n // bs)) and 0 < held[0] * bs <= n - (C - 1)
        for k, (block, r) in enumerate(zip(blocks, ref)):
            for layer, (e, want) in enumerate(zip(block, r)):
                if e is None:
                    assert layer < 3 and k not in held
                    continue
                assert isinstance(e, KV)
                np.testing.assert_allclose(np.array(e.keys), np.array(want.keys), atol=1e-4)
                np.testing.assert_allclose(np.array(e.values), np.array(want.values), atol=1e-4)
