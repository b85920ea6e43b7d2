"""Where a pipelined decode step's host time goes: building the graph, `mx.async_eval`, reading the
last step's tokens. One process per run (MLX's graph limits are read at start).

    python3 benchmarks/paged-kv/phases.py MODEL_DIR BATCHES

Decodes as mlx-lm's GenerationBatch does (the next step queued before the last one's tokens are
read), with mlx-lm's KV cache, greedy; prints ms per step per phase. If `async_eval` takes most of
the step, queuing a step waits for the one before it and the host's work is not hidden behind the
device's.
"""

from __future__ import annotations

import os
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def run(model, batch: int, steps: int = 64) -> tuple[float, float, float, float]:
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (batch, 128))
    tokens = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(tokens)
    build = queue = read = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(tokens[:, None], cache=cache)[:, -1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        tokens.tolist()
        t3 = time.perf_counter()
        build, queue, read = build + t1 - t0, queue + t2 - t1, read + t3 - t2
        tokens = nxt
    mx.eval(tokens)
    total = time.perf_counter() - start
    return tuple(1e3 * v / steps for v in (total, build, queue, read))


def main() -> None:
    model, _ = load(sys.argv[1])
    limits = {k: os.environ.get(k, "MLX's") for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")}
    print(f"{mx.default_device()}, graph limits {limits}")
    print("| batch | ms/step | build graph | async_eval | read last tokens |\n|---|---|---|---|---|")
    for batch in (int(b) for b in sys.argv[2].split(",")):
        run(model, batch, 8)  # kernels compiled
        best = min((run(model, batch) for _ in range(3)), key=lambda r: r[0])
        print(f"| {batch} | " + " | ".join(f"{v:.2f}" for v in best) + " |", flush=True)


if __name__ == "__main__":
    main()
