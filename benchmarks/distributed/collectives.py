"""What one collective costs on this machine's MLX backend, from every rank (run under
mlx.launch, or with MLX_RANK and the backend's variables set; rank 0 prints JSON).

- the step plan a distributed engine sends each step (mlxserve.engine.collectives.share:
  a 1 KB all_sum, evaluated and read back on the host);
- a tensor-parallel layer's all_sum of a decode step's hidden states (rows x hidden,
  bfloat16), evaluated alone: a 4B model runs 2 per layer, 72 per decode step.
"""

import json
import sys
import time

import mlx.core as mx

from mlxserve.engine import collectives


def timed(fn, n: int) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6  # microseconds


def main() -> None:
    group = collectives.init_group(sys.argv[1] if len(sys.argv) > 1 else "any")
    rank = group.rank()
    out = {"ranks": group.size(), "device": str(mx.default_device())}
    out["plan_share_us"] = timed(lambda: collectives.share((0.0, []), rank), 200)
    for hidden in (2560, 5120):
        for rows in (1, 32):
            x = mx.ones((rows, hidden), dtype=mx.bfloat16)
            out[f"all_sum_{rows}x{hidden}_us"] = timed(lambda: mx.eval(mx.distributed.all_sum(x)), 200)
    # 72 all_sums chained as in one decode step of a 36-layer model, evaluated once.
    x = mx.ones((1, 2560), dtype=mx.bfloat16)

    def chain():
        y = x
        for _ in range(72):
            y = mx.distributed.all_sum(y) * 0.5
        mx.eval(y)
    out["chain_72_all_sums_1x2560_us"] = timed(chain, 50)
    if rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
