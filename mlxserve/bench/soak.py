"""`mlxserve bench soak`: a long run of mixed traffic against one server, watching for leaks.

It starts `mlxserve serve` in a child process (or targets a running server with --url) and
keeps --streams streamed chat requests in flight for --minutes: random prompt lengths and
max_tokens, a share aborted by the client mid-stream (the connection closed after a random
number of chunks), a share extending an earlier prompt (prefix-cache hits) and, on a VLM, a
share with synthetic PNG images, some sent again (vision-cache hits). Every --interval seconds
it samples the server's RSS, MLX's memory and the caches' bytes (GET /v1/cache/stats) and the
interval's latencies and counts. The verdict: after the warm-up, RSS and MLX's active memory
are flat (the least-squares line through the samples moves by at most --tolerance of their
mean), no request failed, and once the clients are gone the engine is idle with no cache
block still in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import os
import random
import shlex
import signal
import sys
import time
from collections import Counter, deque

from mlxserve.bench.serve import chunk_text, make_prompt, percentile, request_body, server_info, sse_chunks

from mlxserve.bench import soak_report
from mlxserve.bench.local import ChildServer, free_port, warmed
from mlxserve.bench.soak_report import MiB


def add_parser(sub) -> None:
    from mlxserve.config import ModelConfig, add_arguments

    p = sub.add_parser("soak", help="Hours of mixed traffic (aborts, images) against one server: memory, "
                                     "latency and errors over time.")
    add_arguments(p, ModelConfig)  # the model of the server it starts: the same flags as `serve`
    p.add_argument("--url", default=None,
                   help="Target a running server's /v1 base URL instead of starting one.")
    p.add_argument("--server-pid", type=int, default=None,
                   help="With --url: the server's process id on this machine, for its RSS.")
    p.add_argument("--server-args", default="",
                   help="More `mlxserve serve` flags for the server it starts, e.g. \"--cache-memory 512MB\".")
    p.add_argument("--streams", type=int, default=16, help="Requests kept in flight.")
    p.add_argument("--minutes", type=float, default=20.0, help="How long to run.")
    p.add_argument("--interval", type=float, default=10.0, help="Seconds between samples.")
    p.add_argument("--prompt-len", default="16-1024", help="Prompt length range, in words (about a token each).")
    p.add_argument("--max-tokens", default="16-256", help="max_tokens range (EOS ignored: each runs to its limit).")
    p.add_argument("--abort-rate", type=float, default=0.2,
                   help="Share of requests the client abandons after a random number of chunks.")
    p.add_argument("--prefix-reuse", type=float, default=0.2,
                   help="Share of prompts that begin with most of an earlier prompt (prefix-cache hits).")
    p.add_argument("--image-rate", type=float, default=0.3, help="On a VLM: share of requests with an image.")
    p.add_argument("--image-px", default="64-448", help="Side range of the synthetic square PNGs, in px.")
    p.add_argument("--image-repeat", type=float, default=0.5,
                   help="Share of image requests that send an image already sent (vision-cache hits).")
    p.add_argument("--warmup", type=float, default=0.2, help="Share of the run left out of the verdict.")
    p.add_argument("--tolerance", type=float, default=0.05, help="Largest fitted memory change counted as flat.")
    p.add_argument("--latency-tolerance", type=float, default=0.25,
                   help="Largest fitted rise of the time to first token's p99 (a fall always passes).")
    p.add_argument("--kill", action="store_true",
                   help="End with kill -9 under load, then restart the server (its --disk-cache-dir in "
                        "--server-args): how much of the memory tier the disk tier kept.")
    p.add_argument("--expected-status", default="",
                   help="Comma-separated HTTP statuses counted as refused, not errors (e.g. 429 when "
                        "--streams exceeds the server's queue on purpose).")
    p.add_argument("--api-key", default=os.environ.get("MLXSERVE_API_KEY"), help="Bearer key (default: $MLXSERVE_API_KEY).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the traffic (prompts, lengths, aborts, images).")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds a request may wait for its next chunk.")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="Seconds the started server gets to load.")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--replot", metavar="JSON", help="Only redraw the PNG of an earlier result.")
    p.set_defaults(func=lambda a: replot(a.replot) if a.replot else run(a))


def replot(json_path) -> None:
    soak_report.replot(json_path)


def span(text: str) -> tuple[int, int]:
    """"16-256" -> (16, 256); "32" -> (32, 32)."""
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 0 < lo <= hi:
        raise SystemExit(f"not a range of positive integers: {text!r}")
    return lo, hi


class Traffic:
    """What each request asks for, from one seeded generator: the same seed sends the same
    requests in the same order (their timing, and so what runs beside what, still varies)."""

    def __init__(self, args, images: bool):
        self.args, self.images = args, images
        self.rng = random.Random(args.seed)
        self.prompt_len, self.max_tokens, self.px = span(args.prompt_len), span(args.max_tokens), span(args.image_px)
        self.prompts: deque[list[str]] = deque(maxlen=32)
        self.sent: deque[tuple[int, int]] = deque(maxlen=32)  # (side, seed) of images sent so far
        self.next_seed = 0

    def next(self) -> dict:
        a, rng = self.args, self.rng
        n = rng.randint(*self.prompt_len)
        reuse = bool(self.prompts) and rng.random() < a.prefix_reuse
        if reuse:  # most of an earlier prompt, then at least a quarter new words
            base = rng.choice(self.prompts)
            keep = min(len(base), n - max(1, n // 4))
            words = base[:keep] + make_prompt(rng, n - keep).split()
        else:
            words = make_prompt(rng, n).split()
        self.prompts.append(words)
        max_tokens = rng.randint(*self.max_tokens)
        abort_after = rng.randint(1, max_tokens - 1) if max_tokens > 1 and rng.random() < a.abort_rate else None
        image, repeat, image_first = None, False, False
        if self.images and rng.random() < a.image_rate:
            if self.sent and rng.random() < a.image_repeat:
                image, repeat = rng.choice(self.sent), True
            else:
                image = (rng.randint(*self.px), self.next_seed)
                self.next_seed += 1
                self.sent.append(image)
            # Before the text, a repeat is a prefix-cache hit through the image; after it, the same
            # picture under a new prefix needs its embeddings again (the vision cache, or the tower).
            image_first = rng.random() < 0.5
        return {"prompt": " ".join(words), "reuse": reuse, "max_tokens": max_tokens, "abort_after": abort_after,
                "image": image, "repeat": repeat, "image_first": image_first}


@functools.lru_cache(maxsize=64)  # the repeated ones are drawn from the last 32 sent
def png_data_url(side: int, seed: int) -> str:
    """A photo-like PNG (gradients plus noise, from `bench multimodal`) as a data URL; the same
    (side, seed) gives the same bytes, so a repeat is a vision-cache hit."""
    import base64
    import io

    from mlxserve.bench.multimodal import picture

    buf = io.BytesIO()
    picture(side, seed=seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def soak_request(client, url: str, args, model: str, req: dict, expected: set[int]) -> dict:
    """One streamed chat request; its outcome: ok, aborted (by us, on purpose), refused (an
    expected status) or error (any other status, an error event, a broken or unfinished stream)."""
    body = request_body(args, model, req["prompt"], req["max_tokens"])
    if req["image"]:
        image = await asyncio.to_thread(png_data_url, *req["image"])  # encoding a PNG takes ms: not on the loop
        parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": req["prompt"]}]
        body["messages"][0]["content"] = parts if req["image_first"] else parts[::-1]
    rec = {k: req[k] for k in ("max_tokens", "abort_after", "reuse", "repeat")}
    rec.update(image=req["image"] is not None, outcome="error", error="", chunks=0, ttft=None)
    start = rec["start"] = time.monotonic()
    finish = None
    try:
        async with client.stream("POST", url + "/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec["outcome"] = "refused" if r.status_code in expected else "error"
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                rec["end"] = time.monotonic()
                return rec
            async with contextlib.aclosing(sse_chunks(r)) as chunks:
                async for chunk in chunks:
                    if "error" in chunk:
                        rec["error"] = f"error event: {chunk['error'].get('message')}"
                        break
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                    if chunk_text(chunk, "chat"):
                        rec["chunks"] += 1
                        if rec["ttft"] is None:
                            rec["ttft"] = time.monotonic() - start
                        if rec["chunks"] == req["abort_after"]:
                            rec["outcome"] = "aborted"  # leaving the `async with` closes the connection
                            break
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.monotonic()
    if rec["outcome"] != "aborted" and not rec["error"]:
        if finish in ("length", "stop"):
            rec["outcome"] = "ok"
        else:
            rec["error"] = f"the stream ended with finish_reason {finish!r}"
    return rec


def rss_bytes(pid: int | None) -> int | None:
    """A process's resident set: psutil where installed, else Linux's /proc; None without either."""
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process has gone
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


async def get_json(client, url: str) -> dict | None:
    try:
        r = await client.get(url)
        return r.json() if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - a server that is not mlxserve, or one that has died
        return None


def window(records: list[dict]) -> dict:
    """Counts and latencies of the requests that ended in one interval."""
    outcomes = Counter(r["outcome"] for r in records)
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]  # aborted ones had a first token too
    e2e = [r["end"] - r["start"] for r in records if r["outcome"] == "ok"]
    return {"requests": len(records), "ok": outcomes["ok"], "aborted": outcomes["aborted"],
            "refused": outcomes["refused"], "errors": outcomes["error"],
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99)}


async def take_sample(stats_client, root: str, pid, t: float, ended) -> dict:
    """The server's memory now, and what `ended()` returns: the requests that ended since the
    last sample (taken after the stats arrive, so none falls between two samples)."""
    stats = await get_json(stats_client, root + "/v1/cache/stats") or {}
    records = ended()
    memory = stats.get("mlx_memory") or {}
    pc = stats.get("prefix_cache") or {}
    disk = pc.get("disk") or {}
    s = {"t": t, "rss_bytes": rss_bytes(pid), "mlx_active_bytes": memory.get("active_bytes"),
         "memory_blocks": pc.get("blocks"), "disk_blocks": disk.get("blocks"),
         "memory_blocks_on_disk": disk.get("memory_blocks_on_disk"), "disk_skipped": disk.get("skipped"),
         "mlx_peak_bytes": memory.get("peak_bytes"), "mlx_cache_bytes": memory.get("cache_bytes"),
         "prefix_cache_bytes": (stats.get("prefix_cache") or {}).get("bytes"),
         "vision_cache_bytes": (stats.get("vision_cache") or {}).get("bytes"), **window(records)}
    if s["mlx_active_bytes"] is not None:  # what MLX holds beside the caches: weights, in-flight KV, scratch
        s["mlx_other_bytes"] = s["mlx_active_bytes"] - (s["prefix_cache_bytes"] or 0) - (s["vision_cache_bytes"] or 0)
    print(f"  {t / 60:6.1f} min  RSS {_mib(s['rss_bytes'])}  MLX active {_mib(s['mlx_active_bytes'])}  "
          f"prefix cache {_mib(s['prefix_cache_bytes'])}  {s['requests']} ended ({s['aborted']} aborted, "
          f"{s['errors']} errors)  TTFT p50 {s['ttft_p50_ms']:,.0f} ms", file=sys.stderr, flush=True)
    return s


def _mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.0f} MiB"


async def engine_state(client, root: str) -> dict:
    """Running and waiting requests and finished ones by reason, from /metrics ({} if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(root + "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(r.text)} if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - a server without Prometheus metrics
        return {}
    out = {}
    for name in ("mlxserve_num_requests_running", "mlxserve_num_requests_waiting"):
        if name in families:
            out[name.removeprefix("mlxserve_num_requests_")] = int(families[name].samples[0].value)
    if "mlxserve_request_finished" in families:
        out["finished"] = {s.labels["reason"]: int(s.value) for s in families["mlxserve_request_finished"].samples
                           if s.name.endswith("_total")}
    return out


async def drain(client, root: str, seconds: float = 120.0) -> dict:
    """Once the clients are gone: wait for the engine to empty, then what it still holds. Every
    abort must have freed its slot and released its cache blocks (in_use_blocks 0)."""
    deadline = time.monotonic() + seconds
    state = await engine_state(client, root)
    while state and (state.get("running") or state.get("waiting")) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        state = await engine_state(client, root)
    stats = await get_json(client, root + "/v1/cache/stats") or {}
    pc = stats.get("prefix_cache") or {}
    state.update(in_use_blocks=pc.get("in_use_blocks"), prefix_hit_rate=pc.get("hit_rate"),
                 prefix_evictions=pc.get("evictions"), vision_cache=stats.get("vision_cache"))
    return state


async def soak(args, url: str, model: str, pid: int | None, alive=None) -> dict:
    """The run; `alive()`, for a server it started, says whether that process still runs."""
    import httpx

    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    expected = {int(s) for s in args.expected_status.split(",") if s.strip()}
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client, \
            httpx.AsyncClient(headers=headers, timeout=120) as stats_client:
        start_stats = await get_json(stats_client, root + "/v1/cache/stats") or {}
        traffic = Traffic(args, images="vision_cache" in start_stats)  # only a VLM's stats have one
        done: list[dict] = []
        busy = [0]
        seen_errors: set[str] = set()
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60

        async def stream():
            while time.monotonic() < deadline:
                busy[0] += 1
                rec = await soak_request(client, url, args, model, traffic.next(), expected)
                busy[0] -= 1
                rec["start"] -= t0
                rec["end"] -= t0
                done.append(rec)
                if rec["outcome"] == "error":
                    if rec["error"] not in seen_errors:
                        seen_errors.add(rec["error"])
                        print(f"  request failed: {rec['error']}", file=sys.stderr, flush=True)
                    await asyncio.sleep(1)  # a server that refuses at once is not hammered into a flood of records

        seen = 0

        def ended() -> list[dict]:
            nonlocal seen
            out, seen = done[seen:], len(done)
            return out

        samples = [await take_sample(stats_client, root, pid, 0.0, ended)]  # the idle server, loaded
        streams = [asyncio.create_task(stream()) for _ in range(args.streams)]
        exited = None
        for k in itertools.count(1):
            now = min(t0 + k * args.interval, deadline)
            await asyncio.sleep(max(0.0, now - time.monotonic()))
            samples.append(await take_sample(stats_client, root, pid, now - t0, ended))
            if alive is not None and not alive():
                exited = now - t0
                print(f"  the server exited after {exited / 60:.1f} min: stopping", file=sys.stderr, flush=True)
                break
            if now >= deadline:
                break
        # Still running at the end (nothing ran between the last sample and here): cancelled, which
        # closes their connections, so the server aborts them too; not counted as requests.
        cut = busy[0]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        duration = time.monotonic() - t0
        after = {} if args.kill else await drain(stats_client, root)  # --kill: killed under load
    return {"duration_s": duration, "samples": samples, "requests": done, "cut_at_end": cut, "after": after,
            "images": traffic.images, "server_exited_at_s": exited}


def totals(result: dict) -> dict:
    recs = result["requests"]
    out = {**window(recs), "cut_at_end": result["cut_at_end"],
           "prefix_reuse": sum(r["reuse"] for r in recs), "with_image": sum(r["image"] for r in recs),
           "repeated_image": sum(r["repeat"] for r in recs)}
    out["error_messages"] = Counter(r["error"] for r in recs if r["outcome"] == "error").most_common(5)
    return out


def trend(samples: list[dict], key: str, after_t: float, tolerance: float) -> dict:
    """Whether one memory series is flat after `after_t`: the least-squares line through its
    samples moves by at most `tolerance` of their mean over the window. A slope, not max - min:
    a sample lands wherever the in-flight requests' KV happens to be, and that noise is what a
    max - min spread (shown too) measures, where a leak is a steady climb."""
    pts = [(s["t"], s[key]) for s in samples if s["t"] >= after_t and s.get(key)]
    if len(pts) < 3:
        return {"flat": None, "why": f"{len(pts)} samples after the warm-up (3 needed)"}
    ts, vs = zip(*pts)
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    slope = sum((t - mt) * (v - mv) for t, v in pts) / sum((t - mt) ** 2 for t in ts)
    change = slope * (ts[-1] - ts[0]) / mv
    return {"flat": abs(change) <= tolerance, "samples": len(pts), "first": vs[0], "last": vs[-1],
            "min": min(vs), "max": max(vs), "mean": mv, "slope_bytes_per_min": slope * 60,
            "fitted_change": change, "spread": (max(vs) - min(vs)) / min(vs)}


def verdict(result: dict, args) -> dict:
    after_t = args.warmup * result["duration_s"]
    # mlx_other_bytes is shown, not judged: it tells a cache filling to its budget from a leak elsewhere.
    memory = {key: trend(result["samples"], key, after_t, args.tolerance)
              for key in ("rss_bytes", "mlx_active_bytes", "mlx_other_bytes")}
    after, tot = result["after"], result["totals"]
    idle = None
    if "running" in after:
        idle = after["running"] == 0 and after.get("waiting", 0) == 0 and not after.get("in_use_blocks")
    # Latency may fall as the caches warm; only a rise is a regression.
    latency = trend(result["samples"], "ttft_p99_ms", after_t, args.latency_tolerance)
    rising = None if latency["flat"] is None else latency["fitted_change"] > args.latency_tolerance
    checks = {"RSS flat": memory["rss_bytes"]["flat"], "MLX active memory flat": memory["mlx_active_bytes"]["flat"],
              "no errors": tot["errors"] == 0, "TTFT p99 not rising": None if rising is None else not rising}
    if args.kill:
        crash = result.get("crash") or {}
        share = crash.get("share_on_disk")
        checks["the disk tier held >= 95% of memory at the kill"] = None if share is None else share >= 0.95
        checks["the restart found them"] = crash.get("found_after_restart")
    else:
        checks["engine idle after the run"] = idle
    if result["server_exited_at_s"] is not None:
        checks["the server ran to the end"] = False
    failed = [k for k, v in checks.items() if v is False]
    unjudged = [k for k, v in checks.items() if v is None]
    outcome = "FAIL" if failed else "INCOMPLETE" if unjudged else "PASS"
    return {"outcome": outcome, "checks": checks, "memory": memory, "latency": latency, "warmup_s": after_t,
            "tolerance": args.tolerance}


class SoakServer(ChildServer):
    """`mlxserve serve` in a child process on a free local port; its output goes to a log file."""

    stop_signal = signal.SIGINT  # a clean shutdown
    stop_grace = 60.0
    start_error = SystemExit

    def __init__(self, args):
        from mlxserve.config import ModelConfig

        port = free_port()
        model = []
        for f in dataclasses.fields(ModelConfig):  # the model flags given to `bench soak`, as given
            value = getattr(args, f.name)
            if value is not None and value != f.default:
                model += [str(value)] if f.metadata.get("positional") else ["--" + f.name.replace("_", "-"), str(value)]
        # --log-level first, so --server-args can override it.
        command = [sys.executable, "-m", "mlxserve.cli", "serve", *model, "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
        super().__init__(command, port, name="mlxserve-soak")
        self.url = self.base_url + "/v1"
        print(f"started: {shlex.join(self.command)} (pid {self.pid}, log {self.log})", file=sys.stderr)

    def logged_errors(self) -> list[str]:
        """ERROR and traceback lines the server logged (at --log-level warning, only problems are logged)."""
        return [line for line in self.log_lines() if " ERROR " in line or line.startswith("Traceback")]


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    child = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.server_pid
    else:
        child = SoakServer(args)
        url, pid = child.url, child.pid
    try:
        if child:
            child.wait_healthy(args.startup_timeout, warmed)  # its warm-up over: none of it in the series
        model, server = server_info(url, None, args.api_key)
        args.endpoint, args.ignore_eos = "chat", True  # for request_body: every request runs to its max_tokens
        print(f"soak: {args.streams} streams for {args.minutes:g} min against {url} ({model})", file=sys.stderr)
        result = asyncio.run(soak(args, url, model, pid, alive=child and (lambda: child.proc.poll() is None)))
        if args.kill and child:
            result["crash"] = kill_and_restart(child, args, result["samples"][-1])
    finally:
        exit_code = child.stop() if child else None
    result["server"] = {"url": url, "model": model, **server, "pid": pid,
                        "rss": "psutil" if _has_psutil() else "/proc" if pid and os.path.exists("/proc") else "none"}
    if child:
        result["server"].update(command=shlex.join(child.command), log=child.log, exit_code=exit_code,
                                logged_errors=child.logged_errors()[:20])
    result["totals"] = totals(result)
    del result["requests"]  # one record per request: megabytes over an hour; the samples and totals stay
    result["verdict"] = verdict(result, args)
    result["settings"] = {k: getattr(args, k) for k in (
        "streams", "minutes", "interval", "prompt_len", "max_tokens", "abort_rate", "prefix_reuse", "image_rate",
        "image_px", "image_repeat", "warmup", "tolerance", "latency_tolerance", "kill", "expected_status", "seed",
        "server_args")}
    text = soak_report.markdown(result, info, "mlxserve bench soak " + " ".join(sys.argv[3:]))
    print(text)
    report.write_result("soak", info, text, result, soak_report.plot, args.out_dir)
    return 0 if result["verdict"]["outcome"] == "PASS" else 1


def kill_and_restart(child: "SoakServer", args, last: dict) -> dict:
    """kill -9 the server right after its last sample under load, start it again on the same
    folder, and count the blocks its disk tier finds."""
    import httpx

    child.kill()
    share = None
    if last.get("memory_blocks"):
        share = last["memory_blocks_on_disk"] / last["memory_blocks"]
    print(f"  kill -9 under load: {last.get('memory_blocks_on_disk')} of {last.get('memory_blocks')} blocks in "
          f"memory were on disk; restarting", file=sys.stderr, flush=True)
    again = SoakServer(args)
    try:
        again.wait_healthy(args.startup_timeout)
        stats = httpx.get(again.url + "/cache/stats", timeout=60,
                          headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
        found = ((stats.get("prefix_cache") or {}).get("disk") or {}).get("blocks")
    finally:
        again.stop()
    return {"memory_blocks": last.get("memory_blocks"), "on_disk_at_kill": last.get("memory_blocks_on_disk"),
            "disk_blocks_at_kill": last.get("disk_blocks"), "share_on_disk": share,
            "disk_blocks_after_restart": found,
            "found_after_restart": None if found is None else found >= (last.get("disk_blocks") or 0)}


def _has_psutil() -> bool:
    import importlib.util

    return importlib.util.find_spec("psutil") is not None
