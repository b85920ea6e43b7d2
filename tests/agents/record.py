"""Record an agent harness's requests: a proxy in front of a server that saves each body.

    python tests/agents/record.py --upstream http://127.0.0.1:8000 --port 8100 --out /tmp/rec

Point the harness at the proxy's port; every POST is saved as NNN.json ({method,
path, query, status, body}) in --out, and forwarded unchanged (streams too).
`tests/agents/anonymize.py` turns a recording into a test fixture.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def make_app(upstream: str, out: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    counter = itertools.count(len(list(out.glob("*.json"))))

    async def proxy(request: Request):
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        upstream_request = client.build_request(request.method, request.url.path,
                                                params=request.query_params, headers=headers,
                                                content=raw)
        response = await client.send(upstream_request, stream=True)
        if request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            record = {"method": request.method, "path": request.url.path,
                      "query": str(request.query_params), "status": response.status_code,
                      "body": body}
            (out / f"{next(counter):03d}.json").write_text(json.dumps(record, indent=1))

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        keep = {k: v for k, v in response.headers.items() if k.lower() not in HOP | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=response.status_code, headers=keep)

    return Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "POST", "DELETE", "HEAD"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", default="http://127.0.0.1:8000")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    uvicorn.run(make_app(args.upstream, out), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
