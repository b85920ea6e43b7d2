"""Paged KV (mlxserve/cache/paged.py, paged_batch.py) under mlx-lm's BatchGenerator: the same greedy tokens as its
own batch caches, rows holding only the blocks their tokens fill, every block given back.

The engine-level checks (cache hits, batches, --kv-layout paged) are tests/test_prefix_cache.py's
and tests/test_families.py's, parametrized over the layout."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.cache import paged, paged_batch
from mlxserve.cache.layers import layer_specs
from mlxserve.engine import runner  # noqa: F401 - installs mlxserve's mlx-lm fixes, as the engine does
from parity import prompt_of

BLOCK = 8


def generate(model, prompts, pool=None, max_tokens=6, watch=None):
    """Greedy tokens of `prompts` batched (prefill chunks of 16 tokens); `watch(gen)` after each step."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=3, prefill_step_size=16)
    caches = [make_prompt_cache(model) for _ in prompts]
    if pool is not None:
        caches = [paged_batch.adopt(pool, c) for c in caches]
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), caches=caches)
    out = {u: [] for u in uids}
    while len(gen._generation_batch) or len(gen._prompt_batch) or gen._unprocessed_sequences:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
        if watch is not None:
            watch(gen)
    gen.close()
    return [out[u] for u in uids]


def test_batch_gives_the_same_tokens_and_rows_hold_their_own_blocks(tiny, monkeypatch):
    model = tiny("gemma3-tiny").model  # full-attention layers paged beside sliding-window ones
    prompts = [prompt_of(n, seed) for seed, n in enumerate([37, 5, 61, 18, 26])]  # 5 rows, 3 a prefill batch
    reference = generate(model, prompts)

    paged_batch.install()
    attended = []
    monkeypatch.setattr(paged_batch, "paged_attention_gather", lambda q, *a, _real=paged_batch.paged_attention_gather,
                        **k: attended.append(q.shape[2]) or _real(q, *a, **k))  # the CPU's path
    pool = paged.KVBlocks(BLOCK, paged.paged_layers(make_prompt_cache(model)))
    held = []

    def watch(gen):
        for batch in (gen._prompt_batch, gen._generation_batch):
            layer = next((c for c in batch.prompt_cache if isinstance(c, paged_batch.PagedBatchKVCache)), None)
            if layer is not None:
                # Each row holds the blocks its own tokens fill, none for the batch's padding.
                assert [len(t) for t in layer.rows.tables] == [-(-n // BLOCK) for n in layer.rows.lengths]
                assert layer_specs([layer]) == (("full",),)
        held.append(pool.used_blocks)

    assert generate(model, prompts, pool, watch=watch) == reference
    assert 1 in attended and max(attended) > 1  # decode steps and prefill chunks read the blocks
    assert max(held) > 0 and pool.used_blocks == 0  # every finished row gave its blocks back
    pool.fetch_read = False  # update_and_fetch returns stand-ins: only the attention reads the KV
    assert generate(model, prompts, pool) == reference


def test_stand_ins_only_where_nothing_but_attention_reads_the_kv(tiny):
    """fetch_is_read runs the model with NaN stand-ins for the KV update_and_fetch returns: gemma3's
    layers (sliding ones beside them) pass it to attention only; plamo tiles it first, so it must
    get the real KV."""
    from mlxserve.models.load import load

    assert not paged_batch.fetch_is_read(tiny("gemma3-tiny").model, BLOCK)
    assert paged_batch.fetch_is_read(load("plamo", load_format="dummy", progress=False).model, BLOCK)


def held_while(engine, prompts):
    """Greedy runs of `prompts` together, and the most MLX holds (active memory) between two of the
    engine's steps meanwhile: read on its MLX thread, so no step's temporaries are counted."""
    import threading

    from parity import greedy, run

    most, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], engine.call(held).result())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = run(engine, prompts, greedy(8))
    finally:
        done.set()
        watcher.join()
    return results, max(most[0], engine.call(held).result())


def held() -> int:
    """What MLX holds when no step runs: the steps' work finished, Python's garbage collected."""
    import gc

    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)  # where the batch's steps run
    gc.collect()
    return mx.get_active_memory()


@pytest.fixture(scope="module")
def kv_heavy_model(tmp_path_factory):
    """A llama whose KV outweighs its logits (4 KB a token, a 20k vocabulary): MLX's active memory
    then shows the KV, not a step's outputs."""
    from mlxserve.models.load import load

    config = tmp_path_factory.mktemp("kv-heavy") / "config.json"
    config.write_text(json.dumps(dict(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5, vocab_size=20480, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=False)))
    return load(str(config), load_format="dummy", progress=False)


def long_prefix_run(loaded, layout):
    """One request with an 8k-token prompt alone, then four sharing its prompt together: their hits,
    the paged pool's stats, and MLX's active memory between steps over what it held before any
    request: after the first, and the most while the four ran."""
    import asyncio

    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine

    shared = prompt_of(8192, 1)
    prompts = [shared + prompt_of(40, 10 + i) for i in range(5)]
    engine = AsyncEngine(loaded, EngineConfig(kv_layout=layout, block_size=256, prefill_chunk_size=2048,
                                              max_model_len=8400, warmup=0)).start()
    try:
        base = engine.call(held).result()
        (_, cold), = held_while(engine, prompts[:1])[0]  # alone: the solo path, its blocks stored in the cache
        one = engine.call(held).result() - base
        hits, four = held_while(engine, prompts[1:])  # together: the batch
        stats = asyncio.run(engine.cache_stats())
    finally:
        engine.stop()
    assert cold == 0 and [n for _, n in hits] == [8192] * 4
    return stats, one, four - base


def test_requests_sharing_a_long_prefix_hold_its_kv_once(kv_heavy_model):
    """Issue 35's memory goal: four requests sharing an 8k-token prefix hold its KV once. The first
    request's blocks stay in the pool as the prefix cache's (no copy); the four that follow, run
    together, put them in their tables by reference, each adding only blocks of its own tokens.
    Counted twice: the pool's blocks, and MLX's active memory: the four add to what the first left
    no more than a quarter of its KV; contiguous, each of the four holds a copy of its own."""
    stats, one, four = long_prefix_run(kv_heavy_model, "paged")
    pool = stats["paged_kv"]
    one_request = -(-(8192 + 40 + 8) // pool["block_size"]) * pool["block_bytes"]  # its prompt and output, alone
    assert pool["peak_bytes"] <= 1.25 * one_request, (pool, one_request)
    assert one >= one_request and four - one <= 0.25 * one_request, (one, four, one_request)
    _, one, four = long_prefix_run(kv_heavy_model, "contiguous")
    assert four - one >= 3 * one_request, (one, four, one_request)


def test_paged_refuses_quantized_kv(tiny):
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine, EngineDeadError

    with pytest.raises(EngineDeadError, match="--kv-layout paged takes mlx-lm's text models without --kv-bits"):
        AsyncEngine(tiny("llama-tiny"), EngineConfig(kv_layout="paged", kv_bits=8, warmup=0)).start()


def test_auto_layout_is_paged_on_cuda_only(tiny):
    """The default (auto) runs paged where it measured faster: CUDA; contiguous elsewhere."""
    import asyncio

    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine

    engine = AsyncEngine(tiny("llama-tiny"), EngineConfig(warmup=0)).start()
    try:
        assert ("paged_kv" in asyncio.run(engine.cache_stats())) == mx.cuda.is_available()
    finally:
        engine.stop()
    assert EngineConfig().kv_layout == "auto"
    assert paged_batch.decode_kernel() == ("cuda" if mx.cuda.is_available() else None)


def test_an_idle_pool_gives_back_what_a_burst_grew():
    """The engine shrinks the pool while idle: the prefix cache's blocks move down, their KV intact."""
    import mlx.core as mx
    import numpy as np

    pool = paged.KVBlocks(4, [0], initial_blocks=4)
    burst = pool.allocate(16)  # rows of a burst: the pool grows to 16 blocks
    where = paged.TokenSlots(np.repeat(np.array(burst), 4), np.tile(np.arange(4), 16), 4)
    keys = mx.arange(64 * 2, dtype=mx.float32).reshape(1, 1, 64, 2)
    pool.write(0, where, keys, -keys)
    cached = [paged.PooledKV(pool.ref(b), 0, 4) for b in burst[-3:]]  # what the prefix cache keeps
    kept = [(np.array(e.keys), np.array(e.values)) for e in cached]
    row = pool.allocate(1)
    pool.release(burst)
    assert pool.shrink() == 0  # a running row holds a block: ids must stay
    pool.release(row)
    assert pool.shrink() == 28 and pool.capacity == 4  # it grew to 32 for the row and pool.keys[0].shape[0] == 4
    assert sorted(e.ref.id for e in cached) == [0, 1, 2] and pool.free == [3]
    for e, (k, v) in zip(cached, kept):
        assert np.array_equal(np.array(e.keys), k) and np.array_equal(np.array(e.values), v)
    assert pool.shrink() == 0  # nothing more to give back
    assert set(pool.allocate(2)).isdisjoint({0, 1, 2})
    del cached, e
    assert pool.used_blocks == 2


def test_a_model_that_reshapes_its_kv_before_attention_is_served_alike(tmp_path):
    """plamo tiles its KV heads before attention (query head h reads kv head h % kv_heads): the paged
    batch must attend over what the model passes, not its blocks read as GQA. Batched, cached, from
    disk: the same tokens as alone with the cache off."""
    from mlxserve.models.load import load
    from parity import check_served_alike

    loaded = load("plamo", load_format="dummy", progress=False)
    settings = dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1, warmup=0, kv_layout="paged")
    serving, _ = check_served_alike(loaded, settings, tmp_path / "kv")
    assert serving["batches"] and serving["caches"]


def test_paged_refuses_mlx_vlm_text_models():
    """mlx-vlm's language models (served as text) make their own masks and attention."""
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine, EngineDeadError
    from mlxserve.models.load import load

    loaded = load("qwen3_5_text", load_format="dummy", progress=False)
    assert not paged_batch.attends_through_mlx_lm(loaded.model)
    with pytest.raises(EngineDeadError, match="mlx-vlm's models"):
        AsyncEngine(loaded, EngineConfig(kv_layout="paged", warmup=0)).start()
