"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic_schema import CountTokensRequest, MessagesRequest, Conversation
from mlxserve.api.errors import APIError, bad_request, error_body, from_engine
from mlxserve.api.generate import Choice, ClientGone, Run, ServerState, collect
from mlxserve.api.openai_routes import CLIENT_CLOSED, state_of
from mlxserve.api.sse import SSEResponse, event
from mlxserve.api.tokens import render
from mlxserve.engine.request import Request as EngineRequest
from mlxserve.engine.request import SamplingParams

log = logging.getLogger("mlxserve.api")
router = APIRouter()


def check_supported(body: Conversation) -> None:
    if body.tools is not None or body.tool_choice is not None:
        raise bad_request("tools: tool use is not supported on /v1/messages yet; "
                          "use /v1/chat/completions with tools", "tools")
    if body.thinking is not None and (not isinstance(body.thinking, dict)
                                      or body.thinking.get("type") != "disabled"):
        raise bad_request("thinking: extended thinking is not supported", "thinking")
    if (body.output_config or {}).get("format") is not None:
        raise bad_request("output_config.format: structured output needs constrained decoding, "
                          "which this server does not do", "output_config.format")


def block_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise bad_request(f"{where}.{j}: content blocks of type {block.type!r} are not "
                              "supported; this model takes text only", f"{where}.{j}.type")
        texts.append(block.text)
    return "\n".join(texts)


def prompt_ids(state: ServerState, body: Conversation) -> tuple[list[int], bool]:
    """Token ids of the conversation; True if the last turn is an assistant prefill."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        messages.append({"role": m.role, "content": block_text(m.content, f"messages.{i}.content")})
    # Anthropic continues a final assistant message instead of starting a new turn.
    prefill = body.messages[-1].role == "assistant"
    return render(state.tokenizer, messages, continue_final=prefill), prefill


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def usage(choice: Choice) -> dict:
    # Anthropic's input_tokens excludes the tokens read from the cache.
    return {"input_tokens": choice.prompt_tokens - choice.cached_tokens,
            "output_tokens": choice.completion_tokens,
            "cache_read_input_tokens": choice.cached_tokens,
            "cache_creation_input_tokens": 0}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    arrival = time.perf_counter()  # time to first token includes templating
    state = state_of(request)
    state.check_model(body.model)
    check_supported(body)
    prompt, _ = prompt_ids(state, body)
    rename = {"prompt": "messages", "stop": "stop_sequences"}
    try:
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            stop=list(body.stop_sequences or []),
        )
    except ValueError as e:
        raise from_engine(e, rename) from None
    if body.metadata and body.metadata.get("user_id"):
        log.debug("messages request for user %r", body.metadata["user_id"])
    msg_id = f"msg_{uuid.uuid4().hex}"
    run = Run(state, [EngineRequest(prompt, params, request_id=msg_id, arrival_time=arrival)], rename)
    head = {"id": msg_id, "type": "message", "role": "assistant", "model": state.model_name}
    if body.stream:
        return SSEResponse(message_events(run, head, len(prompt)), run)
    try:
        (choice,) = await collect(run, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    reason, sequence = stop_reason(choice)
    return JSONResponse({
        **head,
        "content": [{"type": "text", "text": choice.text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(choice),
    })


async def message_events(run: Run, head: dict, prompt_tokens: int):
    # Sent before the first token, so cached tokens are not known yet; message_delta
    # carries the final input and cache counts (as Anthropic's own stream does).
    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0,
                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    choice = Choice()
    try:
        yield event({"type": "message_start", "message": {
            **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage,
        }}, "message_start")
        yield event({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}, "content_block_start")
        yield event({"type": "ping"}, "ping")
        async for _, out in run:
            choice.add(out)
            if out.new_text:
                yield event({"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": out.new_text}},
                            "content_block_delta")
        reason, sequence = stop_reason(choice)
        yield event({"type": "content_block_stop", "index": 0}, "content_block_stop")
        yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": usage(choice)}, "message_delta")
        yield event({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield event(error_body(e, anthropic=True), "error")
    except Exception:  # noqa: BLE001 - a bug here must still end the stream properly
        log.exception("stream failed")
        yield event(error_body(APIError(500, "Internal server error."), anthropic=True), "error")
    finally:
        run.close()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    state = state_of(request)
    state.check_model(body.model)
    check_supported(body)
    prompt, _ = prompt_ids(state, body)
    return {"input_tokens": len(prompt)}
