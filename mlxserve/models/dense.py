"""Quantized linear layers that multiply densely over many tokens.

MLX's quantized matmul reads the packed weight once per call: the right kernel for a few tokens
(decoding). Over many tokens (prefill) its CUDA and CPU kernels run far below the same backend's
dense matmul: on an H200 a 4B 4-bit model prefilled 1.4-1.8x faster with the weight dequantized
first, on the CPU with OpenBLAS a 0.6B 4-bit model 12x faster
(benchmarks/dense-prefill-cuda-20261125-1650.md). So over at least `dense_from` tokens these layers
dequantize their weight (a temporary the size of the dense weight, freed after the layer) and
multiply densely; below, they run MLX's quantized matmul. Metal is not measured: off there.

On CUDA a dense call's rows are padded up to a multiple of `row_multiple`: a row count met for
the first time cost 1-8 ms per weight shape in the dense matmul (cuBLASLt choosing its algorithm;
a 4B model's prefill at a new length 12-28 ms more than the same length again). With the rows
padded there are few counts and the warm-up (`warm_row_counts`) runs each of them: passes at new
lengths 8% faster, repeats 4-7% slower (benchmarks/first-length-cuda-20261125-1944.md).

A batch's rows are one matrix here (`quantized_matmul_rows`). mlx-lm's models call a layer on a
decode step's (B, 1, K) rows, and MLX's CUDA kernels (0.32) take the leading axes as a batch of
one-row products, each reading the whole packed weight: a qwen3-4b step's matmuls at 16 rows took
27 ms against 4.5 ms as one (16, K) matrix, the step 32.7 against 14.0 ms on an H200
(benchmarks/paged-kv/matmul-cuda-20261128-*). Each output row is its own input row's product either
way; the reshapes are views.
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


def quantized_matmul_rows(x: mx.array, layer) -> mx.array:
    """`layer`'s quantized weight times x (transposed, as a linear layer), all of x's rows as one
    matrix: (B, 1, K) is multiplied as (B, K). Where the leading axes hold one matrix already (a
    lone request, a prompt) x goes as it is, without the reshapes' cost."""
    k = x.shape[-1]
    one = x.ndim <= 2 or x.size == x.shape[-2] * k
    y = mx.quantized_matmul(x if one else x.reshape(-1, k), layer["weight"], scales=layer["scales"],
                            biases=layer.get("biases"), transpose=True, group_size=layer.group_size,
                            bits=layer.bits, mode=layer.mode)
    return y if one else y.reshape(*x.shape[:-1], y.shape[-1])


class DenseAboveLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that dequantizes its weight for calls over `dense_from` tokens or more,
    and below multiplies its rows as one matrix."""

    dense_from = 0
    row_multiple = 1  # a dense call's rows are padded up to a multiple of this

    def __call__(self, x):
        if self.dense_from and x.size >= self.dense_from * x.shape[-1]:
            w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                              bits=self.bits, mode=self.mode)
            rows = x.size // x.shape[-1]
            pad = -rows % self.row_multiple
            if pad:  # zero rows below the real ones: each output row is its input row's alone
                y = mx.matmul(mx.pad(x.reshape(rows, -1), [(0, pad), (0, 0)]), w.T)[:rows]
                y = y.reshape(*x.shape[:-1], -1)
            else:
                y = mx.matmul(x, w.T)
        else:
            y = quantized_matmul_rows(x, self)
        return y + self["bias"] if "bias" in self else y


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose tied head (`as_linear`) multiplies its rows as one matrix."""

    def as_linear(self, x):
        return quantized_matmul_rows(x, self)


def check_dense_from(tokens: int) -> int:
    """The --dense-from setting (its default filled in by `config.with_backend_defaults`); 0 is off."""
    if tokens < 0:
        raise ValueError(f"--dense-from must be 0 (off) or a number of tokens, not {tokens}")
    return tokens


def dense_from(model: nn.Module, tokens: int, row_multiple: int = 1) -> int:
    """Make `model`'s quantized linear layers multiply densely from `tokens` tokens a call (0: never),
    their rows padded up to a multiple of `row_multiple`.

    Below the threshold they, and a tied head, multiply a batch's rows as one matrix
    (`quantized_matmul_rows`). Returns how many linear layers changed. (The layers keep their
    weights: only their class changes, to a subclass whose call differs.)
    """
    n = 0
    for _, m in model.named_modules():
        if type(m) in (nn.QuantizedLinear, DenseAboveLinear):
            m.__class__ = DenseAboveLinear
            m.dense_from = tokens
            m.row_multiple = row_multiple
            n += 1
        elif type(m) is nn.QuantizedEmbedding:  # a tied head's rows as one matrix too
            m.__class__ = RowsQuantizedEmbedding
    return n


def padded_layers(model: nn.Module) -> list[DenseAboveLinear]:
    """One of `model`'s dense layers whose rows are padded for each weight shape."""
    shapes = {}
    for _, m in model.named_modules():
        if isinstance(m, DenseAboveLinear) and m.dense_from and m.row_multiple > 1:
            shapes.setdefault((m.weight.shape, m.scales.shape, m.bits, m.group_size, m.mode, "bias" in m), m)
    return list(shapes.values())


def warm_row_counts(layers: list[DenseAboveLinear], up_to: int) -> int:
    """Run one dense call of each padded row count up to `up_to` rows (a prefill chunk) on each
    layer, so that no prefill meets a count first. Returns how many calls ran."""
    calls = 0
    for m in layers:
        step = m.row_multiple
        for rows in range(-(-m.dense_from // step) * step, up_to + step, step):
            mx.eval(m(mx.zeros((rows, m.scales.shape[-1] * m.group_size), m.scales.dtype)))
            calls += 1
    return calls


def served_models(loaded) -> list[nn.Module]:
    """A loaded model's modules that hold its layers: the model and its draft model. (A VLM's
    `model` is its text half, models/vlm.py TextModel: the whole model holds the tower too.)"""
    draft = getattr(loaded, "draft", None)
    models = [loaded.vision.model if loaded.vision is not None else loaded.model]
    return models + ([draft.model] if draft is not None else [])


def dense_prefill(loaded, setting: int) -> None:
    """Apply the --dense-from setting to a loaded model and its draft model (their quantized layers
    multiply a batch's rows as one matrix whatever the setting)."""
    from mlxserve import backend

    tokens = check_dense_from(setting)
    if sum(dense_from(m, tokens, backend.dense_row_multiple()) for m in served_models(loaded)) and tokens:
        log.info("quantized layers multiply densely from %d tokens a call (--dense-from)", tokens)
