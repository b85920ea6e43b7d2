"""Errors in the OpenAI and the Anthropic shapes, and the handlers that render them.

Every failure a client can see goes through `APIError`: the route raises it,
and `error_response` renders it in the shape of the API that path belongs to
(`/v1/messages*` speaks Anthropic, everything else OpenAI).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxserve.engine.engine import EngineDeadError, QueueFullError
from mlxserve.engine.guard import InsufficientMemoryError
from mlxserve.engine.request import EngineError, EngineStalledError, PromptTooLongError

log = logging.getLogger("mlxserve.api")

# Seconds a client should wait after a 429: about the time a slot takes to free up
# on a busy server. Clients (openai, anthropic) honour it in their retries.
RETRY_AFTER_SECONDS = 1

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


_IGNORED: set[str] = set()


def ignored_once(what: str) -> None:
    """Log, once per server, a request part this server accepts but cannot act on (a hosted
    tool, an unknown field an agent sends): refusing it would break the agent for nothing."""
    if what not in _IGNORED:
        _IGNORED.add(what)
        log.info("accepted and ignored (logged once): %s", what)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: APIError, anthropic: bool) -> dict:
    if anthropic:
        kind = ANTHROPIC_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(err: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic(path)), status_code=err.status, headers=err.headers)


def from_engine(exc: BaseException, rename: dict | None = None) -> APIError:
    """The APIError for an exception raised by `engine.submit` or a request's stream.

    `rename` maps engine field names to the request's own (max_tokens ->
    max_completion_tokens, prompt -> messages), so `param` names what the
    client sent.
    """
    rename = rename or {}
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=rename.get("prompt", "prompt"), code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {first_line(str(exc))}", code="engine_dead")
    if isinstance(exc, InsufficientMemoryError):  # no Retry-After: the same request will not fit later
        return APIError(503, str(exc), param=rename.get("max_tokens", "max_tokens"), code="insufficient_memory")
    if isinstance(exc, EngineStalledError):
        return APIError(503, f"The engine is stalled: {first_line(str(exc))}; retry later.", code="engine_stalled",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineError):
        # The engine's message names the failure (e.g. the exception's repr), never a traceback.
        return APIError(500, f"The engine failed this request: {first_line(str(exc))}", code="engine_error")
    if isinstance(exc, ValueError):  # SamplingParams and submit: "field: why"
        field, sep, why = str(exc).partition(": ")
        if sep and field.isidentifier():
            name = rename.get(field, field)
            return APIError(400, f"{name}: {why}", param=name)
        return APIError(400, str(exc))
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, "Internal server error.", code="internal_error")


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """One 400 naming the first bad field, in place of FastAPI's 422 list."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    e = errors[0]
    if e.get("type") == "json_invalid":
        why = (e.get("ctx") or {}).get("error", "not valid JSON")
        return bad_request(f"The request body is not valid JSON: {why}.", code="invalid_json")
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = _dotted(loc)
    if not param and "json" not in (content_type or ""):
        # FastAPI parses JSON only when the client says so (a guard against CSRF).
        return bad_request("The request body must be JSON, sent with 'Content-Type: application/json'.")
    if not param:
        return bad_request(f"The request body must be a JSON object: {e.get('msg')}.")
    message = e.get("msg", "invalid value")
    if e.get("type") == "missing":
        message = "required field is missing"
    return bad_request(f"{param}: {message}", param=param)


def unparsable_body(cause: BaseException) -> APIError:
    """The 400 for a body FastAPI's JSON parsing gave up on, saying why (its own message does not)."""
    if isinstance(cause, RecursionError):
        message = "The request body's JSON is nested too deeply."
    elif isinstance(cause, UnicodeError):
        message = "The request body is not JSON in UTF-8."
    else:
        message = f"The request body cannot be read as JSON: {first_line(str(cause))}."
    return bad_request(message, code="invalid_json")


def _dotted(loc) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic union tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "function-" in part or part in ("str", "int", "list", "dict"):
            continue  # a union branch name such as 'list[int]', not a field
        else:
            out += ("." if out else "") + part
    return out


def install(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    async def on_validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc, request.headers.get("content-type")),
                              request.url.path)

    async def on_http(request: Request, exc: StarletteHTTPException):
        message = {404: f"No route {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}
        err = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                       headers=dict(exc.headers or {}))
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "error parsing the body"
            err = unparsable_body(exc.__cause__)
        return error_response(err, request.url.path)

    async def on_unexpected(request: Request, exc: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(APIError(500, "Internal server error.", code="internal_error"),
                              request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
