"""MLX-CUDA defaults mlxserve changes (environment variables; no effect on Metal or the CPU)."""

import os


def prefer_mlx_attention() -> None:
    """Run attention with MLX's own CUDA kernels rather than cuDNN's.

    MLX-CUDA 0.32 sends prefill attention to cuDNN, which builds a graph for
    each (query length, key length) pair it meets and caches it. A server
    meets a new pair on almost every request: on an H100, prefilling 19
    tokens on a 1,300-token cache took 62-86 ms at each new length and 20 ms
    at a repeated one, against 22-28 ms either way with MLX's kernels, and an
    agent's turns 2-8 got their first token in 22-115 ms instead of 63-146 ms
    (benchmarks/prefix-cuda-20261123-0117 vs -0116). Long cold prompts lose:
    8k tokens prefill in 1,055 ms instead of 752. MLX_CUDA_USE_CUDNN_SDPA=1
    brings cuDNN back. MLX reads the variable at the first attention call.
    """
    os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
