"""Quantized layers that multiply densely over many tokens (--dense-from): same results, same tokens."""

import copy
import functools
import logging
import os

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from mlxserve import backend
from mlxserve.config import EngineConfig, with_backend_defaults
from mlxserve.engine import warmup
from mlxserve.engine.engine import AsyncEngine, EngineDeadError
from mlxserve.models import dense
from mlxserve.models.dense import DenseAboveLinear, check_dense_from, dense_from, padded_layers, warm_row_counts
from mlxserve.models.load import load
from parity import check_hits_give_the_same_tokens, greedy, prompt_of, run


@functools.lru_cache(maxsize=None)
def quantized(shape="qwen3-tiny"):
    return load(shape, load_format="dummy", quantize_bits=4, progress=False)


def dequantized_copy(model):
    """The reference: the same model with every quantized linear layer replaced by a plain Linear."""
    ref = copy.deepcopy(model)
    swaps = []
    for name, m in ref.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
                              mode=m.mode)
            dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            dense.weight = w
            if "bias" in m:
                dense.bias = m["bias"]
            swaps.append((name, dense))
    ref.update_modules(tree_unflatten(swaps))
    return ref


def test_dense_layers_compute_what_the_quantized_ones_do():
    loaded = quantized()
    model = loaded.model
    reference = dequantized_copy(model)
    tokens = mx.array([prompt_of(40, 1)])
    try:
        assert dense_from(model, 16) > 0
        assert all(type(m) is not nn.QuantizedLinear for _, m in model.named_modules())
        # A prefill of 40 tokens multiplies densely, a one-token step does not: both match the
        # dense reference to float32 rounding.
        cache, ref_cache = make_prompt_cache(model), make_prompt_cache(reference)
        prefill = model(tokens, cache=cache)
        assert mx.allclose(prefill, reference(tokens, cache=ref_cache), atol=1e-4).item()
        step = model(tokens[:, :1], cache=cache)
        assert mx.allclose(step, reference(tokens[:, :1], cache=ref_cache), atol=1e-4).item()
    finally:
        dense_from(model, 0)


def test_a_dense_call_is_really_dense(monkeypatch):
    layer = next(m for _, m in quantized().model.named_modules() if isinstance(m, nn.QuantizedLinear))
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    dense_from(layer, 8)
    try:
        x = mx.random.normal((2, 4, layer.scales.shape[1] * layer.group_size))
        mx.eval(layer(x[:, :3]))  # 6 tokens: quantized matmul
        assert calls == []
        mx.eval(layer(x))  # 8 tokens: dense
        assert calls == [1]
    finally:
        dense_from(layer, 0)
    assert isinstance(layer, DenseAboveLinear)


def test_a_batch_of_rows_is_one_matrix_with_the_same_products(monkeypatch):
    """A batched decode step's (B, 1, K) rows reach MLX's quantized matmul as one (B, K) matrix (MLX's
    CUDA kernels read the whole weight once per leading index), a tied head's too; one row, or one
    prompt, goes as it is. The logits are what mlx's own layers give."""
    from mlx_lm.models import qwen3

    # bfloat16 as served, K over one quantization group: MLX's CUDA GEMM for K = group size (qmm_sm90)
    # did not compile on the GPU machine (its toolkit lacks crt/mma.h).
    model = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256, max_position_embeddings=512, rope_theta=1e4,
        head_dim=32, tie_word_embeddings=True))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    tokens = mx.array([[5], [17], [99]])
    want = model(tokens)
    shapes = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: shapes.append(x.shape) or real(x, *a, **k))
    dense_from(model, 0)
    assert isinstance(model.model.embed_tokens, dense.RowsQuantizedEmbedding)
    got = model(tokens)
    assert shapes and all(len(shape) == 2 and shape[0] == 3 for shape in shapes)
    assert len(shapes) == 1 + sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert mx.array_equal(got, want)
    shapes.clear()
    model(tokens[:1])
    assert all(shape[:2] == (1, 1) for shape in shapes)


def test_greedy_tokens_are_the_same_dense_cached_and_batched():
    """The prefix cache's parity check on a 4-bit model whose prefills multiply densely: a hit
    restores KV a dense prefill wrote and decodes on with the quantized matmul."""
    loaded = quantized()
    try:
        check_hits_give_the_same_tokens(loaded, dict(block_size=16, dense_from=8))
        off = AsyncEngine(loaded, EngineConfig(prefix_cache=False, dense_from=0)).start()
        try:
            quantized_only = run(off, [prompt_of(75, 2)], greedy(12))
        finally:
            off.stop()
        on = AsyncEngine(loaded, EngineConfig(prefix_cache=False, dense_from=8)).start()
        try:
            assert run(on, [prompt_of(75, 2)], greedy(12)) == quantized_only
        finally:
            on.stop()
    finally:
        dense_from(loaded.model, 0)


def test_padded_rows_give_the_same_answer_and_the_warmup_runs_each_count(monkeypatch, caplog):
    """On CUDA a dense call's rows are padded to few counts (models/dense.py) and the warm-up runs
    each of them first: the layer's output, the engine's greedy tokens and the log show it."""
    loaded = quantized()
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear))
    x = mx.random.normal((2, 13, layer.scales.shape[1] * layer.group_size))
    rows = []
    real = mx.matmul
    monkeypatch.setattr(mx, "matmul", lambda a, b: rows.append(a.shape[0] if a.ndim == 2 else None) or real(a, b))
    try:
        dense_from(layer, 8)
        unpadded = layer(x)
        dense_from(layer, 8, row_multiple=16)
        padded = layer(x)
        assert padded.shape == unpadded.shape == (2, 13, layer.weight.shape[0])
        assert mx.allclose(padded, unpadded, atol=1e-5, rtol=1e-5).item()
        assert rows == [None, 32]  # 26 rows padded to 32
        # From --dense-from (8) to a chunk of 40 rows, padded: 16, 32 and 48 for each weight shape.
        dense_from(loaded.model, 8, row_multiple=16)
        rows.clear()
        shapes = padded_layers(loaded.model)
        assert len({m.weight.shape for m in shapes}) == len(shapes) >= 2
        assert warm_row_counts(shapes, 40) == 3 * len(shapes) and sorted(set(rows)) == [16, 32, 48]
    finally:
        dense_from(loaded.model, 0)

    monkeypatch.setitem(backend.ROW_MULTIPLE, "cpu", 16)
    monkeypatch.setattr(warmup, "full_plan", lambda: True)
    caplog.set_level(logging.INFO, logger="mlxserve.engine")
    settings = dict(prefix_cache=False, prefill_chunk_size=40, max_num_seqs=2)
    try:
        off = AsyncEngine(loaded, EngineConfig(dense_from=0, warmup=0, **settings)).start()
        try:
            quantized_only = run(off, [prompt_of(75, 2)], greedy(12))
        finally:
            off.stop()
        on = AsyncEngine(loaded, EngineConfig(dense_from=8, **settings)).start()
        try:
            assert on.warmed.wait(120)
            rows.clear()
            assert run(on, [prompt_of(75, 2)], greedy(12)) == quantized_only
        finally:
            on.stop()
    finally:
        dense_from(loaded.model, 0)
    assert rows and all(r % 16 == 0 for r in rows if r)  # the request's dense calls: padded
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up done")]
    assert len(done) == 1 and "dense row counts" in done[0]


def test_default_by_backend_and_bad_values():
    assert with_backend_defaults(EngineConfig()).dense_from == 8  # the CPU backend the tests run on
    assert check_dense_from(0) == 0 and check_dense_from(300) == 300
    with pytest.raises(EngineDeadError, match="--dense-from must be 0"):
        AsyncEngine(quantized(), EngineConfig(dense_from=-1)).start()


@pytest.mark.parametrize("cuda, users", [(True, {}), (True, {"MLX_MAX_OPS_PER_BUFFER": "100"}), (False, {})])
def test_cuda_graph_limits_only_on_cuda_never_over_the_users_nor_for_peers(monkeypatch, cuda, users):
    """On CUDA mlxserve cuts MLX's graphs smaller (a new prompt length reuses them); Metal reads the
    same variables for its command buffers, a user's own setting wins, and the peer servers that
    `bench serve` starts run on MLX's defaults, not on mlxserve's."""
    from mlxserve import _cuda
    from mlxserve.bench.peers import PEERS, child_env

    names = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")
    for name in names:
        monkeypatch.setenv(name, "")  # records the variable's state, restored after the test
        monkeypatch.delenv(name)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(_cuda, "SET_HERE", {})
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    _cuda.smaller_cuda_graphs()
    got = {k: os.environ.get(k) for k in names}
    if cuda and not users:
        assert got == {"MLX_MAX_OPS_PER_BUFFER": "25", "MLX_MAX_MB_PER_BUFFER": "1000000"}
    else:
        assert got == {"MLX_MAX_OPS_PER_BUFFER": users.get("MLX_MAX_OPS_PER_BUFFER"), "MLX_MAX_MB_PER_BUFFER": None}
    peer = child_env(PEERS["mlx_lm"], None, "/tmp")
    assert {k: peer.get(k) for k in names} == {k: users.get(k) for k in names}
