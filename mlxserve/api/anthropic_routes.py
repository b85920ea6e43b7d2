"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic_schema import CountTokensRequest, MessagesRequest, Conversation
from mlxserve.api import images
from mlxserve.api.constraints import anthropic_grammar, constrain, forces_calls
from mlxserve.api.errors import APIError, bad_request, error_body, from_engine, ignored_once
from mlxserve.api.generate import Choice, ClientGone, ModelState, Run, collect
from mlxserve.api.models import served
from mlxserve.api import thinking
from mlxserve.api.openai_routes import CLIENT_CLOSED
from mlxserve.api.reasoning import ReasoningSplitter
from mlxserve.api.sse import SSEResponse, dumps, event, with_heartbeats
from mlxserve.api.tool_calls import ToolCall, ToolCallStream, anthropic_tool_use, check_tool_schema, split_text
from mlxserve.engine.request import Request as EngineRequest
from mlxserve.engine.request import SamplingParams

log = logging.getLogger("mlxserve.api")
router = APIRouter()


def check_supported(body: Conversation) -> None:
    check_contents(body)
    check_tools(body)
    thinking.check_thinking(body.thinking, getattr(body, "max_tokens", None))


def check_contents(body: Conversation) -> None:
    """Anthropic's rule: an empty turn (the prompt would show the model nothing from it) is
    refused, except a last assistant turn, which the answer continues."""
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            raise bad_request(f"messages.{i}: all messages must have non-empty content except for "
                              "the optional final assistant message", f"messages.{i}.content")


def check_tools(body: Conversation) -> None:
    choice = (body.tool_choice or {}).get("type", "auto")
    if choice not in ("auto", "none", "any", "tool"):
        raise bad_request(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {choice!r}",
                          "tool_choice.type")
    for j, tool in enumerate(body.tools or []):
        if not client_tool(tool):
            if choice == "tool" and (body.tool_choice or {}).get("name") == tool.name:
                raise bad_request(f"tool_choice.name: {tool.name!r} is a server tool ({tool.type}), "
                                  "which this server cannot run", "tool_choice.name")
            ignored_once(f"Anthropic server tool {tool.type!r}: left out of the prompt")
            continue
        # Anthropic requires an object schema: a tool's input is always a JSON object.
        if not isinstance(tool.input_schema, dict) or tool.input_schema.get("type") != "object":
            raise bad_request(f"tools.{j}.input_schema: must be a JSON schema of type 'object'",
                              f"tools.{j}.input_schema.type")
        check_tool_schema(tool.input_schema, f"tools.{j}.input_schema")


def client_tool(tool) -> bool:
    """A tool the client runs (type absent or custom); server tools (web_search_20250305,
    code_execution, ...) run on Anthropic's side, which this server is not."""
    return tool.type in (None, "custom")


def template_tools(body: Conversation) -> list[dict] | None:
    """Anthropic's client tools as the OpenAI-style function tools chat templates are written for."""
    if not body.tools or (body.tool_choice or {}).get("type") == "none":
        return None
    return [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        "parameters": t.input_schema}} for t in body.tools if client_tool(t)] or None


def block_text(content, where: str, placeholders=None) -> str:
    """Text blocks joined by newlines; image blocks (user turns) become their placeholder text."""
    if isinstance(content, str):
        return content
    return images.content_text(content, placeholders, media_types=("image",), where=lambda j: f"{where}.{j}")


def image_sources(body: Conversation) -> list[tuple[str, str]]:
    """(where, url) of the image blocks of user turns, in prompt order; base64 sources as data URLs."""
    out = []
    for i, m in enumerate(body.messages):
        if m.role != "user" or isinstance(m.content, str):
            continue
        for j, block in enumerate(m.content):
            if block.type != "image":
                continue
            where, source = f"messages.{i}.content.{j}", block.source or {}
            if source.get("type") == "base64" and source.get("data"):
                out.append((where, f"data:{source.get('media_type', 'image/png')};base64,{source['data']}", "image"))
            elif source.get("type") == "url" and source.get("url"):
                out.append((where, source["url"], "image"))
            else:
                raise bad_request(f"{where}.source: an image source is {{'type': 'base64', 'media_type', "
                                  f"'data'}} or {{'type': 'url', 'url'}}", f"{where}.source")
    return out


def user_messages(content, where: str, placeholders=None) -> list[dict]:
    """A user turn: each tool_result becomes a `tool` message, the text around it user messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for j, block in enumerate(content):
        if block.type != "tool_result":
            texts.append(block)
            continue
        if texts:
            out.append({"role": "user", "content": block_text(texts, where, placeholders)})
            texts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": block_text(block.content or "", f"{where}.{j}.content")})
    if texts or not out:
        out.append({"role": "user", "content": block_text(texts, where, placeholders)})
    return out


def assistant_message(content, where: str) -> dict:
    """An assistant turn: its tool_use blocks become tool_calls, arguments as dicts (as templates print them)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": b.input if isinstance(b.input, dict) else {}}}
             for b in content if b.type == "tool_use"]
    # Past thinking is accepted and left out, as the models' own templates drop past reasoning.
    skipped = ("tool_use", "thinking", "redacted_thinking")
    message = {"role": "assistant",
               "content": block_text([b for b in content if b.type not in skipped], where)}
    if calls:
        message["tool_calls"] = calls
    return message


async def prompt_ids(state: ModelState, body: Conversation) -> tuple[list[int], list]:
    """Token ids of the conversation and its images (PromptImages)."""
    prepared = await images.prepare(state, image_sources(body), type_name="image")
    placeholders = images.placeholders(state, prepared)
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if m.role == "user":
            messages += user_messages(m.content, where, placeholders)
        elif m.role == "system":
            messages.append({"role": "system", "content": block_text(m.content, where)})
        else:
            messages.append(assistant_message(m.content, where))
    # Anthropic continues a final assistant message instead of starting a new turn.
    prefill = body.messages[-1].role == "assistant"
    # Claude Code's user_id names its session: a tool it loads mid-session goes after the others.
    session = (getattr(body, "metadata", None) or {}).get("user_id")
    tools = state.tool_order.arrange(session if isinstance(session, str) else None, template_tools(body))
    prompt = await state.render(messages, tools=tools, continue_final=prefill,
                                chat_template_kwargs=thinking.template_kwargs(body.thinking))
    return prompt, images.prompt_images(state, prompt, prepared, "messages")


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def with_calls(reason: tuple[str, str | None], calls: bool) -> tuple[str, str | None]:
    # A turn that ended on its own after calling tools waits for their results.
    return ("tool_use", None) if calls and reason[0] == "end_turn" else reason


def response_content(choice: Choice, syntax, tools, splitter: ReasoningSplitter | None = None,
                     forced: bool = False) -> tuple[list[dict], bool]:
    """The answer's content blocks (thinking, text, then tool_use), and whether it called tools."""
    reasoning, content = splitter.split(choice.texts, choice.token_ids) if splitter else ("", choice.text)
    head = [{"type": "thinking", "thinking": reasoning, "signature": thinking.signature(reasoning)}] \
        if reasoning else []
    text, calls = split_text(syntax, content, tools, forced) if tools else (content, [])
    if not calls:
        return [*head, {"type": "text", "text": text}], False
    return [*head, *([{"type": "text", "text": text}] if text else []),
            *(anthropic_tool_use(c) for c in calls)], True


def usage(choice: Choice, caching: bool) -> dict:
    """Anthropic's usage: input_tokens excludes the tokens read from the cache. With the prefix
    cache on, every prompt token it did not serve was prefilled and is stored (whole blocks and
    the prompt's tail), so those are the cache's creation; with it off there is none."""
    new = choice.prompt_tokens - choice.cached_tokens
    return {"input_tokens": new,
            "output_tokens": choice.completion_tokens,
            "cache_read_input_tokens": choice.cached_tokens,
            "cache_creation_input_tokens": new if caching else 0}


def caches_prompts(state: ModelState) -> bool:
    return bool(state.engine.config.prefix_cache)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    arrival = time.perf_counter()  # time to first token includes templating
    state = await served(request, body.model)
    check_supported(body)
    prompt, prompt_images = await prompt_ids(state, body)
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
    tools = template_tools(body)
    engine_request = EngineRequest(prompt, params, request_id=msg_id, arrival_time=arrival,
                                   images=prompt_images)
    grammar = await anthropic_grammar(state, body, tools)
    budget = thinking.budget(body.thinking)
    if grammar is not None and budget is not None:
        # Anthropic refuses this pair too: a forced call or format leaves no room to think first.
        raise bad_request(f"thinking: cannot be combined with {grammar[1]}; turn thinking off", "thinking")
    await constrain(state, [engine_request], grammar)
    if budget is not None and state.reasoning is not None:
        run = thinking.BudgetedRun(state, engine_request, budget, rename)
    else:
        run = Run(state, [engine_request], rename)
    head = {"id": msg_id, "type": "message", "role": "assistant", "model": state.model_name}
    syntax = state.tool_syntax if tools else None
    splitter = state.reasoning.splitter(prompt) if state.reasoning else None
    if body.stream:
        stream = ToolCallStream(syntax, tools, forces_calls(grammar)) if tools else None
        return SSEResponse(message_events(run, head, len(prompt), stream, splitter,
                                          caches_prompts(state)), run)
    try:
        (choice,) = await collect(run, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    content, called = response_content(choice, syntax, tools, splitter, forces_calls(grammar))
    reason, sequence = with_calls(stop_reason(choice), called)
    return JSONResponse({
        **head,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(choice, caches_prompts(state)),
    })


class BlockEvents:
    """The content block events of a streamed answer: text blocks, and tool_use blocks between them.

    A text block opens with the first text (from the start when no tools and
    no reasoning are in play); a tool call closes it, is sent whole as its own
    block, and text after it opens a new text block.
    """

    def __init__(self, stream: ToolCallStream | None):
        self.stream = stream
        self.index = 0
        self.text_open = False
        self.calls = 0
        self.thinking: list[str] | None = None  # the open thinking block's text

    def think(self, text: str) -> list[bytes]:
        """A thinking delta, in a thinking block opened on its first one."""
        out = []
        if self.thinking is None:
            self.thinking = []
            out.append(event({"type": "content_block_start", "index": self.index, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}}, "content_block_start"))
        self.thinking.append(text)
        out.append(event({"type": "content_block_delta", "index": self.index,
                          "delta": {"type": "thinking_delta", "thinking": text}}, "content_block_delta"))
        return out

    def close_thinking(self) -> list[bytes]:
        """Anthropic ends a thinking block with its signature."""
        if self.thinking is None:
            return []
        sig = thinking.signature("".join(self.thinking))
        self.thinking = None
        self.index += 1
        return [event({"type": "content_block_delta", "index": self.index - 1,
                       "delta": {"type": "signature_delta", "signature": sig}}, "content_block_delta"),
                event({"type": "content_block_stop", "index": self.index - 1}, "content_block_stop")]

    def open_text(self) -> list[bytes]:
        out = self.close_thinking()
        self.text_open = True
        return out + [event({"type": "content_block_start", "index": self.index,
                             "content_block": {"type": "text", "text": ""}}, "content_block_start")]

    def close(self) -> list[bytes]:
        if not self.text_open:
            return self.close_thinking()
        self.text_open = False
        self.index += 1
        return [event({"type": "content_block_stop", "index": self.index - 1}, "content_block_stop")]

    def text(self, text: str) -> list[bytes]:
        head = [] if self.text_open else self.open_text()
        return head + [event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "text_delta", "text": text}}, "content_block_delta")]

    def tool_use(self, call: ToolCall) -> list[bytes]:
        block = anthropic_tool_use(call)
        out = self.close()
        out.append(event({"type": "content_block_start", "index": self.index,
                          "content_block": {**block, "input": {}}}, "content_block_start"))
        out.append(event({"type": "content_block_delta", "index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": dumps(block["input"])}}, "content_block_delta"))
        out.append(event({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
        self.index += 1
        self.calls += 1
        return out

    def __call__(self, text: str, finished: bool) -> list[bytes]:
        if self.stream is None:
            return self.text(text) if text else []
        pieces = self.stream.feed(text) + (self.stream.finish() if finished else [])
        out = []
        for p in pieces:
            out += self.tool_use(p) if isinstance(p, ToolCall) else self.text(p) if p else []
        return out


async def message_events(run: Run, head: dict, prompt_tokens: int, stream: ToolCallStream | None,
                         splitter: ReasoningSplitter | None = None, caching: bool = True):
    # Sent before the first token, so cached tokens are not known yet; message_delta
    # carries the final input and cache counts (as Anthropic's own stream does).
    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0,
                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    choice = Choice()
    blocks = BlockEvents(stream)
    try:
        yield event({"type": "message_start", "message": {
            **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage,
        }}, "message_start")
        # Opened before the first token, as Anthropic does, unless the first block may be a
        # thinking block (a reasoning model) or a tool_use block (tools offered): an empty
        # text block before a call is one the real API refuses when a client sends it back.
        if splitter is None and stream is None:
            for e in blocks.open_text():
                yield e
        yield event({"type": "ping"}, "ping")
        async for item in with_heartbeats(run):
            if item is None:
                yield event({"type": "ping"}, "ping")
                continue
            out = item[1]
            choice.add(out)
            reasoning, text = ("", out.new_text) if splitter is None else \
                splitter.feed(out.new_text, out.new_token_ids, out.finished)
            for e in (blocks.think(reasoning) if reasoning else []) + blocks(text, out.finished):
                yield e
        reason, sequence = with_calls(stop_reason(choice), blocks.calls > 0)
        if blocks.index == 0 and not blocks.text_open:  # nothing at all: one empty text block
            for e in blocks.open_text():
                yield e
        for e in blocks.close():
            yield e
        yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": usage(choice, caching)}, "message_delta")
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
    state = await served(request, body.model)
    check_supported(body)
    prompt, _ = await prompt_ids(state, body)
    return {"input_tokens": len(prompt)}
