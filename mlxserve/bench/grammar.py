"""`mlxserve bench grammar`: what constrained decoding costs inside the continuous batch.

In-process, per model and concurrency, on the same prompts: aggregate decode
tok/s of N requests constrained to a JSON schema vs N free ones, and the host
time llguidance spends per mask. The schema asks for more items than fit in
the output, so constrained rows run their full length like the free rows
(which ignore EOS); both decode greedily, with the prefix cache off.
"""

from __future__ import annotations

import asyncio
import sys
import time

from mlxserve.bench.engine import MODEL_HELP, _parse_model, _prompts

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["open", "closed", "pending"]},
            "note": {"type": "string", "maxLength": 24},
        },
        "required": ["id", "status", "note"],
        "additionalProperties": False,
    },
}


def add_parser(sub) -> None:
    p = sub.add_parser("grammar", help="Constrained (JSON schema) vs free decoding in one batch.")
    p.add_argument("--models", default="default,dummy:qwen3-0.6b:q4", help=MODEL_HELP)
    p.add_argument("--concurrency", default="1,16", help="Comma-separated request counts.")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="Interleaved passes; the best of each is kept.")
    p.add_argument("--dtype", default=None)
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


async def _decode(engine, prompts, params_of) -> tuple[float, int]:
    """(seconds from the first request's first token to the last token, tokens after the first ones)."""
    from mlxserve.engine.request import Request

    async def one(i, p):
        stamps = []
        async for out in engine.submit(Request(list(p), params_of(i))):
            stamps.append((time.perf_counter(), len(out.new_token_ids)))
        return stamps

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    start = min(s[0][0] for s in results)
    end = max(s[-1][0] for s in results)
    return end - start, sum(k for s in results for _, k in s[1:])


def bench_model(spec: dict, args, concurrency: list[int]) -> dict:
    from mlxserve.api.constraints import Grammars, json_grammar
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.engine.grammar import mask_stats
    from mlxserve.engine.request import SamplingParams
    from mlxserve.models.load import load

    print(f"\n== {spec['label']}: loading", file=sys.stderr, flush=True)
    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"],
                  dtype=args.dtype)
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size)
    grammar = json_grammar(SCHEMA, "schema")
    start = time.perf_counter()
    grammars.llg_tokenizer()
    tokenizer_s = time.perf_counter() - start
    n = args.output_len
    rows = []
    engine = AsyncEngine(loaded, EngineConfig(max_num_seqs=max(concurrency), prefix_cache=False)).start(
        wait_warmup=True)
    try:
        for c in concurrency:
            print(f"   concurrency {c}", file=sys.stderr, flush=True)
            prompts = _prompts(c, args.prompt_len, loaded.vocab_size, 100 + c)

            def free(i):
                return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

            def constrained(matchers):
                return lambda i: SamplingParams(temperature=0, max_tokens=n, grammar=matchers[i])

            asyncio.run(_decode(engine, prompts, lambda i: SamplingParams(temperature=0, max_tokens=4)))
            best = {"free": 0.0, "json": 0.0}
            mask_us = []
            for _ in range(args.repeats):
                seconds, tokens = asyncio.run(_decode(engine, prompts, free))
                best["free"] = max(best["free"], tokens / seconds)
                matchers = grammars.new_matchers(grammar, c)
                mask_stats.reset()
                seconds, tokens = asyncio.run(_decode(engine, prompts, constrained(matchers)))
                best["json"] = max(best["json"], tokens / seconds)
                mask_us.append(mask_stats.seconds / max(mask_stats.masks, 1) * 1e6)
                assert all(not m.is_error() for m in matchers), [m.get_error() for m in matchers]
            rows.append({"concurrency": c, "free": best["free"], "json": best["json"],
                         "mask_us": min(mask_us)})
    finally:
        engine.stop()
    return {"label": spec["label"], "name": loaded.name, "tokenizer_s": tokenizer_s, "rows": rows}


def run(args) -> int:
    from mlxserve.bench import report

    concurrency = [int(c) for c in args.concurrency.split(",")]
    info = report.machine()
    results = [bench_model(_parse_model(m), args, concurrency) for m in args.models.split(",")]
    command = "mlxserve bench grammar " + " ".join(sys.argv[3:])
    md = [report.header("Constrained decoding benchmark", info, command), ""]
    md.append(f"Prompt {args.prompt_len} tokens, {args.output_len} output tokens per request, greedy, "
              f"best of {args.repeats} interleaved passes. Constrained rows follow a JSON schema (an array "
              "of objects with an integer, an enum and a bounded string) through llguidance; free rows "
              "ignore EOS. tok/s counts the tokens after each request's first, over the time from the "
              "first token to the last. Mask time is host time per token in llguidance, overlapped with "
              "the forward pass.\n")
    for r in results:
        md.append(f"## {r['label']} ({r['name']})\n")
        md.append(f"llguidance tokenizer built in {r['tokenizer_s']:.2f} s (once per server).\n")
        md.append(report.table(
            ["concurrency", "free tok/s", "json_schema tok/s", "json / free", "mask time per token (us)"],
            [[x["concurrency"], x["free"], x["json"], f"{x['json'] / x['free']:.2f}x", x["mask_us"]]
             for x in r["rows"]]))
        md.append("")
    text = "\n".join(md)
    print(text)
    report.write_result("grammar", info, text, results, None, args.out_dir)
    return 0
