"""A quantized matmul over a few rows that reads the packed weight once (CUDA).

A batched decode step multiplies B rows (one per sequence) by every weight of the model. MLX's
CUDA backend (0.32) runs fewer than 8 rows through its vector kernel (`qmv`) with one grid slice
per row, so each row reads the whole packed weight again; from 8 rows it takes a tiled GEMM.
Reading the weight is the step's main cost, so a step of B rows costs about B lone steps: on an
H100 a qwen3-4b decode step took 7.1 ms at batch 1 and 12.8 ms at batch 4.

This kernel gives each output column one warp, which loads its packed weights once (16 bytes a
lane) and multiplies them into all R rows, accumulating in float32: the weight's bytes are read
once for the R rows. Affine mode, 4 or 8 bits, a group size that is a multiple of one load's
values (32 at 4 bits). Where it runs and from how many rows is chosen by measurement
(`mlxserve.backend`); elsewhere MLX's own kernels run.
"""

from __future__ import annotations

import functools

import mlx.core as mx

MAX_ROWS = 16

_HEADER = """
struct alignas(16) RowsWords { uint32_t w[4]; };
template <typename T> struct alignas(16) RowsPack { T v[16 / sizeof(T)]; };

__device__ __forceinline__ float rows_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
"""

# Template constants: T (dtype), R (rows), G (group size), BITS. One warp a column of the output.
_SOURCE = """
  constexpr int VPW = 32 / BITS;                 // values per 32-bit word
  constexpr int VPL = 4 * VPW;                   // values per 16-byte load of the weight
  constexpr int XP = 16 / sizeof(T);             // x values per 16-byte load
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int N = w_shape[0];
  const int K = x_shape[1];
  if (n >= N) return;                            // whole warps only
  const RowsWords* wr = reinterpret_cast<const RowsWords*>(w) + (int64_t)n * (K / VPL);
  const T* sr = scales + (int64_t)n * (K / G);
  const T* br = biases + (int64_t)n * (K / G);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int c = lane; c < K / VPL; c += 32) {
    const RowsWords q = wr[c];
    const int k0 = c * VPL;
    const float s = static_cast<float>(sr[k0 / G]);
    const float b = static_cast<float>(br[k0 / G]);
    float wv[VPL];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int e = 0; e < VPW; ++e) wv[i * VPW + e] = static_cast<float>((q.w[i] >> (BITS * e)) & MASK);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const T* xr = x + (int64_t)r * K + k0;
      float qx = 0.f;
      float sx = 0.f;
#pragma unroll
      for (int p = 0; p < VPL; p += XP) {
        const RowsPack<T> xv = *reinterpret_cast<const RowsPack<T>*>(xr + p);
#pragma unroll
        for (int e = 0; e < XP; ++e) {
          const float xe = static_cast<float>(xv.v[e]);
          qx += wv[p + e] * xe;
          sx += xe;
        }
      }
      acc[r] += s * qx + b * sx;                 // sum of (s * q + b) * x over the load
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = rows_warp_sum(acc[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) out[(int64_t)r * N + n] = static_cast<T>(acc[r]);
  }
"""

INPUTS = ["x", "w", "scales", "biases"]
WARPS = 8  # output columns per thread block


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="rows_matmul", input_names=INPUTS, output_names=["out"],
                               source=_SOURCE, header=_HEADER)


def supports(x: mx.array, w: mx.array, biases, group_size: int, bits: int, mode: str) -> bool:
    """Whether the kernel computes this call: affine 4/8-bit, a 2-D weight, K a whole number of loads."""
    if mode != "affine" or biases is None or bits not in (4, 8) or w.ndim != 2:
        return False
    per_load = 128 // bits
    return (x.dtype in (mx.float16, mx.bfloat16, mx.float32) and group_size % per_load == 0
            and x.shape[-1] % per_load == 0 and 1 <= x.size // x.shape[-1] <= MAX_ROWS)


def launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
           kernel=None) -> mx.array:
    """x (R, K) times the packed (N, K) weight, transposed: (R, N) in x's dtype."""
    rows, n = x.shape[0], w.shape[0]
    scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
    return (kernel or _kernel())(
        inputs=[x, w, scales, biases], template=[("T", x.dtype), ("R", rows), ("G", group_size), ("BITS", bits)],
        grid=(32 * WARPS * -(-n // WARPS), 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]


@functools.lru_cache(maxsize=64)
def _zero_rows(rows: int, k: int, dtype) -> mx.array:
    return mx.zeros((rows, k), dtype)


def quantized_rows(x: mx.array, w: mx.array, scales: mx.array, biases, group_size: int, bits: int, mode: str,
                   kernel_rows: int = 0, pad_rows: int = 0) -> mx.array:
    """`mx.quantized_matmul(x, w, transpose=True)` over all of x's rows as one matrix.

    MLX's CUDA kernels run the leading axes as a batch of matrices, each reading the whole weight:
    a decode step's (B, 1, K) rows read every weight B times, where (B, K) reads it once in a GEMM
    (from 8 rows) or B times in `qmv` (below). From 2 to `kernel_rows` rows take this module's
    kernel instead, which reads the weight once for them all."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    flat = x.reshape(rows, k)
    if 2 <= rows <= kernel_rows and supports(flat, w, biases, group_size, bits, mode):
        y = launch(flat, w, scales, biases, group_size, bits)
    elif 2 <= rows < pad_rows:  # zero rows below: each output row is its own input row's alone
        padded = mx.concatenate([flat, _zero_rows(pad_rows - rows, k, flat.dtype)])
        y = mx.quantized_matmul(padded, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                                bits=bits, mode=mode)[:rows]
    else:
        y = mx.quantized_matmul(flat, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                                bits=bits, mode=mode)
    return y.reshape(*x.shape[:-1], y.shape[-1])
