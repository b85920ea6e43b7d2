"""`mlxserve bench stall`: does one heavy request stall the streams of everyone else?

Against a running server (--url): --streams streamed chats decode (EOS ignored, so they
run to --max-tokens); after --lead seconds one chat with a --big-mb prompt is posted. The
gaps between each stream's chunks are recorded. The verdict compares the largest gap
while the big request is being served with the streams' median gap before it (the goal:
at most --tolerance times it). The big request's status and time are reported too: on a
model whose context it exceeds, a 400 it should get at once.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

from mlxserve.bench.serve import server_info, sse_chunks


def add_parser(sub) -> None:
    p = sub.add_parser("stall", help="Streams' gaps between tokens while a multi-MB prompt is posted.")
    p.add_argument("--url", required=True, help="The running server's /v1 base URL.")
    p.add_argument("--api-key", default=None)
    p.add_argument("--streams", type=int, default=8, help="Streams decoding meanwhile.")
    p.add_argument("--max-tokens", type=int, default=256, help="Each stream's length (EOS ignored).")
    p.add_argument("--big-mb", type=float, default=3.0, help="Size of the big prompt, in MB of text.")
    p.add_argument("--lead", type=float, default=3.0, help="Seconds the streams run before the big prompt.")
    p.add_argument("--tolerance", type=float, default=2.0, help="Largest gap allowed, in median gaps.")
    p.add_argument("--label", default="", help="Words added to the result's title (e.g. the commit).")
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


def big_text(megabytes: float, seed: int = 0) -> str:
    """Prose-like text of about `megabytes` MB: words a tokenizer splits like real text."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    out, size = [], 0
    while size < megabytes * 1e6:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20))) + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


async def stream(client, url: str, model: str, args, i: int, times: list[float]) -> None:
    body = {"model": model, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}]}
    async with client.stream("POST", url + "/chat/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in sse_chunks(r):
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())


async def measure(args, url: str, model: str) -> dict:
    import httpx

    text = big_text(args.big_mb)
    # Encoded now: json.dumps of a 6 MB body takes tens of ms on this process's event loop, where
    # the streams' chunk times are taken (the first runs, on the H100, counted it as the server's).
    big = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}).encode()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        times = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, url, model, args, i, times[i])) for i in range(args.streams)]
        await asyncio.sleep(args.lead)
        posted = time.perf_counter()
        big = await client.post(url + "/chat/completions", content=big,
                                headers={"Content-Type": "application/json"})
        answered = time.perf_counter()
        await asyncio.gather(*tasks)
    gaps_before, gaps_during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b < posted:
                gaps_before.append(b - a)
            elif a < answered:  # the gap overlaps the big request's time
                gaps_during.append(b - a)
    median = statistics.median(gaps_before) if gaps_before else None
    largest = max(gaps_during, default=None)
    error = big.json().get("error", {}) if big.status_code != 200 else {}
    return {"big_bytes": len(text.encode()), "big_status": big.status_code, "big_code": error.get("code"),
            "big_seconds": round(answered - posted, 3), "median_gap_ms": median and round(median * 1e3, 2),
            "largest_gap_ms": largest and round(largest * 1e3, 2),
            # The same before the post: pauses the big prompt did not cause (a garbage collection).
            "largest_gap_before_ms": round(max(gaps_before) * 1e3, 2) if gaps_before else None,
            "ratio": round(largest / median, 2) if median and largest else None,
            "gaps_before": len(gaps_before), "gaps_during": len(gaps_during)}


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    url = args.url.rstrip("/")
    model, server = server_info(url, None, args.api_key)
    result = asyncio.run(measure(args, url, model))
    result.update(server=server, model=model, streams=args.streams, tolerance=args.tolerance)
    ok = result["ratio"] is not None and result["ratio"] <= args.tolerance
    title = f"# bench stall {args.label}".rstrip()
    text = "\n".join([
        title, "",
        f"{model} at {url}, commit {info['commit']}, {info['device']}, {info.get('backend', '')}", "",
        f"{args.streams} streams decoding; a {result['big_bytes'] / 1e6:.1f} MB chat prompt posted after "
        f"{args.lead:g} s.", "",
        "| big prompt | its time | streams' median gap before | largest gap before | largest gap while it is "
        "served | ratio | verdict |",
        "|---|---|---|---|---|---|---|",
        f"| {result['big_status']} {result['big_code'] or ''} | {result['big_seconds']} s | "
        f"{result['median_gap_ms']} ms | {result['largest_gap_before_ms']} ms | {result['largest_gap_ms']} ms | "
        f"{result['ratio']}x | "
        f"{'PASS' if ok else 'FAIL'} (≤ {args.tolerance:g}x) |", ""])
    print(text)
    path = report.write_result("stall", info, text, result, None, args.out_dir)
    print(f"wrote {path}.md", file=sys.stderr)
    return 0 if ok else 1
