"""Attention over block tables: the first building block of paged KV (issue 35).

Today the running batch keeps its own contiguous KV and the prefix cache keeps
blocks, so every restore, admission and store copies between the two. With
attention that reads KV through a block table, a request's KV can live in the
blocks themselves. This module is the op; `paged.py` runs the batch over it (--kv-layout paged).

The layout, per attention layer:

- a block pool: keys and values each `(num_blocks, kv_heads, block_size, head_dim)`.
  One (block, kv head) is then `block_size * head_dim` contiguous elements and
  one token's vector `head_dim` contiguous elements: a kernel that walks a
  row's blocks for one kv head reads each block in one contiguous span, a
  lane reads a whole key with 16-byte loads, and the query heads that share
  a kv head (GQA) read the same span. (Tokens-major, `(num_blocks, block_size,
  kv_heads, head_dim)`, would interleave the heads and make each span
  `kv_heads` times shorter.)
- a request's block table: int32 block ids, one row per request, padded to
  the longest row with any value (entries past the row's KV length are never
  read by the kernels; the gather path clips them into range). Rows may share
  blocks (a shared prefix).
- a request's KV length: tokens in its blocks, its new ones included.

Queries are `(B, q_heads, L, head_dim)`: L=1 decodes, L>1 is a chunk of
prefill whose queries are the last L positions of each row's KV (causal
within the chunk). `q_heads` is a multiple of `kv_heads` (GQA). Every row
needs `kv_len >= L`.

Three implementations of one contract, all through `paged_attention`:

- `gather`: pure MLX (take the table's blocks, mask past each row's length
  and causally, `mx.fast.scaled_dot_product_attention`). The reference, and
  the path on the CPU.
- `cuda`: `mx.fast.cuda_kernel`, chosen when `mx.cuda.is_available()`.
- `metal`: `mx.fast.metal_kernel`, the same algorithm, used only when asked
  for (`kernel="metal"`): it has never run (this project has no Mac to
  measure it on), so nothing picks it by default.

The kernels: one warp (simdgroup) per (row, query head, query), its 32 lanes
taking 32 keys at a time (each lane a whole key's dot product against the
query held in shared memory), an online softmax in float32 over the row's
blocks, then each lane accumulating its `head_dim / 32` output dims over
those keys. The warps of one thread block serve query heads of one kv head,
so they read the same blocks. The key range is split into partitions (grid
z) when the batch alone would leave the GPU idle (decode at batch 1: one
block per kv head); each partition writes its normalized partial output and
log-sum-exp, and `_combine` merges them with MLX ops.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
LOG2E = 1.4426950408889634
# Partitioning: aim for this many thread blocks (about two per SM on an H100/H200),
# each partition at least this many tokens (fewer would cost more in combining than they gain).
_TARGET_BLOCKS = 256
_MIN_PART_TOKENS = 512


def paged_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
                    kv_lens: mx.array, scale: float, window: int | None = None,
                    kernel: str = "auto") -> mx.array:
    """Attention of `queries` over the KV that `block_tables` names in the pools.

    queries (B, q_heads, L, D); k_pool, v_pool (num_blocks, kv_heads, block_size, D);
    block_tables (B, max_blocks) int32; kv_lens (B,) int32, each >= L; window: a
    sliding window (a query at position p sees keys p-window+1..p), None for none.
    kernel: auto (the CUDA kernel where CUDA is available and it supports the shapes,
    else gather), gather, cuda or metal (opt-in: never measured). Returns (B, q_heads, L, D)
    in the queries' dtype.
    """
    check_inputs(queries, k_pool, v_pool, block_tables, kv_lens, window)
    if kernel == "auto":
        kernel = (kernel_here() if kernel_supports(queries, k_pool) else None) or "gather"
    if kernel == "gather":
        return paged_attention_gather(queries, k_pool, v_pool, block_tables, kv_lens, scale, window)
    if kernel not in ("cuda", "metal"):
        raise ValueError(f"kernel must be auto, gather, cuda or metal, not {kernel!r}")
    if not kernel_supports(queries, k_pool):
        raise ValueError(f"the {kernel} kernel takes head dims {KERNEL_HEAD_DIMS} and float32, float16 or "
                         f"bfloat16; got {queries.shape[-1]} and {queries.dtype}")
    return paged_attention_kernel(queries, k_pool, v_pool, block_tables, kv_lens, scale, window, kernel)


def kernel_here() -> str | None:
    """The kernel `auto` picks on this device: "cuda" where MLX runs on a CUDA GPU, else None (the
    gather path; the Metal kernel is opt-in: never measured)."""
    return "cuda" if mx.default_device().type == mx.gpu and mx.cuda.is_available() else None


def check_inputs(queries, k_pool, v_pool, block_tables, kv_lens, window) -> None:
    """Shapes and dtypes only: nothing that would wait for the GPU (kv_lens' values are not read)."""
    if queries.ndim != 4 or k_pool.ndim != 4:
        raise ValueError(f"queries and pools must be 4-D, got {queries.shape} and {k_pool.shape}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    B, q_heads, _, D = queries.shape
    _, kv_heads, _, pool_d = k_pool.shape
    if pool_d != D:
        raise ValueError(f"queries' head dim {D} is not the pools' {pool_d}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    if queries.dtype != k_pool.dtype or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"queries {queries.dtype} and pools {k_pool.dtype}/{v_pool.dtype} must share a dtype")
    if block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.dtype != mx.int32:
        raise ValueError(f"block_tables must be ({B}, max_blocks) int32, got {block_tables.shape} {block_tables.dtype}")
    if kv_lens.shape != (B,) or kv_lens.dtype != mx.int32:
        raise ValueError(f"kv_lens must be ({B},) int32, got {kv_lens.shape} {kv_lens.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens or None, got {window}")


def kernel_supports(queries: mx.array, k_pool: mx.array) -> bool:
    return queries.shape[-1] in KERNEL_HEAD_DIMS and k_pool.dtype in KERNEL_DTYPES


def paged_attention_gather(queries, k_pool, v_pool, block_tables, kv_lens, scale, window=None):
    """The reference: the table's blocks gathered into contiguous KV, masked, and MLX's SDPA.

    Gathers every row to the table's full width (max_blocks * block_size): cutting it to
    the longest row would need kv_lens on the host, a wait for the GPU.
    """
    B, _, L, D = queries.shape
    num_blocks, kv_heads, block_size, _ = k_pool.shape
    width = block_tables.shape[1] * block_size
    ids = mx.clip(block_tables, 0, num_blocks - 1)

    def gather(pool):  # (B, max_blocks, H, S, D) -> (B, H, max_blocks * S, D)
        return pool[ids].transpose(0, 2, 1, 3, 4).reshape(B, kv_heads, width, D)

    key_pos = mx.arange(width)
    query_pos = kv_lens[:, None] - L + mx.arange(L)[None, :]  # (B, L)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if window is not None:
        mask = mask & (key_pos[None, None, :] > query_pos[:, :, None] - window)
    return mx.fast.scaled_dot_product_attention(queries, gather(k_pool), gather(v_pool), scale=scale,
                                                mask=mask[:, None])


def partitions(batch: int, kv_heads: int, row_tiles: int, max_blocks: int, block_size: int) -> tuple[int, int]:
    """(partitions, table blocks per partition) for a launch: enough thread blocks to fill the GPU,
    each partition at least _MIN_PART_TOKENS long. From shapes only, so a launch never waits."""
    blocks = batch * kv_heads * row_tiles
    want = max(1, -(-_TARGET_BLOCKS // blocks))
    per_part = max(1, min(max_blocks, max(-(-max_blocks // want), -(-_MIN_PART_TOKENS // block_size))))
    return max(1, -(-max_blocks // per_part)), per_part


def warps_per_block(rows_per_kv_head: int) -> int:
    """Warps in a thread block: one per query row, up to 4, all serving one kv head."""
    return 1 if rows_per_kv_head == 1 else 2 if rows_per_kv_head == 2 else 4


def launch_shape(queries, k_pool, block_tables) -> tuple[int, int, int, int]:
    """(warps per thread block, thread blocks per (row, kv head), partitions, table blocks per partition)."""
    B, q_heads, L, _ = queries.shape
    _, kv_heads, block_size, _ = k_pool.shape
    rows = (q_heads // kv_heads) * L  # query rows per kv head
    warps = warps_per_block(rows)
    tiles = -(-rows // warps)
    return (warps, tiles) + partitions(B, kv_heads, tiles, block_tables.shape[1], block_size)


def paged_attention_kernel(queries, k_pool, v_pool, block_tables, kv_lens, scale, window, backend):
    B, q_heads, L, D = queries.shape
    _, kv_heads, block_size, _ = k_pool.shape
    warps, tiles, n_parts, per_part = launch_shape(queries, k_pool, block_tables)
    params, qscale = _constants(per_part, window or 0, scale)
    launch = dict(inputs=[queries, k_pool, v_pool, block_tables, kv_lens, params, qscale],
                  template=[("T", queries.dtype), ("D", D), ("S", block_size), ("W", warps)],
                  grid=(32 * warps * tiles, B * kv_heads, n_parts), threadgroup=(32 * warps, 1, 1))
    if n_parts == 1 and backend == "cuda":
        return _cuda_whole_kernel()(output_shapes=[queries.shape], output_dtypes=[queries.dtype], **launch)[0]
    build = _cuda_kernel if backend == "cuda" else _metal_kernel
    out, lse = build()(output_shapes=[(B, q_heads, L, n_parts, D), (B, q_heads, L, n_parts)],
                       output_dtypes=[mx.float32, mx.float32], **launch)
    return _combine(out, lse, queries.dtype)


@functools.lru_cache(maxsize=64)
def _constants(per_part: int, window: int, scale: float) -> tuple[mx.array, mx.array]:
    """A launch's small inputs, made once per value: a decode step launches once per layer."""
    return mx.array([per_part, window], dtype=mx.int32), mx.array([scale * LOG2E], dtype=mx.float32)


def _combine(out: mx.array, lse: mx.array, dtype) -> mx.array:
    """Merge partitions: each holds its normalized output and log2-sum-exp2 of its scores."""
    if out.shape[-2] == 1:
        return out[..., 0, :].astype(dtype)
    top = mx.max(lse, axis=-1, keepdims=True)
    top = mx.where(mx.isinf(top), 0.0, top)  # a row with no keys at all (kv_len < L): zeros, not NaN
    weights = mx.exp((lse - top) * math.log(2.0))
    total = mx.sum(weights, axis=-1, keepdims=True)
    merged = mx.sum(out * weights[..., None], axis=-2) / mx.where(total > 0, total, 1.0)
    return merged.astype(dtype)


_INPUTS = ["queries", "k_pool", "v_pool", "block_tables", "kv_lens", "params", "qscale"]
_OUTPUTS = ["out_part", "lse_part"]

_CUDA_HEADER = """
template <typename T> struct alignas(16) PagedPack { T v[16 / sizeof(T)]; };

__device__ __forceinline__ float paged_warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float paged_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
"""

# Template constants: T (dtype), D (head dim), S (block size), W (warps per thread block).
_CUDA_SOURCE = """
  constexpr int DPL = D / 32;                    // output dims per lane
  constexpr int PACK = 16 / sizeof(T);           // elements per 16-byte load
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ float qs[W][D];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int HQ = queries_shape[1];
  const int L = queries_shape[2];
  const int HKV = k_pool_shape[1];
  const int MB = block_tables_shape[1];
  const int G = HQ / HKV;
  const int b = blockIdx.y / HKV;
  const int h = blockIdx.y - b * HKV;
  const int part = blockIdx.z;
  const int n_parts = gridDim.z;
  const int r = blockIdx.x * W + warp;           // query row among this kv head's G * L
  if (r >= G * L) return;                        // whole warps only: nothing below syncs the block
  const int g = r / L;
  const int i = r - g * L;
  const int qh = h * G + g;

  const int q_pos = kv_lens[b] - L + i;          // this query's position in its row
  const int window = params[1];
  const int part_tokens = params[0] * S;
  int lo = window > 0 ? max(0, q_pos - window + 1) : 0;
  int hi = q_pos + 1;
  lo = max(lo, part * part_tokens);
  hi = min(hi, (part + 1) * part_tokens);

  const float qsc = qscale[0];                   // scale * log2(e): softmax in base 2
  const T* q = queries + ((int64_t)(b * HQ + qh) * L + i) * D;
  for (int d = lane; d < D; d += 32) qs[warp][d] = static_cast<float>(q[d]) * qsc;
  __syncwarp();

  const int* table = block_tables + (int64_t)b * MB;
  float m = NEG_INF;
  float l = 0.f;
  float acc[DPL];
#pragma unroll
  for (int k = 0; k < DPL; ++k) acc[k] = 0.f;

  for (int base = lo; base < hi; base += 32) {
    const int j = base + lane;
    const bool valid = j < hi;
    const int blk = valid ? table[j / S] : 0;
    float s = NEG_INF;
    if (valid) {
      const T* kr = k_pool + (((int64_t)blk * HKV + h) * S + (j % S)) * D;
      float dot = 0.f;
#pragma unroll
      for (int d0 = 0; d0 < D; d0 += PACK) {
        const PagedPack<T> pk = *reinterpret_cast<const PagedPack<T>*>(kr + d0);
#pragma unroll
        for (int e = 0; e < PACK; ++e) dot += qs[warp][d0 + e] * static_cast<float>(pk.v[e]);
      }
      s = dot;
    }
    const float m_new = fmaxf(m, paged_warp_max(s));   // finite: lane 0 is always valid
    const float alpha = exp2f(m - m_new);
    const float p = valid ? exp2f(s - m_new) : 0.f;
    l = l * alpha + paged_warp_sum(p);
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] *= alpha;
    // Values, 8 keys at a time: their loads are issued together, before any of them is used
    // (one at a time, each key's row would wait on memory alone).
    const int n = min(32, hi - base);
    int jj = 0;
    for (; jj + 8 <= n; jj += 8) {
      float pu[8];
      T vu[8][DPL];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        pu[u] = __shfl_sync(0xffffffffu, p, jj + u);
        const int bj = __shfl_sync(0xffffffffu, blk, jj + u);
        const T* vr = v_pool + (((int64_t)bj * HKV + h) * S + ((base + jj + u) % S)) * D + lane * DPL;
#pragma unroll
        for (int k = 0; k < DPL; ++k) vu[u][k] = vr[k];
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
#pragma unroll
        for (int k = 0; k < DPL; ++k) acc[k] += pu[u] * static_cast<float>(vu[u][k]);
      }
    }
    for (; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const int bj = __shfl_sync(0xffffffffu, blk, jj);
      const T* vr = v_pool + (((int64_t)bj * HKV + h) * S + ((base + jj) % S)) * D + lane * DPL;
#pragma unroll
      for (int k = 0; k < DPL; ++k) acc[k] += pj * static_cast<float>(vr[k]);
    }
    m = m_new;
  }

  const int64_t row = ((int64_t)(b * HQ + qh) * L + i) * n_parts + part;
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int k = 0; k < DPL; ++k) out_part[row * D + lane * DPL + k] = acc[k] * inv;
  if (lane == 0) lse_part[row] = l > 0.f ? m + log2f(l) : NEG_INF;
"""

# One partition (a short row's decode): the output in the queries' dtype, no partials to combine;
# a decode step saves a cast per layer.
_CUDA_WHOLE_SOURCE = _CUDA_SOURCE[:_CUDA_SOURCE.index("  const int64_t row")] + """  const int64_t row = (int64_t)(b * HQ + qh) * L + i;
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int k = 0; k < DPL; ++k) out[row * D + lane * DPL + k] = static_cast<T>(acc[k] * inv);
"""

# The same algorithm for Metal. NOT RUN: this project has no Mac; opt-in only (kernel="metal").
_METAL_SOURCE = """
  constexpr int DPL = D / 32;
  const float NEG_INF = -INFINITY;
  threadgroup float qs[W * D];

  const uint lane = thread_index_in_simdgroup;
  const uint warp = simdgroup_index_in_threadgroup;
  const int HQ = queries_shape[1];
  const int L = queries_shape[2];
  const int HKV = k_pool_shape[1];
  const int MB = block_tables_shape[1];
  const int G = HQ / HKV;
  const int b = int(threadgroup_position_in_grid.y) / HKV;
  const int h = int(threadgroup_position_in_grid.y) - b * HKV;
  const int part = int(threadgroup_position_in_grid.z);
  const int n_parts = int(threadgroups_per_grid.z);
  const int r = int(threadgroup_position_in_grid.x) * W + int(warp);
  if (r >= G * L) return;
  const int g = r / L;
  const int i = r - g * L;
  const int qh = h * G + g;

  const int q_pos = kv_lens[b] - L + i;
  const int window = params[1];
  const int part_tokens = params[0] * S;
  int lo = window > 0 ? max(0, q_pos - window + 1) : 0;
  int hi = q_pos + 1;
  lo = max(lo, part * part_tokens);
  hi = min(hi, (part + 1) * part_tokens);

  const float qsc = qscale[0];
  const int64_t q_off = ((int64_t)(b * HQ + qh) * L + i) * D;
  for (int d = int(lane); d < D; d += 32) qs[warp * D + d] = static_cast<float>(queries[q_off + d]) * qsc;
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const int64_t t_off = (int64_t)b * MB;
  float m = NEG_INF;
  float l = 0.f;
  float acc[DPL];
  for (int k = 0; k < DPL; ++k) acc[k] = 0.f;

  for (int base = lo; base < hi; base += 32) {
    const int j = base + int(lane);
    const bool valid = j < hi;
    const int blk = valid ? block_tables[t_off + j / S] : 0;
    float s = NEG_INF;
    if (valid) {
      const int64_t k_off = (((int64_t)blk * HKV + h) * S + (j % S)) * D;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += qs[warp * D + d] * static_cast<float>(k_pool[k_off + d]);
      s = dot;
    }
    const float m_new = max(m, simd_max(s));
    const float alpha = exp2(m - m_new);
    const float p = valid ? exp2(s - m_new) : 0.f;
    l = l * alpha + simd_sum(p);
    for (int k = 0; k < DPL; ++k) acc[k] *= alpha;
    const int n = min(32, hi - base);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = simd_shuffle(p, ushort(jj));
      const int bj = simd_shuffle(blk, ushort(jj));
      const int64_t v_off = (((int64_t)bj * HKV + h) * S + ((base + jj) % S)) * D + lane * DPL;
      for (int k = 0; k < DPL; ++k) acc[k] += pj * static_cast<float>(v_pool[v_off + k]);
    }
    m = m_new;
  }

  const int64_t row = ((int64_t)(b * HQ + qh) * L + i) * n_parts + part;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int k = 0; k < DPL; ++k) out_part[row * D + lane * DPL + k] = acc[k] * inv;
  if (lane == 0) lse_part[row] = l > 0.f ? m + log2(l) : NEG_INF;
"""


@functools.cache
def _cuda_kernel():
    """Built once per process; MLX compiles one instance per (T, D, S, W) at its first call."""
    return mx.fast.cuda_kernel(name="paged_attention", input_names=_INPUTS, output_names=_OUTPUTS,
                               source=_CUDA_SOURCE, header=_CUDA_HEADER)


@functools.cache
def _cuda_whole_kernel():
    return mx.fast.cuda_kernel(name="paged_attention_whole", input_names=_INPUTS, output_names=["out"],
                               source=_CUDA_WHOLE_SOURCE, header=_CUDA_HEADER)


@functools.cache
def _metal_kernel():
    return mx.fast.metal_kernel(name="paged_attention", input_names=_INPUTS, output_names=_OUTPUTS,
                                source=_METAL_SOURCE)
