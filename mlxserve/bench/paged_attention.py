"""`mlxserve bench paged-attention`: attention over block tables, its kernel against the gather path and
contiguous SDPA.

For each head dim, batch and KV length, decode (one query per row) and a prefill chunk (--chunk
queries, the last positions of each row, causal): every row's KV laid out contiguously, then the
same KV scattered into a block pool in shuffled order. Checked first, on this device: the kernel
against the gather path on rows of ragged lengths, and both against MLX's SDPA on the contiguous
KV (max abs error). Then timed (ms per call, the median of --repeats runs of --iters calls): the
kernel (CUDA where available; Metal only with --metal, it has never been measured), the gather
path, and SDPA on the contiguous KV (what the batch runs today). GB/s: the KV bytes a call reads
once, over its time.
"""

from __future__ import annotations

import math
import statistics
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("paged-attention", help="Attention over block tables: kernel vs gather vs contiguous SDPA.")
    p.add_argument("--batches", default="1,8,32", help="Rows per call, comma-separated.")
    p.add_argument("--kv-lens", default="512,4096,16384", help="KV tokens per row, comma-separated.")
    p.add_argument("--head-dims", default="64,128", help="Head dims, comma-separated (the kernels take 64/128/256).")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (GQA: q-heads / kv-heads queries share one).")
    p.add_argument("--chunk", type=int, default=128, help="Queries of the prefill chunk (0: decode only).")
    p.add_argument("--block-size", type=int, default=256, help="Tokens per block (the prefix cache's GPU default).")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=20, help="Calls per timed run.")
    p.add_argument("--repeats", type=int, default=5, help="Timed runs; the median counts.")
    p.add_argument("--tol", type=float, default=None,
                   help="Largest max abs error that passes (default: 0.02 in bf16, 0.005 in fp16 and in fp32, "
                        "whose matmuls MLX runs in TF32 on a GPU by default).")
    p.add_argument("--metal", action="store_true",
                   help="Time the Metal kernel (opt-in: never measured) where Metal is available.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def make_inputs(B, q_heads, kv_heads, L, D, kv_len, S, dtype, seed):
    """Contiguous KV (B, kv_heads, kv_len, D), the same KV in a shuffled block pool, its tables, queries."""
    import mlx.core as mx

    mx.random.seed(seed)
    n = -(-kv_len // S)
    keys = mx.random.normal((B, kv_heads, n * S, D)).astype(dtype)
    values = mx.random.normal((B, kv_heads, n * S, D)).astype(dtype)
    queries = mx.random.normal((B, q_heads, L, D)).astype(dtype)

    def pooled(x):  # block i of the pool holds block order[i] of the rows laid end to end
        return x.reshape(B, kv_heads, n, S, D).transpose(0, 2, 1, 3, 4).reshape(B * n, kv_heads, S, D)

    perm = mx.random.permutation(B * n)  # table entry -> pool block
    order = mx.argsort(perm)
    k_pool, v_pool = pooled(keys)[order], pooled(values)[order]
    tables = perm.reshape(B, n).astype(mx.int32)
    kv_lens = mx.full((B,), kv_len, dtype=mx.int32)
    keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
    mx.eval(keys, values, queries, k_pool, v_pool, tables)
    return queries, keys, values, k_pool, v_pool, tables, kv_lens


def time_ms(fn, iters: int, repeats: int) -> float:
    import mlx.core as mx

    for _ in range(2):
        mx.eval(fn())
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            mx.eval(fn())
        runs.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(runs)


def measure_one(args, B, kv_len, D, L, kernel):
    import mlx.core as mx

    from mlxserve.cache.paged_attention import paged_attention

    dtype = getattr(mx, args.dtype)
    scale = 1 / math.sqrt(D)
    q, keys, values, k_pool, v_pool, tables, kv_lens = make_inputs(
        B, args.q_heads, args.kv_heads, L, D, kv_len, args.block_size, dtype, args.seed)
    mask = "causal" if L > 1 else None
    contiguous = lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)  # noqa: E731
    paged = dict(queries=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, kv_lens=kv_lens, scale=scale)
    gather = lambda: paged_attention(**paged, kernel="gather")  # noqa: E731
    ref = contiguous().astype(mx.float32)

    def err(out):
        return mx.max(mx.abs(out.astype(mx.float32) - ref)).item()

    row = {"D": D, "B": B, "kv_len": kv_len, "L": L, "gather_err": err(gather())}
    fns = {"contiguous": contiguous, "gather": gather}
    if kernel:
        run_kernel = lambda: paged_attention(**paged, kernel=kernel)  # noqa: E731
        row["kernel_err"] = err(run_kernel())
        # Ragged rows: random lengths (each at least L), against the gather path on the same tables.
        ragged = mx.random.randint(L, kv_len + 1, (B,)).astype(mx.int32)
        ragged_args = dict(paged, kv_lens=ragged)
        row["ragged_err"] = mx.max(mx.abs(
            paged_attention(**ragged_args, kernel=kernel).astype(mx.float32)
            - paged_attention(**ragged_args, kernel="gather").astype(mx.float32))).item()
        fns["kernel"] = run_kernel
    for name, fn in fns.items():
        row[f"{name}_ms"] = time_ms(fn, args.iters, args.repeats)
    kv_bytes = 2 * B * args.kv_heads * kv_len * D * q.itemsize
    row["kv_mb"] = kv_bytes / 1e6
    if "kernel_ms" in row:
        row["kernel_gbs"] = kv_bytes / row["kernel_ms"] / 1e6
    del q, keys, values, k_pool, v_pool, paged
    mx.clear_cache()
    return row


def run(args) -> int:
    import mlx.core as mx

    from mlxserve.bench import report

    info = report.machine()
    kernel = "cuda" if mx.cuda.is_available() else "metal" if args.metal and mx.metal.is_available() else None
    tol = args.tol if args.tol is not None else {"bfloat16": 0.02, "float16": 0.005, "float32": 0.005}[args.dtype]
    lengths = [1] + ([args.chunk] if args.chunk else [])
    rows = []
    for D in _ints(args.head_dims):
        for L in lengths:
            for B in _ints(args.batches):
                for kv_len in _ints(args.kv_lens):
                    if kv_len < L:
                        continue
                    row = measure_one(args, B, kv_len, D, L, kernel)
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    errors = [r[k] for r in rows for k in ("gather_err", "kernel_err", "ragged_err") if k in r]
    ok = all(e <= tol for e in errors)

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    lines = [f"# bench paged-attention ({kernel or 'no'} kernel)", "",
             f"{args.q_heads} query heads, {args.kv_heads} kv heads, {args.dtype}, blocks of {args.block_size} "
             f"tokens in shuffled order; commit {info['commit']}, {info['device']} "
             f"{info.get('gpu', info.get('backend', ''))}.", "",
             "| D | batch | KV len | queries | kernel ms | gather ms | contiguous SDPA ms | kernel / contiguous | "
             "kernel GB/s | max err kernel | ragged vs gather | max err gather |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r.get("kernel_ms")
        lines.append(
            f"| {r['D']} | {r['B']} | {r['kv_len']} | {r['L']} | {fmt(k, '.3f')} | {r['gather_ms']:.3f} | "
            f"{r['contiguous_ms']:.3f} | {fmt(k and k / r['contiguous_ms'], '.2f')} | "
            f"{fmt(r.get('kernel_gbs'), ',.0f')} | {fmt(r.get('kernel_err'), '.2e')} | "
            f"{fmt(r.get('ragged_err'), '.2e')} | {r['gather_err']:.2e} |")
    lines += ["", f"Errors against SDPA on the contiguous KV (ragged: kernel against the gather path); "
                  f"pass at <= {tol:g}: {'PASS' if ok else 'FAIL'}."]
    if not kernel:
        lines.append("No kernel timed: no CUDA here (and Metal only with --metal).")
    text = "\n".join(lines)
    print(text)
    result = {"rows": rows, "kernel": kernel, "tol": tol, "ok": ok, "args": vars(args) | {"func": None}}
    path = report.write_result("paged-attention", info, report.header("bench paged-attention", info,
                               " ".join(sys.argv)) + "\n" + text + "\n", result, None, args.out_dir)
    print(f"wrote {path}.md", file=sys.stderr)
    return 0 if ok else 1
