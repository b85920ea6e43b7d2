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
}


def name() -> str:
    """The backend MLX computes on by default: cpu, metal or cuda."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def default(setting: str) -> int:
    """`setting`'s default on this backend."""
    return DEFAULTS[setting][name()]
