"""Which model a request gets, and /v1/models: list, retrieve, load, unload, pin.

A route calls `served(request, body.model)`: the name is looked up (an unknown
one is a 404 that lists the models, in the API's own shape), the model is loaded
if it is not (the request waits; requests for other models go on) and held until
the response has been sent. The Gate middleware (api/server.py) releases it then,
however the request ended: answered, streamed, refused or abandoned.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from mlxserve.api.errors import APIError
from mlxserve.api.generate import ModelState, ServerState
from mlxserve.engine.pool import ModelBusy, ModelUnavailable, PoolLimit

router = APIRouter()

LEASES = "mlxserve.models"  # scope key: the pool entries this HTTP request holds
# Seconds a client should wait after a 503 for a model that could not be loaded now.
RETRY_AFTER_LOAD = 5


def server_of(request: Request) -> ServerState:
    return request.app.state.mlx


def entry_of(state: ServerState, name: str | None):
    """The pool entry a request names (None: the default model); 404 listing the models if none."""
    entry = state.pool.get(name)
    if entry is None:
        names = ", ".join(f"'{n}'" for n in state.pool.entries)
        raise APIError(404, f"The model '{name}' does not exist; this server serves {names} "
                       "(--alias gives a model more names, e.g. 'claude-*').",
                       param="model", code="model_not_found")
    return entry


def unavailable(e: ModelUnavailable) -> APIError:
    # A 503, not a 4xx: the model is one this server was configured to serve, and the
    # request named it rightly; the server cannot load it now (its files, the memory).
    return APIError(503, f"{e}", param="model", code="model_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_LOAD)})


async def served(request: Request, name: str | None) -> ModelState:
    """The named model's state, loaded, held until the response is sent."""
    state = server_of(request)
    entry = entry_of(state, name)
    leases = request.scope.get(LEASES)
    if leases is None:  # without the Gate nobody would release it: the model could never unload
        raise RuntimeError("served() needs the Gate middleware of api/server.py")
    try:
        entry = await state.pool.acquire(entry.name)
    except ModelUnavailable as e:
        raise unavailable(e) from None
    leases.append(entry)
    return entry.served


def release(state: ServerState, scope) -> None:
    """(Gate) Release the models the request held."""
    for entry in scope.pop(LEASES, ()):
        state.pool.release(entry)


def model_card(state: ServerState, entry) -> dict:
    """OpenAI's model object, with where the model stands (state, pinned, requests, ...)."""
    engine = entry.engine
    return {"id": entry.name, "object": "model", "created": state.started, "owned_by": "mlxserve",
            "max_model_len": engine.max_model_len if engine is not None else None,
            # Layer kinds; whether it batches, caches, survives a restart (engine/capabilities.py).
            "serving": engine.serving if engine is not None else None,
            "aliases": state.pool.aliases_of(entry), **entry.describe()}


@router.get("/v1/models")
async def list_models(request: Request):
    state = server_of(request)
    return {"object": "list", "data": [model_card(state, e) for e in state.pool.entries.values()]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request):
    state = server_of(request)
    return model_card(state, entry_of(state, model))


# ---- administration (behind --api-key, as all of /v1) ----

@router.post("/v1/models/{model:path}/load")
async def load_model(model: str, request: Request):
    state = server_of(request)
    entry = entry_of(state, model)
    try:
        await state.pool.load(entry.name)
    except ModelUnavailable as e:
        raise unavailable(e) from None
    return model_card(state, entry)


@router.post("/v1/models/{model:path}/unload")
async def unload_model(model: str, request: Request):
    state = server_of(request)
    entry = entry_of(state, model)
    try:
        await state.pool.unload(entry.name)
    except ModelBusy as e:
        raise APIError(409, str(e), param="model", code="model_busy") from None
    return model_card(state, entry)


@router.post("/v1/models/{model:path}/pin")
async def pin_model(model: str, request: Request):
    state = server_of(request)
    entry = entry_of(state, model)
    try:
        await state.pool.pin(entry.name)
    except PoolLimit as e:
        raise APIError(400, str(e), param="model", code="model_limit") from None
    except ModelUnavailable as e:
        raise unavailable(e) from None
    return model_card(state, entry)


@router.delete("/v1/models/{model:path}/pin")
async def unpin_model(model: str, request: Request):
    state = server_of(request)
    entry = entry_of(state, model)
    state.pool.unpin(entry.name)
    return model_card(state, entry)
