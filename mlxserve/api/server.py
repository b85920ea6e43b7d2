"""The HTTP server: `create_app` builds the FastAPI app, `serve` runs it with uvicorn.

The app holds no MLX state: it tokenizes, hands `Request`s to the engine and
turns `RequestOutput`s into OpenAI or Anthropic JSON and SSE.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response

import mlxserve
from mlxserve.api import anthropic_routes, errors, openai_routes, responses_routes
from mlxserve.api.errors import APIError, error_response
from mlxserve.api.generate import ServerState
from mlxserve.metrics import CONTENT_TYPE_LATEST, Metrics

log = logging.getLogger("mlxserve.api")

# Larger bodies are refused (413) before they are read. Text-only requests are
# bounded by the context anyway; this only stops a client from filling memory.
# After SIGINT/SIGTERM, in-flight requests get this long to finish; then they are
# ended with an error event (streams) or a 503. A second signal ends them at once.


def create_app(engine, loaded, server_cfg) -> FastAPI:
    """The app for one engine. The engine starts and stops with the app's lifespan."""
    metrics = Metrics(engine)
    state = ServerState(engine, loaded, server_cfg, metrics)

    @asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        await asyncio.to_thread(engine.start)  # no-op if already started
        yield
        state.draining = True
        state.end_all()
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="mlxserve", version=mlxserve.__version__, lifespan=lifespan)
    app.state.mlx = state
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    backend = mlx_backend()

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not engine.alive:
            reason = errors.first_line(engine.fatal_error or "the engine is not running")
            return JSONResponse({"status": "dead", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version_info():
        return {"version": mlxserve.__version__, "mlx": package_version("mlx"),
                "mlx_lm": package_version("mlx-lm"), **backend,
                "model": state.model_name, "fingerprint": loaded.fingerprint}

    @app.get("/v1/cache/stats")
    async def cache_stats():
        return await engine.cache_stats()

    @app.post("/v1/cache/reset")
    async def cache_reset():
        return await engine.reset_cache()

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    routes = [*openai_routes.router.routes, *anthropic_routes.router.routes, *app.routes]
    app.add_middleware(Gate, state=state, paths={getattr(r, "path", None) for r in routes} - {None})
    return app


class Gate:
    """Auth, the body size limit and per-request metrics, as a plain ASGI middleware.

    (Starlette's BaseHTTPMiddleware would sit between streaming responses and
    the client's disconnect.)
    """

    def __init__(self, app, state: ServerState, paths: set[str]):
        self.app = app
        self.mlx = state
        self.paths = paths  # metric labels: route paths only, so unknown URLs cannot add series

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if the app dies before answering

        async def send_and_count(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refused = self.refuse(scope)
            if refused is not None:
                await error_response(refused, scope["path"])(scope, receive, send_and_count)
            else:
                await self.app(scope, limit_body(receive, self.mlx.server_cfg.max_request_bytes), send_and_count)
        finally:
            route = getattr(scope.get("route"), "path", None)  # set by the router when matched
            endpoint = route or (scope["path"] if scope["path"] in self.paths else "other")
            self.mlx.metrics.requests.labels(endpoint, str(status)).inc()

    def refuse(self, scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        length = headers.get("content-length")
        limit = self.mlx.server_cfg.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return APIError(413, f"The request body is larger than {limit} bytes.")
        key = self.mlx.server_cfg.api_key
        if key and (scope["path"] + "/").startswith("/v1/") and not authorized(headers, key):
            return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY' "
                            "or 'x-api-key: KEY'.", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


def authorized(headers: dict, key: str) -> bool:
    given = headers.get("x-api-key", b"")
    auth = headers.get("authorization", b"")
    if auth[:7].lower() == b"bearer ":
        given = auth[7:].strip()
    # compare_digest: the time taken does not tell how much of the key matched.
    return hmac.compare_digest(given, key.encode())


def limit_body(receive, limit: int):
    """Refuse chunked bodies that grow past the limit (sized ones are checked up front)."""
    seen = 0

    async def limited():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, f"The request body is larger than {limit} bytes.")
        return message

    return limited


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def mlx_backend() -> dict:
    """MLX's device and backend, read once (no arrays are touched)."""
    import mlx.core as mx

    if mx.metal.is_available():
        backend = "metal"
    elif hasattr(mx, "cuda") and mx.cuda.is_available():
        backend = "cuda"
    else:
        backend = "cpu"
    return {"backend": backend, "device": str(mx.default_device())}


def serve(model_cfg, engine_cfg, server_cfg) -> int:
    """Load the model, start the engine and serve HTTP until SIGINT/SIGTERM; returns 0.

    On the first signal the server stops accepting connections, lets in-flight
    requests finish for `server_cfg.shutdown_timeout` seconds, then ends the rest cleanly (an SSE
    error event and [DONE], or a 503) and exits. A second signal ends them at once.
    """
    import uvicorn

    from mlxserve.engine.engine import AsyncEngine, EngineDeadError
    from mlxserve.models.files import ModelLoadError
    from mlxserve.models.load import load, load_draft

    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loaded = load(model_cfg.model, load_format=model_cfg.load_format, dtype=model_cfg.dtype,
                      quantize_bits=model_cfg.quantize, seed=model_cfg.dummy_seed)
        if model_cfg.draft_model:
            load_draft(loaded, model_cfg.draft_model, load_format=model_cfg.load_format, dtype=model_cfg.dtype,
                       quantize_bits=model_cfg.quantize, seed=model_cfg.dummy_seed)
    except (ModelLoadError, ValueError) as e:
        log.error("%s", e)
        return 2
    try:
        engine = AsyncEngine(loaded, engine_cfg).start()
    except EngineDeadError as e:
        log.error("%s", e)
        return 1
    app = create_app(engine, loaded, server_cfg)
    state = app.state.mlx
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.log_level,
                            timeout_graceful_shutdown=int(server_cfg.shutdown_timeout) + 5)
    server = uvicorn.Server(config)
    uvicorn_exit = server.handle_exit

    def handle_exit(sig, frame):
        loop = state.loop
        if state.draining:  # second signal: end the in-flight requests now
            if loop is not None:
                loop.call_soon_threadsafe(state.end_all)
            return
        state.draining = True
        log.info("shutting down: in-flight requests have %.0fs to finish", server_cfg.shutdown_timeout)
        if loop is not None:
            loop.call_soon_threadsafe(loop.call_later, server_cfg.shutdown_timeout, state.end_all)
        uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit
    # uvicorn re-raises the caught signal after its shutdown, to the handler that
    # was in place before: make that a no-op so a clean shutdown exits with 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log.info("serving %s on http://%s:%d/v1", state.model_name, server_cfg.host, server_cfg.port)
        server.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        engine.stop()
    return 0
