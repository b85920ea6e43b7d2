"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, its input items.

A Responses request is translated into the chat-completions request it amounts
to (`responses_input.chat_request`) and runs through chat completions' own
checks, template, sampling and tool-call parsing; only the input items and the
output (items and their stream events) are this API's own.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api import images
from mlxserve.api.constraints import constrain, forces_calls, openai_grammar
from mlxserve.api.errors import APIError
from mlxserve.api.generate import Choice, ClientGone, Run, collect
from mlxserve.api.models import served
from mlxserve.api.reasoning import ReasoningSplitter
from mlxserve.api.openai_routes import (
    CLIENT_CLOSED,
    ToolCalls,
    check_chat_supported,
    engine_requests,
    state_of,
    template_message,
)
from mlxserve.api.responses_input import (
    CUSTOM_INPUT,
    ResponseStore,
    Stored,
    ToolKind,
    chat_messages,
    chat_request,
    chat_tools,
    image_sources,
    input_items,
    item_id,
    not_found,
    previous_conversation,
)
from mlxserve.api.openai_schema import ChatCompletionRequest
from mlxserve.api.responses_schema import ResponsesRequest
from mlxserve.api.sse import SSEResponse, event, with_heartbeats
from mlxserve.api.tool_calls import ToolCall, ToolCallStream, call_id

log = logging.getLogger("mlxserve.api")
router = APIRouter()

# Chat completions' names for what Responses calls otherwise, for error messages.
RENAME = {"prompt": "input", "max_tokens": "max_output_tokens"}
CHAT_PARAMS = {"response_format.json_schema": "text.format", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
               "messages": "input"}


def store_of(request: Request) -> ResponseStore:
    app_state = request.app.state
    store = getattr(app_state, "responses", None)
    if store is None:
        store = app_state.responses = ResponseStore(state_of(request).server_cfg.responses_store_size)
    return store


def check_supported(body: ResponsesRequest) -> None:
    refused = {"background": "background responses are not supported",
               "conversation": "conversations are not supported; use previous_response_id",
               "prompt": "stored prompt templates are not supported",
               "top_logprobs": "logprobs are not supported by the Responses API here; use chat "
                               "completions"}
    for field, why in refused.items():
        if getattr(body, field):
            raise APIError(400, f"{field}: {why}", param=field)


def check_chat(chat) -> None:
    """Chat completions' check, with its errors naming the Responses fields."""
    try:
        check_chat_supported(chat)
    except APIError as e:
        raise renamed(e) from None


def renamed(e: APIError) -> APIError:
    """A chat-completions error as the Responses API names its field (text.format, not response_format)."""
    for chat_name, name in CHAT_PARAMS.items():
        if e.param and e.param.startswith(chat_name):
            e.message = name + e.message.removeprefix(chat_name)
            e.param = name + e.param.removeprefix(chat_name)
            break
    return e


# ---- the response object ----

class Head:
    """What every snapshot of one response shares: its id, time and the echoed request."""

    def __init__(self, state, body: ResponsesRequest, response_id: str):
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        self.response_id = response_id
        self.fields = {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "model": state.model_name, "background": False, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None, "metadata": body.metadata or {},
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "user": body.user,
        }

    def response(self, status: str, output: list[dict], choice: Choice | None = None) -> dict:
        out = {**self.fields, "status": status, "output": copy.deepcopy(output),
               "incomplete_details": None, "usage": None}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if choice is not None:
            out["usage"] = {
                "input_tokens": choice.prompt_tokens,
                # cache_write_tokens: what OpenAI bills for explicit cache writes; the
                # prefix cache stores blocks for free.
                "input_tokens_details": {"cached_tokens": choice.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": choice.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": choice.prompt_tokens + choice.completion_tokens,
            }
        return out


def final_status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


class Output:
    """A response's output items, built from the generated text as it comes.

    `feed` and `finish` return the stream events each step makes (without
    sequence numbers); the non-streamed path drops them and keeps `items`, so
    both paths answer with the same items. Text goes into a `message` item,
    each parsed tool call becomes a `function_call` item; text after a call
    opens a new message. A reasoning model's reasoning becomes a `reasoning`
    item before them, streamed with `response.reasoning_text.*` events.
    """

    def __init__(self, stream: ToolCallStream | None, splitter: ReasoningSplitter | None = None,
                 tool_kinds: dict[str, ToolKind] | None = None):
        self.stream = stream
        self.splitter = splitter
        self.tool_kinds = tool_kinds or {}
        self.items: list[dict] = []
        self.message: dict | None = None  # the open message item text goes into
        self.reasoning: dict | None = None  # the open reasoning item

    def feed(self, text: str, token_ids=(), finished: bool = False) -> list[dict]:
        events = []
        if self.splitter is not None:
            thought, text = self.splitter.feed(text, token_ids, finished)
            events += self._reason(thought)
            if text:
                events += self._close_reasoning("completed")
        return events + self._pieces(self.stream.feed(text) if self.stream else [text])

    def finish(self, status: str) -> list[dict]:
        end = "incomplete" if status == "incomplete" else "completed"
        events = self.feed("", finished=True) if self.splitter is not None else []
        events += self._close_reasoning(end)
        events += self._pieces(self.stream.finish() if self.stream else [])
        if not any(i["type"] != "reasoning" for i in self.items):  # no text, no call: one empty message
            events += self._open_message()
        return events + self._close_message(end)

    def _reason(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.reasoning is None:
            self.reasoning = {"type": "reasoning", "id": item_id("rs"), "summary": [],
                              "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            self.items.append(self.reasoning)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": copy.deepcopy(self.reasoning)})
        self.reasoning["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", **self._at(), "content_index": 0,
                          "delta": text}]

    def _close_reasoning(self, status: str) -> list[dict]:
        if self.reasoning is None:
            return []
        item, self.reasoning = self.reasoning, None
        item["status"] = status
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        return [{"type": "response.reasoning_text.done", **at, "content_index": 0,
                 "text": item["content"][0]["text"]},
                {"type": "response.output_item.done", "output_index": at["output_index"],
                 "item": copy.deepcopy(item)}]

    def _pieces(self, pieces: list) -> list[dict]:
        events = []
        for p in pieces:
            if isinstance(p, ToolCall):
                events += self._close_message("completed") + self._call(p)
            elif p:
                if self.message is None:
                    events += self._open_message()
                part = self.message["content"][0]
                part["text"] += p
                events.append({"type": "response.output_text.delta", **self._at(), "content_index": 0,
                               "delta": p, "logprobs": []})
        return events

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open_message(self) -> list[dict]:
        self.message = {"type": "message", "id": item_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
        self.items.append(self.message)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(self.message)}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        return [added, {"type": "response.content_part.added", **self._at(), "content_index": 0,
                        "part": copy.deepcopy(part)}]

    def _close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        message["status"] = status
        part = message["content"][0]
        return [
            {"type": "response.output_text.done", **self._at(), "content_index": 0,
             "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **self._at(), "content_index": 0,
             "part": copy.deepcopy(part)},
            {"type": "response.output_item.done", "output_index": len(self.items) - 1,
             "item": copy.deepcopy(message)},
        ]

    def _call(self, call: ToolCall) -> list[dict]:
        """A call's item, added, its input streamed whole (one delta), and done. A function's
        input is its JSON arguments; a custom tool's, the text of its template function's one
        argument."""
        kind = self.tool_kinds.get(call.name, ToolKind("function"))
        if kind.type == "custom":
            text = call.arguments.get(CUSTOM_INPUT)
            text = text if isinstance(text, str) else json.dumps(call.arguments, ensure_ascii=False)
            item = {"type": "custom_tool_call", "id": item_id("ctc"), "call_id": call_id("call_"),
                    "name": call.name, "input": "", "status": "in_progress"}
            field, events, done = "input", "response.custom_tool_call_input", {"input": text}
        else:
            text = json.dumps(call.arguments, ensure_ascii=False)
            item = {"type": "function_call", "id": item_id("fc"), "call_id": call_id("call_"),
                    "name": call.name, "arguments": "", "status": "in_progress"}
            if kind.namespace:
                item["namespace"] = kind.namespace
            field, events = "arguments", "response.function_call_arguments"
            done = {"name": call.name, "arguments": text}
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}
        item.update({field: text, "status": "completed"})
        return [
            added,
            {"type": f"{events}.delta", **self._at(), "delta": text},
            {"type": f"{events}.done", **self._at(), **done},
            {"type": "response.output_item.done", "output_index": len(self.items) - 1,
             "item": copy.deepcopy(item)},
        ]


# ---- routes ----

@dataclass
class Prepared:
    """A Responses request made ready to run: its chat form, prompt and tools."""

    chat: ChatCompletionRequest
    prompt: list[int]
    prompt_images: list
    tools: list[dict] | None  # the template's (chat) tools; None with tool_choice 'none'
    tool_kinds: dict[str, ToolKind]
    new_items: list[dict]
    conversation: list[dict]


async def prepare(state, body: ResponsesRequest, store: ResponseStore) -> Prepared:
    """The conversation (stored turns and this request's items) as a prompt, checked."""
    check_supported(body)
    history = previous_conversation(store, body)
    new_items = input_items(body)
    conversation = history + new_items
    messages = chat_messages(conversation, len(history), body.instructions)
    if not messages:
        raise APIError(400, "input: required field is missing (or empty)", param="input")
    template_tools, tool_kinds = chat_tools(body)
    chat = chat_request(body, messages, template_tools)
    check_chat(chat)
    sources = image_sources(conversation, len(history))
    prepared = await images.prepare(state, sources, type_name="input_image")
    placeholders = images.placeholders(state, prepared)
    template = [template_message(m, i, placeholders) for i, m in enumerate(chat.messages)]
    tools = None
    if chat.tools and chat.tool_choice != "none":  # 'none': the model is not told of tools
        tools = [t.model_dump(exclude_none=True) for t in chat.tools]
        tools = state.tool_order.arrange(body.prompt_cache_key, tools)  # Codex's: its thread id
    effort = {"reasoning_effort": chat.reasoning_effort} if chat.reasoning_effort else None
    prompt = await state.render(template, tools=tools, chat_template_kwargs=effort, param="input")
    prompt_images = images.prompt_images(state, prompt, prepared, "input")
    return Prepared(chat, prompt, prompt_images, tools, tool_kinds, new_items, conversation)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    arrival = time.perf_counter()
    state = await served(request, body.model)
    store = store_of(request)
    p = await prepare(state, body, store)
    chat, prompt, tools, conversation, new_items = p.chat, p.prompt, p.tools, p.conversation, p.new_items
    prompt_images, tool_kinds = p.prompt_images, p.tool_kinds
    head = Head(state, body, item_id("resp"))
    requests = engine_requests(state, chat, [prompt], api_id=head.response_id,
                               max_tokens=body.max_output_tokens, logprobs=False, top_logprobs=0,
                               rename=RENAME, arrival=arrival, images=prompt_images)
    try:
        grammar = await openai_grammar(state, chat, tools)
        await constrain(state, requests, grammar)
    except APIError as e:
        raise renamed(e) from None
    run = Run(state, requests, RENAME)
    splitter = state.reasoning.splitter(prompt) if state.reasoning else None
    output = Output(ToolCalls(state.tool_syntax, tools, forced=forces_calls(grammar)).stream(), splitter,
                    tool_kinds)

    def save(response: dict) -> None:
        if body.store is not False:
            store.put(Stored(response, new_items, conversation + copy.deepcopy(output.items)))

    if body.stream:
        return SSEResponse(response_events(run, head, output, save), run)
    try:
        choice = (await collect(run, request))[0]
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    status = final_status(choice)
    aligned = len(choice.token_ids) == len(choice.texts)  # one token per output (harmony's markers)
    for k, text in enumerate(choice.texts):
        output.feed(text, choice.token_ids[k:k + 1] if aligned else ())
    output.finish(status)
    response = head.response(status, output.items, choice)
    save(response)
    return JSONResponse(response)


async def response_events(run: Run, head: Head, output: Output, save):
    """The stream: created and in_progress, the items' events, then completed or incomplete."""
    sequence = 0

    def send(data: dict) -> bytes:
        nonlocal sequence
        data["sequence_number"] = sequence
        sequence += 1
        return event(data, data["type"])

    choice = Choice()
    try:
        yield send({"type": "response.created", "response": head.response("in_progress", [])})
        yield send({"type": "response.in_progress", "response": head.response("in_progress", [])})
        async for item in with_heartbeats(run):
            if item is None:  # still prefilling: an event Codex and the SDKs know, changing nothing
                yield send({"type": "response.in_progress", "response": head.response("in_progress", [])})
                continue
            out = item[1]
            choice.add(out)
            for e in output.feed(out.new_text, out.new_token_ids):
                yield send(e)
        status = final_status(choice)
        for e in output.finish(status):
            yield send(e)
        response = head.response(status, output.items, choice)
        save(response)
        yield send({"type": f"response.{status}", "response": response})
    except Exception as e:  # noqa: BLE001 - a bug here must still end the stream properly
        if not isinstance(e, APIError):
            log.exception("stream failed")
            e = APIError(500, "Internal server error.", code="internal_error")
        yield send({"type": "error", "code": e.code, "message": e.message, "param": e.param})
    finally:
        run.close()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    entry = store_of(request).get(response_id)
    if entry is None:
        raise not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not store_of(request).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, order: str = "desc",
                           limit: int = 20, after: str | None = None):
    entry = store_of(request).get(response_id)
    if entry is None:
        raise not_found(response_id)
    if order not in ("asc", "desc"):
        raise APIError(400, "order: must be 'asc' or 'desc'", param="order")
    if not 1 <= limit <= 100:
        raise APIError(400, "limit: must be between 1 and 100", param="limit")
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise APIError(400, f"after: no input item with id {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
