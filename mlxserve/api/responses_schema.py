"""Request bodies of the OpenAI Responses API (pydantic).

Unknown fields are ignored, as OpenAI does. Input items are one loose model
(every item type's fields, all optional) rather than a union: `responses_routes`
checks each item by its `type` and names the bad one (`input[3].call_id`),
where a pydantic union would report every branch it tried.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from mlxserve.api.openai_schema import _Body


class InputPart(_Body):
    """A content part: input_text, output_text, input_image (refusal is read as text)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # a data URL or an http(s) URL
    file_id: str | None = None  # declared only to be refused
    detail: str | None = None  # accepted; images are sized by the model's processor


class InputItem(_Body):
    """One input item: a message, a function call, its output, or a reasoning item."""

    type: str | None = None  # a message may leave it out (OpenAI's "easy" input message)
    id: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    status: str | None = None
    # function_call and function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    namespace: str | None = None  # a function_call of a namespace's tool
    input: str | None = None  # custom_tool_call
    # reasoning
    summary: list[dict] | None = None
    encrypted_content: str | None = None


class FunctionTool(_Body):
    """A function tool; a namespace of function tools (`tools`); a custom (freeform) tool, whose
    input is text, optionally in a grammar (`format`); or a hosted tool (web_search, ...).
    Fields of other tool types are kept (the response echoes the tools as sent)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # namespace
    format: dict | None = None  # custom: {type: text} | {type: grammar, syntax: lark | regex, definition}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    # Null means "the default" for every optional field, as in OpenAI's API.
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None  # accepted: the model may make several calls
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict | None = None  # its `effort` goes to the template; reasoning comes back as an item
    prompt_cache_key: str | None = None  # a session's key: its tools keep their first order (api/tool_order.py)
    truncation: Literal["auto", "disabled"] | None = None
    # Extensions that vLLM's Responses API accepts too.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    # Declared only to be refused (see responses_routes.check_supported).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
