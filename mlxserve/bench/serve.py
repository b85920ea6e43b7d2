"""`mlxserve bench serve`: an HTTP load generator for OpenAI-compatible servers.

For each concurrency level it sends `--requests` streamed requests, at most
`concurrency` at a time, and measures what a client sees: time to first token,
inter-token latency (the gaps between streamed chunks), end-to-end time, and
from those aggregate output tok/s, per-request decode tok/s and requests/s.
It works against any OpenAI-compatible server (mlxserve, mlx_lm.server, vLLM,
llama.cpp, Ollama); token counts come from the server's `usage`. With `--start`
it starts the servers itself on one model folder (bench/peers.py), one at a time.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Common English words: nearly all are one token with a leading space in BPE and
# SentencePiece vocabularies, so N words make a prompt of about N tokens. Prompts
# are random sequences of them, different per request, so a prefix cache does not
# turn the benchmark into a cache benchmark.
WORDS = """time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program question
work government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education foot boy age policy process music market sense nation plan college interest
death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director position
player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair
window evidence population truth song""".split()


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="HTTP load generator against an OpenAI-compatible server.")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1",
                   help="The server's /v1 base URL; several, comma-separated, are measured one after "
                        "the other with the same prompts and compared in one result.")
    p.add_argument("--model", default=None,
                   help="Model name to request, one for all or one per URL (default: each server's "
                        "first model; mlx_lm.server's own name for its model is 'default_model').")
    p.add_argument("--label", default=None, help="Names of the servers in the result, one per URL.")
    p.add_argument("--start", default=None, metavar="NAMES",
                   help="Instead of --url: start these servers (comma-separated: mlxserve, mlx_lm, "
                        "vllm-mlx) one after the other on --model-dir, each alone on the device, and "
                        "compare them in one result. A server that fails to start is reported as such. "
                        "NAME@VARIANT starts NAME again under another label, with its own --peer-args "
                        "(e.g. mlxserve,mlxserve@paged and 'mlxserve@paged=--kv-layout paged').")
    p.add_argument("--model-dir", default=None, help="With --start: the MLX model folder every server loads.")
    p.add_argument("--peer-path", action="append", metavar="NAME=DIR",
                   help="With --start: a folder of packages put first on that server's PYTHONPATH "
                        "(e.g. vllm-mlx=~/vllm-site, where vllm-mlx and the mlx-lm it pins live apart).")
    p.add_argument("--peer-args", action="append", metavar="NAME=ARGS",
                   help="With --start: extra command-line arguments for that server, e.g. "
                        "'mlxserve=--max-num-seqs 64'.")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="With --start: seconds a server may take to load and answer /health.")
    p.add_argument("--concurrency", default="1,4,16", help="Comma-separated concurrency levels.")
    p.add_argument("--requests", type=int, default=64, help="Requests per concurrency level (at least one per stream).")
    p.add_argument("--input-len", type=int, default=128, help="Prompt length, in words (about one token each).")
    p.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="Stream /chat/completions or /completions.")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="For servers without `ignore_eos`: outputs may end early; tokens are counted from usage.")
    p.add_argument("--api-key", default=os.environ.get("MLXSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="Bearer key (default: $MLXSERVE_API_KEY or $OPENAI_API_KEY).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")
    p.add_argument("--out-dir", default="benchmarks", help="Where the markdown and PNG go.")
    p.add_argument("--replot", metavar="JSON", help="Only redraw the PNG of an earlier result.")
    p.set_defaults(func=lambda a: replot(a.replot) if a.replot else run(a))


@dataclass
class Result:
    ok: bool
    error: str = ""
    ttft: float = 0.0  # seconds from send to the first content
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    timed_out: bool = False  # no answer within --timeout: the server may have stopped answering


def make_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def request_body(args, model: str, prompt: str, output_len: int | None = None) -> dict:
    body = {"model": model, "max_tokens": output_len or args.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # a fixed output length, so every request does the same work
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def sse_chunks(response):
    """The JSON chunks of an OpenAI-style SSE stream, up to `data: [DONE]` or the stream's end
    (a stream cut short just ends: callers judge completion by the finish_reason they saw)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def chunk_text(chunk: dict, endpoint: str) -> str:
    """The content a chunk streams (all choices), "" for role, usage and finish chunks."""
    return "".join((choice.get("text") if endpoint == "completions" else
                    (choice.get("delta") or {}).get("content")) or ""
                   for choice in chunk.get("choices") or [])


async def one_request(client, args, model: str, prompt: str, output_len: int | None = None) -> Result:
    import httpx

    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    start = time.perf_counter()
    stamps = []
    usage = None
    try:
        async with client.stream("POST", args.url.rstrip("/") + path,
                                 json=request_body(args, model, prompt, output_len)) as r:
            if r.status_code != 200:
                return Result(False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    return Result(False, str(chunk["error"].get("message")))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk_text(chunk, args.endpoint):
                    stamps.append(time.perf_counter())
    except httpx.TimeoutException as e:
        return Result(False, f"no answer within {args.timeout:g} s ({type(e).__name__})", timed_out=True)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return Result(False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not stamps:
        return Result(False, "no content was streamed")
    return Result(
        ok=True,
        ttft=stamps[0] - start,
        e2e=end - start,
        gaps=[b - a for a, b in zip(stamps, stamps[1:])],
        prompt_tokens=(usage or {}).get("prompt_tokens", 0),
        # Without usage, count streamed chunks (one token each on most servers).
        output_tokens=(usage or {}).get("completion_tokens", len(stamps)),
    )


async def run_level(args, model: str, concurrency: int, prompts: list[str], progress,
                    output_len: int | None = None) -> tuple[list[Result], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    todo: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    results = []

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client:
        async def worker():
            # After a timeout, send no more: a server that stopped answering would otherwise hold
            # the run for --timeout seconds per request left.
            while not todo.empty() and not any(r.timed_out for r in results):
                prompt = todo.get_nowait()
                results.append(await one_request(client, args, model, prompt, output_len))
                if progress is not None:
                    progress.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return results, duration


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summarize(concurrency: int, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    decode = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in ok if r.output_tokens > 1 and r.e2e > r.ttft]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / duration,
        "per_request_tok_per_s": percentile(decode, 50),
        "ttft_p50_ms": percentile([r.ttft for r in ok], 50) * 1000,
        "ttft_p99_ms": percentile([r.ttft for r in ok], 99) * 1000,
        "itl_p50_ms": percentile(gaps, 50) * 1000,
        "itl_p99_ms": percentile(gaps, 99) * 1000,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
        "mean_output_tokens": sum(r.output_tokens for r in ok) / max(len(ok), 1),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


COLUMNS = [
    ("concurrency", "concurrency"), ("requests", "requests"), ("failed", "failed"),
    ("req_per_s", "req/s"), ("output_tok_per_s", "output tok/s"),
    ("per_request_tok_per_s", "per-request tok/s (p50)"),
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
    ("mean_prompt_tokens", "prompt tokens"), ("mean_output_tokens", "output tokens"),
]


# Where the first token's time goes, from the server's own histograms (mlxserve's /metrics):
# (histogram, the row's key of its mean over one level, the column's title).
PHASES = [
    ("mlxserve_time_to_first_token_seconds", "server_ttft_mean_ms", "server TTFT mean ms"),
    ("mlxserve_queue_seconds", "queue_mean_ms", "queue mean ms"),
    ("mlxserve_prefill_seconds", "prefill_mean_ms", "prefill mean ms"),
    ("mlxserve_first_step_seconds", "first_step_mean_ms", "first step mean ms"),
]


async def scrape_phases(client, url: str) -> dict | None:
    """{histogram: (sum, count)} of PHASES from the server's /metrics; None where it has no such
    metrics (another server, or mlxserve with /metrics behind a key it was not given)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(url.rstrip("/").removesuffix("/v1") + "/metrics")
        if r.status_code != 200:
            return None
        samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    except (httpx.HTTPError, ValueError):
        return None
    names = [name for name, _, _ in PHASES]
    if not all(f"{n}_sum" in samples and f"{n}_count" in samples for n in names):
        return None
    return {n: (samples[f"{n}_sum"], samples[f"{n}_count"]) for n in names}


def phase_means(before: dict | None, after: dict | None) -> dict:
    """Each phase's mean in ms over the requests between two scrapes (None where not exposed)."""
    means = {key: None for _, key, _ in PHASES}
    if before is None or after is None:
        return means
    for name, key, _ in PHASES:
        count = after[name][1] - before[name][1]
        if count > 0:
            means[key] = (after[name][0] - before[name][0]) / count * 1000
    return means


def server_info(url: str, model: str | None, api_key: str | None) -> tuple[str, dict]:
    """The model to request, and what the server says about itself (mlxserve's /version)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=30) as c:
        if model is None:
            models = c.get(url.rstrip("/") + "/models")
            models.raise_for_status()
            model = models.json()["data"][0]["id"]
        info = {}
        root = url.rstrip("/").removesuffix("/v1")
        try:
            version = c.get(root + "/version")
            if version.status_code == 200:
                info = {k: v for k, v in version.json().items()
                        if k in ("version", "backend", "device", "mlx", "mlx_lm")}
        except httpx.HTTPError:
            pass
    return model, info


def bench_server(args, url: str, model: str, levels: list[int]) -> list[dict]:
    from tqdm import tqdm

    args.url = url
    rng = random.Random(args.seed)  # the same prompts for every server

    async def scrape():
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(headers=headers, timeout=min(args.timeout, 30)) as client:
            return await scrape_phases(client, url)

    async def all_levels():
        # One short request first: the server's first request pays for warm-up (compilation,
        # allocation). It also finds servers that refuse `ignore_eos` (OpenAI's own does).
        (warm,), _ = await run_level(args, model, 1, [make_prompt(rng, 8)], None)
        if not warm.ok and args.ignore_eos and ("HTTP 400" in warm.error or "HTTP 422" in warm.error):
            print(f"the server refused the warm-up request ({warm.error}); retrying without ignore_eos",
                  file=sys.stderr)
            args.ignore_eos = False
            (warm,), _ = await run_level(args, model, 1, [make_prompt(rng, 8)], None)
        if not warm.ok:
            raise SystemExit(f"the warm-up request to {url} failed: {warm.error}")
        rows = []
        with tqdm(total=sum(max(args.requests, c) for c in levels), unit="req", file=sys.stderr) as progress:
            for c in levels:
                progress.set_description(f"concurrency {c}")
                # An unmeasured round at this concurrency first: GPU backends compile
                # kernels per new shape, and the server measured first would pay for
                # it (MLX's compiled-kernel cache is shared by the servers of one run).
                warm, _ = await run_level(args, model, c, [make_prompt(rng, args.input_len) for _ in range(c)],
                                          None, output_len=4)
                # At least one request per stream: fewer would never have `c` in flight.
                prompts = [make_prompt(rng, args.input_len) for _ in range(max(args.requests, c))]
                before = await scrape()  # after the warm round: only this level's requests count
                results, duration = await run_level(args, model, c, prompts, progress)
                rows.append({**summarize(c, results, duration), **phase_means(before, await scrape())})
                if any(r.timed_out for r in warm + results):
                    rows[-1]["stopped"] = f"a request got no answer within {args.timeout:g} s"
                    print(f"{url}: {rows[-1]['stopped']} at concurrency {c}; the higher levels are not measured",
                          file=sys.stderr)
                    break
        return rows

    return asyncio.run(all_levels())


def _per_url(value: str | None, n: int, what: str) -> list:
    items = value.split(",") if value else [None] * n
    if len(items) == 1:
        items = items * n
    if len(items) != n:
        raise SystemExit(f"--{what}: give one, or one per URL ({n})")
    return items


def measure_urls(args, levels: list[int]) -> list[dict]:
    """Runs against servers already listening at --url."""
    urls = args.url.split(",")
    labels = _per_url(args.label, len(urls), "label")
    models = _per_url(args.model, len(urls), "model")
    ignore_eos = args.ignore_eos
    runs = []
    for url, label, model in zip(urls, labels, models):
        model, server = server_info(url, model, args.api_key)
        args.ignore_eos = ignore_eos
        rows = bench_server(args, url, model, levels)
        runs.append({"label": label or url, "url": url, "model": model, "server": server,
                     "ignore_eos": args.ignore_eos, "rows": rows})
    return runs


def measure_started(args, levels: list[int]) -> list[dict]:
    """Runs against servers this command starts on --model-dir, one alive at a time; a server that
    does not start or answer is a run with an `error` and no rows."""
    import shlex

    import httpx

    from mlxserve.bench import peers

    names = args.start.split(",")
    unknown = [n for n in names if peers.peer_of(n) is None]
    if unknown or not args.model_dir:
        raise SystemExit(f"--start takes {', '.join(peers.PEERS)} (got {unknown}) and needs --model-dir"
                         if unknown else "--start needs --model-dir")
    paths = peers.parse_pairs(args.peer_path, "peer-path")
    extra = peers.parse_pairs(args.peer_args, "peer-args")
    ignore_eos = args.ignore_eos
    runs = []
    for name in names:
        peer = peers.peer_of(name)
        result = {"label": name, "url": None, "model": None, "server": {}, "ignore_eos": False, "rows": []}
        try:
            path = paths.get(name, paths.get(peer.name))  # a variant shares its server's packages
            with peers.Started(peer, args.model_dir, path, extra.get(name, ""),
                               args.start_timeout) as started:
                model, server = server_info(started.url, peer.model, args.api_key)
                result.update(url=started.url, model=model, server={
                    **started.versions, **{k: v for k, v in server.items() if k in ("backend", "device")},
                    "mode": peer.note or "default", "started in": f"{started.startup_s:.1f} s",
                    "command": f"`{shlex.join(started.command)}`", "log": started.child.log})
                args.ignore_eos = ignore_eos
                result["rows"] = bench_server(args, started.url, model, levels)
                # Servers without ignore_eos take the field and drop it: outputs may end early.
                result["ignore_eos"] = args.ignore_eos and peer.honours_ignore_eos
        except (RuntimeError, SystemExit, OSError, httpx.HTTPError, subprocess.SubprocessError) as e:
            result["error"] = str(e)
            print(f"{name} did not run: {e}", file=sys.stderr)
        runs.append(result)
    return runs


def level(run: dict, concurrency: int, key: str):
    """A run's number at one concurrency, "-" where that level was not measured."""
    return next((row[key] for row in run["rows"] if row["concurrency"] == concurrency), "-")


def run(args) -> int:
    from mlxserve.bench import report

    levels = [int(c) for c in args.concurrency.split(",")]
    info = report.machine()
    runs = measure_started(args, levels) if args.start else measure_urls(args, levels)

    command = "mlxserve bench serve " + " ".join(sys.argv[3:])
    md = [report.header("Serving benchmark", info, command),
          f"{args.requests} streamed {args.endpoint} requests per level (or one per stream, if more); prompts of {args.input_len} "
          f"random words, {args.output_len} output tokens, greedy. TTFT: send to first content. "
          "ITL: gaps between streamed chunks. Per-request tok/s: (output tokens - 1) / (end - first "
          "token). Output tok/s and req/s: totals over the level's wall time.\n"]
    for r in runs:
        if "error" in r:
            reason, _, log = r["error"].partition("\n")
            md.append(f"## {r['label']}\n\nDid not run: {reason}\n" + (f"\n```\n{log.strip()}\n```\n" if log else ""))
            continue
        table = report.table([title for _, title in COLUMNS], [[row[k] for k, _ in COLUMNS] for row in r["rows"]])
        phases = phase_table(r["rows"])
        if phases:
            table += ("\n\nWhere the first token's time goes (the server's own clock, from its arrival to the "
                      "token leaving the engine; means over each level's requests):\n\n" + phases)
        print(f"\n{r['label']} ({r['url']}, model {r['model']})\n{table}")
        md.append(f"## {r['label']}\n\n- url: {r['url']}\n- model: {r['model']}\n"
                  + "".join(f"- {k}: {v}\n" for k, v in r["server"].items())
                  + f"- output length: {args.output_len} tokens"
                  + (" (EOS ignored)" if r["ignore_eos"] else " at most (this server has no ignore_eos)")
                  + f"\n\n{table}\n"
                  + "".join(f"\nStopped at concurrency {row['concurrency']}: {row['stopped']}; the higher "
                            "levels were not measured.\n" for row in r["rows"] if "stopped" in row))
        for row in r["rows"]:
            for error in row["errors"]:
                print(f"{r['label']} concurrency {row['concurrency']}: failed: {error}", file=sys.stderr)
    measured = [r for r in runs if r["rows"]]
    if len(runs) > 1:
        compare = report.table(
            ["concurrency"] + [f"{r['label']} tok/s" for r in measured]
            + [f"{r['label']} TTFT p50 ms" for r in measured]
            + [f"{r['label']} queue / prefill / first step ms" for r in measured],
            [[c] + [level(r, c, "output_tok_per_s") for r in measured]
             + [level(r, c, "ttft_p50_ms") for r in measured]
             + [phases_cell(r, c) for r in measured] for c in levels])
        missing = "".join(f"\n{r['label']}: did not run ({r['error'].splitlines()[0]})\n"
                          for r in runs if "error" in r)
        print("\n" + compare + missing)
        md.append("## Side by side\n\n" + compare + "\n" + missing)
    answered = any(row["failed"] < row["requests"] for r in runs for row in r["rows"])
    report.write_result("serve", info, "\n".join(md), runs, plot if answered else None, args.out_dir)
    return 0 if all("error" not in r and all(row["failed"] == 0 for row in r["rows"]) for r in runs) else 1


def phase_table(rows: list[dict]) -> str | None:
    """Per level, the server's mean TTFT and its phases ("-" where not exposed); None when no level has them."""
    if not any(row.get(key) is not None for row in rows for _, key, _ in PHASES):
        return None
    from mlxserve.bench import report

    return report.table(["concurrency"] + [title for _, _, title in PHASES],
                        [[row["concurrency"]] + ["-" if row.get(key) is None else row[key] for _, key, _ in PHASES]
                         for row in rows])


def phases_cell(run: dict, concurrency: int) -> str:
    """A run's queue / prefill / first step means at one level, "-" where it has none."""
    row = next((row for row in run["rows"] if row["concurrency"] == concurrency), {})
    means = [row.get(key) for _, key, _ in PHASES[1:]]
    return "-" if None in means else " / ".join(f"{m:,.1f}" for m in means)


def replot(json_path) -> None:
    from mlxserve.bench import report

    report.replot(json_path, plot)


def plot(runs: list[dict], png, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        rows = [row for row in r["rows"] if row["failed"] < row["requests"]]
        if not rows:  # a server that did not run or answered nothing
            continue
        cs = [row["concurrency"] for row in rows]
        line, = ax1.plot(cs, [row["output_tok_per_s"] for row in rows], marker="o",
                         label=f"{r['label']} aggregate")
        ax1.plot(cs, [row["per_request_tok_per_s"] for row in rows], marker="s", linestyle="--",
                 color=line.get_color(), label=f"{r['label']} per request (p50)")
        ax2.plot(cs, [row["ttft_p50_ms"] for row in rows], marker="o", color=line.get_color(),
                 label=f"{r['label']} TTFT p50")
        ax2.plot(cs, [row["itl_p50_ms"] for row in rows], marker="s", linestyle="--",
                 color=line.get_color(), label=f"{r['label']} ITL p50")
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"serving benchmark, {info.get('backend')} ({info.get('device')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
