"""One decode step's quantized matmuls at B rows: MLX's call shape against one matrix and the rows kernel.

    python3 benchmarks/paged-kv/matmul.py MODEL_DIR [BATCHES]

Every quantized linear layer of the model and its tied head (if any), each called once on B rows
as a batched decode step calls them, all evaluated together; best of 5, ms per step. Variants:
- 3d: x (B, 1, K), as mlx-lm's models call them (MLX's CUDA kernels: a batch of B one-row products)
- flat: x (B, K), one matrix (mlxserve's quantized layers always)
- pad8: flat, with fewer than 8 rows padded to 8 by zero rows (MLX's CUDA GEMM instead of qmv)
- rows: models/rows_matmul.py's kernel (B <= its MAX_ROWS), the weight read once for all rows
Weights: the model's own (random, 4-bit); every layer's distinct, as in a real step."""

import sys
import time

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models import rows_matmul
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
        args = (m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits, m.mode)
        if variant == "3d":
            ys.append(mx.quantized_matmul(x, *args[:3], transpose=True, group_size=m.group_size, bits=m.bits,
                                          mode=m.mode))
        else:
            ys.append(rows_matmul.quantized_rows(x, *args, kernel_rows=rows_matmul.MAX_ROWS if variant == "rows" else 0,
                                                 pad_rows=8 if variant == "pad8" else 0))
    return ys


def main():
    model = load(sys.argv[1]).model
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16,32").split(",")]
    mods = calls(model)
    dtype = mods[0].scales.dtype
    print(f"{mx.default_device()}, {len(mods)} quantized matmuls a step; ms per step's matmuls, best of 5")
    print("| rows | 3d (MLX as called) | flat (one matrix) | pad8 | rows kernel | 3d / best |\n|---|---|---|---|---|---|")
    for b in batches:
        xs = {k: mx.random.normal((b, 1, k)).astype(dtype) for k in {m.scales.shape[-1] * m.group_size for m in mods}}
        mx.eval(xs)
        ms = {}
        for variant in ("3d", "flat", "pad8", "rows"):
            if variant == "rows" and (b > rows_matmul.MAX_ROWS or not mx.cuda.is_available()):
                continue
            best = float("inf")
            for _ in range(6):
                t = time.perf_counter()
                mx.eval(step(mods, xs, variant))
                best = min(best, time.perf_counter() - t)
            ms[variant] = best * 1e3
        rows = f"{ms['rows']:.2f}" if "rows" in ms else "-"
        print(f"| {b} | {ms['3d']:.2f} | {ms['flat']:.2f} | {ms['pad8']:.2f} | {rows} | {ms['3d'] / min(ms.values()):.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
