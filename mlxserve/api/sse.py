"""Server-sent events: framing, and a response that always closes its Run."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
# Seconds without an output after which a stream sends a keep-alive event: a long prompt's
# prefill (minutes on a CPU) sends nothing else, and agents give up on a silent stream (Claude
# Code then retried without streaming, Codex after stream_idle_timeout_ms), doubling the work.
HEARTBEAT_S = 10.0
MAX_EVENTS_PER_SEND = 64
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(data, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {dumps(data)}\n\n".encode()


class EventTemplate:
    """`event(data)` with one slot of `data` filled per call: serialized once, so a streamed
    token costs a json.dumps of its own text, not of the whole chunk (the same bytes)."""

    SLOT = "\x00slot\x00"  # put where the value goes; no real value is this string

    def __init__(self, data):
        head, tail = f"data: {dumps(data)}\n\n".split(dumps(self.SLOT))  # exactly one slot
        self.head, self.tail = head.encode(), tail.encode()

    def __call__(self, value) -> bytes:
        return self.head + dumps(value).encode() + self.tail


async def with_heartbeats(outputs, every: float | None = None):
    """`outputs`' items, and None after each `every` seconds (HEARTBEAT_S) in which none came,
    until the first one (the prefill's wait); after it the items are read directly, with no
    task a token."""
    every = HEARTBEAT_S if every is None else every
    items = outputs.__aiter__()
    first = asyncio.ensure_future(items.__anext__())
    try:
        while not (await asyncio.wait({first}, timeout=every))[0]:
            yield None
        try:
            item = first.result()
        except StopAsyncIteration:
            return
    finally:
        first.cancel()  # a no-op once it is done
    yield item
    async for item in items:
        yield item


class SSEResponse(StreamingResponse):
    """A streamed answer whose engine requests end with the response, however it ends.

    The body generator's own `finally` does not run if the client leaves
    before the first chunk (Starlette cancels the send of the headers, and a
    generator never started has nothing to clean up); this does.
    """

    media_type = "text/event-stream"

    def __init__(self, content, run):
        super().__init__(content, headers=HEADERS)
        self.run = run

    async def stream_response(self, send) -> None:
        """Starlette's, but events whose outputs were already waiting go out in one send: a
        stream that fell behind the engine (the event loop busy) catches up in fewer sends,
        each a trip through the ASGI stack and a socket write. The events are the same."""
        pending = getattr(self.run, "pending", None)  # Run has it; wrappers may not
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        parts = []
        async for chunk in self.body_iterator:
            parts.append(chunk if isinstance(chunk, bytes) else chunk.encode(self.charset))
            if pending is not None and len(parts) < MAX_EVENTS_PER_SEND and pending():
                continue
            await send({"type": "http.response.body", "body": parts[0] if len(parts) == 1 else b"".join(parts),
                        "more_body": True})
            parts = []
        if parts:
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
