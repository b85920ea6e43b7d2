"""`mlxserve bench decode`: one lone request's decode step, against the memory-bandwidth floor.

For each model, in one process: mlx-lm's `generate_step`, the engine's solo path
decoding eagerly and through the compiled step (--compile-decode off / on), as
tok/s, ms per step and the share of the bandwidth floor (the tok/s at which a
step reads the weights and the KV once at the memory's nominal bandwidth). Then
a step's anatomy, outside the engine: the ms Python takes to build the eager
step's graph, the ms its evaluation takes, and the same for the compiled step
(its call replays a traced graph): what host work a step costs.
"""

from __future__ import annotations

import statistics
import sys
import time

from mlxserve.bench.engine import MODEL_HELP, _parse_model, _prompts, bench_generate_step, engine_single

# Nominal memory bandwidth (GB/s) by GPU name, most specific first.
NOMINAL_BANDWIDTH = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="Lone-request decode: generate_step vs the solo path, eager and "
                                      "compiled, as a share of the bandwidth floor.")
    p.add_argument("--models", default="dummy:qwen3-4b:q4,dummy:qwen3-0.6b:q4", help=MODEL_HELP)
    p.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens.")
    p.add_argument("--tokens", type=int, default=256, help="Output tokens per run (EOS ignored).")
    p.add_argument("--repeats", type=int, default=3, help="Interleaved runs of each path; the best counts.")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="Memory bandwidth in GB/s for the floor. Default: the GPU's nominal one from its "
                        "name (H200 4,800, H100 3,350, H100 PCIe 2,000); none elsewhere (no floor column).")
    p.add_argument("--dtype", default=None, help="Weight dtype (default: per backend).")
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


def nominal_bandwidth(info: dict) -> float | None:
    name = info.get("gpu", "") if info.get("backend") != "cpu" else ""
    return next((bw for key, bw in NOMINAL_BANDWIDTH if key in name), None)


def bytes_per_step(model, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) a one-token step reads at `context` tokens. An untied embedding
    table is left out: a step looks up one row of it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and not getattr(getattr(model, "args", None), "tie_word_embeddings", True):
        weights -= sum(v.nbytes for _, v in tree_flatten(embed.parameters()))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=cache))
    # Full-attention layers' KV (a KVCache's state is its whole buffer, longer than its offset).
    per_token = sum((c.keys.nbytes + c.values.nbytes) / c.keys.shape[2] for c in cache
                    if isinstance(getattr(c, "keys", None), mx.array) and isinstance(c.values, mx.array))
    return weights, per_token * context


def anatomy(model, prompt: list[int], n: int) -> dict:
    """Median ms per step of building the graph (the Python call) and of evaluating it, eager
    and compiled, one step at a time (no pipelining)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    from mlxserve.engine.compiled import CompiledDecode, compilable

    out = {}
    compiled = CompiledDecode(model)
    for name in ("eager", "compiled"):
        with mx.stream(generation_stream):
            cache = make_prompt_cache(model)
            if name == "compiled" and not compilable(model, cache):
                continue
            token = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)
            mx.eval(token)
            build, run = [], []
            for i in range(n + 4):
                t0 = time.perf_counter()
                if name == "eager":
                    logits = model(token[None], cache=cache)[:, -1, :]
                else:
                    logits = compiled(token, cache)
                token = mx.argmax(logits, axis=-1)
                t1 = time.perf_counter()
                mx.eval(token)
                t2 = time.perf_counter()
                if i >= 4:  # the first steps trace and warm up
                    build.append(t1 - t0)
                    run.append(t2 - t1)
        out[name] = (statistics.median(build) * 1e3, statistics.median(run) * 1e3)
    return out


def linear_kernels(model, rounds: int = 8) -> list[dict]:
    """GPU time of the decode step's matrix-vector products, one row per projection: each
    layer's instance applied to one token, all layers in one evaluation, `rounds` times over
    (more weight bytes than any cache holds, so each call reads its weights from memory), timed
    from the evaluation's start to its end (the graph is built before). For a quantized
    projection the same product with its weights dequantized (bf16 `x @ w.T`) beside it:
    whether the quantized kernel, not the host, sets a step's time."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None) or getattr(model, "layers", [])
    names = [n for n, m in layers[0].named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    groups = [(n, [dict(layer.named_modules()).get(n) for layer in layers], None) for n in names]
    embed = getattr(inner, "embed_tokens", None)
    if getattr(model, "lm_head", None) is not None:
        groups.append(("lm_head", [model.lm_head], None))
    elif embed is not None and hasattr(embed, "as_linear"):  # a tied head reads the embedding table
        groups.append(("embed_tokens (tied head)", [embed], lambda mod, v: mod.as_linear(v)))

    def timed(fns, x) -> float:
        """Best seconds of one round (one call of each fn)."""
        best = float("inf")
        for attempt in range(4):  # the first builds kernels
            outs = [fn(x) for _ in range(rounds) for fn in fns]
            t0 = time.perf_counter()
            mx.eval(outs)
            if attempt:
                best = min(best, (time.perf_counter() - t0) / rounds)
        return best

    rows = []
    for name, mods, call in groups:
        if any(m is None or type(m) is not type(mods[0]) for m in mods):
            continue
        m = mods[0]
        quantized = hasattr(m, "scales")
        out_dim = m.weight.shape[0]
        in_dim = m.weight.shape[1] * 32 // m.bits if quantized else m.weight.shape[1]
        x = mx.random.normal((1, 1, in_dim)).astype(mx.bfloat16)
        nbytes = sum(v.nbytes for mod in mods for _, v in tree_flatten(mod.parameters()))
        seconds = timed([mod if call is None else (lambda v, mod=mod: call(mod, v)) for mod in mods], x)
        row = {"name": name, "shape": f"{out_dim}x{in_dim}", "layers": len(mods), "bytes": nbytes,
               "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9}
        if quantized:
            dense = [mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size, mod.bits,
                                   **({"mode": mod.mode} if hasattr(mod, "mode") else {})).astype(mx.bfloat16)
                     for mod in mods]
            mx.eval(dense)
            dense_s = timed([lambda v, w=w: v @ w.T for w in dense], x)
            row.update(dense_ms=dense_s * 1e3, dense_gb_s=sum(w.nbytes for w in dense) / dense_s / 1e9)
            del dense
        rows.append(row)
    return rows


def bench_model(spec: dict, args, bandwidth: float | None) -> dict:
    from mlxserve.config import EngineConfig
    from mlxserve.engine.compiled import compilable
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.models.load import load

    from mlx_lm.models.cache import make_prompt_cache

    print(f"\n== {spec['label']}: loading", file=sys.stderr, flush=True)
    loaded = load(spec["source"], load_format=spec["load_format"],
                  quantize_bits=spec["quantize_bits"], dtype=args.dtype)
    model = loaded.model
    prompt = _prompts(1, args.prompt_len, loaded.vocab_size or 32000, 1)[0]
    weights, kv = bytes_per_step(model, args.prompt_len + args.tokens // 2)
    result = {"label": spec["label"], "name": loaded.name, "weight_bytes": weights, "kv_bytes_mean": kv,
              "compiled_applies": compilable(model, make_prompt_cache(model))}

    def engine(compile_decode: str) -> AsyncEngine:
        return AsyncEngine(loaded, EngineConfig(prefix_cache=False, compile_decode=compile_decode)).start()

    eager, compiled = engine("off"), engine("on")
    paths = {"mlx-lm generate_step": lambda n: bench_generate_step(model, prompt, n),
             "engine solo path, eager": lambda n: engine_single(eager, prompt, n),
             "engine solo path, compiled": lambda n: engine_single(compiled, prompt, n)}
    try:
        for run in paths.values():  # warm-up at full length: kernels, and each buffer length's trace
            run(args.tokens)
        print("   single stream", file=sys.stderr, flush=True)
        rates = {k: [] for k in paths}
        for _ in range(args.repeats):  # interleaved, best of each: run-to-run spread is large
            for k, run in paths.items():
                rates[k].append(run(args.tokens))
        result["tok_s"] = {k: max(v) for k, v in rates.items()}
    finally:
        eager.stop()
        compiled.stop()
    print("   step anatomy", file=sys.stderr, flush=True)
    result["anatomy"] = anatomy(model, prompt, min(args.tokens, 64))
    print("   matrix-vector kernels", file=sys.stderr, flush=True)
    result["kernels"] = linear_kernels(model)
    if bandwidth:
        result["floor_tok_s"] = bandwidth * 1e9 / (weights + kv)
    return result


def kernel_table(rows: list[dict], eval_ms: float, bandwidth: float | None) -> str:
    from mlxserve.bench import report

    if not rows:
        return ""
    dense = any("dense_ms" in r for r in rows)
    headers = ["projection", "shape", "layers", "MB", "ms per step", "GB/s"]
    headers += ["bf16 ms", "bf16 GB/s"] if dense else []
    table = [[r["name"], r["shape"], r["layers"], r["bytes"] / 1e6, r["ms"], r["gb_s"]]
             + ([r.get("dense_ms", "-"), r.get("dense_gb_s", "-")] if dense else []) for r in rows]
    total = sum(r["ms"] for r in rows)
    text = ("\nMatrix-vector products of one decode step, timed alone on the device (each projection "
            "of every layer applied to one token; GB/s: its weight bytes over its time"
            + (f", against {bandwidth:,.0f} nominal" if bandwidth else "")
            + ("; bf16: the same product with the weights dequantized" if dense else "") + "):\n\n")
    text += report.table(headers, table)
    share = f"{100 * total / eval_ms:.0f}%" if eval_ms else "-"
    text += (f"\n\nTogether {total:.2f} ms, {share} of the eager step's {eval_ms:.2f} ms evaluation"
             + (f" (bf16: {sum(r.get('dense_ms', r['ms']) for r in rows):.2f} ms)" if dense else "") + ".\n")
    return text


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    bandwidth = args.bandwidth or nominal_bandwidth(info)
    results = [bench_model(_parse_model(m), args, bandwidth) for m in args.models.split(",")]

    command = "mlxserve bench decode " + " ".join(sys.argv[3:])
    md = [report.header("Lone-request decode benchmark", info, command), ""]
    md.append(f"Prompt {args.prompt_len} tokens, {args.tokens} output tokens (EOS ignored), best of "
              f"{args.repeats} interleaved runs; no prefix cache.")
    if bandwidth:
        source = "given (--bandwidth)" if args.bandwidth else f"the nominal one of {info.get('gpu')}"
        md.append(f"Floor: the tok/s at which each step reads the weights and the mean context's KV once at "
                  f"{bandwidth:,.0f} GB/s, {source}.\n")
    else:
        md.append("No floor column: no nominal bandwidth for this device (give --bandwidth).\n")
    for r in results:
        md.append(f"## {r['label']} ({r['name']})\n")
        md.append(f"Bytes per step: weights {r['weight_bytes'] / 1e9:.3f} GB, KV {r['kv_bytes_mean'] / 1e6:.1f} MB"
                  + (f"; floor {r['floor_tok_s']:,.0f} tok/s" if bandwidth else "")
                  + ("" if r["compiled_applies"] else "; the compiled step does not apply to this model "
                     "(its row decodes eagerly)") + ".\n")
        base = r["tok_s"]["mlx-lm generate_step"]
        headers = ["path", "tok/s", "ms/step", "vs generate_step"] + (["% of floor"] if bandwidth else [])
        rows = [[k, v, 1e3 / v, f"{v / base:.2f}x"] + ([f"{100 * v / r['floor_tok_s']:.1f}%"] if bandwidth else [])
                for k, v in r["tok_s"].items()]
        md.append(report.table(headers, rows))
        md.append("\nOne step at a time outside the engine (median ms): building the graph in Python "
                  "(compiled: replaying the trace) and evaluating it.\n")
        md.append(report.table(["step", "build ms", "eval ms", "build share"],
                               [[k, b, e, f"{100 * b / (b + e):.0f}%"] for k, (b, e) in r["anatomy"].items()]))
        md.append(kernel_table(r["kernels"], r["anatomy"]["eager"][1], bandwidth))
        md.append("")
    text = "\n".join(md)
    print(text)
    report.write_result("decode", info, text, results, None, args.out_dir)
    return 0
