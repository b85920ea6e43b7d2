"""Quantized linear layers that multiply densely over many tokens.

MLX's quantized matmul reads the packed weight once per call: the right kernel for a few tokens
(decoding). Over many tokens (prefill) its CUDA and CPU kernels run far below the same backend's
dense matmul: on an H200 a 4B 4-bit model prefilled 1.4-1.8x faster with the weight dequantized
first, on the CPU with OpenBLAS a 0.6B 4-bit model 12x faster
(benchmarks/dense-prefill-cuda-20261125-1650.md). So over at least `dense_from` tokens these layers
dequantize their weight (a temporary the size of the dense weight, freed after the layer) and
multiply densely; below, they are mlx's layer unchanged. Metal is not measured: off there.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("mlxserve.models")

# The default threshold is mlxserve.backend.DEFAULTS["dense_from"]. CUDA: prefill chunks (and batched
# prompts) reach 512, decode batches and speculative verification stay below; from 512 tokens every
# layer shape measured was faster dense (1.0-2.1x), below some were slower. CPU: the dense matmul
# wins from 8 tokens on.


class DenseAboveLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that dequantizes its weight for calls over `dense_from` tokens or more."""

    dense_from = 0

    def __call__(self, x):
        if self.dense_from and x.size >= self.dense_from * x.shape[-1]:
            w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                              bits=self.bits, mode=self.mode)
            y = mx.matmul(x, w.T)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def check_dense_from(tokens: int) -> int:
    """The --dense-from setting (its default filled in by `config.with_backend_defaults`); 0 is off."""
    if tokens < 0:
        raise ValueError(f"--dense-from must be 0 (off) or a number of tokens, not {tokens}")
    return tokens


def dense_from(model: nn.Module, tokens: int) -> int:
    """Make `model`'s quantized linear layers multiply densely from `tokens` tokens a call (0: never).

    Returns how many layers changed. (The layers keep their weights: only their class changes, to
    a subclass whose call differs above the threshold.)
    """
    n = 0
    for _, m in model.named_modules():
        if type(m) in (nn.QuantizedLinear, DenseAboveLinear):
            m.__class__ = DenseAboveLinear
            m.dense_from = tokens
            n += 1
    return n


def dense_prefill(loaded, setting: int) -> None:
    """Apply the --dense-from setting to a loaded model and its draft model."""
    tokens = check_dense_from(setting)
    draft = getattr(loaded, "draft", None)
    # A VLM's `model` is its text half (models/vlm.py TextModel): the whole model holds the tower too.
    models = [loaded.vision.model if loaded.vision is not None else loaded.model]
    models += [draft.model] if draft is not None else []
    if sum(dense_from(m, tokens) for m in models) and tokens:
        log.info("quantized layers multiply densely from %d tokens a call (--dense-from)", tokens)
