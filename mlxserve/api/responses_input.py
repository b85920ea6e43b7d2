"""Responses API input: items checked and normalized, the stored conversations, and
the translation into the chat-completions request the rest of the server speaks.

A conversation is a list of normalized items (plain dicts in the Responses
shape, each with an id): what the client sent, then what the model answered.
A stored response keeps its whole conversation, so `previous_response_id`
rebuilds the prompt from it; rendered by the same template, the earlier turns
are the same tokens, and the prefix cache serves them.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import ValidationError

from mlxserve.api.errors import APIError, bad_request, ignored_once
from mlxserve.api.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    Tool,
    ToolCall,
)
from mlxserve.api.responses_schema import InputItem, InputPart, ResponsesRequest
from mlxserve.api.tool_calls import check_tool_schema

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "refusal")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the store ----

@dataclass
class Stored:
    response: dict  # the response object, as GET returns it
    input_items: list[dict]  # this request's own input items
    conversation: list[dict]  # every item of every turn, up to this response's output


class ResponseStore:
    """The last `size` stored responses, least recently used out first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, entry: Stored) -> None:
        if self.size <= 0:
            return
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def previous_conversation(store: ResponseStore, body: ResponsesRequest) -> list[dict]:
    if body.previous_response_id is None:
        return []
    entry = store.get(body.previous_response_id)
    if entry is None:
        raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return entry.conversation


# ---- input items ----

def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as normalized items; a 400 naming the first bad one."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [message_item("user", [{"type": "input_text", "text": body.input}])]
    return [normalize(item, f"input[{i}]") for i, item in enumerate(body.input)]


def message_item(role: str, content: list[dict]) -> dict:
    return {"type": "message", "id": item_id("msg"), "role": role, "status": "completed",
            "content": content}


def normalize(item: InputItem, where: str) -> dict:
    kind = item.type or ("message" if item.role else None)
    if kind == "message":
        return normalize_message(item, where)
    if kind == "function_call":
        name = require(item.name, f"{where}.name")
        args = require(item.arguments, f"{where}.arguments")
        parse_arguments(args, f"{where}.arguments")
        out = {"type": "function_call", "id": item.id or item_id("fc"),
               "call_id": require(item.call_id, f"{where}.call_id"), "name": name,
               "arguments": args, "status": "completed"}
        return {**out, "namespace": item.namespace} if item.namespace else out
    if kind == "custom_tool_call":
        return {"type": "custom_tool_call", "id": item.id or item_id("ctc"),
                "call_id": require(item.call_id, f"{where}.call_id"),
                "name": require(item.name, f"{where}.name"), "input": require(item.input, f"{where}.input"),
                "status": "completed"}
    if kind in ("function_call_output", "custom_tool_call_output"):
        call = require(item.call_id, f"{where}.call_id")
        output = require(item.output, f"{where}.output")
        if not isinstance(output, str):
            output = [text_part(p, f"{where}.output[{j}]") for j, p in enumerate(output)]
        return {"type": kind, "id": item.id or item_id("fco"), "call_id": call,
                "output": output, "status": "completed"}
    if kind == "reasoning":
        out = {"type": "reasoning", "id": item.id or item_id("rs"), "summary": item.summary or []}
        if item.encrypted_content is not None:
            out["encrypted_content"] = item.encrypted_content
        return out
    if kind is None:
        raise bad_request(f"{where}: an item needs a 'type' (or a 'role', for a message)",
                          f"{where}.type")
    if kind == "item_reference":
        raise bad_request(f"{where}: item references are not supported; send the item itself, "
                          "or continue a stored response with previous_response_id", f"{where}.type")
    raise bad_request(f"{where}.type: items of type {kind!r} are not supported; this server takes "
                      "message, function_call, function_call_output, custom_tool_call, "
                      "custom_tool_call_output and reasoning items",
                      f"{where}.type")


def require(value, param: str):
    if value is None:
        raise bad_request(f"{param}: required field is missing", param)
    return value


def parse_arguments(args: str, param: str) -> dict:
    """A function call's arguments (a JSON object in a string) as a dict."""
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        raise bad_request(f"{param}: not valid JSON", param) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{param}: must be a JSON object", param)
    return parsed


def normalize_message(item: InputItem, where: str) -> dict:
    if item.role not in MESSAGE_ROLES:
        raise bad_request(f"{where}.role: must be one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
    content = require(item.content, f"{where}.content")
    assistant = item.role == "assistant"
    if isinstance(content, str):
        return message_item(item.role, [{"type": "output_text" if assistant else "input_text",
                                         "text": content}])
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if part.type == "input_image" and not assistant:
            if part.file_id is not None or not part.image_url:
                raise bad_request(f"{at}: only images given by image_url (a data URL or an "
                                  "http(s) URL) are supported", f"{at}.image_url")
            parts.append({"type": "input_image", "image_url": part.image_url,
                          "detail": part.detail or "auto"})
        else:
            parts.append(text_part(part, at))
    return message_item(item.role, parts)


def text_part(part: InputPart, at: str) -> dict:
    if part.type not in TEXT_PARTS:
        raise bad_request(f"{at}.type: content of type {part.type!r} is not supported here; this "
                          "server takes input_text, output_text and (in user, system and developer "
                          "messages) input_image", f"{at}.type")
    text = part.refusal if part.type == "refusal" else part.text
    out = {"type": part.type, part.type if part.type == "refusal" else "text": require(text, f"{at}.text")}
    if part.type == "output_text":
        out["annotations"] = []
    return out


def part_text(part: dict) -> str:
    return part.get("text", part.get("refusal", ""))


# ---- conversation -> chat request ----

def chat_messages(items: list[dict], first_new: int, instructions: str | None) -> list[ChatMessage]:
    """Chat messages of a conversation, as chat completions takes them.

    Function calls join the assistant message before them as its tool_calls;
    each call's output is a `tool` message. `first_new` is where this request's
    own items start (for errors naming `input[i]`).
    """
    out: list[ChatMessage] = []
    if instructions:
        out.append(ChatMessage(role="system", content=instructions))
    calls: set[str] = set()
    for k, item in enumerate(items):
        where = f"input[{k - first_new}]" if k >= first_new else "previous_response_id"
        kind = item["type"]
        if kind == "message":
            out.append(ChatMessage(role=item["role"], content=message_content(item)))
        elif kind in ("function_call", "custom_tool_call"):
            calls.add(item["call_id"])
            # A custom tool's text input is shown as the one argument its template tool has.
            arguments = item["arguments"] if kind == "function_call" else \
                json.dumps({CUSTOM_INPUT: item["input"]}, ensure_ascii=False)
            call = ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item["call_id"] not in calls:
                raise bad_request(f"{where}.call_id: no function_call with call_id "
                                  f"{item['call_id']!r} comes before this output", f"{where}.call_id")
            output = item["output"]
            text = output if isinstance(output, str) else "\n".join(part_text(p) for p in output)
            out.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=text))
        # reasoning items: their text is left out of the prompt (chat templates drop earlier
        # turns' thinking too); the reasoning helper may pass it on as reasoning_content.
    return out


def message_content(item: dict) -> str | list[ContentPart]:
    parts = item["content"]
    if all(p["type"] != "input_image" for p in parts):
        return "\n".join(part_text(p) for p in parts)
    return [ContentPart(type="image_url", image_url=ImageURL(url=p["image_url"]))
            if p["type"] == "input_image" else ContentPart(type="text", text=part_text(p))
            for p in parts]


def image_sources(items: list[dict], first_new: int) -> list[tuple[str, str, str]]:
    """(where, url, "image") of every input_image part, in prompt order."""
    out = []
    for k, item in enumerate(items):
        if item["type"] != "message":
            continue
        for j, part in enumerate(item["content"]):
            if part["type"] == "input_image":
                where = f"input[{k - first_new}].content[{j}]" if k >= first_new else "previous_response_id"
                out.append((where, part["image_url"], "image"))
    return out


@dataclass
class ToolKind:
    """What a tool the template shows as a function is, for the output item of its call."""

    type: str  # "function" or "custom"
    namespace: str | None = None


def chat_tools(body: ResponsesRequest) -> tuple[list[Tool] | None, dict[str, ToolKind]]:
    """Responses' tools as chat function tools, and each one's kind by name.

    A namespace's function tools are served as functions of their own names (its
    calls come back as function_call items naming the namespace); a custom tool
    as a function of one string argument, its text input; hosted tools
    (web_search, file_search, code_interpreter, computer_use, mcp, ...) run on
    OpenAI's side, so they are left out of the prompt.
    """
    tools, kinds = [], {}

    def add(t, where: str, namespace: str | None = None) -> None:
        name = require(t.name, f"{where}.name")
        if name in kinds:
            raise bad_request(f"{where}.name: two tools are named {name!r}", f"{where}.name")
        if t.type == "custom":
            parameters = custom_parameters(t, where)
        else:
            check_tool_schema(t.parameters, f"{where}.parameters")
            parameters = t.parameters
        kinds[name] = ToolKind(t.type, namespace)
        tools.append(Tool(type="function", function=FunctionDefinition(
            name=name, description=t.description, parameters=parameters, strict=t.strict)))

    for j, t in enumerate(body.tools or []):
        where = f"tools[{j}]"
        if t.type in ("function", "custom"):
            add(t, where)
        elif t.type == "namespace":
            namespace = require(t.name, f"{where}.name")
            for k, inner in enumerate(t.tools or []):
                if inner.type not in ("function", "custom"):
                    raise bad_request(f"{where}.tools[{k}].type: a namespace holds function and "
                                      f"custom tools, not {inner.type!r}", f"{where}.tools[{k}].type")
                add(inner, f"{where}.tools[{k}]", namespace)
        else:
            ignored_once(f"Responses hosted tool {t.type!r}: left out of the prompt (it runs on "
                         "OpenAI's side)")
    return tools or None, kinds


# The argument a custom tool's text input is shown as, to templates made for function tools.
CUSTOM_INPUT = "input"


def custom_parameters(tool, where: str) -> dict:
    """A custom tool's one string argument, its grammar (if any) in its description."""
    fmt = tool.format or {"type": "text"}
    if fmt.get("type") not in ("text", "grammar"):
        raise bad_request(f"{where}.format.type: must be 'text' or 'grammar'", f"{where}.format.type")
    prop = {"type": "string", "description": "The tool's input: plain text, not JSON."}
    if fmt["type"] == "grammar":
        if fmt.get("syntax") not in ("lark", "regex") or not isinstance(fmt.get("definition"), str):
            raise bad_request(f"{where}.format: a grammar is {{'syntax': 'lark' | 'regex', "
                              "'definition': '...'}", f"{where}.format")
        prop["description"] = f"The tool's input, in this {fmt['syntax']} grammar:\n{fmt['definition']}"
        if fmt["syntax"] == "regex":  # a forced call's grammar holds the input to it (llguidance);
            prop["pattern"] = f"^(?:{fmt['definition']})$"  # JSON Schema's patterns are unanchored
    return {"type": "object", "properties": {CUSTOM_INPUT: prop}, "required": [CUSTOM_INPUT],
            "additionalProperties": False}


def chat_constraints(body: ResponsesRequest) -> tuple[str | dict | None, dict | None]:
    """(tool_choice, response_format) in the chat-completions shape.

    Forcing a call and structured output go through chat completions' own
    check (and, once it decodes them, its constrained decoding) from here.
    """
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") == "custom":  # a custom tool is a function in the template
            choice = {**choice, "type": "function"}
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice: type {choice.get('type')!r} is not supported; use "
                              "'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                              "tool_choice")
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: required field is missing", "tool_choice.name")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format.schema: required field is missing", "text.format.schema")
        spec = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        if fmt.description is not None:
            spec["description"] = fmt.description
        response_format = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        response_format = {"type": fmt.type}
    return choice, response_format


def reasoning_effort(body: ResponsesRequest) -> str | None:
    """`reasoning.effort`, which gpt-oss's chat template reads (as chat completions' reasoning_effort)."""
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and effort not in ("low", "medium", "high"):
        raise bad_request(f"reasoning.effort: must be 'low', 'medium' or 'high', got {effort!r}",
                          "reasoning.effort")
    return effort


def chat_request(body: ResponsesRequest, messages: list[ChatMessage],
                 tools: list[Tool] | None) -> ChatCompletionRequest:
    """The chat-completions request this Responses request amounts to (`tools`: chat_tools')."""
    tool_choice, response_format = chat_constraints(body)
    try:
        return ChatCompletionRequest(
            messages=messages,
            max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, user=body.user,
            top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            tools=tools, tool_choice=tool_choice, response_format=response_format,
            parallel_tool_calls=body.parallel_tool_calls, reasoning_effort=reasoning_effort(body),
        )
    except ValidationError as e:  # ResponsesRequest checked these fields; a 400 all the same
        raise bad_request(f"input: {e.errors()[0].get('msg', 'invalid value')}", "input") from None
