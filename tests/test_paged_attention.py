"""Attention over block tables (mlxserve/cache/paged_attention.py) against MLX's SDPA on contiguous KV.

Each case draws rows of ragged KV lengths, lays each row's KV out contiguously (the reference's
input) and scatters it into a block pool through a random block table: blocks in shuffled order,
the first rows sharing prefix blocks, a partial last block whose unused slots hold large garbage,
unused pool blocks of garbage, tables padded with -1 and stray ids. Reading any position the
table does not name for a row, or missing a mask, moves the output far past the tolerance.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.cache import paged_attention as paged
from mlxserve.cache.paged_attention import _combine, paged_attention, partitions

TOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
if mx.default_device().type == mx.gpu:
    # MLX runs float32 matmuls in TF32 on GPUs that have it (MLX_ENABLE_TF32, on by default): the
    # reference's unfused path (masked rows) is then good to about 1e-3. A misread block or a missed
    # mask is off by far more (the garbage around the rows' KV is 50 times larger).
    TOL[mx.float32] = 5e-3


def make_case(seed, *, B, kv_heads, group, D, S, L, dtype=mx.float32, min_len=1, max_len=80, shared=2,
              window=None):
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(L, min_len), max_len + 1, size=B)
    lens[0] = max(lens[0], shared * S + L)  # rows 0 and 1 share `shared` full blocks
    if B > 1:
        lens[1] = max(lens[1], shared * S + L)
    lens[-1] = max(L, (lens[-1] // S) * S + (S // 2 if S > 1 else 0))  # a partial last block, for sure
    q_heads = kv_heads * group
    keys = [rng.standard_normal((kv_heads, n, D)).astype(np.float32) for n in lens]
    values = [rng.standard_normal((kv_heads, n, D)).astype(np.float32) for n in lens]
    if B > 1:
        keys[1][:, :shared * S] = keys[0][:, :shared * S]
        values[1][:, :shared * S] = values[0][:, :shared * S]
    n_blocks = [-(-int(n) // S) for n in lens]
    spare = 3
    total = sum(n_blocks) - (shared if B > 1 else 0) + spare
    ids = rng.permutation(total)
    k_pool = (rng.standard_normal((total, kv_heads, S, D)) * 50).astype(np.float32)  # garbage everywhere
    v_pool = (rng.standard_normal((total, kv_heads, S, D)) * 50).astype(np.float32)
    width = max(n_blocks) + 2
    tables = np.full((B, width), -1, dtype=np.int32)
    tables[:, -1] = rng.integers(0, total, size=B)  # stray ids past every row's length
    nxt = 0
    for b in range(B):
        for t in range(n_blocks[b]):
            if b == 1 and t < shared:
                tables[b, t] = tables[0, t]
                continue
            blk = ids[nxt]
            nxt += 1
            tables[b, t] = blk
            chunk = slice(t * S, min((t + 1) * S, lens[b]))
            used = chunk.stop - chunk.start
            k_pool[blk, :, :used] = keys[b][:, chunk]
            v_pool[blk, :, :used] = values[b][:, chunk]
    queries = rng.standard_normal((B, q_heads, L, D)).astype(np.float32)
    cast = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    case = dict(queries=cast(queries), k_pool=cast(k_pool), v_pool=cast(v_pool),
                block_tables=mx.array(tables), kv_lens=mx.array(lens.astype(np.int32)),
                scale=1 / math.sqrt(D), window=window)
    return case, [cast(k) for k in keys], [cast(v) for v in values]


def reference(case, keys, values):
    """MLX's SDPA, one row at a time, on that row's contiguous KV."""
    q, window = case["queries"], case["window"]
    L = q.shape[2]
    outs = []
    for b, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[1]
        mask = "causal" if L > 1 else None
        if window is not None:
            pos = np.arange(n)
            qpos = n - L + np.arange(L)
            mask = mx.array((pos[None] <= qpos[:, None]) & (pos[None] > qpos[:, None] - window))
        outs.append(mx.fast.scaled_dot_product_attention(q[b:b + 1], k[None], v[None], scale=case["scale"],
                                                         mask=mask))
    return mx.concatenate(outs, axis=0)


def max_error(case, keys, values, kernel):
    out = paged_attention(**case, kernel=kernel)
    assert out.shape == case["queries"].shape and out.dtype == case["queries"].dtype
    ref = reference(case, keys, values)
    return mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))).item()


CASES = [  # (seed, B, kv_heads, group, D, S, L, dtype, window)
    (0, 3, 2, 1, 64, 16, 1, mx.float32, None),     # decode, MHA
    (1, 4, 2, 4, 64, 16, 1, mx.float32, None),     # decode, GQA 4:1
    (2, 3, 1, 2, 128, 8, 5, mx.float32, None),     # a prefill chunk, GQA 2:1
    (3, 2, 2, 2, 256, 16, 7, mx.float32, None),
    (4, 3, 2, 2, 128, 16, 1, mx.float16, None),
    (5, 3, 2, 4, 64, 32, 6, mx.bfloat16, None),
    (6, 3, 2, 2, 64, 16, 4, mx.float32, 20),       # sliding window
    (7, 2, 1, 3, 64, 1, 3, mx.float32, None),      # one-token blocks, GQA 3:1
]


def _case(params):
    seed, B, kv_heads, group, D, S, L, dtype, window = params
    return make_case(seed, B=B, kv_heads=kv_heads, group=group, D=D, S=S, L=L, dtype=dtype, window=window)


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"seed{p[0]}")
def test_gather_matches_sdpa_on_contiguous_kv(params):
    case, keys, values = _case(params)
    assert max_error(case, keys, values, "gather") < TOL[params[7]]


def test_cpu_picks_the_gather_path():
    case, keys, values = _case(CASES[1])
    with mx.stream(mx.cpu):
        out = paged_attention(**case)
        assert mx.array_equal(out, paged_attention(**case, kernel="gather")).item()


KERNELS = [
    pytest.param("cuda", marks=pytest.mark.skipif(not mx.cuda.is_available(),
                                                  reason="no CUDA GPU here: mx.cuda.is_available() is False")),
    pytest.param("metal", marks=pytest.mark.skipif(not mx.metal.is_available(),
                                                   reason="no Metal GPU here: mx.metal.is_available() is False")),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"seed{p[0]}")
def test_kernel_matches_sdpa_on_contiguous_kv(kernel, params):
    case, keys, values = _case(params)
    assert max_error(case, keys, values, kernel) < TOL[params[7]]


# Lone long rows: the launch splits their keys into partitions and merges them (with a window and a
# prefill chunk too, whose queries then straddle partitions).
LONG_ROWS = {
    "long-row": dict(B=1, kv_heads=1, group=4, D=128, S=16, L=1, min_len=2000, max_len=2500, shared=0),
    "long-window-chunk": dict(B=1, kv_heads=1, group=2, D=64, S=16, L=3, min_len=1500, max_len=2000, shared=0,
                              window=700),
}


def _long_case(name):
    case, keys, values = make_case(11, **LONG_ROWS[name])
    assert paged.launch_shape(case["queries"], case["k_pool"], case["block_tables"])[2] > 1
    return case, keys, values


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", LONG_ROWS)
def test_kernel_splits_long_rows_into_partitions(kernel, name):
    case, keys, values = _long_case(name)
    assert max_error(case, keys, values, kernel) < TOL[mx.float32]


@pytest.fixture(scope="module")
def emulated_cuda_kernel():
    """The CUDA kernel's source built for the CPU (tests/cuda_emulator.py), for every case here."""
    from tests import cuda_emulator

    if not cuda_emulator.available():
        pytest.skip("g++ or the CUDA toolkit's headers (cuda_bf16.h) are missing: the CUDA source cannot be "
                    "built for the CPU emulator")
    shapes = [(p[7], p[4], p[5], p[3] * p[6]) for p in CASES]
    shapes += [(mx.float32, c["D"], c["S"], c["group"] * c["L"]) for c in LONG_ROWS.values()]
    instances = sorted({(("T", t), ("D", d), ("S", s), ("W", paged.warps_per_block(rows)))
                        for t, d, s, rows in shapes}, key=str)
    types = ["T", "T", "T", mx.int32, mx.int32, mx.int32, mx.float32]
    # Both kernels: the partitioned one, and the one-partition one that writes the queries' dtype.
    return (cuda_emulator.EmulatedKernel(paged._INPUTS, paged._OUTPUTS, paged._CUDA_SOURCE, paged._CUDA_HEADER,
                                         instances, types),
            cuda_emulator.EmulatedKernel(paged._INPUTS, ["out"], paged._CUDA_WHOLE_SOURCE, paged._CUDA_HEADER,
                                         instances, types))


@pytest.mark.parametrize("params", CASES + list(LONG_ROWS), ids=lambda p: p if isinstance(p, str) else f"seed{p[0]}")
def test_cuda_kernel_source_on_a_cpu_emulator(params, emulated_cuda_kernel, monkeypatch):
    """The CUDA kernel's own text, launched as paged_attention launches it and merged by `_combine`,
    with the GPU's warps emulated on the CPU: its indexing, masks and partitions, here on every run."""
    monkeypatch.setattr(paged, "_cuda_kernel", lambda: emulated_cuda_kernel[0])
    monkeypatch.setattr(paged, "_cuda_whole_kernel", lambda: emulated_cuda_kernel[1])
    if isinstance(params, str):
        (case, keys, values), tol = _long_case(params), TOL[mx.float32]
    else:
        (case, keys, values), tol = _case(params), TOL[params[7]]
    assert max_error(case, keys, values, "cuda") < tol


def test_partials_merge_into_the_whole():
    """What the kernels write per partition (normalized output, log2-sum-exp2), merged by `_combine`,
    is attention over all the keys; an empty partition (past a row's length) changes nothing."""
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 3, 40)).astype(np.float32) * 4
    values = rng.standard_normal((2, 3, 40, 8)).astype(np.float32)
    bounds = [(0, 7), (7, 23), (23, 40), (40, 40)]
    outs, lses = [], []
    for lo, hi in bounds:
        s, v = scores[..., lo:hi], values[..., lo:hi, :]
        if hi == lo:
            outs.append(np.zeros(values.shape[:-2] + (8,), np.float32))
            lses.append(np.full(scores.shape[:-1], -np.inf, np.float32))
            continue
        w = np.exp2(s - s.max(-1, keepdims=True))
        outs.append((w[..., None] * v).sum(-2) / w.sum(-1)[..., None])
        lses.append(s.max(-1) + np.log2(w.sum(-1)))
    merged = _combine(mx.array(np.stack(outs, -2)), mx.array(np.stack(lses, -1)), mx.float32)
    w = np.exp2(scores - scores.max(-1, keepdims=True))
    whole = (w[..., None] * values).sum(-2) / w.sum(-1)[..., None]
    assert np.abs(np.array(merged) - whole).max() < 1e-5


def test_partitions_fill_the_gpu_only_when_the_batch_does_not():
    n, per = partitions(1, 8, 1, 64, 256)  # batch 1, 16k tokens: split
    assert n > 1 and n * per >= 64 and (n - 1) * per < 64
    assert partitions(32, 8, 1, 64, 256) == (1, 64)  # 256 thread blocks already
    assert partitions(1, 8, 1, 1, 256) == (1, 1)


@pytest.mark.parametrize("change, message", [
    (dict(queries=mx.zeros((2, 3, 1, 64))), "multiple"),
    (dict(block_tables=mx.zeros((2, 4), dtype=mx.int64)), "int32"),
    (dict(kv_lens=mx.zeros((3,), dtype=mx.int32)), "kv_lens"),
    (dict(window=0), "window"),
])
def test_bad_shapes_are_refused_with_a_reason(change, message):
    args = dict(queries=mx.zeros((2, 4, 1, 64)), k_pool=mx.zeros((5, 2, 16, 64)), v_pool=mx.zeros((5, 2, 16, 64)),
                block_tables=mx.zeros((2, 4), dtype=mx.int32), kv_lens=mx.ones((2,), dtype=mx.int32), scale=0.125)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def test_metal_kernel_is_opt_in_and_cuda_needs_supported_shapes():
    args = dict(queries=mx.zeros((1, 2, 1, 48)), k_pool=mx.zeros((2, 2, 16, 48)), v_pool=mx.zeros((2, 2, 16, 48)),
                block_tables=mx.zeros((1, 1), dtype=mx.int32), kv_lens=mx.ones((1,), dtype=mx.int32), scale=0.1)
    with pytest.raises(ValueError, match="head dims"):
        paged_attention(**args, kernel="metal")
    out = paged_attention(**args)  # auto: head dim 48 has no kernel, so the gather path serves it anywhere
    assert out.shape == (1, 2, 1, 48)
