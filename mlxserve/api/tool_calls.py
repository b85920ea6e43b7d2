"""Tool calls in generated text: found with the tokenizer's own markup and parser.

mlx-lm's TokenizerWrapper infers from the chat template how the model writes a
call (for Hermes/Qwen templates: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`)
and which parser reads it; using that keeps every template mlx-lm knows working
here. What cannot be parsed stays in the answer as plain text: a client gets
the model's words rather than an error, and can see why no call came back.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Callable

from mlxserve.api.errors import bad_request


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolSyntax:
    start: str
    end: str
    parser: Callable  # parser(text between the markers, tools) -> dict or list of dicts


def tool_syntax(tokenizer) -> ToolSyntax | None:
    """The model's tool-call markup, or None if mlx-lm knows none for its template."""
    if not getattr(tokenizer, "has_tool_calling", False) or not tokenizer.tool_call_start:
        return None
    return ToolSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser)


def _as_call(item) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    # Llama 3's templates ask for "parameters" where Hermes and Qwen say "arguments".
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return ToolCall(item["name"], args) if isinstance(args, dict) else None


def parse_calls(syntax: ToolSyntax, inner: str, tools) -> list[ToolCall] | None:
    """The calls in one block of markup, or None if it is not a well-formed call."""
    try:
        parsed = syntax.parser(inner, tools)
    except Exception:  # noqa: BLE001 - each parser raises its own errors on bad model output
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [_as_call(item) for item in items]
    return calls if calls and all(c and offered(c, tools) for c in calls) else None


def offered(call: ToolCall, tools) -> bool:
    """Whether the call names a tool the request offered, with arguments its schema accepts.

    A call a client cannot run (an unknown tool, arguments its code would reject)
    stays text: the client sees what the model wrote instead of a broken call.
    """
    function = next((t.get("function", {}) for t in tools or []
                     if t.get("function", {}).get("name") == call.name), None)
    if function is None:
        return False
    schema = function.get("parameters")
    if not isinstance(schema, dict):
        return True
    import jsonschema

    try:
        jsonschema.validate(call.arguments, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        pass  # the client's schema is broken; it cannot be held against the model
    return True


def check_tool_schema(schema, param: str) -> None:
    """A 400 for a tool schema that is not a JSON schema (as OpenAI's and Anthropic's APIs refuse
    one): the template would show the model a tool nobody can call, and a forced call would
    fail later, in grammar compilation, with a less clear message."""
    if schema is None:
        return
    why = _schema_error(json.dumps(schema, sort_keys=True))
    if why is not None:
        raise bad_request(f"{param}: not a valid JSON schema: {why}", param)


@functools.lru_cache(maxsize=1024)  # agents send the same tools with every turn; a check takes ~2 ms
def _schema_error(text: str) -> str | None:
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        return f"{e.message}" + (f" (at {where.lstrip('.')})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return None


class ToolCallStream:
    """Splits generated text, fed piece by piece, into plain text and tool calls.

    Text that could be the start of a call's markup is held back until it is
    known not to be, so markup never reaches the client as content. Whitespace
    is held too: it is dropped when a call follows, so the newline a model
    writes before `<tool_call>` does not become the whole content of a reply.
    An answer that opens with "{" or "[" (bare or in a ```json fence) is held
    whole, as it may be a call in bare JSON (`bare_calls`); answers in JSON
    then stream only at their end.
    """

    def __init__(self, syntax: ToolSyntax | None, tools, forced: bool = False):
        self.syntax = syntax
        self.tools = tools
        # A forced call (a grammar of calls only): what is not a call is the unfinished end of
        # one cut by max_tokens, or the whitespace between calls; neither is an answer.
        self.forced = forced
        self.buffer = ""
        self.in_call = False
        self.saw_call = False
        self.gap = ""  # whitespace cut before the current markup, restored if it is no call
        # None until the answer's first character: "{" or "[" may be a call without markup.
        self.bare: bool | None = None

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buffer += text
        if self.bare is None:
            self.bare = _opens_json(self.buffer)
        if self.bare is not False:
            return []  # held until the answer is whole (see finish)
        out: list[str | ToolCall] = []
        while self._step(out):
            pass
        return self._calls_only(out) if self.forced else out

    def _calls_only(self, pieces: list) -> list[ToolCall]:
        return [p for p in pieces if isinstance(p, ToolCall)]

    def finish(self) -> list[str | ToolCall]:
        """What is left when generation ends: an unfinished call is plain text (none if forced)."""
        rest = self._finish()
        return self._calls_only(rest) if self.forced else rest

    def _finish(self) -> list[str | ToolCall]:
        if self.bare is not False:
            self.bare = False
            calls = bare_calls(self.buffer, self.tools)
            if calls:
                self.buffer, self.saw_call = "", True
                return calls
            return self.feed("") + self._finish()
        rest = self.gap + self.syntax.start + self.buffer if self.in_call else self.buffer
        self.buffer, self.in_call, self.gap = "", False, ""
        if self.saw_call and not rest.strip():
            return []
        return [rest] if rest else []

    def _step(self, out: list) -> bool:
        """Consumes what the buffer settles; True if it should be scanned again."""
        if self.syntax is None:  # no markup: only a bare JSON answer can be a call
            if self.buffer:
                out.append(self.buffer)
                self.buffer = ""
            return False
        start, end = self.syntax.start, self.syntax.end
        if self.in_call:
            at = self.buffer.find(end) if end else -1
            if at < 0:
                return False  # the call is not complete yet (or ends with the text)
            inner, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(end):], False
            calls = parse_calls(self.syntax, inner, self.tools)
            if calls is None:
                out.append(self.gap + start + inner + end)
            else:
                self.saw_call = True
                out.extend(calls)
            return True
        at = self.buffer.find(start)
        if at >= 0:
            before, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(start):], True
            text = before.rstrip()
            self.gap = before[len(text):]
            if text:
                out.append(text)
            return True
        keep = _held_back(self.buffer, start)
        if keep < len(self.buffer):
            out.append(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
        return False


def _opens_json(text: str) -> bool | None:
    """Whether an answer opens with JSON, bare or in a ```json fence; None while undecided."""
    text = text.lstrip()
    if not text or "```".startswith(text):
        return None
    if not text.startswith("```"):
        return text[0] in "{["
    if "\n" not in text:
        return None
    label, body = text[3:].split("\n", 1)
    if label.strip() not in ("", "json"):
        return False
    body = body.lstrip()
    return body[0] in "{[" if body else None


def _unfenced(text: str) -> str:
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and "\n" in text:
        return text[:-3].split("\n", 1)[1]
    return text


def bare_calls(text: str, tools) -> list[ToolCall] | None:
    """Calls written as bare JSON, without the template's markup, or None.

    Small models often drop the markup (Qwen2.5-Coder-0.5B answers a tool
    request with just `{"name": ..., "arguments": ...}`, or that JSON in a
    ```json fence). Only a whole answer that is such JSON, naming tools the
    request offered, counts, so ordinary JSON answers stay text.
    """
    try:
        parsed = json.loads(_unfenced(text))
    except json.JSONDecodeError:
        return None
    calls = [_as_call(item) for item in (parsed if isinstance(parsed, list) else [parsed])]
    if not calls or not all(c and offered(c, tools) for c in calls):
        return None
    return calls


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters to hold: whitespace, then any start of the marker."""
    partial = 0
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            partial = n
            break
    body = text[: len(text) - partial]
    return partial + len(body) - len(body.rstrip())


def split_text(syntax: ToolSyntax | None, text: str, tools, forced: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole answer as (text outside the calls, calls); the text as is if no call parsed,
    unless the call was forced: then it is a call cut by max_tokens, markup the stream drops too."""
    stream = ToolCallStream(syntax, tools, forced)
    pieces = stream.feed(text) + stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    if not calls:
        return ("" if forced else text), []
    return "".join(p for p in pieces if isinstance(p, str)).strip(), calls


def call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def openai_tool_call(call: ToolCall, index: int | None = None) -> dict:
    """OpenAI's tool_calls entry; `index` is set in streamed deltas only."""
    out = {"id": call_id("call_"), "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def anthropic_tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call_id("toolu_"), "name": call.name, "input": call.arguments}
