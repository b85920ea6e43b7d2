"""`mlxserve bench prefix`: what the prefix cache saves, in-process.

- Time to first token for a shared prefix of each length plus a new 32-token
  suffix: on a miss with the cache off, on a miss with it on (the cost of
  storing blocks), on a hit, for the suffix alone (the paper's Table 7
  setting), and the floor any cache can reach: the suffix alone plus what
  attending to the prefix adds (measured with direct model calls: the suffix
  onto the prefix's KV already in memory, minus onto nothing).
- The same hit at several block sizes (hit granularity vs copy and bookkeeping).
- A multi-turn agent trace: a long system prompt with tool definitions, a
  growing history rendered with the model's chat template each turn (as
  agents do), and the share of prompt tokens served from the cache.
- The disk tier: a prefix cached by one engine, read back from disk by a new
  one (a restart), next to the miss and a hit from memory.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{desc} Returns JSON. Use it whenever the user asks about {topic}.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": f"What to look up about {topic}."},
            "limit": {"type": "integer", "description": "Most results to return."}},
            "required": ["query"]}}}
    for name, desc, topic in [
        ("search_docs", "Search the project documentation.", "the documentation"),
        ("read_file", "Read a file of the repository.", "source files"),
        ("run_tests", "Run the test suite and report failures.", "tests"),
        ("git_log", "Show recent commits.", "history"),
    ]
]


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="Prefix cache: TTFT on miss vs hit, block sizes, an agent trace.")
    p.add_argument("--model", default="default", help="'default', a model source, or dummy:SHAPE[:q4|:q8].")
    p.add_argument("--prefix-lens", default="512,2048,8192", help="Shared prefix lengths, in tokens.")
    p.add_argument("--suffix-len", type=int, default=32, help="New tokens after the shared prefix.")
    p.add_argument("--block-size", type=int, default=None, help="Block size of the miss/hit table (default: the engine's).")
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8), help="Quantized KV in every engine run.")
    p.add_argument("--block-sizes", default="32,64,128,256", help="Block sizes to compare (at the middle prefix length).")
    p.add_argument("--turns", type=int, default=8, help="Turns of the agent trace (0 skips it).")
    p.add_argument("--disk-lens", default="2048", help="Prefix lengths of the disk-tier table ('' skips it).")
    p.add_argument("--answer-len", type=int, default=32, help="Tokens per answer in the agent trace.")
    p.add_argument("--reasoning-len", type=int, default=128,
                   help="Tokens of reasoning before each answer in the agent trace, dropped from the next "
                        "turn's history as Qwen3.5's and gpt-oss's templates do (0: none).")
    p.add_argument("--system-tokens", type=int, default=2048,
                   help="Tokens of the agent trace's system prompt and tool definitions (agents send thousands).")
    p.add_argument("--checkpoint-intervals", default="1,4",
                   help="Recurrent-state checkpoint intervals (blocks) to run the agent trace with, for "
                        "models with recurrent layers.")
    p.add_argument("--repeats", type=int, default=2, help="Repeats of each timing; the best is kept.")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--replot", metavar="JSON", help="Only redraw the PNG of an earlier result.")
    p.set_defaults(func=lambda a: replot(a.replot) if a.replot else run(a))


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]


async def _ttft(engine, prompt: list[int]) -> tuple[float, int]:
    from mlxserve.engine.request import Request, SamplingParams

    start = time.perf_counter()
    async for out in engine.submit(Request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))):
        return time.perf_counter() - start, out.cached_tokens
    raise RuntimeError("no output")


def ttft(engine, prompt) -> tuple[float, int]:
    return asyncio.run(_ttft(engine, prompt))


def resident_suffix(model, prefix: list[int], suffix: list[int], chunk: int = 512, kv_bits=None) -> float:
    """Seconds to prefill `suffix` onto a cache that already holds `prefix`, up to the first token."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from mlxserve.cache.quantized import make_cache

    with mx.stream(generation_stream):
        cache = make_cache(model, kv_bits)
        for i in range(0, len(prefix), chunk):
            model(mx.array(prefix[i:i + chunk])[None], cache=cache)
            mx.eval([c.state for c in cache])
        start = time.perf_counter()
        token = mx.argmax(model(mx.array(suffix)[None], cache=cache)[:, -1, :], axis=-1)
        token.item()
        return time.perf_counter() - start


def context_cost(model, context: list[int], suffix: list[int], kv_bits=None, tries: int = 1) -> float:
    """Seconds that attending to `context`, already in the cache, adds to prefilling `suffix`
    (model calls, no cache machinery; best of `tries` each): with the suffix alone, the floor
    any cache can reach."""
    if not context:
        return 0.0
    return max(0.0, min(resident_suffix(model, context, suffix, kv_bits=kv_bits) for _ in range(tries))
               - min(resident_suffix(model, [], suffix, kv_bits=kv_bits) for _ in range(tries)))


def start_engine(loaded, args, **settings):
    """An engine with these settings and the run's --kv-bits."""
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine

    return AsyncEngine(loaded, EngineConfig(kv_bits=args.kv_bits, **settings)).start(wait_warmup=True)


def measure_lengths(loaded, args, rng, vocab) -> list[dict]:
    block = {"block_size": args.block_size} if args.block_size else {}
    on = start_engine(loaded, args, cache_memory="50%", **block)
    off = start_engine(loaded, args, prefix_cache=False)
    rows = []
    try:
        ttft(on, _tokens(rng, 64, vocab)), ttft(off, _tokens(rng, 64, vocab))  # warm up
        for n in [int(x) for x in args.prefix_lens.split(",")]:
            print(f"   prefix {n}", file=sys.stderr, flush=True)
            row = {"prefix": n, "miss_off": [], "miss_on": [], "hit": [], "suffix_only": [], "resident": [],
                   "cached": 0}
            for _ in range(args.repeats):
                row["miss_off"].append(ttft(off, _tokens(rng, n + args.suffix_len, vocab))[0])
                prefix = _tokens(rng, n, vocab)
                row["miss_on"].append(ttft(on, prefix + _tokens(rng, args.suffix_len, vocab))[0])
                seconds, cached = ttft(on, prefix + _tokens(rng, args.suffix_len, vocab))
                row["hit"].append(seconds)
                row["cached"] = cached
                row["suffix_only"].append(ttft(off, _tokens(rng, args.suffix_len, vocab))[0])
                # The floor: the suffix alone, plus what attending to the prefix adds (model calls, both).
                suffix = _tokens(rng, args.suffix_len, vocab)
                row["resident"].append(row["suffix_only"][-1]
                                       + context_cost(loaded.model, prefix, suffix, kv_bits=args.kv_bits))
            rows.append({k: min(v) if isinstance(v, list) else v for k, v in row.items()})
    finally:
        on.stop()
        off.stop()
    return rows


def measure_block_sizes(loaded, args, rng, vocab) -> list[dict]:
    lens = [int(x) for x in args.prefix_lens.split(",")]
    n = lens[len(lens) // 2]
    rows = []
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        print(f"   block size {bs}", file=sys.stderr, flush=True)
        engine = start_engine(loaded, args, block_size=bs, cache_memory="50%")
        try:
            ttft(engine, _tokens(rng, 64, vocab))
            hits, misses, cached = [], [], 0
            for _ in range(args.repeats):
                prefix = _tokens(rng, n, vocab)
                misses.append(ttft(engine, prefix + _tokens(rng, args.suffix_len, vocab))[0])
                seconds, cached = ttft(engine, prefix + _tokens(rng, args.suffix_len, vocab))
                hits.append(seconds)
            stats = asyncio.run(engine.cache_stats())["prefix_cache"]
        finally:
            engine.stop()
        rows.append({"block_size": bs, "prefix": n, "miss": min(misses), "hit": min(hits), "cached": cached,
                     "blocks": stats["blocks"], "bytes_per_token": stats["bytes"] / max(1, stats["tokens"])})
    return rows


def measure_disk(loaded, args, rng, vocab) -> list[dict]:
    """TTFT of a prefix read back from the disk tier by a new engine (a restart)."""
    import tempfile

    block = {"block_size": args.block_size} if args.block_size else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxserve-bench-disk-") as folder:
        settings = dict(cache_memory="50%", disk_cache_dir=folder, **block)
        for n in [int(x) for x in args.disk_lens.split(",")]:
            print(f"   disk tier, prefix {n}", file=sys.stderr, flush=True)
            row = {"prefix": n, "miss": [], "disk_hit": [], "memory_hit": [], "cached": 0}
            for _ in range(args.repeats):
                prefix = _tokens(rng, n, vocab)
                first = start_engine(loaded, args, **settings)
                try:
                    ttft(first, _tokens(rng, 64, vocab))  # warm-up
                    row["miss"].append(ttft(first, prefix + _tokens(rng, args.suffix_len, vocab))[0])
                finally:
                    first.stop()  # writes what is still queued
                second = start_engine(loaded, args, **settings)
                try:
                    ttft(second, _tokens(rng, 64, vocab))
                    seconds, row["cached"] = ttft(second, prefix + _tokens(rng, args.suffix_len, vocab))
                    row["disk_hit"].append(seconds)
                    row["memory_hit"].append(ttft(second, prefix + _tokens(rng, args.suffix_len, vocab))[0])
                    row["disk"] = asyncio.run(second.cache_stats())["prefix_cache"]["disk"]
                finally:
                    second.stop()
            rows.append({k: min(v) if isinstance(v, list) else v for k, v in row.items()})
    return rows


def agent_trace(loaded, args, **settings) -> dict:
    """Turns of a tool-using conversation, re-rendered with the chat template each turn.

    Each answer follows `--reasoning-len` tokens of reasoning, which the next turn's
    history drops (the agent "rewind": the prompt parts from what the cache holds right
    where this turn's output began). Each turn's TTFT is compared with prefilling its
    new (uncached) tokens alone, and with the floor: those plus attending to the rest.
    """
    from mlxserve.engine.request import Request, SamplingParams
    from mlxserve.models.chat import render_chat

    tok = loaded.tokenizer
    rule = ("You are a coding agent working in a large repository. Think step by step, call tools "
            "when you need facts, and answer concisely. ")
    system = rule
    while len(render_chat(tok, [{"role": "system", "content": system}], tools=TOOLS)) < args.system_tokens:
        system += rule
    questions = ["Where is the scheduler defined?", "What does it do when the queue is full?",
                 "Which tests cover it?", "Run them.", "Why did the second one fail?",
                 "Suggest a fix.", "Write the patch.", "Summarize the change for the commit message."]
    engine = start_engine(loaded, args, cache_memory="50%", **settings)
    off = start_engine(loaded, args, prefix_cache=False)

    def conversation(measure: bool) -> list[dict]:
        messages, rows, before = [{"role": "system", "content": system}], [], []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": questions[turn % len(questions)]})
            prompt = render_chat(tok, messages, tools=TOOLS)

            async def one():
                start, first, ids, cached = time.perf_counter(), None, [], 0
                params = SamplingParams(temperature=0, max_tokens=args.reasoning_len + args.answer_len,
                                        ignore_eos=True)
                async for out in engine.submit(Request(prompt, params)):
                    first = first or time.perf_counter() - start
                    ids += out.new_token_ids
                    cached = out.cached_tokens
                return first, time.perf_counter() - start, ids, cached

            first, total, ids, cached = asyncio.run(one())
            messages.append({"role": "assistant", "content": tok.decode(ids[args.reasoning_len:])})
            # The most any cache could give: what this prompt shares with everything computed so far.
            ideal = max([len(os.path.commonprefix([prompt, seen])) for seen in before] + [0])
            before.append(prompt + ids)
            new = prompt[cached:]
            alone = floor = first
            if cached and measure:
                alone = ttft(off, new)[0]
                floor = alone + context_cost(loaded.model, prompt[:cached], new, kv_bits=args.kv_bits)
            rows.append({"turn": turn + 1, "prompt": len(prompt), "cached": cached, "ideal": ideal, "ttft": first,
                         "total": total, "new_alone": alone, "floor": floor})
        return rows

    try:
        ttft(engine, tok.encode("warm up")), ttft(off, tok.encode("warm up"))
        # A first pass compiles the kernels of every shape the trace meets (on a GPU, each new
        # prompt length costs one); the measured pass meets the same lengths (greedy decoding).
        conversation(measure=False)
        passes = []
        for _ in range(args.repeats):  # the same conversation again: the best of each turn's times
            asyncio.run(engine.reset_cache())
            passes.append(conversation(measure=True))
            stats = asyncio.run(engine.cache_stats())["prefix_cache"]
        rows = [{**turns[0], **{k: min(t[k] for t in turns) for k in ("ttft", "total", "new_alone", "floor")}}
                for turns in zip(*passes)]
    finally:
        engine.stop()
        off.stop()
    return {"turns": rows, "system_tokens": len(render_chat(tok, [{"role": "system", "content": system}], tools=TOOLS)),
            "settings": settings, "cache_bytes": stats["bytes"], "cache_tokens": stats["tokens"],
            "layers": stats["layers"], "block_size": stats["block_size"]}


def agent_traces(loaded, args) -> list[dict]:
    """The agent trace, once per checkpoint interval for models with recurrent layers."""
    from mlxserve.cache.layers import model_specs, spec_kinds

    if "state" not in spec_kinds(model_specs(loaded.model)):
        return [agent_trace(loaded, args)]
    intervals = [int(x) for x in args.checkpoint_intervals.split(",")]
    return [agent_trace(loaded, args, checkpoint_interval=k) for k in intervals]


def trace_markdown(traces, args) -> list[str]:
    from mlxserve.bench import report

    md = ["## Agent trace\n",
          f"System prompt with {len(TOOLS)} tools, history re-rendered with the chat template each turn; "
          f"each answer ({args.answer_len} tokens) follows {args.reasoning_len} tokens of reasoning that the "
          "next turn's history drops, so every turn parts from the cache where the previous turn's output "
          f"began. System prompt and tools: {traces[0]['system_tokens']} tokens. 'new alone': the "
          "turn's uncached tokens prefilled with no context; 'floor': those plus attending to the cached "
          f"context (model calls). Times are the best of {args.repeats} passes over the same conversation, each "
          "after a cache reset and a first pass that compiled the kernels of each prompt length.\n"]
    summary = []
    for t in traces:
        rows = t["turns"]
        prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
        ideal = sum(r.get("ideal", r["cached"]) for r in rows)
        later = rows[1:]
        label = (f"checkpoints every {t['settings']['checkpoint_interval']} blocks"
                 if "checkpoint_interval" in t["settings"] else "attention layers only")
        ratios = [r["ttft"] / r["new_alone"] for r in later]
        summary.append([label, f"{cached / prompt:.1%}", f"{ideal / prompt:.1%}", prompt - cached,
                        f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-",
                        t["cache_bytes"] / 2**20, t["cache_bytes"] / max(1, t["cache_tokens"]) / 1024])
        md += [f"### {label} ({t['block_size']}-token blocks)\n", report.table(
            ["turn", "prompt tokens", "cached tokens", "new tokens", "TTFT ms", "new alone ms", "floor ms",
             "TTFT/new alone", "TTFT/floor", "turn ms"],
            [[r["turn"], r["prompt"], r["cached"], r["prompt"] - r["cached"], r["ttft"] * 1e3,
              r["new_alone"] * 1e3, r["floor"] * 1e3, f"{r['ttft'] / r['new_alone']:.2f}x",
              f"{r['ttft'] / r['floor']:.2f}x", r["total"] * 1e3] for r in rows]), ""]
    md += ["### Summary\n", "Prompt tokens from the cache over all turns (and the most any cache could give: "
           "what each prompt shares with the tokens computed before it), tokens prefilled again, turns 2+ "
           "TTFT against their new tokens alone, and what the cache held at the end (per token held).\n",
           report.table(["run", "from cache", "most any cache could", "tokens recomputed", "turns 2+ TTFT/new alone", "cache MiB",
                         "KiB per token held"], summary), ""]
    return md


def run(args) -> int:
    from mlxserve.bench import report
    from mlxserve.bench.engine import _parse_model
    from mlxserve import backend
    from mlxserve.models.load import load

    spec = _parse_model(args.model)
    info = report.machine()
    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"])
    vocab = loaded.vocab_size or 32000
    rng = random.Random(0)
    print(f"== {spec['label']} ({loaded.name})", file=sys.stderr)
    lengths = measure_lengths(loaded, args, rng, vocab)
    blocks = measure_block_sizes(loaded, args, rng, vocab) if args.block_sizes else []
    traces = agent_traces(loaded, args) if args.turns else []
    disk = measure_disk(loaded, args, rng, vocab) if args.disk_lens else []

    command = "mlxserve bench prefix " + " ".join(sys.argv[3:])
    md = [report.header("Prefix cache benchmark", info, command),
          f"Model: {spec['label']} ({loaded.name}), {report.kv_label(args.kv_bits)}. "
          f"Time to first token (TTFT) in ms, best of "
          f"{args.repeats}; each prompt is a shared prefix plus {args.suffix_len} new tokens; "
          f"block size {args.block_size or backend.default('block_size')}.\n"]
    table = report.table(
        ["prefix tokens", "miss, cache off", "miss, cache on", "hit", "suffix alone", "floor (suffix + context)",
         "cached tokens", "miss/hit", "hit/suffix", "hit/floor"],
        [[r["prefix"], r["miss_off"] * 1e3, r["miss_on"] * 1e3, r["hit"] * 1e3, r["suffix_only"] * 1e3,
          r["resident"] * 1e3, r["cached"], f"{r['miss_on'] / r['hit']:.1f}x", f"{r['hit'] / r['suffix_only']:.2f}x",
          f"{r['hit'] / r['resident']:.2f}x"]
         for r in lengths])
    md += ["## Miss vs hit\n", table, ""]
    if blocks:
        md += [f"## Block size (prefix {blocks[0]['prefix']} tokens)\n", report.table(
            ["block size", "miss ms", "hit ms", "cached tokens", "blocks stored", "bytes/token"],
            [[b["block_size"], b["miss"] * 1e3, b["hit"] * 1e3, b["cached"], b["blocks"], b["bytes_per_token"]]
             for b in blocks]), ""]
    if traces:
        md += trace_markdown(traces, args)
    if disk:
        md += ["## Disk tier: a prefix cached before a restart\n",
               "One engine answers the prompt (a miss) and stops; a new engine, its memory empty, answers "
               "the prefix with a new suffix from the blocks on disk, then from memory.\n",
               report.table(["prefix tokens", "miss", "hit from disk", "hit from memory", "cached tokens",
                             "MB read", "miss/disk hit"],
                            [[d["prefix"], d["miss"] * 1e3, d["disk_hit"] * 1e3, d["memory_hit"] * 1e3, d["cached"],
                              d["disk"]["bytes"] / max(1, d["disk"]["blocks"]) * d["disk"]["reads"] / 1e6,
                              f"{d['miss'] / d['disk_hit']:.1f}x"] for d in disk]), ""]
    text = "\n".join(md)
    print(text)
    report.write_result("prefix", info, text, {"lengths": lengths, "blocks": blocks, "traces": traces, "disk": disk},
                        _plot, args.out_dir)
    return 0


def replot(json_path) -> None:
    from mlxserve.bench import report

    report.replot(json_path, _plot)


def _plot(results, png, info) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = results["lengths"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["prefix"] for r in lengths]
    for key, label in (("miss_off", "miss, cache off"), ("miss_on", "miss, cache on"),
                       ("hit", "hit"), ("suffix_only", "suffix alone"), ("resident", "floor (suffix + context)")):
        if key in lengths[0]:  # results from before a column existed
            ax1.plot(xs, [r[key] * 1e3 for r in lengths], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("shared prefix tokens")
    ax1.set_ylabel("time to first token, ms")
    ax1.legend(fontsize=8)
    # Older results have one "trace" (a list of turns); newer ones "traces", one per run.
    trace = results["traces"][0]["turns"] if results.get("traces") else results.get("trace")
    if trace:
        turns = [t["turn"] for t in trace]
        ax2.bar(turns, [t["prompt"] for t in trace], color="lightgray", label="prompt tokens")
        ax2.bar(turns, [t["cached"] for t in trace], color="tab:green", label="cached tokens")
        ax2.set_xlabel("agent turn")
        ax2.set_ylabel("tokens")
        ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"prefix cache, {info['backend']} ({info['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
