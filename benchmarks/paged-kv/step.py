"""Decode step time of mlx-lm's BatchGenerator, its own batch caches against paged KV (issue 35).

    python3 benchmarks/paged-kv/step.py MODEL_DIR [BATCHES]

Per batch size: B prompts of 128 tokens prefilled, then 64 decode steps timed (wall and this
process's CPU time per step), for each of CONFIGS: the KV layout, contiguous (mlx-lm's caches) or
paged (--kv-layout paged's caches, update_and_fetch returning stand-ins where
`paged_batch.fetch_is_read` says only paged attention reads its KV, as the engine does; the layout
"paged-gathered" returns the lazily gathered KV always), and how quantized layers multiply (`matmul`).
Then a cProfile of paged steps at the largest batch (the host's top functions)."""

import cProfile
import pstats
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.cache import paged, paged_batch
from mlxserve.engine import runner  # noqa: F401 - mlxserve's mlx-lm fixes, as the engine has them
from mlxserve.models import dense
from mlxserve.models.load import load

STEPS = 64
# (KV layout, matmul variant): mlx-lm as vllm-mlx runs it, then mlxserve's paged batch with each matmul.
CONFIGS = [("contiguous", "mlx"), ("paged", "mlx"), ("paged", "flat")]


def matmul(model, variant):
    """How the model's quantized layers multiply: "mlx" (mlx's own layers, on mlx-lm's (B, 1, K) call
    shape, as vllm-mlx runs them) or "flat" (mlxserve's: a batch's rows as one matrix)."""
    if variant == "mlx":
        for _, m in model.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                m.__class__ = nn.QuantizedLinear
            elif isinstance(m, nn.QuantizedEmbedding):
                m.__class__ = nn.QuantizedEmbedding
    else:
        dense.dense_from(model, 0)


def run(model, batch, layout, profile=None, fetch_read=False):
    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=2048)
    caches = [make_prompt_cache(model) for _ in range(batch)]
    if layout != "contiguous":
        pool = paged.KVBlocks(256, paged.paged_layers(make_prompt_cache(model)))
        pool.fetch_read = fetch_read or layout == "paged-gathered"
        caches = [paged_batch.adopt(pool, c) for c in caches]
    prompts = [[(7 * r + 13 * i) % 1000 + 10 for i in range(128)] for r in range(batch)]
    gen.insert(prompts, max_tokens=[STEPS + 8] * batch, caches=caches)
    while len(gen._generation_batch) < batch:  # prefill and the first steps, untimed
        gen.next()
    for _ in range(4):
        gen.next()
    mx.synchronize()
    if profile is not None:
        profile.enable()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(STEPS):
        gen.next()
    mx.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profile is not None:
        profile.disable()
    gen.close()
    return wall / STEPS * 1e3, cpu / STEPS * 1e3


def main():
    model = load(sys.argv[1]).model
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16,32").split(",")]
    paged_batch.install()
    fetch_read = paged_batch.fetch_is_read(model, 256)
    print(f"{mx.default_device()}, {STEPS} decode steps after 128-token prompts; fetch_is_read: {fetch_read}")
    print("| batch | layout | matmul | ms/step | host CPU ms/step | tok/s |\n|---|---|---|---|---|---|")
    for batch in batches:
        for layout, variant in CONFIGS:
            matmul(model, variant)
            run(model, batch, layout, fetch_read=fetch_read)  # warm: kernels for these shapes
            ms, cpu = run(model, batch, layout, fetch_read=fetch_read)
            print(f"| {batch} | {layout} | {variant} | {ms:.2f} | {cpu:.2f} | {batch * 1e3 / ms:,.0f} |", flush=True)
    prof = cProfile.Profile()
    matmul(model, "flat")
    run(model, batches[-1], "paged", prof, fetch_read)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
