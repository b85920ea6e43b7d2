"""The hand-over of one request's items from the MLX thread to its caller's event loop."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from mlxserve.engine.request import EngineError, Request


@dataclass
class StreamToken:
    token: int
    finish_reason: str | None
    is_stop_token: bool
    logprob: float | None
    top: list
    cached_tokens: int
    time: float
    prompt_logprobs: list | None = None
    # On a request's first token: (admitted, prefill done), perf_counter times (runner.TokenEvent.phases).
    phases: tuple | None = None


@dataclass
class StreamFailure:
    message: str
    error: type = EngineError  # what the caller's stream raises


ABORTED = object()  # put in a stream's items by abort()


class RequestStream:
    """One request's items, handed from the MLX thread to its caller's event loop.

    A list and a future made only while the caller waits: asyncio.Queue's machinery
    (a getter future per item, loop binding checks) cost more per token than the
    rest of the hand-over, on the thread the MLX thread waits on for the GIL."""

    __slots__ = ("loop", "request", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, request: Request):
        self.loop = loop
        self.request = request
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, items: list) -> None:
        """On the caller's loop (call_soon_threadsafe from the MLX thread)."""
        self.items.extend(items)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self):
        """The next item; waits for one if there is none."""
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()
