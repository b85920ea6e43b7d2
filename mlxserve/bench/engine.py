"""`mlxserve bench engine`: the engine against mlx-lm itself, in-process.

For each model it measures, in one process and one run:
- single-stream decode: mlx-lm's `generate_step` vs the engine's lone request
  (solo fast path) vs the engine forced through `BatchGenerator` at batch 1;
- aggregate decode throughput at each concurrency: the engine vs a bare
  `BatchGenerator` loop on the same prompts (what the batching allows);
- prefill tok/s of one long prompt through the engine.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time

MODEL_HELP = (
    "Comma-separated models: 'default', a model source, or 'dummy:SHAPE[:q4|:q8]' "
    "(random weights of a named shape, e.g. dummy:qwen3-0.6b:q4)."
)


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="In-process engine benchmark vs mlx-lm.")
    p.add_argument("--models", default="default,dummy:qwen3-0.6b:q4,dummy:qwen3-4b:q4", help=MODEL_HELP)
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="Comma-separated request counts.")
    p.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=64, help="Output tokens per request (EOS ignored).")
    p.add_argument("--single-len", type=int, default=128, help="Tokens for the single-stream comparison.")
    p.add_argument("--prefill-len", type=int, default=512, help="Prompt tokens for the prefill measurement.")
    p.add_argument("--dtype", default=None, help="Weight dtype (default: per backend).")
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="Quantized KV in the engine's runs (generate_step and BatchGenerator stay unquantized).")
    p.add_argument("--kv-layout", default="auto", choices=("auto", "contiguous", "paged"),
                   help="The engine's batch KV layout (serve's --kv-layout); the bare BatchGenerator stays mlx-lm's.")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--replot", metavar="JSON", help="Only redraw the PNG of an earlier result.")
    p.set_defaults(func=lambda a: replot(a.replot) if a.replot else run(a))


def _parse_model(spec: str) -> dict:
    if spec.startswith("dummy:"):
        parts = spec.split(":")
        bits = int(parts[2][1:]) if len(parts) > 2 else None
        return {"source": parts[1], "load_format": "dummy", "quantize_bits": bits, "label": spec}
    return {"source": None if spec == "default" else spec, "load_format": "auto",
            "quantize_bits": None, "label": spec}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, min(vocab, 100_000)) for _ in range(length)] for _ in range(n)]


def bench_generate_step(model, prompt: list[int], n: int) -> float:
    """Decode tok/s of mlx-lm's own single-sequence loop."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    times = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=n):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def bench_batch_generator(model, prompts: list[list[int]], n: int, chunk: int) -> tuple[float, float]:
    """Aggregate tok/s and median time to first token of a bare BatchGenerator loop."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=max(len(prompts), 1),
                         prefill_batch_size=8, prefill_step_size=chunk)
    start = time.perf_counter()
    gen.insert([list(p) for p in prompts], max_tokens=[n] * len(prompts))
    tokens = 0
    first = {}
    remaining = len(prompts)
    while remaining:
        for r in gen.next_generated():
            tokens += 1
            first.setdefault(r.uid, time.perf_counter() - start)
            remaining -= r.finish_reason is not None
    elapsed = time.perf_counter() - start
    gen.close()
    return tokens / elapsed, statistics.median(first.values())


async def _engine_run(engine, prompts, params):
    from mlxserve.engine.request import Request

    async def one(p):
        stamps = []
        async for out in engine.submit(Request(list(p), params)):
            stamps.append((time.perf_counter(), len(out.new_token_ids)))
        return stamps

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return start, results


def engine_single(engine, prompt, n) -> float:
    from mlxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    _, (stamps,) = asyncio.run(_engine_run(engine, [prompt], params))
    return (len(stamps) - 1) / (stamps[-1][0] - stamps[0][0])


def engine_aggregate(engine, prompts, n) -> tuple[float, float]:
    """Aggregate tok/s and median time to first token of concurrent engine requests."""
    from mlxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start, results = asyncio.run(_engine_run(engine, prompts, params))
    end = max(s[-1][0] for s in results)
    ttft = statistics.median(s[0][0] - start for s in results)
    return sum(k for s in results for _, k in s) / (end - start), ttft


def engine_prefill(engine, prompt) -> float:
    from mlxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start, (stamps,) = asyncio.run(_engine_run(engine, [prompt], params))
    return len(prompt) / (stamps[0][0] - start)


def bench_model(spec: dict, args, concurrency: list[int]) -> dict:
    from mlxserve.config import EngineConfig, with_backend_defaults
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.models.load import load

    print(f"\n== {spec['label']}: loading", file=sys.stderr, flush=True)
    loaded = load(spec["source"], load_format=spec["load_format"],
                  quantize_bits=spec["quantize_bits"], dtype=args.dtype)
    vocab = loaded.vocab_size or 32000
    model = loaded.model
    max_c = max(concurrency)
    chunk = with_backend_defaults(EngineConfig()).prefill_chunk_size
    single_prompt = _prompts(1, args.prompt_len, vocab, 1)[0]
    result = {"label": spec["label"], "name": loaded.name}

    def engine(solo: bool) -> AsyncEngine:
        # No prefix cache: repeated prompts would hit it, and this measures the engine.
        return AsyncEngine(loaded, EngineConfig(max_num_seqs=max_c, solo_fast_path=solo,
                                                prefix_cache=False, kv_bits=args.kv_bits,
                                                kv_layout=args.kv_layout)).start(wait_warmup=True)

    solo_engine, batch_engine = engine(True), engine(False)
    try:
        # Warm up every path once (kernel compilation, allocator).
        bench_generate_step(model, single_prompt, 8)
        engine_single(solo_engine, single_prompt, 8)
        engine_single(batch_engine, single_prompt, 8)
        bench_batch_generator(model, _prompts(2, args.prompt_len, vocab, 2), 4, chunk)

        print("   single stream", file=sys.stderr, flush=True)
        single = {"generate_step": [], "engine solo path": [], "engine via BatchGenerator": []}
        for _ in range(3):  # interleaved repeats, best of each: run-to-run spread is large
            single["generate_step"].append(bench_generate_step(model, single_prompt, args.single_len))
            single["engine solo path"].append(engine_single(solo_engine, single_prompt, args.single_len))
            single["engine via BatchGenerator"].append(
                engine_single(batch_engine, single_prompt, args.single_len))
        result["single"] = {k: max(v) for k, v in single.items()}

        result["aggregate"] = []
        for c in concurrency:
            print(f"   concurrency {c}", file=sys.stderr, flush=True)
            prompts = _prompts(c, args.prompt_len, vocab, 100 + c)
            # Warm up this batch size first: MLX's GPU backends compile kernels
            # for each new shape, and whichever runs first would pay for it.
            engine_aggregate(solo_engine, prompts, 4)
            bench_batch_generator(model, prompts, 4, chunk)
            eng, eng_ttft = max(engine_aggregate(solo_engine, prompts, args.output_len) for _ in range(2))
            raw, raw_ttft = max(bench_batch_generator(model, prompts, args.output_len, chunk) for _ in range(2))
            result["aggregate"].append((c, eng, raw, eng_ttft, raw_ttft))

        print("   prefill", file=sys.stderr, flush=True)
        prefill_prompt = _prompts(1, args.prefill_len, vocab, 7)[0]
        result["prefill"] = max(engine_prefill(solo_engine, prefill_prompt) for _ in range(2))
    finally:
        solo_engine.stop()
        batch_engine.stop()
    return result


def run(args) -> int:
    from mlxserve.bench import report

    concurrency = [int(c) for c in args.concurrency.split(",")]
    info = report.machine()
    results = [bench_model(_parse_model(m), args, concurrency) for m in args.models.split(",")]

    command = "mlxserve bench engine " + " ".join(sys.argv[3:])
    md = [report.header("Engine benchmark", info, command), ""]
    md.append(f"Prompt {args.prompt_len} tokens, output {args.output_len} tokens per request "
              f"(EOS ignored); single stream {args.single_len} tokens; prefill {args.prefill_len} tokens.\n")
    if args.kv_bits:
        md.append(f"The engine's runs use {report.kv_label(args.kv_bits)}; generate_step and the bare "
                  "BatchGenerator run unquantized.\n")
    md.append(f"The engine's batch KV layout: --kv-layout {args.kv_layout} (auto: paged on CUDA for text models "
              "without --kv-bits); the bare BatchGenerator runs mlx-lm's own caches.\n")
    for r in results:
        gs = r["single"]["generate_step"]
        md.append(f"## {r['label']} ({r['name']})\n")
        md.append(report.table(
            ["single-stream decode", "tok/s", "vs generate_step"],
            [[k, v, f"{v / gs:.2f}x"] for k, v in r["single"].items()]))
        md.append("")
        md.append(report.table(
            ["concurrency", "engine tok/s", "bare BatchGenerator tok/s", "engine / bare", "engine scaling vs 1",
             "engine TTFT p50 ms", "bare TTFT p50 ms"],
            [[c, e, b, f"{e / b:.2f}", f"{e / r['aggregate'][0][1]:.2f}x", *[t * 1e3 for t in rest]]
             for c, e, b, *rest in r["aggregate"]]))
        md.append(f"\nPrefill: {r['prefill']:,.0f} tok/s ({args.prefill_len}-token prompt).\n")
    text = "\n".join(md)
    print(text)

    report.write_result("engine", info, text, results, _plot, args.out_dir)
    return 0


def replot(json_path) -> None:
    from mlxserve.bench import report

    report.replot(json_path, _plot)


def _plot(results, png, info) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        cs = [row[0] for row in r["aggregate"]]
        line, = ax.plot(cs, [row[1] for row in r["aggregate"]], marker="o", label=f"{r['label']} engine")
        ax.plot(cs, [row[2] for row in r["aggregate"]], linestyle="--", color=line.get_color(),
                label=f"{r['label']} bare BatchGenerator")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(f"mlxserve engine, {info['backend']} ({info['device']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
