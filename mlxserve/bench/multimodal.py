"""`mlxserve bench multimodal`: what the image caches save, in-process.

The vllm-mlx paper's tables, on one model:
- multi-turn questions about one image, turns 1-3, caches off vs on (Table 2);
- turn 2 with no cache, vision embeddings only, KV only, both (Table 4);
- image resolution 224 / 448 / 768 / 1024 px: cold vs cached turn (Table 5);
- video of 4-64 frames: cold vs a second question about it (Tables 3 and 6);
- bytes one cached image costs (vision embeddings, and its KV blocks);
- the longest pause in a running text stream when an image request arrives:
  tower and prompt in one go vs in slices between decode steps.

Time to first token (TTFT) and whole-turn latency include fetching nothing
(images are in memory) but do include building the prompt: pixel hashing,
preprocessing (skipped for images whose embeddings are cached), the chat
template ("prep", also shown alone). "Suffix alone" is the TTFT of a text-only
prompt as long as what the turn left uncached, prefilled on an empty cache and
answered at the turn's length; the floor adds what attending to the cached
context costs the model itself (model calls, no cache involved): no cache can
beat it. hit/suffix and hit/floor compare the engine's part of a hit (TTFT -
prep) with them.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

QUESTIONS = ["Describe this image in detail.", "What colors stand out, and where?",
             "Is there any text in it? Quote it.", "What would you change to improve it?"]


def add_parser(sub) -> None:
    p = sub.add_parser("multimodal", help="Image caches: multi-turn, ablation, resolution, bytes per image.")
    p.add_argument("--model", default="dummy:qwen2.5-vl-mid", help="A VLM source, or dummy:SHAPE[:q4|:q8].")
    p.add_argument("--size", type=int, default=1024, help="Image side (px) of the multi-turn and ablation runs.")
    p.add_argument("--sizes", default="224,448,768,1024", help="Image sides (px) of the resolution table.")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2,
                   help="Runs of each conversation, each with a new picture of the same size; the best "
                        "time per turn is kept (the first run also compiles kernels for new shapes).")
    p.add_argument("--answer-len", type=int, default=16, help="Output tokens per turn.")
    p.add_argument("--block-size", type=int, default=None, help="Prefix-cache block size (default: the engine's).")
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8), help="Quantized KV in every engine run.")
    p.add_argument("--video-frames", default="4,8,16,32,64", help="Frame counts of the video table ('' skips it).")
    p.add_argument("--video-size", type=int, default=448, help="Frame side (px) of the video table.")
    p.add_argument("--stall-tokens", type=int, default=64,
                   help="Tokens of the text stream in the decode-stall test (0 skips it).")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--replot", metavar="JSON", help="Only redraw the PNG of an earlier result.")
    p.set_defaults(func=lambda a: replot(a.replot) if a.replot else run(a))


def picture(side: int, seed: int = 0):
    """A deterministic photo-like test image: smooth gradients plus noise (not a flat color)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([x, y, (x + y) / 2], axis=-1) * 200
    return Image.fromarray((base + rng.random((side, side, 3)) * 55).astype(np.uint8))


class Bench:
    def __init__(self, loaded, args):
        self.loaded = loaded
        self.args = args

    def engine(self, prefix: bool, vision: bool, **settings):
        from mlxserve.config import EngineConfig
        from mlxserve.engine.engine import AsyncEngine

        if self.args.block_size:
            settings["block_size"] = self.args.block_size
        settings.setdefault("kv_bits", self.args.kv_bits)
        return AsyncEngine(self.loaded, EngineConfig(
            prefix_cache=prefix, vision_cache_memory="1GB" if vision else "0", cache_memory="50%",
            **settings)).start(wait_warmup=True)

    def turn(self, engine, messages, max_tokens=None) -> dict:
        """One chat turn: TTFT, whole-turn latency, the answer, cached tokens."""
        from mlxserve.engine.request import Request, SamplingParams
        from mlxserve.multimodal.prompt import chat_prompt

        async def go():
            start = time.perf_counter()
            ids, images = chat_prompt(self.loaded, messages, is_cached=engine.image_is_cached)
            prep = time.perf_counter() - start
            params = SamplingParams(temperature=0, max_tokens=max_tokens or self.args.answer_len, ignore_eos=True)
            first, text, cached = None, [], 0
            async for out in engine.submit(Request(ids, params, images=images)):
                first = first or time.perf_counter() - start
                text.append(out.new_text)
                cached = out.cached_tokens
            return {"ttft": first, "total": time.perf_counter() - start, "prep": prep, "answer": "".join(text),
                    "prompt": len(ids), "cached": cached,
                    "image_tokens": sum(im.num_tokens for im in images)}

        return asyncio.run(go())

    def conversation(self, engine, image, turns: int) -> list[dict]:
        """Turns about one image (a PIL image) or video (a list of frames)."""
        messages, rows = [], []
        for t in range(turns):
            content = [{"type": "text", "text": QUESTIONS[t % len(QUESTIONS)]}]
            if t == 0:
                media = {"type": "video", "video": image} if isinstance(image, list) else {"type": "image", "image": image}
                content.insert(0, media)
            messages.append({"role": "user", "content": content})
            row = self.turn(engine, messages)
            row["suffix_alone"] = self.suffix_alone(row["prompt"] - row["cached"])
            messages.append({"role": "assistant", "content": row.pop("answer")})
            rows.append(row)
        return rows

    def suffix_alone(self, n: int) -> float:
        from mlxserve.engine.request import Request, SamplingParams

        if not hasattr(self, "_plain"):
            self._plain = self.engine(prefix=False, vision=False)
        rng = random.Random(n)
        tokens = [rng.randrange(1000, 30000) for _ in range(n)]

        async def go():  # answered like a turn (same length), so both first tokens are timed alike
            start, first = time.perf_counter(), None
            params = SamplingParams(temperature=0, max_tokens=self.args.answer_len, ignore_eos=True)
            async for _ in self._plain.submit(Request(tokens, params)):
                first = first or time.perf_counter() - start
            return first

        asyncio.run(go())  # the first run of a length compiles its shapes
        return asyncio.run(go())

    def close(self):
        if hasattr(self, "_plain"):
            self._plain.stop()


TIMES = ("ttft", "total", "prep", "suffix_alone")


def best_of(runs: list[list[dict]]) -> list[dict]:
    """Per turn, the best time over runs (the counts are the same in every run)."""
    return [{**rows[-1], **{k: min(r[k] for r in rows) for k in TIMES}} for rows in zip(*runs)]


def conversations(bench: Bench, engine, side: int, turns: int, repeats: int, seed: int) -> list[dict]:
    """The same conversation `repeats` times, each about a new picture (so each turn 1 is cold)."""
    return best_of([bench.conversation(engine, picture(side, seed=seed + r), turns) for r in range(repeats)])


def multi_turn(bench: Bench, args) -> dict:
    out = {}
    for name, prefix, vision in (("no cache", False, False), ("cached", True, True)):
        print(f"   multi-turn, {name}", file=sys.stderr, flush=True)
        engine = bench.engine(prefix, vision)
        try:
            out[name] = conversations(bench, engine, args.size, args.turns, args.repeats, seed=100)
            out[name + " bytes"] = asyncio.run(engine.cache_stats())
        finally:
            engine.stop()
    for row in out["cached"]:
        new_tokens = row["prompt"] - row["cached"]
        row["floor"] = row["suffix_alone"] + random_context_cost(bench.loaded.model, row["cached"], new_tokens,
                                                                 args.kv_bits)
    return out


def random_context_cost(model, n_context: int, n_suffix: int, kv_bits=None) -> float:
    """`bench.prefix.context_cost` of `n_context` cached tokens and `n_suffix` new ones (random
    tokens), best of 2."""
    from mlxserve.bench.prefix import context_cost

    rng = random.Random(n_context)
    context = [rng.randrange(1000, 30000) for _ in range(n_context)]
    suffix = [rng.randrange(1000, 30000) for _ in range(n_suffix)]
    return context_cost(model, context, suffix, kv_bits=kv_bits, tries=2)


def ablation(bench: Bench, args) -> list[dict]:
    rows = []
    for name, prefix, vision in (("no cache", False, False), ("embeddings only", False, True),
                                 ("KV only", True, False), ("both", True, True)):
        print(f"   ablation, {name}", file=sys.stderr, flush=True)
        engine = bench.engine(prefix, vision)
        try:
            turns = conversations(bench, engine, args.size, 2, args.repeats, seed=200)
        finally:
            engine.stop()
        rows.append({"config": name, "turn1": turns[0], "turn2": turns[1]})
    return rows


def resolutions(bench: Bench, args) -> list[dict]:
    rows = []
    engine = bench.engine(True, True)
    try:
        for side in [int(s) for s in args.sizes.split(",")]:
            print(f"   resolution {side}", file=sys.stderr, flush=True)
            turns = conversations(bench, engine, side, 2, args.repeats, seed=300 + side)
            rows.append({"side": side, "cold": turns[0], "hit": turns[1]})
    finally:
        engine.stop()
    return rows


def videos(bench: Bench, args) -> list[dict]:
    rows = []
    if bench.loaded.vision.video_token_id is None:
        return rows
    engine = bench.engine(True, True)
    try:
        for n in [int(x) for x in args.video_frames.split(",")]:
            print(f"   video, {n} frames", file=sys.stderr, flush=True)
            runs = [bench.conversation(engine, [picture(args.video_size, seed=1000 * r + f) for f in range(n)], 2)
                    for r in range(args.repeats)]
            cold, hit = best_of(runs)
            rows.append({"frames": n, "cold": cold, "hit": hit})
    finally:
        engine.stop()
    return rows


def decode_stall(bench: Bench, args) -> list[dict]:
    """Gaps between a text stream's tokens while an image request is prefilled beside it."""
    from mlxserve.engine.request import Request, SamplingParams
    from mlxserve.multimodal.prompt import chat_prompt

    image_msgs = [{"role": "user", "content": [{"type": "image", "image": picture(args.size, seed=2)},
                                               {"type": "text", "text": QUESTIONS[0]}]}]
    ids, images = chat_prompt(bench.loaded, image_msgs)
    text_ids, _ = chat_prompt(bench.loaded, [{"role": "user", "content": "Tell me a long story."}])
    rows = []
    for name, settings in (("tower and prompt in one step", {"vision_step_ms": 0, "prefill_chunk_size": len(ids) + 1}),
                           ("in slices (defaults)", {})):
        print(f"   decode stall, {name}", file=sys.stderr, flush=True)
        engine = bench.engine(False, False, **settings)

        async def go():
            times = []

            async def stream():
                params = SamplingParams(temperature=0, max_tokens=args.stall_tokens, ignore_eos=True)
                async for _ in engine.submit(Request(list(text_ids), params)):
                    times.append(time.perf_counter())

            async def image_request():
                while len(times) < 8:  # join once the stream is decoding
                    await asyncio.sleep(0.001)
                start = time.perf_counter()
                params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
                async for _ in engine.submit(Request(list(ids), params, images=images)):
                    pass
                return time.perf_counter() - start

            _, image_ttft = await asyncio.gather(stream(), image_request())
            gaps = [b - a for a, b in zip(times, times[1:])]
            return gaps, image_ttft

        try:
            asyncio.run(go())  # warm-up: shapes compile, caches fill
            gaps, image_ttft = asyncio.run(go())
        finally:
            engine.stop()
        gaps.sort()
        rows.append({"mode": name, "max_gap": gaps[-1], "median_gap": gaps[len(gaps) // 2],
                     "image_ttft": image_ttft, "settings": settings})
    return rows


def run(args) -> int:
    from mlxserve.bench import report
    from mlxserve.bench.engine import _parse_model
    from mlxserve import backend
    from mlxserve.models.load import load

    spec = _parse_model(args.model)
    info = report.machine()
    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"])
    if loaded.vision is None:
        print(f"{args.model} is not a vision-language model", file=sys.stderr)
        return 2
    print(f"== {spec['label']} ({loaded.name})", file=sys.stderr)
    bench = Bench(loaded, args)
    try:
        turns = multi_turn(bench, args)
        abl = ablation(bench, args)
        res = resolutions(bench, args) if args.sizes else []
        vids = videos(bench, args) if args.video_frames else []
        stall = decode_stall(bench, args) if args.stall_tokens else []
    finally:
        bench.close()

    ms = 1e3
    off, on = turns["no cache"], turns["cached"]
    kv = report.kv_label(args.kv_bits)
    md = [report.header("Multimodal cache benchmark", info, "mlxserve bench multimodal " + " ".join(sys.argv[3:])),
          f"Model: {spec['label']} ({loaded.name}); {kv}; block size {args.block_size or backend.default('block_size')}; "
          f"{args.answer_len} output tokens per turn; synthetic {args.size}x{args.size} image "
          f"({on[0]['image_tokens']} image tokens). Times in ms, best of {args.repeats} runs, each "
          f"with a new picture of the same size.\n",
          "## Multi-turn on one image (paper Table 2)\n",
          report.table(
              ["turn", "prompt tokens", "cached tokens", "TTFT, no cache", "TTFT, cached", "TTFT speedup",
               "turn, no cache", "turn, cached", "turn speedup", "prep, cached", "suffix alone",
               "floor (suffix + context)", "hit/suffix", "hit/floor"],
              [[i + 1, c["prompt"], c["cached"], o["ttft"] * ms, c["ttft"] * ms, f"{o['ttft'] / c['ttft']:.1f}x",
                o["total"] * ms, c["total"] * ms, f"{o['total'] / c['total']:.1f}x", c["prep"] * ms,
                c["suffix_alone"] * ms, c["floor"] * ms, f"{(c['ttft'] - c['prep']) / c['suffix_alone']:.2f}x",
                f"{(c['ttft'] - c['prep']) / c['floor']:.2f}x"]
               for i, (o, c) in enumerate(zip(off, on))]),
          "",
          "## Turn 2 by cache (paper Table 4)\n",
          report.table(
              ["caches", "turn 1 TTFT", "turn 2 TTFT", "turn 2 cached tokens", "turn 2 total", "vs no cache"],
              [[r["config"], r["turn1"]["ttft"] * ms, r["turn2"]["ttft"] * ms, r["turn2"]["cached"],
                r["turn2"]["total"] * ms, f"{abl[0]['turn2']['ttft'] / r['turn2']['ttft']:.1f}x"] for r in abl]),
          ""]
    if res:
        md += ["## Image resolution (paper Table 5)\n",
               report.table(
                   ["side px", "image tokens", "cold TTFT", "turn 2 TTFT", "speedup", "turn 2 prep", "suffix alone",
                    "hit/suffix"],
                   [[r["side"], r["cold"]["image_tokens"], r["cold"]["ttft"] * ms, r["hit"]["ttft"] * ms,
                     f"{r['cold']['ttft'] / r['hit']['ttft']:.1f}x", r["hit"]["prep"] * ms,
                     r["hit"]["suffix_alone"] * ms,
                     f"{(r['hit']['ttft'] - r['hit']['prep']) / r['hit']['suffix_alone']:.2f}x"] for r in res]),
               ""]
    if vids:
        md += [f"## Video ({args.video_size} px frames; paper Tables 3 and 6)\n",
               report.table(["frames", "video tokens", "cold TTFT", "2nd question TTFT", "speedup", "cold turn",
                             "2nd turn", "suffix alone", "hit/suffix"],
                            [[r["frames"], r["cold"]["image_tokens"], r["cold"]["ttft"] * ms, r["hit"]["ttft"] * ms,
                              f"{r['cold']['ttft'] / r['hit']['ttft']:.1f}x", r["cold"]["total"] * ms,
                              r["hit"]["total"] * ms, r["hit"]["suffix_alone"] * ms,
                              f"{(r['hit']['ttft'] - r['hit']['prep']) / r['hit']['suffix_alone']:.2f}x"]
                             for r in vids]), ""]
    if stall:
        md += [f"## A text stream's longest pause when a {args.size} px image request arrives\n",
               report.table(["image prefill", "longest gap ms", "median gap ms", "image request TTFT ms"],
                            [[r["mode"], r["max_gap"] * ms, r["median_gap"] * ms, r["image_ttft"] * ms]
                             for r in stall]), ""]
    stats = turns["cached bytes"]
    pc, vc = stats["prefix_cache"], stats["vision_cache"]
    kv_per_token = pc["bytes"] / max(1, pc["tokens"])
    image_tokens = on[0]["image_tokens"]
    images = vc["entries"] + vc.get("released", 0)  # each conversation's picture: encoded once
    encoded = (vc["bytes"] + vc.get("released_bytes", 0)) / max(1, images)
    held = vc["bytes"] / max(1, images)
    entry = held + kv_per_token * image_tokens
    md += ["## Bytes per cached image\n",
           f"- Vision embeddings: {encoded / 2**20:.1f} MiB per image; {vc.get('released', 0)} of {images} "
           f"dropped once the prefix cache held their KV, so {held / 2**20:.1f} MiB per image stay.",
           f"- KV blocks: {kv_per_token / 1024:.1f} KiB per token, so {kv_per_token * image_tokens / 2**20:.1f} MiB "
           f"for the image's {image_tokens} tokens.",
           f"- Together: {entry / 2**20:.1f} MiB ({entry / 1e6:.1f} MB) per image.", ""]
    text = "\n".join(md)
    print(text)
    report.write_result("multimodal", info, text, {"turns": turns, "ablation": abl, "resolutions": res,
                                                    "videos": vids, "stall": stall},
                        _plot, args.out_dir)
    return 0


def replot(json_path) -> None:
    from mlxserve.bench import report

    report.replot(json_path, _plot)


def _plot(results, png, info) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    off, on = results["turns"]["no cache"], results["turns"]["cached"]
    xs = range(1, len(on) + 1)
    ax1.plot(xs, [r["ttft"] * 1e3 for r in off], marker="o", label="TTFT, no cache")
    ax1.plot(xs, [r["ttft"] * 1e3 for r in on], marker="o", label="TTFT, cached")
    ax1.plot(xs, [r["suffix_alone"] * 1e3 for r in on], ls="--", label="suffix alone")
    ax1.set_xlabel("turn")
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    abl = results["ablation"]
    ax2.bar([r["config"] for r in abl], [r["turn2"]["ttft"] * 1e3 for r in abl], color="tab:blue")
    ax2.set_ylabel("turn 2 TTFT, ms")
    ax2.tick_params(axis="x", labelsize=8)
    res = results["resolutions"]
    sides = [r["side"] for r in res]
    ax3.plot(sides, [r["cold"]["ttft"] * 1e3 for r in res], marker="o", label="cold")
    ax3.plot(sides, [r["hit"]["ttft"] * 1e3 for r in res], marker="o", label="turn 2 (cached)")
    ax3.set_xlabel("image side, px")
    ax3.set_ylabel("TTFT, ms")
    ax3.set_yscale("log")
    for ax in (ax1, ax3):
        ax.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle(f"image caches, {info['backend']} ({info['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
