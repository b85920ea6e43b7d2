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
from mlxserve.api import anthropic_routes, cache_routes, errors, models, openai_routes, responses_routes, web
from mlxserve.api.errors import APIError, error_response
from mlxserve.api.generate import ServerState
from mlxserve.engine.pool import ModelPool, ModelSpec
from mlxserve.metrics import CONTENT_TYPE_LATEST, Metrics

log = logging.getLogger("mlxserve.api")

# Larger bodies are refused (413) before they are read. Text-only requests are
# bounded by the context anyway; this only stops a client from filling memory.
# After SIGINT/SIGTERM, in-flight requests get this long to finish; then they are
# ended with an error event (streams) or a 503. A second signal ends them at once.


def create_app(engine, loaded, server_cfg) -> FastAPI:
    """The app for one engine (tests, embedding). The engine starts and stops with the app."""
    name = server_cfg.served_model_name or loaded.name
    return create_pool_app(ModelPool.of_engine(engine, loaded, name), server_cfg)


def create_pool_app(pool: ModelPool, server_cfg, pins=(), pin_file: str | None = None) -> FastAPI:
    """The app for a pool of models; their engines start and stop with the app's lifespan,
    and the `pins` (bodies of POST /v1/cache/pin, from `pin_file`) are made at start."""
    metrics = Metrics(pool.loaded_engines, lambda: [(e.name, e.state) for e in pool.entries.values()])
    state = ServerState(pool, server_cfg, metrics)
    pool.attach(state.model_state)
    pool.on_loaded = cache_routes.repin

    @asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        await pool.start()
        try:
            await cache_routes.pin_at_start(state, list(pins), pin_file)
        except ValueError as e:
            log.error("%s", e)
            state.startup_error = str(e)
            await pool.stop()
            raise
        yield
        state.draining = True
        state.end_all()
        await pool.stop()
        state.prompt_worker.shutdown(wait=False)

    app = FastAPI(title="mlxserve", version=mlxserve.__version__, lifespan=lifespan)
    app.state.mlx = state
    errors.install(app)
    routers = [openai_routes.router, anthropic_routes.router, responses_routes.router, models.router,
               cache_routes.router, web.router]  # web: the page at / and its stats
    for router in routers:
        app.include_router(router)
    backend = mlx_backend()

    @app.api_route("/api/hello", methods=["GET", "HEAD"], include_in_schema=False)
    async def hello():
        """Claude Code's connection pre-warm (HEAD {ANTHROPIC_BASE_URL}/api/hello); a 404 there
        would be the only 4xx of a clean session in the server's log."""
        return {}

    @app.get("/health")
    async def health():
        """200 when the engine serves; 503 when it is shutting down, stalled (a step has run past
        --step-timeout) or dead. Read without the MLX thread, so a stalled engine still answers."""
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        infos = {name: e.engine.health() for name, e in pool.entries.items()
                 if e.engine is not None and e.state == "loaded"}
        bad = next(((name, i) for name, i in infos.items() if i["status"] != "ok"), None)
        if bad is not None:  # a stalled or dead engine: 503, naming the model when there are several
            name, info = bad
            if len(pool.entries) > 1 and "reason" in info:
                info = {**info, "reason": f"{name}: {info['reason']}"}
            return JSONResponse({**info, "model": name}, status_code=503)
        if len(pool.entries) == 1 and infos:
            return next(iter(infos.values()))
        return {"status": "ok", "models": infos}

    @app.get("/version")
    async def version_info():
        default = pool.default
        return {"version": mlxserve.__version__, "mlx": package_version("mlx"),
                "mlx_lm": package_version("mlx-lm"), **backend, "model": default.name,
                "fingerprint": default.loaded.fingerprint if default.loaded is not None else None,
                "models": list(pool.entries)}

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    routes = [r for router in routers for r in router.routes] + app.routes
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

        scope[models.LEASES] = []  # the models the request holds (api/models.served)
        try:
            refused = self.refuse(scope)
            if refused is not None:
                await error_response(refused, scope["path"])(scope, receive, send_and_count)
            else:
                await self.app(scope, limit_body(receive, self.mlx.server_cfg.max_request_bytes), send_and_count)
        finally:
            # The response has been sent (streams too): the request no longer holds its model.
            models.release(self.mlx, scope)
            route = getattr(scope.get("route"), "path", None)  # set by the router when matched
            endpoint = route or (scope["path"] if scope["path"] in self.paths else "other")
            self.mlx.metrics.requests.labels(endpoint, str(status)).inc()

    def refuse(self, scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        length = headers.get("content-length")
        limit = self.mlx.server_cfg.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return APIError(413, f"The request body is larger than {limit} bytes.")
        cfg = self.mlx.server_cfg
        if cfg.api_key and not public(scope["path"], cfg) and not authorized(headers, cfg.api_key):
            return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY' "
                            "or 'x-api-key: KEY'.", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


# Open with --api-key: liveness, Claude Code's pre-warm (an empty answer) and the web page's
# static files (the page asks for the key and sends it with its data requests). Everything
# else, /metrics, /version and the API's schema included, tells about the server or uses it.
_PUBLIC = {"/health", "/api/hello", "/"}


def public(path: str, cfg) -> bool:
    if path in _PUBLIC or path.startswith("/web/"):
        return True
    return path == "/metrics" and cfg.metrics_public


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

    from mlxserve import backend

    return {"backend": backend.name(), "device": str(mx.default_device())}


def serve(models, server_cfg, pool_cfg) -> int:
    """Load the default (and pinned) models, start their engines and serve HTTP until
    SIGINT/SIGTERM; returns 0 (2 for a bad setting or model, 1 for an engine that fails to start).

    `models` are config.ServedModel (config.served_models). On the first signal the
    server stops accepting connections, lets in-flight requests finish for
    `server_cfg.shutdown_timeout` seconds, then ends the rest cleanly (an SSE error
    event and [DONE], or a 503) and exits. A second signal ends them at once.
    """
    import uvicorn

    from mlxserve.cache.sizes import parse_size
    from mlxserve.engine.engine import EngineDeadError
    from mlxserve.models.files import ModelLoadError

    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        memory = parse_size(pool_cfg.models_memory) if pool_cfg.models_memory else None
        pool = ModelPool([ModelSpec.of(m, pool_cfg.model_ttl) for m in models],
                         max_loaded=pool_cfg.max_loaded_models, memory=memory, wait_s=pool_cfg.model_wait,
                         aliases=pool_cfg.alias)
        pins = cache_routes.read_pin_file(pool_cfg.pin) if pool_cfg.pin else []
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        pool.preload()
    except (EngineDeadError, ModelLoadError, ValueError) as e:
        log.error("%s", e)
        pool.stop_blocking()
        return 1 if isinstance(e, EngineDeadError) else 2
    app = create_pool_app(pool, server_cfg, pins, pool_cfg.pin)
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
        log.info("serving %s on http://%s:%d/v1", ", ".join(pool.entries), server_cfg.host, server_cfg.port)
        server.run()
    except SystemExit:  # uvicorn's, when the app's start failed
        if not state.startup_error:
            raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        pool.stop_blocking()
    return 2 if state.startup_error else 0
