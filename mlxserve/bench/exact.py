"""`mlxserve bench exact`: do a batch or a prefix-cache hit change greedy tokens on this backend?

Per model, greedy, EOS ignored, with the engine the server runs:
- each prompt decoded alone, twice (is one path repeatable?), then all of them in one batch;
- turn 2 of each conversation (turn 1's prompt, its answer, a new user message) decoded with the
  prefix cache that turn 1 left (the answer's KV computed by decode steps, the prompt's by prefill)
  and with the prefix cache off, where a prefill pass computes all of it.

Counts the sequences whose tokens differ and where each first parts. The tests assert equality
on the CPU in float32; on a GPU in bfloat16 or 4-bit the kernels for one row and for many (and
for a prefill pass and a decode step) round differently, and a near-tie of two logits can then
flip a token, after which the sequences part.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import replace

from mlxserve.bench.engine import MODEL_HELP, _parse_model


def add_parser(sub) -> None:
    p = sub.add_parser("exact", help="Whether a batch or a prefix-cache hit changes greedy tokens here.")
    p.add_argument("--models", default="dummy:qwen3-0.6b:q4", help=MODEL_HELP)
    p.add_argument("--prompts", type=int, default=16, help="Conversations (and the batch's size).")
    p.add_argument("--prompt-words", type=int, default=150, help="Words of each first user message.")
    p.add_argument("--output-len", type=int, default=128, help="Tokens decoded per request.")
    p.add_argument("--dtype", default=None, help="Weight dtype (default: per backend).")
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


def parting(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Where each pair of token sequences first differs (pairs that agree left out), sorted."""
    return sorted(next(i for i, (x, y) in enumerate(zip(s, t)) if x != y)
                  for s, t in zip(a, b) if s != t)


def _decode_all(engine, prompts, n_out: int, together: bool) -> list[list[int]]:
    from mlxserve.engine.request import Request, SamplingParams
    from mlxserve.llm import collect

    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)

    async def one(ids):
        return (await collect(engine.submit(Request(list(ids), params)), len(ids))).token_ids

    async def all_of():
        if together:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    return asyncio.run(all_of())


def bench_model(spec: dict, args) -> dict:
    from mlxserve.api.tokens import render
    from mlxserve.bench.serve import make_prompt
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.models.load import load

    print(f"\n== {spec['label']}: loading", file=sys.stderr, flush=True)
    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"],
                  dtype=args.dtype)
    rng = random.Random(1)
    prompts = [render(loaded.tokenizer, [{"role": "user", "content": make_prompt(rng, args.prompt_words)}])
               for _ in range(args.prompts)]
    n_out = args.output_len
    cfg = EngineConfig(warmup=0, max_num_seqs=max(args.prompts, 2))
    cold = AsyncEngine(loaded, replace(cfg, prefix_cache=False)).start()
    try:
        alone = _decode_all(cold, prompts, n_out, together=False)
        again = _decode_all(cold, prompts, n_out, together=False)
        batch = _decode_all(cold, prompts, n_out, together=True)
        follow = render(loaded.tokenizer, [{"role": "user", "content": "Go on."}])
        turn2 = [p + answer + follow for p, answer in zip(prompts, alone)]  # the answer's ids, as decoded
        turn2_uncached = _decode_all(cold, turn2, n_out, together=False)
    finally:
        cold.stop()
    warm = AsyncEngine(loaded, cfg).start()
    try:
        turn1_cached = _decode_all(warm, prompts, n_out, together=False)  # leaves each turn 1 in the cache
        turn2_cached = _decode_all(warm, turn2, n_out, together=False)
        stats = warm.prefix_cache.stats()
    finally:
        warm.stop()
    return {"label": spec["label"], "name": loaded.name, "prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "turn2_tokens": sum(map(len, turn2)) / len(turn2), "hit_tokens": stats["hit_tokens"],
            "queried_tokens": stats["queried_tokens"],
            "rows": {"alone, twice": parting(alone, again),
                     f"alone vs a batch of {len(prompts)}": parting(alone, batch),
                     "turn 1, prefix cache on vs off": parting(turn1_cached, alone),
                     "turn 2 from turn 1's cache vs uncached": parting(turn2_cached, turn2_uncached)}}


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    results = [bench_model(_parse_model(m), args) for m in args.models.split(",")]
    command = "mlxserve bench exact " + " ".join(sys.argv[3:])
    md = [report.header("Greedy tokens: alone, batched, from the prefix cache", info, command), ""]
    md.append(f"{args.prompts} chat prompts of {args.prompt_words} words, {args.output_len} tokens each, greedy, "
              "EOS ignored. Turn 2 is turn 1's prompt, its answer and a new user message; \"from turn 1's "
              "cache\" restores what turn 1 stored (its answer's KV computed by decode steps), \"uncached\" "
              "prefills it all. Each row: how many sequences differ, and the token where each first "
              "differs.\n")
    for r in results:
        md.append(f"## {r['label']} ({r['name']})\n")
        md.append(f"Prompts {r['prompt_tokens']:.0f} tokens, turn 2 {r['turn2_tokens']:.0f}; the prefix cache "
                  f"served {r['hit_tokens']} of {r['queried_tokens']} prompt tokens asked for.\n")
        md.append(report.table(["comparison", "sequences that differ", "first differing token"],
                               [[k, f"{len(v)} of {r['prompts']}", ", ".join(map(str, v)) or "-"]
                                for k, v in r["rows"].items()]))
        md.append("")
    text = "\n".join(md)
    print(text)
    report.write_result("exact", info, text, results, None, args.out_dir)
    return 0
