"""`mlxserve bench http`: what the HTTP layer and the engine cost, in one run.

For one model it measures three (to five) ways of running the same requests, level by level:
- a bare mlx-lm `BatchGenerator` loop (what batching allows, with nothing around it);
- the in-process engine (`AsyncEngine.submit`, with detokenizing);
- optionally the same engine in a child process ("engine-process": `ProcessEngine`, what
  `--engine-process` serves with), driven from here the same way;
- `mlxserve serve` in a child process, streamed over HTTP by `bench serve`'s client ("http");
- optionally a second such child with `--process-args` added ("http-process": by default
  `--engine-process`, its engine in a process of its own), so the two server setups meet
  in one run;
and reports each one's aggregate output tok/s with the ratios to the engine and
engine / bare. Every mode gets the same token ids (chat prompts are rendered with
the model's template here, as the server renders them), the same number of requests
per level (`--waves` x concurrency, at most `concurrency` in flight, a finished one
replaced at once), the same output length (EOS ignored) and the same warm-up (one
unmeasured round per level). Repeats are interleaved (bare, engine, HTTP, bare, ...)
and the best of each is kept. The engine here and the servers' are built from the
same flags (`--server-args`). Beside tok/s it reports the CPU seconds per output token
of each server (its process and all its descendants) and of this process's load
generator (Linux), which show what the host spends per token when decoding is host-bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

from mlxserve.bench.engine import MODEL_HELP, _parse_model
from mlxserve.bench.local import ChildServer, checkout_env, free_port, warmed

START_TIMEOUT_S = 600
ENGINE_PROCESS_FLAG = "--engine-process"  # `serve` runs its engine in a child process
MODES = ("bare", "engine", "engine-process", "http", "http-process")
SERVER_MODES = ("http", "http-process")  # each one a `mlxserve serve` child of its own


def add_parser(sub) -> None:
    p = sub.add_parser("http", help="HTTP server vs in-process engine vs bare BatchGenerator, one run.")
    p.add_argument("--model", default="dummy:qwen3-0.6b:q4", help=MODEL_HELP.replace("Comma-separated models", "One model"))
    p.add_argument("--concurrency", default="1,4,16,32", help="Comma-separated concurrency levels.")
    p.add_argument("--waves", type=int, default=3, help="Requests per level: this many times the concurrency.")
    p.add_argument("--repeats", type=int, default=2, help="Interleaved repeats of each level; the best is kept.")
    p.add_argument("--input-len", type=int, default=128,
                   help="Prompt length: words of a chat message (the template adds its own tokens), "
                        "or token ids with --endpoint completions.")
    p.add_argument("--output-len", type=int, default=128, help="Output tokens per request (EOS ignored).")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat: word prompts through the chat template; completions: token-id prompts "
                        "(for shapes whose vocabulary lacks the template's tokens, e.g. qwen3-host).")
    p.add_argument("--dtype", default=None, help="Weight dtype (default: per backend).")
    p.add_argument("--server-args", default="",
                   help="Engine and server flags of `mlxserve serve` (one string), e.g. '--no-prefix-cache'; "
                        "the in-process engine takes the same engine flags.")
    p.add_argument("--process-args", default=ENGINE_PROCESS_FLAG,
                   help="The flags the http-process server adds to http's (one string; a lone flag "
                        "as --process-args=--flag, or argparse takes it for an option).")
    p.add_argument("--modes", default="bare,engine,http", help=f"Which of {', '.join(MODES)} to run.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


# ---- prompts ----

def make_prompts(args, tokenizer, vocab: int, n: int, rng: random.Random) -> list[tuple[object, list[int]]]:
    """(what the HTTP client sends, the token ids the engine and BatchGenerator get) per request."""
    from mlxserve.bench.serve import make_prompt

    out = []
    for _ in range(n):
        if args.endpoint == "completions":
            ids = [rng.randrange(min(1000, vocab // 2), min(vocab, 100_000)) for _ in range(args.input_len)]
            out.append((ids, ids))
        else:
            from mlxserve.api.tokens import render

            text = make_prompt(rng, args.input_len)
            out.append((text, render(tokenizer, [{"role": "user", "content": text}])))
    return out


# ---- the three modes; each returns (output tokens, seconds) ----

def run_bare(loaded, engine_cfg, prompts: list[list[int]], c: int, n_out: int) -> tuple[int, float]:
    """A closed loop on a bare BatchGenerator, sized as the engine sizes its own: c in flight,
    the next inserted as one finishes."""
    from mlx_lm.generate import BatchGenerator

    from mlxserve.config import with_backend_defaults
    from mlxserve.models.families import prefill_batch_size

    gen = BatchGenerator(loaded.model, completion_batch_size=engine_cfg.max_num_seqs,
                         prefill_batch_size=prefill_batch_size(loaded.config, engine_cfg.prefill_batch_size),
                         prefill_step_size=with_backend_defaults(engine_cfg).prefill_chunk_size)
    todo = list(prompts)
    start = time.perf_counter()
    gen.insert([list(p) for p in todo[:c]], max_tokens=[n_out] * min(c, len(todo)))
    todo = todo[c:]
    tokens = finished = steps = 0
    while finished < len(prompts):
        steps += 1
        for r in gen.next_generated():
            tokens += 1
            if r.finish_reason is not None:
                finished += 1
                if todo:
                    gen.insert([list(todo.pop(0))], max_tokens=[n_out])
    elapsed = time.perf_counter() - start
    gen.close()
    return tokens, elapsed, steps


async def _engine_level(engine, prompts: list[list[int]], c: int, n_out: int) -> tuple[int, float]:
    from mlxserve import SamplingParams
    from mlxserve.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    todo = list(prompts)
    tokens = 0

    async def worker():
        nonlocal tokens
        while todo:
            ids = todo.pop(0)
            async for out in engine.submit(Request(list(ids), params)):
                tokens += len(out.new_token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return tokens, time.perf_counter() - start


def run_engine(engine, prompts, c, n_out) -> tuple[int, float]:
    return asyncio.run(_engine_level(engine, prompts, c, n_out))


async def lean_request(host: str, port: int, path: str, body: dict) -> tuple[int, str]:
    """(completion tokens, error or "") of one streamed request, read as lightly as a client can be:
    raw bytes on its own connection until the server closes it, parsed once at the end (the
    load generator shares the host with the server: httpx and a json.loads per chunk cost more
    CPU per token than the server's own event loop)."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    parts = []
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            parts.append(data)
    finally:
        writer.close()
    raw = b"".join(parts)
    head, _, body_bytes = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return 0, head.split(b"\r\n", 1)[0].decode(errors="replace") + " " + body_bytes[:200].decode(errors="replace")
    if b"transfer-encoding: chunked" in head.lower():
        body_bytes = _unchunk(body_bytes)
    usage = None
    for line in body_bytes.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage":{' in line:
            usage = json.loads(line[6:]).get("usage")
        elif line.startswith(b'data: {"error"'):
            return 0, line[6:206].decode(errors="replace")
    if b"data: [DONE]" not in body_bytes or not usage:
        return 0, "the stream ended without usage and [DONE]"
    return usage["completion_tokens"], ""


def _unchunk(data: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out, i = [], 0
    while True:
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[j + 2:j + 2 + size])
        i = j + 2 + size + 2


async def _http_level(url: str, body_of, prompts: list, c: int) -> tuple[int, float, int, str]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    todo = list(prompts)
    tokens = failed = 0
    error = ""

    async def worker():
        nonlocal tokens, failed, error
        while todo:
            n, err = await lean_request(parts.hostname, parts.port, parts.path, body_of(todo.pop(0)))
            tokens += n
            if err:
                failed, error = failed + 1, err

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return tokens, time.perf_counter() - start, failed, error


def run_http(args, url: str, model: str, prompts: list, c: int, n_out: int) -> tuple[int, float, int]:
    """(output tokens, seconds, failed requests) of the closed loop over HTTP."""
    from mlxserve.bench.serve import request_body

    client = Namespace(endpoint=args.endpoint, ignore_eos=True, output_len=n_out)
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    tokens, seconds, failed, error = asyncio.run(_http_level(
        url.rstrip("/") + path, lambda p: request_body(client, model, p), prompts, c))
    if failed:
        print(f"   http: {failed} failed: {error}", file=sys.stderr, flush=True)
    return tokens, seconds, failed


# ---- the server child ----

class ServerChild(ChildServer):
    """`mlxserve serve` on a free port, running this checkout's code."""

    stop_grace = 60.0
    start_error = SystemExit

    def __init__(self, spec: dict, args, engine_flags: list[str], log_path: Path):
        port = free_port()
        command = [sys.executable, "-m", "mlxserve.cli", "serve", *([spec["source"]] if spec["source"] else []),
                   "--load-format", spec["load_format"], "--port", str(port), "--log-level", "warning"]
        if spec["quantize_bits"]:
            command += ["--quantize", str(spec["quantize_bits"])]
        if args.dtype:
            command += ["--dtype", args.dtype]
        super().__init__(command + engine_flags, port, checkout_env(), log=log_path)

    def cpu_seconds(self) -> tuple[float, float] | None:
        return process_tree_cpu(self.pid)


def process_tree_cpu(root: int) -> tuple[float, float] | None:
    """User + system CPU seconds so far of process `root` with all its descendants (an engine
    process, say; every thread) and of its main thread (a server's event loop: HTTP,
    detokenizing), on Linux; else None."""
    def fields(path: str) -> list[str]:  # those after "(comm)", which may hold spaces
        return Path(path).read_text().rsplit(")", 1)[1].split()

    def ticks(f: list[str], reaped: bool) -> int:  # utime + stime (+ cutime + cstime: reaped children's)
        return sum(int(v) for v in f[11:15 if reaped else 13])

    try:
        main = ticks(fields(f"/proc/{root}/task/{root}/stat"), False)
        children: dict[int, list[int]] = {}
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = f = fields(f"{entry}/stat")
                except OSError:  # gone since the listing
                    continue
                children.setdefault(int(f[1]), []).append(int(entry.name))
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            total += ticks(stats[pid], True)
            todo += children.get(pid, [])
        return total / os.sysconf("SC_CLK_TCK"), main / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, KeyError):
        return None


def engine_config(server_args: str, max_c: int):
    """The EngineConfig the server child builds from the same flags (server-only flags ignored)."""
    from mlxserve.config import EngineConfig, add_arguments, from_namespace

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, EngineConfig)
    flags = ["--max-num-seqs", str(max_c), *shlex.split(server_args)]
    ns, _ = parser.parse_known_args(flags)
    return from_namespace(EngineConfig, ns), flags


def _measure(fn, steps=None) -> tuple[int, float, float, float, int | None]:
    """fn() -> (tokens, seconds[, steps]), plus this process's CPU seconds over it (all threads,
    and the main thread's: the event loop, or the bare loop itself) and the engine steps it
    took: fn's own count, or `steps()` (an engine's counter) read before and after."""
    cpu, main = time.process_time(), time.thread_time()
    before = steps() if steps is not None else None
    out = fn()
    cpu, main = time.process_time() - cpu, time.thread_time() - main
    taken = out[2] if len(out) > 2 else (steps() - before if before is not None else None)
    return out[0], out[1], cpu, main, taken


def server_steps(server: "ServerChild") -> int | None:
    """The server's engine steps so far, from /health (one model)."""
    import httpx

    try:
        return httpx.get(server.base_url + "/health", timeout=10).json().get("steps")
    except (httpx.HTTPError, ValueError):
        return None


def run(args) -> int:
    from mlxserve.bench import report
    from mlxserve.bench.serve import server_info
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.models.load import load

    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown --modes {', '.join(sorted(unknown))}; they are {', '.join(MODES)}")
    spec = _parse_model(args.model)
    cfg, flags = engine_config(args.server_args, max(levels))
    info = report.machine()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServerChild] = {}  # mode -> its server; they load while this process loads its own copy
    for mode in SERVER_MODES:
        if mode in modes:
            extra = shlex.split(args.process_args) if mode == "http-process" else []
            servers[mode] = ServerChild(spec, args, flags + extra, out_dir / f"bench-{mode}-server.log")
            print(f"{mode} server: {shlex.join(servers[mode].command)}", file=sys.stderr, flush=True)
    print(f"loading {args.model}", file=sys.stderr, flush=True)
    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"],
                  dtype=args.dtype)
    vocab = loaded.vocab_size or 32000
    engine = AsyncEngine(loaded, cfg).start(wait_warmup=True) if "engine" in modes else None
    remote = None  # engine-process: the engine in a child process, driven from here as `engine` is
    if "engine-process" in modes:
        from dataclasses import replace

        from mlxserve.config import ModelConfig
        from mlxserve.engine.process import ProcessEngine

        model_cfg = ModelConfig(model=spec["source"], load_format=spec["load_format"],
                                quantize=spec["quantize_bits"], dtype=args.dtype)
        remote = ProcessEngine.launch(model_cfg, replace(cfg, engine_process=True)).start(wait_warmup=True)
    served: dict[str, tuple[str, str]] = {}  # mode -> (url, model name)
    rng = random.Random(args.seed)
    rows = []
    try:
        for mode, server in servers.items():
            server.wait_healthy(START_TIMEOUT_S, warmed)  # its warm-up over: none of it between the timed requests
            url = server.base_url + "/v1"
            served[mode] = url, server_info(url, None, None)[0]

        def one(mode: str, prompts, c: int, n_out: int):
            if mode == "bare":
                return _measure(lambda: run_bare(loaded, cfg, [p[1] for p in prompts], c, n_out))
            if mode in ("engine", "engine-process"):
                e = engine if mode == "engine" else remote
                return _measure(lambda: run_engine(e, [p[1] for p in prompts], c, n_out), lambda: e.steps)
            return _measure(lambda: run_http(args, *served[mode], [p[0] for p in prompts], c, n_out)[:2],
                            lambda: server_steps(servers[mode]))

        # One short request each first (compilation, allocation), as bench serve does.
        warm = make_prompts(args, loaded.tokenizer, vocab, 1, rng)
        for mode in modes:
            one(mode, warm, 1, 8)
        for c in levels:
            print(f"concurrency {c}", file=sys.stderr, flush=True)
            # An unmeasured round at this concurrency: GPU backends compile kernels per new shape.
            warm = make_prompts(args, loaded.tokenizer, vocab, c, rng)
            for mode in modes:
                one(mode, warm, c, 4)
            prompts = make_prompts(args, loaded.tokenizer, vocab, args.waves * c, rng)
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for mode in modes:
                    server = servers.get(mode)
                    server_cpu = server.cpu_seconds() if server is not None else None
                    child = remote._process.pid if mode == "engine-process" else None
                    child_cpu = process_tree_cpu(child) if child else None
                    tokens, seconds, cpu, main, steps = one(mode, prompts, c, args.output_len)
                    if child_cpu is not None:  # the engine's work is its child's
                        after = process_tree_cpu(child)
                        cpu += after[0] - child_cpu[0] if after else 0
                    per_token = 1e6 / max(tokens, 1)
                    row = {"tok_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                           "cpu_us_per_token": cpu * per_token, "main_thread_us_per_token": main * per_token,
                           "client_cpu_us_per_token": None, "steps": steps,
                           "ms_per_step": seconds * 1e3 / steps if steps else None,
                           "tokens_per_step": tokens / steps if steps else None}
                    if server is not None:  # the work is the server's; this process only ran the load generator
                        row["client_cpu_us_per_token"] = row["cpu_us_per_token"]
                        after = server.cpu_seconds() if server_cpu is not None else None
                        row["cpu_us_per_token"] = (after[0] - server_cpu[0]) * per_token if after else None
                        row["main_thread_us_per_token"] = (after[1] - server_cpu[1]) * per_token if after else None
                    if mode not in best or row["tok_per_s"] > best[mode]["tok_per_s"]:
                        best[mode] = row
                    print(f"   {mode}: {row['tok_per_s']:,.1f} tok/s", file=sys.stderr, flush=True)
            rows.append({"concurrency": c, "requests": len(prompts),
                         "prompt_tokens": statistics.mean(len(p[1]) for p in prompts), **{m: best[m] for m in modes}})
    finally:
        for e in (engine, remote):
            if e is not None:
                e.stop()
        for server in servers.values():
            server.stop()

    command = "mlxserve bench http " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    text = markdown(args, info, command, rows, modes, flags)
    print(text)
    report.write_result("http", info, text, {"rows": rows, "modes": modes, "flags": flags,
                                             "process_args": args.process_args if "http-process" in modes else None,
                                             "model": args.model, "endpoint": args.endpoint}, None, args.out_dir)
    return 0


def markdown(args, info, command, rows, modes, flags) -> str:
    from mlxserve.bench import report

    ratios = [(a, b) for a, b in (("http", "engine"), ("http-process", "engine"), ("engine-process", "engine"),
                                  ("engine", "bare"))
              if a in modes and b in modes]
    served = [m for m in modes if m in SERVER_MODES]
    headers = ["concurrency", "requests", "prompt tokens"] + [f"{m} tok/s" for m in modes]
    headers += [f"{a} / {b}" for a, b in ratios] + [f"{m} CPU µs/token" for m in modes]
    headers += [f"{m} main thread µs/token" for m in modes]
    headers += [f"load generator CPU µs/token ({m})" for m in served]
    headers += [f"{m} tok/step" for m in modes] + [f"{m} ms/step" for m in modes]

    def num(v):
        return "-" if v is None else round(v)

    def dec(v):
        return "-" if v is None else f"{v:.2f}"

    table_rows = []
    for row in rows:
        cells = [row["concurrency"], row["requests"], row["prompt_tokens"]]
        cells += [row[m]["tok_per_s"] for m in modes]
        cells += [f"{row[a]['tok_per_s'] / row[b]['tok_per_s']:.2f}" for a, b in ratios]
        cells += [num(row[m]["cpu_us_per_token"]) for m in modes]
        cells += [num(row[m]["main_thread_us_per_token"]) for m in modes]
        cells += [num(row[m]["client_cpu_us_per_token"]) for m in served]
        cells += [dec(row[m].get("tokens_per_step")) for m in modes] + [dec(row[m].get("ms_per_step")) for m in modes]
        table_rows.append(cells)
    return "\n".join([
        report.header("HTTP vs engine vs bare BatchGenerator", info, command),
        f"Model {args.model}; {args.endpoint} prompts of {args.input_len} "
        f"{'words' if args.endpoint == 'chat' else 'token ids'}, {args.output_len} output tokens (EOS ignored), "
        f"greedy; {args.waves} x concurrency requests per level, at most `concurrency` in flight; best of "
        f"{args.repeats} interleaved repeats. Engine and server flags: `{shlex.join(flags)}`"
        + (f"; http-process adds `{args.process_args}`" if "http-process" in modes else "") + ". CPU µs/token: "
        "CPU time of the process doing the work (for http modes the server child with its descendants; MLX's "
        "compute threads included; for engine-process this process and its engine child) per output token; "
        "main thread: its event loop (engine, http modes) or the bare loop itself; the load generator's: "
        "this process during the http runs (Linux for the server's). "
        "tok/step and ms/step: output tokens and wall time per engine step (prefill steps count; the servers' "
        "steps read from /health): a batch kept full makes more tokens a step.\n",
        report.table(headers, table_rows), ""])
