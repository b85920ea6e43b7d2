"""The web page at `/` (a chat and a dashboard, plain files in mlxserve/web/) and the
stats it reads: `GET /v1/stats` (one snapshot) and `GET /v1/stats/stream` (SSE, one a second).

The page and its files are public; the stats sit under /v1/, so with --api-key
they need the key like every other API route (the page asks for it).
"""

from __future__ import annotations

import asyncio
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from mlxserve.api import stats
from mlxserve.api.errors import APIError
from mlxserve.api.sse import HEADERS, event

router = APIRouter()

# The files the page is made of (a fixed list: no path from the URL reaches the disk).
_FILES = {"app.js": "text/javascript", "chat.js": "text/javascript", "dashboard.js": "text/javascript",
          "style.css": "text/css", "index.html": "text/html"}
STREAM_INTERVAL_S = 1.0


def _file(name: str) -> Response:
    body = (files("mlxserve") / "web" / name).read_bytes()
    # no-cache: the browser fetches the files again on each load (~25 KB), so after an upgrade
    # the page never mixes old and new scripts.
    return Response(body, media_type=_FILES[name] + "; charset=utf-8", headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def page():
    return _file("index.html")


@router.get("/web/{name}", include_in_schema=False)
async def web_file(name: str):
    if name not in _FILES:
        raise APIError(404, f"No such file: /web/{name}.", code="not_found")
    return _file(name)


@router.get("/v1/stats")
async def server_stats(request: Request):
    """A snapshot of the engine, the request counters, the caches and memory."""
    state = request.app.state.mlx
    reader = stats.CacheReader(state.engine)
    try:
        caches = await reader.read(wait=10.0)
    finally:
        reader.close()
    return stats.snapshot(state, caches)


# Left out of /openapi.json: a stream that never ends on its own would hang schema-driven
# clients and fuzzers (tests/test_fuzz.py) that call every listed operation.
@router.get("/v1/stats/stream", include_in_schema=False)
async def server_stats_stream(request: Request, interval: float = STREAM_INTERVAL_S):
    """Server-sent events: a snapshot with the rates since the last one, every `interval`
    seconds (0.2-60), until the client leaves or the server shuts down."""
    if not 0.2 <= interval <= 60:
        raise APIError(400, "interval must be between 0.2 and 60 seconds.", param="interval")
    state = request.app.state.mlx

    async def events():
        reader = stats.CacheReader(state.engine)
        prev = None
        loop = asyncio.get_running_loop()
        try:
            while not state.draining:
                tick = loop.time()
                cur = stats.snapshot(state, await reader.read(wait=interval / 2))
                yield event({**cur, "rates": stats.rates(prev, cur)})
                prev = cur
                await asyncio.sleep(max(0.0, interval - (loop.time() - tick)))
        finally:
            reader.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)
