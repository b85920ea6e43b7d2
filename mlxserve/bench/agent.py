"""`mlxserve bench agent`: replay an agent harness's recorded session and measure its cache.

A session is a fixture of tests/agents/ (Claude Code on /v1/messages, Codex on
/v1/responses; `tests/agents/record.py` records one, `anonymize.py` makes it a
fixture). Each request is sent in order to a fresh server, as the harness sent
it but for its output cap (`--max-tokens`, non-streamed). Per request:

- `possible`: the tokens its prompt shares with the previous request's prompt
  (the longest prefix a cache could serve; the previous answer's own tokens are
  left out, as the replay's answers are not the recorded ones);
- `cached`: what the server read from its prefix cache (the API's usage);
- `ttft`: the request's time (one output token: its prefill and one step);
- `alone`: the time of a prompt of just its new tokens (prompt less cached),
  with nothing cached: what prefilling them costs by themselves;
- `as ids`: the same prompts sent again in order as token ids (/v1/completions)
  from an empty cache: the engine's side of each turn (its restore and its
  prefill over the cached context) without the API's (JSON, template, tokens).

The goals (issue 32): cached >= 90% of possible, and ttft <= 1.5x alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from mlxserve.bench.local import ChildServer, checkout_env, free_port, warmed
from mlxserve.models.chat import common_prefix_length

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "agents"


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="Replay a recorded Claude Code / Codex session: cache hits and TTFT per turn.")
    p.add_argument("fixtures", nargs="*", help="session fixtures (default: tests/agents/*.json)")
    p.add_argument("--model", default="", help="model to serve (default: the embedded default model)")
    p.add_argument("--server-args", default="", help="more `mlxserve serve` flags, e.g. '--load-format dummy'")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per replayed request")
    p.add_argument("--passes", type=int, default=1,
                   help="replays of each session, the prefix cache reset before each; the last is "
                        "reported (2 on a fresh GPU machine: the first builds the kernels)")
    p.add_argument("--out", default="benchmarks", help="folder for the .md and .json results")
    p.set_defaults(func=run)


def load_fixture(path) -> dict:
    return json.loads(Path(path).read_text())


def fixtures(paths) -> list[Path]:
    return [Path(p) for p in paths] or sorted(FIXTURES.glob("*.json"))


def tokenizer_state(tokenizer) -> SimpleNamespace:
    """What the routes' prompt builders read of a model's state, for a text-only model. Its
    `render` tokenizes on the caller's thread, so its time is what tokenizing takes."""
    from mlxserve.api import tokens
    from mlxserve.api.tool_order import ToolOrder

    async def render(messages, **kwargs):
        return tokens.render(tokenizer, messages, **kwargs)

    return SimpleNamespace(tokenizer=tokenizer, loaded=SimpleNamespace(vision=None), tool_order=ToolOrder(),
                           render=render)


async def prompt_tokens(state, path: str, body: dict) -> list[int]:
    """The prompt the server renders for a recorded request (its own code, not a copy)."""
    if path.startswith("/v1/messages"):
        from mlxserve.api.anthropic_routes import check_supported, prompt_ids
        from mlxserve.api.anthropic_schema import MessagesRequest

        request = MessagesRequest.model_validate(body)
        check_supported(request)
        return (await prompt_ids(state, request))[0]
    from mlxserve.api.responses_input import ResponseStore
    from mlxserve.api.responses_routes import prepare
    from mlxserve.api.responses_schema import ResponsesRequest

    return (await prepare(state, ResponsesRequest.model_validate(body), ResponseStore(0))).prompt


def capped(path: str, body: dict, max_tokens: int, stream: bool | None = None) -> dict:
    """The body with its output cap set (and its stream flag, when given)."""
    out = dict(body)
    out["max_tokens" if path.startswith("/v1/messages") else "max_output_tokens"] = max_tokens
    if stream is not None:
        out["stream"] = stream
    return out


def usage_of(path: str, answer: dict) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a non-streamed answer."""
    u = answer["usage"]
    if path.startswith("/v1/messages"):
        cached = u["cache_read_input_tokens"]
        return u["input_tokens"] + cached, cached
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def alone_time(client: httpx.Client, n: int, rng: random.Random, vocab: int) -> float:
    """Seconds to answer (one token) a prompt of `n` random token ids no cache holds."""
    prompt = [rng.randrange(1000, vocab) for _ in range(max(n, 1))]
    r, elapsed = timed_post(client, "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return elapsed


def timed_post(client: httpx.Client, path: str, **kw) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    r = client.post(path, **kw)
    return r, time.perf_counter() - start


def ids_times(client: httpx.Client, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Each prompt's time sent as token ids to /v1/completions, in order, from an empty cache:
    the turns' engine side alone (no JSON of the agent's body, no template, no tokenizing)."""
    client.post("/v1/cache/reset").raise_for_status()
    out = []
    for prompt in prompts:
        r, elapsed = timed_post(client, "/v1/completions",
                                json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        out.append(elapsed)
    return out


def replay(client: httpx.Client, fixture: dict, tokenizer, *, max_tokens: int, vocab: int,
           seed: int = 0) -> list[dict]:
    """One row a request, measured as the module's docstring says."""
    state = tokenizer_state(tokenizer)
    rng = random.Random(seed)
    rows, previous, prompts = [], None, []
    for i, request in enumerate(fixture["requests"]):
        path, body = request["path"], request["body"]
        prompt = asyncio.run(prompt_tokens(state, path, body))
        prompts.append(prompt)
        r, elapsed = timed_post(client, path, params=request["query"] or None,
                                json=capped(path, body, max_tokens, stream=False))
        row = {"request": i, "path": path, "status": r.status_code, "prompt": len(prompt),
               "possible": common_prefix_length(previous, prompt) if previous else 0, "ttft_s": elapsed}
        if r.status_code == 200:
            reported, row["cached"] = usage_of(path, r.json())
            row["prompt_reported"] = reported
            if row["cached"]:  # with nothing cached, the request itself is the alone case
                row["alone_s"] = alone_time(client, reported - row["cached"], rng, vocab)
        rows.append(row)
        previous = prompt
    for row, seconds in zip(rows, ids_times(client, prompts, max_tokens)):
        row["ids_s"] = seconds
    return rows


def markdown(name: str, fixture: dict, rows: list[dict], info: dict, command: str) -> str:
    from mlxserve.bench.report import header

    lines = [header(f"bench agent: {name}", info, command), "",
             f"{fixture['harness']}: {fixture.get('note', '')}", "",
             "| # | status | prompt | possible | cached | cached/possible | new | TTFT s | as ids s | alone s "
             "| TTFT/alone |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["status"] != 200:
            lines.append(f"| {row['request']} | {row['status']} | {row['prompt']} | | | | | | | | |")
            continue
        share = f"{row['cached'] / row['possible']:.2f}" if row["possible"] else "-"
        new = row["prompt_reported"] - row["cached"]
        alone = row.get("alone_s")
        ratio = f"{alone:.3f} | {row['ttft_s'] / alone:.2f}" if alone else "- | -"
        lines.append(f"| {row['request']} | 200 | {row['prompt_reported']} | {row['possible']} | {row['cached']} | "
                     f"{share} | {new} | {row['ttft_s']:.3f} | {row['ids_s']:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import sys

    from mlx_lm.utils import load_tokenizer

    from mlxserve.bench.report import machine, write_result
    from mlxserve.models.embedded import default_tokenizer_dir

    port = free_port()
    command = [sys.executable, "-m", "mlxserve.cli", "serve", *([args.model] if args.model else []),
               "--port", str(port), "--alias", "*", *args.server_args.split()]
    server = ChildServer(command, port, checkout_env(), name="bench-agent")
    try:
        server.wait_healthy(1800, warmed)
        with httpx.Client(base_url=server.base_url, timeout=3600) as client:
            card = client.get("/v1/models").json()["data"][0]
            tokenizer = load_tokenizer(default_tokenizer_dir())
            info = {**machine(), "model": f"{card['id']} {args.server_args}".strip()}
            for path in fixtures(args.fixtures):
                fixture = load_fixture(path)
                for _ in range(args.passes):
                    client.post("/v1/cache/reset").raise_for_status()
                    rows = replay(client, fixture, tokenizer, max_tokens=args.max_tokens,
                                  vocab=len(tokenizer.vocab))
                text = markdown(path.stem, fixture, rows, info, " ".join(["mlxserve", *sys.argv[1:]]))
                print(text)
                write_result(f"agent-{path.stem}", info, text, rows, None, args.out)
    finally:
        server.stop()
    return 0
