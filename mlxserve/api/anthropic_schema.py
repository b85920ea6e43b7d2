"""Request bodies of Anthropic's Messages API (pydantic).

Unknown fields are ignored. Content blocks other than text and tool use/results,
server tools and structured output are declared so they can be refused with a
clear 400; `thinking` is checked in `mlxserve.api.thinking`. Current anthropic SDKs no longer send temperature/top_p/top_k
themselves; clients pass them in `extra_body`, and they are honoured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # Strict types, as Anthropic's API: "5" is not a number, "yes" not a boolean.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentBlock(_Body):
    type: str
    text: str | None = None
    # tool_use (assistant turns)
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result (user turns): its content is text or a list of blocks
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    # image (user turns): {"type": "base64", "media_type": ..., "data": ...} or {"type": "url", "url": ...}
    source: dict | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class Tool(_Body):
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused
    name: str
    description: str | None = None
    input_schema: dict | None = None


class Message(_Body):
    # "system": Claude Code puts system content among the messages; taken at its place.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Conversation(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict | None = None  # auto, any, tool (name) and none
    thinking: Any = None  # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}
    output_config: dict | None = None  # its `format`: {type: json_schema, schema}


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict | None = None


class CountTokensRequest(Conversation):
    pass
