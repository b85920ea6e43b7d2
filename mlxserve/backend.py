"""Which MLX backend computes, and the settings whose defaults differ by backend.

Each default was measured where it differs (config.py's help says where); Metal keeps the plain
choice until it is measured there.
"""

from __future__ import annotations

DEFAULTS = {
    # Tokens from which a quantized layer multiplies densely (models/dense.py); 0: never.
    "dense_from": {"cuda": 512, "cpu": 8, "metal": 0},
    # Prompt tokens a prefill pass takes of each prompt.
    "prefill_chunk_size": {"cuda": 2048, "cpu": 512, "metal": 512},
    # Tokens per prefix-cache block (benchmarks/prefix-*): on a GPU storing a block costs kernel
    # launches per layer, so small blocks slow misses (2k-token miss on an H100: 311 ms at 32, 222 ms
    # at 256). On the CPU hit and miss cost the same from 32 to 256 within noise (2k-token hit
    # 592-646 ms, miss 21.4-22.6 s), so the finest granularity wins: more of each conversation turn
    # (a prompt plus its answer) falls in full blocks.
    "block_size": {"cuda": 256, "cpu": 32, "metal": 256},
}


# Rows of a dense prefill matmul are padded up to a multiple of this (models/dense.py). CUDA: a
# new row count's first call cost 1-8 ms per weight shape; padded to 64 rows (at most 12% more
# work at 512 tokens, 3% at 2048) the warm-up runs every count (benchmarks/first-length-cuda-*).
# CPU (OpenBLAS): no first-call cost measured. Metal: dense layers are off.
ROW_MULTIPLE = {"cuda": 64, "cpu": 1, "metal": 1}


def name() -> str:
    """The backend MLX computes on by default: cpu, metal or cuda."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def default(setting: str) -> int:
    """`setting`'s default on this backend."""
    return DEFAULTS[setting][name()]


def dense_row_multiple() -> int:
    return ROW_MULTIPLE[name()]
