"""One decode step's quantized matmuls at B rows: MLX's call shape against one matrix.

    python3 benchmarks/paged-kv/matmul.py MODEL_DIR [BATCHES]

Every quantized linear layer of the model and its tied head (if any), each called once on B rows
as a batched decode step calls them, all evaluated together; best of 6, ms per step. Variants:
- 3d: x (B, 1, K), as mlx-lm's models call them (MLX's CUDA kernels: a batch of B one-row products)
- flat: x (B, K), one matrix (mlxserve's quantized layers: models/dense.py)
The results of 2026-11-28 (benchmarks/paged-kv/matmul-cuda-20261128-*) have two more columns, from
variants measured then and dropped: fewer than 8 rows padded to 8 with zero rows (MLX's GEMM instead
of its vector kernel; slower in the decode step), and a CUDA kernel of mlxserve's reading the weight
once for 2-16 rows (faster here at 3-6 rows, level in serving).
Weights: the model's own (random, 4-bit); every layer's distinct, as in a real step."""

import sys
import time

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models import dense
from mlxserve.models.load import load


def calls(model):
    out = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False) and isinstance(embed, nn.QuantizedEmbedding):
        out.append(embed)
    return out


def step(mods, xs, variant):
    ys = []
    for m in mods:
        x = xs[m.scales.shape[-1] * m.group_size]
        if variant == "3d":
            ys.append(mx.quantized_matmul(x, m["weight"], m["scales"], m.get("biases"), transpose=True,
                                          group_size=m.group_size, bits=m.bits, mode=m.mode))
        else:
            ys.append(dense.quantized_matmul_rows(x, m))
    return ys


def main():
    model = load(sys.argv[1]).model
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16,32").split(",")]
    mods = calls(model)
    dtype = mods[0].scales.dtype
    print(f"{mx.default_device()}, {len(mods)} quantized matmuls a step; ms per step's matmuls, best of 6")
    print("| rows | 3d (MLX as called) | flat (one matrix) | 3d / flat |\n|---|---|---|---|")
    for b in batches:
        xs = {k: mx.random.normal((b, 1, k)).astype(dtype) for k in {m.scales.shape[-1] * m.group_size for m in mods}}
        mx.eval(xs)
        ms = {}
        for variant in ("3d", "flat"):
            best = float("inf")
            for _ in range(6):
                t = time.perf_counter()
                mx.eval(step(mods, xs, variant))
                best = min(best, time.perf_counter() - t)
            ms[variant] = best * 1e3
        print(f"| {b} | {ms['3d']:.2f} | {ms['flat']:.2f} | {ms['3d'] / ms['flat']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
