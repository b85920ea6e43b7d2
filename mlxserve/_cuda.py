"""MLX-CUDA defaults mlxserve changes (environment variables; no effect on Metal or the CPU)."""

import os

# What mlxserve set in this process's environment (not the user): children that are not
# mlxserve (the peer servers `mlxserve bench serve` starts) get MLX's own defaults back.
SET_HERE: dict[str, str] = {}


def _set_default(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = SET_HERE[name] = value


def without_our_defaults(env: dict) -> dict:
    """`env` less the variables mlxserve set (unchanged since)."""
    return {k: v for k, v in env.items() if SET_HERE.get(k) != v}


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
    _set_default("MLX_CUDA_USE_CUDNN_SDPA", "0")


def smaller_cuda_graphs() -> None:
    """Cut MLX-CUDA's graphs after 25 kernels, whatever their bytes (MLX: 100 kernels or 1 GB
    of inputs on an H100/H200).

    MLX-CUDA records an evaluation's kernels into CUDA graphs and keeps one executable graph per
    sequence of node kinds, updated in place when a later graph matches it and instantiated anew
    when none does. A prefill at a length not met before paid 8-135 ms more than the same length
    again (4B 4-bit, eight lengths of 700-2,000 tokens: 758 ms against 542; graphs off: 563
    against 540). Without the byte limit alone, no better; with graphs of 25 kernels and no byte
    limit, 572 against 526 (a graph that short, about a layer's part, most likely recurs at any
    length), and a fresh server's first turn took 102 ms instead of 128
    (benchmarks/graph-size-cuda-20261125-2105). Decoding does not pay for it: the lone path 180
    tok/s against 183 with MLX's values over three alternating pairs, within their spread, and
    batched decoding with no consistent direction (benchmarks/graph-limits-decode-cuda-20261125-2310).
    Only on CUDA: Metal reads the same variables for its command buffers. Set either variable and
    mlxserve sets neither.
    """
    import mlx.core as mx

    if mx.cuda.is_available() and not {"MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER"} & os.environ.keys():
        _set_default("MLX_MAX_OPS_PER_BUFFER", "25")
        _set_default("MLX_MAX_MB_PER_BUFFER", "1000000")
