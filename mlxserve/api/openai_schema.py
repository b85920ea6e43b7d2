"""Request bodies of the OpenAI API (pydantic).

Unknown fields are ignored, as OpenAI does, but the fields read are strictly typed, as
OpenAI's are: "5" is not a number, "yes" not a boolean (pydantic's lax mode would take
both and run a request other than the one the client meant). Fields OpenAI defines that this
server cannot honour are declared anyway, so that `check_supported` can refuse
them with a clear 400 instead of dropping them silently.
Responses are built as plain dicts in `openai_routes` (they are written on
every streamed token, and a dict is the cheapest thing to serialize).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.engine.request import MAX_TOP_LOGPROBS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # strict: ints may still fill floats


class ImageURL(_Body):
    url: str
    detail: str | None = None  # accepted; images are sized by the model's processor


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # some clients send the URL as a plain string
    video_url: ImageURL | str | None = None  # vLLM's convention for video


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` field: the same constraints as its `guided_*` fields."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationFields(_Body):
    """What chat and legacy completions share."""

    # Null means "the default" for every optional field, as in OpenAI's API.
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM and others accept too.
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM's "off") and 0 both disable
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    # vLLM's constrained decoding fields (see api/constraints.py).
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is one call
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # passed to the template
    # Declared only to be refused (see check_supported).
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Declared only to be refused (see check_supported).
    suffix: str | None = None
    best_of: int | None = None
