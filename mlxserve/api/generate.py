"""One HTTP request's engine requests: submit, merge their streams, end them.

An HTTP request may fan out into several engine requests (`n` choices, or a
list of prompts). `Run` submits them all up front, so that a bad or refused
request fails with an HTTP status before any byte is streamed, then pumps each
stream into one queue. Closing a Run (client gone, server shutting down, an
error) cancels the pumps; cancelling an engine stream aborts its request, so
its slot is free at the next engine step.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mlxserve.api.constraints import Grammars
from mlxserve.api.errors import APIError, from_engine
from mlxserve.api.reasoning import detect as detect_reasoning
from mlxserve.api import tokens
from mlxserve.api.tokens import TokenBytes
from mlxserve.api.tool_calls import check_tool_schema, tool_syntax
from mlxserve.api.tool_order import ToolOrder
from mlxserve.engine.request import Request, RequestOutput, TokenLogprob
from mlxserve.models.chat import hf_of
from mlxserve.models.token_bound import bytes_per_token

_SHUTDOWN = object()
PROMPT_WORKERS = 4
_SAMPLE_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


from mlxserve.multimodal.media import MediaLimits  # noqa: E402 - plain Python, no MLX


class ServerState:
    """What every route shares: the model pool and the server's lifecycle (app.state.mlx).

    Routes work with one model's `ModelState`, which `api/models.served` gives them.
    """

    def __init__(self, pool, server_cfg, metrics):
        self.pool = pool
        self.server_cfg = server_cfg
        self.metrics = metrics
        self.media_limits = MediaLimits.from_config(server_cfg)
        self.started = int(time.time())
        self.draining = False
        self.startup_error: str | None = None  # a --pin that failed: the server stops
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, set at startup
        self._runs: set[Run] = set()
        # Renders and tokenizes prompts off the event loop (api/tokens.py). Several threads, so a
        # prompt that takes seconds holds up only itself; the Rust tokenizer encodes in parallel
        # (it releases the GIL, and nothing here changes its settings).
        self.prompt_worker = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="mlxserve-prompts")

    async def off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the prompt worker; the event loop serves streams meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self.prompt_worker, functools.partial(fn, *args, **kwargs))

    def model_state(self, entry, loaded, engine) -> "ModelState":
        """The pool's `build`: a model's state, made in its load thread."""
        state = ModelState(self, engine, loaded, entry.name)
        state.prepare()
        return state

    @property
    def default(self) -> "ModelState":
        """The default (first) model's state, while it is loaded."""
        served = self.pool.default.served
        if served is None:
            raise RuntimeError(f"the default model {self.pool.default.name!r} is not loaded")
        return served

    # The default model's, as with a single model (tests, embedding).
    engine = property(lambda self: self.default.engine)
    loaded = property(lambda self: self.default.loaded)
    tokenizer = property(lambda self: self.default.tokenizer)
    model_name = property(lambda self: self.pool.default.name)

    def end_all(self) -> None:
        """End every in-flight run now (shutdown); each client gets an error event or a 503."""
        for run in list(self._runs):
            run.shutdown()


class ModelState:
    """What a route needs of the model a request names: its engine, tokenizer and the
    syntaxes read from it, with the server's settings and lifecycle beside them."""

    def __init__(self, server: ServerState, engine, loaded, name: str):
        self.server = server
        self.engine = engine
        self.loaded = loaded
        self.model_name = name
        self.tokenizer = loaded.tokenizer
        self.token_bytes = TokenBytes(loaded.tokenizer)
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size)
        self.tool_syntax = tool_syntax(loaded.tokenizer)  # None: no call markup mlx-lm knows
        self.reasoning = detect_reasoning(loaded.tokenizer)  # None: the model does not reason
        self.tool_order = ToolOrder()  # each agent session's tools in the order first sent

    def prepare(self) -> None:
        """Pay the first request's one-time costs here, in the load thread: the chat template's
        compilation and the JSON-schema checker's import (on an H200 they were 150 ms of a fresh
        server's first agent turn, after the engine's warm-up)."""
        check_tool_schema(_SAMPLE_TOOL["function"]["parameters"], "tools")
        try:
            tokens.render(self.tokenizer, [{"role": "user", "content": "Hi"}], tools=[_SAMPLE_TOOL])
        except APIError:
            pass  # a template that refuses tools refuses them per request too, with a 400
        hf = hf_of(self.tokenizer)
        if hf is not None:
            bytes_per_token(hf)  # reads the vocabulary's longest piece (0.3 s for 150k pieces)

    async def render(self, messages: list[dict], **kwargs) -> list[int]:
        """The prompt's token ids (api/tokens.render), off the event loop; a prompt whose length
        alone proves it cannot fit the context is refused before it is tokenized."""
        return await self.server.off_loop(tokens.render, self.tokenizer, messages,
                                          token_limit=self.engine.max_model_len, **kwargs)

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A plain prompt's token ids (api/tokens.encode), off the event loop, as `render`."""
        return await self.server.off_loop(tokens.encode, self.tokenizer, text, param=param,
                                          token_limit=self.engine.max_model_len)

    server_cfg = property(lambda self: self.server.server_cfg)
    metrics = property(lambda self: self.server.metrics)
    media_limits = property(lambda self: self.server.media_limits)
    draining = property(lambda self: self.server.draining)
    _runs = property(lambda self: self.server._runs)


class Run:
    def __init__(self, state: "ModelState", requests: list[Request], rename: dict | None = None):
        if state.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        self.state = state
        self.requests = requests
        self._rename = rename
        engine = state.engine
        if len(requests) > engine.capacity:  # a 429 would ask the client to retry what can never fit
            raise APIError(400, f"This request asks for {len(requests)} completions (prompts x n), more than "
                           f"the {engine.capacity} this server runs and queues at once; send fewer.",
                           param="n", code="too_many_completions")
        streams = []
        try:
            for r in requests:
                streams.append(engine.submit(r))
        except Exception as e:
            for r in requests[: len(streams)]:  # unstarted streams have no finally to run
                engine.abort(r.request_id)
            raise from_engine(e, rename) from None
        for r in requests:
            state.metrics.prompt_tokens.inc(len(r.prompt_token_ids))
        self._shutdown = False
        self._ended = [False] * len(requests)  # finished, failed or counted as aborted
        state._runs.add(self)
        if len(streams) == 1:
            # One engine request (the usual case): its stream is read where the run is, with no
            # task and queue between (one task switch and queue hop less per token).
            self._stream, self._queue, self._pumps = streams[0], None, []
        else:
            self._stream, self._queue = None, asyncio.Queue()
            self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    def _observe(self, index: int, out: RequestOutput, last: float | None) -> float:
        """The metrics of one output; returns its time (the next one's `last`)."""
        m = self.state.metrics
        now = time.perf_counter()
        if last is None:
            m.ttft.observe(out.first_token_time or now - self.requests[index].arrival_time)
            if out.first_token_phases is not None:
                for phase, histogram in m.phases.items():
                    histogram.observe(getattr(out.first_token_phases, phase))
            m.cached_tokens.inc(out.cached_tokens)
        else:
            m.itl.observe(now - last)
        m.generation_tokens.inc(len(out.new_token_ids))
        if out.finish_reason is not None:
            m.e2e.observe(now - self.requests[index].arrival_time)
            m.finished.labels(out.finish_reason).inc()
            self._ended[index] = True
        return now

    def _failed(self, index: int) -> None:
        self._ended[index] = True
        self.state.metrics.finished.labels("error").inc()

    async def _pump(self, index: int, stream) -> None:
        last = None
        try:
            async for out in stream:
                last = self._observe(index, out, last)
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            if not self._ended[index]:
                self._ended[index] = True
                self.state.metrics.finished.labels("abort").inc()
            raise
        except Exception as e:  # noqa: BLE001 - EngineError: handed to the consumer
            self._failed(index)
            self._queue.put_nowait((index, e))

    def pending(self) -> bool:
        """Whether an output is already here, so the next one comes without waiting."""
        if self._stream is not None:
            return self.state.engine.pending(self.requests[0].request_id)
        return not self._queue.empty()

    def shutdown(self) -> None:
        """End the run now (server shutdown): its reader gets an APIError 503 after the outputs
        already delivered."""
        self._shutdown = True
        if self._queue is not None:
            self._queue.put_nowait(_SHUTDOWN)
        elif not self._ended[0]:
            self.state.engine.abort(self.requests[0].request_id)  # its stream ends with "abort"

    def _shut_down(self) -> APIError:
        return APIError(503, "The server is shutting down; this request was ended.", code="shutting_down")

    async def __aiter__(self):
        """(index, output) pairs in arrival order, until every request finished."""
        if self._stream is not None:
            last = None
            try:
                async for out in self._stream:
                    if self._shutdown and out.finish_reason == "abort":
                        self._ended[0] = True
                        raise self._shut_down()
                    last = self._observe(0, out, last)
                    yield 0, out
                    if out.finish_reason is not None:
                        return
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - EngineError and friends, as the pumps hand them over
                self._failed(0)
                raise from_engine(e, self._rename)
            return
        remaining = len(self._pumps)
        while remaining:
            item = await self._queue.get()
            if item is _SHUTDOWN:
                raise self._shut_down()
            index, out = item
            if isinstance(out, BaseException):
                raise from_engine(out, self._rename)
            yield index, out
            if out.finished:
                remaining -= 1

    def close(self) -> None:
        self.state._runs.discard(self)
        for p in self._pumps:
            p.cancel()
        if self._stream is not None and not self._ended[0]:
            # Left before its end (client gone, an error): free its slot, counted as the pumps count it.
            self._ended[0] = True
            self.state.metrics.finished.labels("abort").inc()
            self.state.engine.abort(self.requests[0].request_id)


@dataclass
class Choice:
    """The outputs of one engine request, put together."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    all_logprobs: list[TokenLogprob] = field(default_factory=list)  # the stop token's too
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.texts.append(out.new_text)
        self.token_ids += out.new_token_ids
        self.logprobs += visible_logprobs(out)
        self.all_logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.texts)


def visible_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """Logprobs of the tokens whose text the client sees.

    The EOS or stop token that ends a request has no text, so OpenAI leaves it
    out of `logprobs`; keeping it would make the tokens' bytes differ from the text.
    """
    lps = out.logprobs or []
    if lps and out.finish_reason == "stop" and isinstance(out.stop_reason, int) \
            and lps[-1].token_id == out.stop_reason:
        return lps[:-1]
    return lps


async def wait_disconnect(request) -> None:
    """Returns when the HTTP client goes away (after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before a non-streamed answer was ready."""


async def collect(run: Run, request) -> list[Choice]:
    """Every choice of a non-streamed run; aborts the run if the client leaves first."""
    choices = [Choice() for _ in run.requests]

    async def gather():
        async for index, out in run:
            choices[index].add(out)

    task = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
        run.close()
    if task not in done:
        raise ClientGone()
    task.result()  # raises APIError if the engine failed a request
    return choices


def usage(choices: list[Choice], n: int) -> dict:
    """OpenAI usage: each prompt counted once (its first choice), completions summed."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
    }
