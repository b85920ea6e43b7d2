"""Server-sent events: framing, and a response that always closes its Run."""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
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

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
