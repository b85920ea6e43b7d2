"""/v1/cache: a model's prefix-cache stats and reset, and pinned prefixes.

A pin (`POST /v1/cache/pin`) takes what a later request will start with:
chat `messages` (and `tools`), rendered without the generation prompt so the
rendering is the start of the conversations that follow, or `prompt` (text or
token ids). Its id is a hash of the model and the tokens, so pinning the same
body again is the same pin (idempotent) and `DELETE /v1/cache/pin/{id}`
unpins it. Each model keeps its pins' tokens and pins them again whenever it
is loaded again after an unload.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from mlxserve.api.errors import APIError, bad_request, from_engine
from mlxserve.api.generate import ModelState, ServerState
from mlxserve.api.models import entry_of, served, server_of
from mlxserve.api.openai_routes import template_message
from mlxserve.api.openai_schema import ChatMessage, Tool
from mlxserve.engine.engine import EngineDeadError
from mlxserve.engine.pins import PinError
from mlxserve.engine.pool import LOADED
from mlxserve.engine.request import EngineStalledError

log = logging.getLogger("mlxserve.api")
router = APIRouter()


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field would pin something else

    model: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    prompt: str | list[int] | None = None


async def pin_tokens(state: ModelState, body: PinRequest) -> list[int]:
    """The token ids a pin body stands for."""
    if (body.messages is None) == (body.prompt is None):
        raise bad_request("give either messages (with tools) or prompt", "messages")
    if body.prompt is not None:
        if body.tools or body.chat_template_kwargs:
            raise bad_request("tools and chat_template_kwargs go with messages, not prompt", "prompt")
        ids = await state.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        vocab = state.loaded.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None) if vocab else None
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    else:
        for i, m in enumerate(body.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text":
                    raise bad_request(f"messages[{i}].content[{j}]: a pinned prefix takes text only",
                                      f"messages[{i}].content[{j}].type")
        messages = [template_message(m, i) for i, m in enumerate(body.messages)]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        # No generation prompt: the pin is the start of later conversations, not one to answer.
        kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": False}
        ids = await state.render(messages, tools=tools, chat_template_kwargs=kwargs)
    if not ids:
        raise bad_request("prompt: must contain at least one token", "prompt")
    return ids


def pin_id(model: str, ids: list[int]) -> str:
    digest = hashlib.sha256(json.dumps([model, ids]).encode()).hexdigest()
    return f"pin_{digest[:24]}"


async def make_pin(server: ServerState, state: ModelState, body: PinRequest) -> dict:
    ids = await pin_tokens(state, body)
    try:
        state.engine.check_length(len(ids), 1)  # the prefill makes one token
        pid = pin_id(state.model_name, ids)
        pin = await state.engine.pins.pin(pid, ids)
    except PinError as e:
        raise APIError(e.status, str(e), param="messages" if body.messages is not None else "prompt",
                       code="cache_budget_exceeded" if e.status == 400 else "pin_failed") from None
    except Exception as e:  # noqa: BLE001 - the engine's refusals (too long, queue full, dead)
        raise from_engine(e, {"prompt": "messages" if body.messages is not None else "prompt"}) from None
    server.pool.entries[state.model_name].prefix_pins[pid] = ids
    return {"object": "cache.pin", "model": state.model_name, **pin}


@router.post("/v1/cache/pin")
async def pin_prefix(body: PinRequest, request: Request):
    state = await served(request, body.model)
    return await make_pin(server_of(request), state, body)


@router.delete("/v1/cache/pin/{pin_id}")
async def unpin_prefix(pin_id: str, request: Request):
    server = server_of(request)
    entry = next((e for e in server.pool.entries.values() if pin_id in e.prefix_pins), None)
    if entry is None:
        raise APIError(404, f"No pinned prefix has the id {pin_id!r}.", param="pin_id", code="pin_not_found")
    del entry.prefix_pins[pin_id]
    if entry.state == LOADED:
        try:
            await entry.engine.pins.unpin(pin_id)
        except EngineDeadError:
            pass  # unloaded meanwhile: its pins went with its cache
    return {"id": pin_id, "object": "cache.pin.deleted", "model": entry.name, "deleted": True}


@router.get("/v1/cache/pins")
async def list_pins(request: Request):
    server = server_of(request)
    data = []
    for entry in server.pool.entries.values():
        active = {}
        if entry.state == LOADED and entry.prefix_pins:
            try:
                active = {p["id"]: p for p in await entry.engine.pins.describe()}
            except EngineDeadError:
                pass
        for pid, ids in entry.prefix_pins.items():
            # pending: its model is not loaded (it is pinned again when it is)
            data.append({"object": "cache.pin", "model": entry.name, "prompt_tokens": len(ids),
                         **active.get(pid, {"id": pid}), "active": pid in active})
    return {"object": "list", "data": data}


async def repin(entry) -> None:
    """(pool.on_loaded) Pin a model's prefixes again after it was loaded again."""
    engine = entry.engine
    for pid, ids in list(entry.prefix_pins.items()):
        try:
            await engine.pins.pin(pid, ids)
            if pid not in entry.prefix_pins:  # unpinned while it was being pinned again
                await engine.pins.unpin(pid)
        except Exception as e:  # noqa: BLE001 - the model serves anyway; the pin stays listed as inactive
            log.warning("could not pin %s again on %s: %s", pid, entry.name, e)


# ---- stats and reset ----

async def _on_engine(request: Request, model: str | None, action: str):
    """A loaded model's cache stats or reset; an unloaded model has no cache to show."""
    entry = entry_of(server_of(request), model)
    if entry.state == LOADED:
        engine = entry.engine
        try:
            out = await (engine.cache_stats() if action == "stats" else engine.reset_cache())
            return {"model": entry.name, **out}
        except EngineStalledError as e:  # its MLX thread cannot answer until the step returns
            raise from_engine(e) from None
        except EngineDeadError:
            pass
    return {"model": entry.name, "state": entry.state}


@router.get("/v1/cache/stats")
async def cache_stats(request: Request, model: str | None = None):
    return await _on_engine(request, model, "stats")


@router.post("/v1/cache/reset")
async def cache_reset(request: Request, model: str | None = None):
    return await _on_engine(request, model, "reset")


# ---- --pin FILE ----

def read_pin_file(path: str) -> list[PinRequest]:
    """The pin bodies of a JSON file (a list); ValueError naming the file and entry."""
    try:
        items = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--pin {path}: cannot read it as JSON: {e}") from None
    if not isinstance(items, list):
        raise ValueError(f"--pin {path}: must hold a JSON list of pin bodies")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(PinRequest.model_validate(item))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"--pin {path}: [{i}]{'.' + where if where else ''}: {first['msg']}") from None
    return out


async def pin_at_start(server: ServerState, bodies: list[PinRequest], path: str) -> None:
    """Make the --pin file's pins (at start-up); raises ValueError naming the one that failed."""
    for i, body in enumerate(bodies):
        try:
            entry = entry_of(server, body.model)
            entry = await server.pool.acquire(entry.name)
            try:
                pin = await make_pin(server, entry.served, body)
            finally:
                server.pool.release(entry)
        except APIError as e:
            raise ValueError(f"--pin {path}: [{i}]: {e.message}") from None
        except Exception as e:  # noqa: BLE001 - ModelUnavailable and the like
            raise ValueError(f"--pin {path}: [{i}]: {e}") from None
        log.info("pinned %s: %d tokens of %s", pin["id"], pin["tokens"], pin["model"])
