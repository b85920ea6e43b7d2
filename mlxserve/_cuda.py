"""MLX-CUDA defaults mlxserve changes (environment variables; no effect on Metal or the CPU)."""

import os


def prefer_mlx_attention() -> None:
    """Run attention with MLX's own CUDA kernels rather than cuDNN's.

    MLX-CUDA 0.32 sends prefill attention to cuDNN, which builds a graph for
    each (query length, key length) pair it meets and caches it. A server
    meets a new pair on almost every request: on an H100, prefilling 19
    tokens on a 1,300-token cache took 62-86 ms at each new length and 20 ms
    at a repeated one; with MLX's kernels it takes 22-28 ms either way
    (benchmarks/README.md). Setting MLX_CUDA_USE_CUDNN_SDPA=1 brings cuDNN back.
    MLX reads the variable at the first attention call, so this must run before.
    """
    os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
