"""Paged KV (mlxserve/cache/paged.py) under mlx-lm's BatchGenerator: the same greedy tokens as its
own batch caches, rows holding only the blocks their tokens fill, every block given back.

The engine-level checks (cache hits, batches, --kv-layout paged) are tests/test_prefix_cache.py's
and tests/test_families.py's, parametrized over the layout."""

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.cache import paged
from mlxserve.cache.layers import layer_specs
from mlxserve.engine import runner  # noqa: F401 - installs mlxserve's mlx-lm fixes, as the engine does
from parity import prompt_of

BLOCK = 8


def generate(model, prompts, pool=None, max_tokens=6, watch=None):
    """Greedy tokens of `prompts` batched (prefill chunks of 16 tokens); `watch(gen)` after each step."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=3, prefill_step_size=16)
    caches = [make_prompt_cache(model) for _ in prompts]
    if pool is not None:
        caches = [pool.adopt(c) for c in caches]
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

    paged.install()
    attended = []
    monkeypatch.setattr(paged, "paged_attention", lambda q, *a, _real=paged.paged_attention, **k:
                        attended.append(q.shape[2]) or _real(q, *a, **k))
    pool = paged.KVBlocks(BLOCK)
    held = []

    def watch(gen):
        for batch in (gen._prompt_batch, gen._generation_batch):
            layer = next((c for c in batch.prompt_cache if isinstance(c, paged.PagedBatchKVCache)), None)
            if layer is not None:
                # Each row holds the blocks its own tokens fill, none for the batch's padding.
                assert [len(t) for t in layer.rows.tables] == [-(-n // BLOCK) for n in layer.rows.lengths]
                assert layer_specs([layer]) == (("full",),)
        held.append(pool.used_blocks)

    assert generate(model, prompts, pool, watch=watch) == reference
    assert 1 in attended and max(attended) > 1  # decode steps and prefill chunks read the blocks
    assert max(held) > 0 and pool.used_blocks == 0  # every finished row gave its blocks back

