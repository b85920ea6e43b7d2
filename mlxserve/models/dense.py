"""Quantized linear layers that multiply densely over many tokens.

MLX's quantized matmul reads the packed weight once per call: the right kernel for a few tokens
(decoding). Over many tokens (prefill) its CUDA and CPU kernels run far below the same backend's
dense matmul: on an H200 a 4B 4-bit model prefilled 1.4-1.8x faster with the weight dequantized
first, on the CPU with OpenBLAS a 0.6B 4-bit model 12x faster
(benchmarks/dense-prefill-cuda-20261125-1650.md). So over at least `dense_from` tokens these layers
dequantize their weight (a temporary the size of the dense weight, freed after the layer) and
multiply densely; below, they are mlx's layer unchanged. Metal is not measured: off there.

On CUDA a dense call's rows are padded up to a multiple of `row_multiple`: a row count met for
the first time cost 1-8 ms per weight shape in the dense matmul (cuBLASLt choosing its algorithm;
a 4B model's prefill at a new length 12-28 ms more than the same length again). With the rows
padded there are few counts and the warm-up (`warm_row_counts`) runs each of them: passes at new
lengths 8% faster, repeats 4-7% slower (benchmarks/first-length-cuda-20261125-1944.md).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models.rows_matmul import quantized_rows

log = logging.getLogger("mlxserve.models")

# The default threshold is mlxserve.backend.DEFAULTS["dense_from"]. CUDA: prefill chunks (and batched
# prompts) reach 512, decode batches and speculative verification stay below; from 512 tokens every
# layer shape measured was faster dense (1.0-2.1x), below some were slower. CPU: the dense matmul
# wins from 8 tokens on.


class DenseAboveLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that dequantizes its weight for calls over `dense_from` tokens or more."""

    dense_from = 0
    row_multiple = 1  # a dense call's rows are padded up to a multiple of this
    rows_kernel = 0  # the most rows (from 2) that take models/rows_matmul.py's kernel; 0: none
    pad_rows = 0  # calls of 2 rows to fewer than this are padded up to it with zero rows; 0: none

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
            return y + self["bias"] if "bias" in self else y
        y = quantized_rows(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                           self.mode, self.rows_kernel, self.pad_rows)
        return y + self["bias"] if "bias" in self else y


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose tied head (`as_linear`) multiplies all rows as one matrix."""

    rows_kernel = 0
    pad_rows = 0

    def as_linear(self, x):
        return quantized_rows(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                              self.mode, self.rows_kernel, self.pad_rows)


def check_dense_from(tokens: int) -> int:
    """The --dense-from setting (its default filled in by `config.with_backend_defaults`); 0 is off."""
    if tokens < 0:
        raise ValueError(f"--dense-from must be 0 (off) or a number of tokens, not {tokens}")
    return tokens


def dense_from(model: nn.Module, tokens: int, row_multiple: int = 1) -> int:
    """Make `model`'s quantized linear layers multiply densely from `tokens` tokens a call (0: never),
    their rows padded up to a multiple of `row_multiple`.

    Returns how many layers changed. (The layers keep their weights: only their class changes, to
    a subclass whose call differs above the threshold.)
    """
    n = 0
    for _, m in model.named_modules():
        if type(m) in (nn.QuantizedLinear, DenseAboveLinear):
            m.__class__ = DenseAboveLinear
            m.dense_from = tokens
            m.row_multiple = row_multiple
            n += 1
    return n


def rows_kernel(model: nn.Module, most: int, pad_rows: int = 0) -> int:
    """Send `model`'s quantized matmuls (its linear layers and a tied head) of 2 to `most` rows to
    models/rows_matmul.py's kernel (0: none); every call multiplies its rows as one matrix either way.
    Returns how many layers changed (their class, not their weights)."""
    n = 0
    for _, m in model.named_modules():
        if type(m) in (nn.QuantizedLinear, DenseAboveLinear):
            m.__class__ = DenseAboveLinear
        elif type(m) in (nn.QuantizedEmbedding, RowsQuantizedEmbedding):
            m.__class__ = RowsQuantizedEmbedding
        else:
            continue
        m.rows_kernel = most
        m.pad_rows = pad_rows
        n += 1
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


def dense_prefill(loaded, setting: int, rows: int = 0, pad_rows: int = 0) -> None:
    """Apply the --dense-from, --rows-kernel and --pad-rows settings to a loaded model and its draft model."""
    from mlxserve import backend

    if rows < 0 or pad_rows < 0:
        raise ValueError(f"--rows-kernel and --pad-rows must be 0 (off) or a number of rows, not {min(rows, pad_rows)}")
    if rows >= 2 and backend.name() != "cuda":
        raise ValueError(f"--rows-kernel is a CUDA kernel; this backend is {backend.name()}: use 0")
    if sum(rows_kernel(m, rows, pad_rows) for m in served_models(loaded)) and max(rows, pad_rows) > 2:
        log.info("quantized matmuls: 2-%d rows padded to %d (--pad-rows); 2-%d rows in mlxserve's kernel "
                 "(--rows-kernel)", pad_rows - 1, pad_rows, rows)
    tokens = check_dense_from(setting)
    if sum(dense_from(m, tokens, backend.dense_row_multiple()) for m in served_models(loaded)) and tokens:
        log.info("quantized layers multiply densely from %d tokens a call (--dense-from)", tokens)
