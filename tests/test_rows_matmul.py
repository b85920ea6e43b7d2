"""The rows kernel (models/rows_matmul.py, --rows-kernel): a quantized matmul over a few rows that reads
the weight once. Its CUDA source runs on the GPU where there is one, else on the CPU emulator of the
CUDA kernel (tests/cuda_emulator.py); either way against MLX's own quantized matmul."""

import functools

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxserve.models import dense, rows_matmul
from mlxserve.models.load import load

# (dtype, bits, group size, rows, K, N): row counts from 2 to the most, both bit widths, the group
# sizes models use, N not a multiple of a thread block's columns.
CASES = [(mx.float32, 4, 64, r, 256, 40) for r in (2, 3, 7, 9, rows_matmul.MAX_ROWS)] + [
    (mx.bfloat16, 4, 64, 4, 512, 24), (mx.float16, 4, 32, 3, 128, 20), (mx.float32, 8, 64, 5, 256, 16),
    (mx.bfloat16, 8, 128, 8, 256, 36), (mx.float32, 4, 128, 2, 384, 8)]
TOL = {mx.float32: 1e-3, mx.float16: 4e-3, mx.bfloat16: 2e-2}  # relative to the output's largest value


@pytest.fixture(scope="module")
def kernel():
    """The real kernel on CUDA; elsewhere its source built for the CPU emulator."""
    if mx.cuda.is_available():
        return rows_matmul._kernel()
    from tests import cuda_emulator

    if not cuda_emulator.available():
        pytest.skip("no GPU, and g++ or the CUDA toolkit's headers are missing for the CPU emulator")
    instances = sorted({(("T", t), ("R", r), ("G", g), ("BITS", b)) for t, b, g, r, _, _ in CASES}
                       | {(("T", mx.float32), ("R", r), ("G", 64), ("BITS", 4)) for r in (2, 3)}, key=str)
    return cuda_emulator.EmulatedKernel(rows_matmul.INPUTS, ["out"], rows_matmul._SOURCE, rows_matmul._HEADER,
                                        instances, ["T", mx.uint32, "T", "T"])


def quantized_weight(n, k, group_size, bits, dtype, seed):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return q, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}bit-g{c[2]}-r{c[3]}")
def test_the_kernel_multiplies_as_mlx_does(case, kernel):
    """Each row's product with the dequantized weight, within the dtype's rounding."""
    dtype, bits, group_size, rows, k, n = case
    q, scales, biases = quantized_weight(n, k, group_size, bits, dtype, seed=rows)
    x = mx.random.normal((rows, k), key=mx.random.key(100 + rows)).astype(dtype)
    got = rows_matmul.launch(x, q, scales, biases, group_size, bits, kernel=kernel)
    w = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    want = x.astype(mx.float32) @ w.T
    assert got.shape == (rows, n) and got.dtype == dtype
    err = mx.abs(got.astype(mx.float32) - want).max().item() / mx.abs(want).max().item()
    assert err < TOL[dtype], err


def test_what_the_kernel_does_not_take_stays_with_mlx():
    q, scales, biases = quantized_weight(16, 64, 64, 4, mx.float32, seed=1)
    x = mx.zeros((3, 64))
    assert rows_matmul.supports(x, q, biases, 64, 4, "affine")
    assert not rows_matmul.supports(x, q, None, 64, 4, "affine")  # no biases
    assert not rows_matmul.supports(mx.zeros((17, 64)), q, biases, 64, 4, "affine")  # past MAX_ROWS
    q3, s3, b3 = mx.quantize(mx.zeros((16, 64)), group_size=64, bits=3)
    assert not rows_matmul.supports(x, q3, b3, 64, 3, "affine")  # 3 bits


@functools.lru_cache(maxsize=None)
def tiny_model():
    return load("qwen3-tiny", load_format="dummy", quantize_bits=4, progress=False).model


def logits(model, tokens):
    """A batched decode-shaped call: B rows of one token each, through every quantized layer and the tied head."""
    return model(mx.array(tokens)[:, None])


def test_a_model_gives_the_same_logits_with_its_rows_as_one_matrix_and_through_the_kernel(kernel, monkeypatch):
    """mlxserve's quantized layers multiply (B, 1, K) rows as one (B, K) matrix (what mlx's own layers
    give), and with --rows-kernel the kernel takes 2..MAX_ROWS rows, tied head included."""
    model = tiny_model()
    tokens = [5, 17, 99]
    want = logits(model, tokens)
    try:
        assert dense.rows_kernel(model, 0) > 0  # one matrix, MLX's kernels
        assert mx.array_equal(logits(model, tokens), want)
        monkeypatch.setattr(rows_matmul, "_kernel", lambda: kernel)
        launched = []
        real = rows_matmul.launch
        monkeypatch.setattr(rows_matmul, "launch", lambda *a, **k: launched.append(a[0].shape) or real(*a, **k))
        dense.rows_kernel(model, rows_matmul.MAX_ROWS)
        model.lm_head.rows_kernel = 0  # its 151,936 columns: minutes on the emulator
        got = logits(model, tokens)
        assert launched and all(shape[0] == 3 for shape in launched)
        n_linear = sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        assert len(launched) == n_linear - 1
        assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()
        launched.clear()
        logits(model, [5])  # one row: MLX's own kernel
        assert not launched
    finally:
        dense.rows_kernel(model, 0)


def test_the_setting_is_refused_off_cuda(monkeypatch):
    from mlxserve import backend
    from mlxserve.config import EngineConfig, with_backend_defaults

    monkeypatch.setattr(backend, "name", lambda: "cpu")
    assert with_backend_defaults(EngineConfig()).rows_kernel == 0

    class Loaded:
        model, vision, draft = tiny_model(), None, None

    with pytest.raises(ValueError, match="CUDA kernel"):
        dense.dense_prefill(Loaded, 0, rows=8)
    with pytest.raises(ValueError, match="number of rows"):
        dense.dense_prefill(Loaded, 0, rows=-1)
