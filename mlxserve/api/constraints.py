"""What a request constrains its output to, as an llguidance grammar.

Every API spells structured output its own way: OpenAI's `response_format`
and forced `tool_choice`, vLLM's `guided_*` fields, Anthropic's `tool_choice`
{type: any | tool} and `output_config.format`. Each becomes one grammar here;
the engine then masks the logits row by row (`engine/grammar.py`).

Forced tool calls are a grammar over the model's own call markup (what its
chat template asks for and mlx-lm's parser reads), with each tool's JSON
schema for the arguments, so a forced call always parses.

JSON is generated compactly (", " and ": ", no free whitespace): with free
whitespace a model can emit newlines forever, and a grammar cannot stop it.
"""

from __future__ import annotations

import asyncio
import json
import threading

from mlxserve.api.errors import bad_request
from mlxserve.api.tool_calls import ToolSyntax

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """The model's llguidance tokenizer (built once, on first use: ~1 s) and matchers from it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._llg = None
        self._lock = threading.Lock()

    def llg_tokenizer(self):
        with self._lock:
            if self._llg is None:
                from mlxserve.engine.grammar import llg_tokenizer

                try:
                    self._llg = llg_tokenizer(self.tokenizer, self.vocab_size)
                except ValueError as e:  # a slow (Python) tokenizer
                    raise bad_request(f"constrained decoding needs a fast tokenizer: {e}") from None
            return self._llg

    async def matchers(self, grammar: str, count: int, param: str) -> list:
        """`count` fresh matchers for one grammar; a grammar that does not compile is a 400."""
        return await asyncio.to_thread(self.new_matchers, grammar, count, param)

    def new_matchers(self, grammar: str, count: int, param: str = "grammar") -> list:
        from llguidance import LLMatcher

        llg = self.llg_tokenizer()
        error = LLMatcher.validate_grammar(grammar, llg)
        if error:
            raise bad_request(f"{param}: cannot be compiled into a grammar: {error.strip()[:500]}", param)
        first = LLMatcher(llg, grammar, log_level=0)
        if first.is_error():
            raise bad_request(f"{param}: {first.get_error()[:500]}", param)
        return [first] + [first.deep_copy() for _ in range(count - 1)]

    def is_special(self, token_id: int) -> bool:
        return self.llg_tokenizer().is_special_token(token_id)


# ---- grammars ----

def json_grammar(schema, param: str, *, strict: bool = True) -> str:
    """JSON matching `schema` (a dict or a JSON string). Not strict: keywords llguidance
    does not implement are ignored instead of refused."""
    from llguidance import LLMatcher

    options = dict(JSON_LAYOUT, lenient=not strict)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        raise bad_request(f"{param}: not a valid JSON schema: {e}", param) from None


def regex_grammar(regex: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str, param: str) -> str:
    """A Lark grammar (llguidance's dialect); GBNF (llama.cpp's, with `::=`) is converted."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(lark)
    except Exception as e:  # noqa: BLE001 - the converter raises its own parse errors
        raise bad_request(f"{param}: cannot read the GBNF grammar: {e}", param) from None
    return LLMatcher.grammar_from_lark(lark)


def choice_grammar(choices, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{param}: must be a non-empty list of non-empty strings", param)
    return lark_grammar("start: " + " | ".join(_literal(c) for c in choices), param)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(grammars: Grammars, syntax: ToolSyntax | None, tools: list[dict], *,
                      several: bool, strict: bool = False) -> str:
    """One call (or several, when `several`) of one of `tools` in the model's markup.

    `tools` are OpenAI function tools. Markup mlx-lm parses as JSON between two
    markers (Hermes/Qwen `<tool_call>`) and models with no markup at all (a bare
    JSON call, which the server reads too) are supported; other formats are refused.
    """
    options = dict(JSON_LAYOUT, lenient=not strict)
    schema = {"anyOf": [_call_schema(t["function"]) for t in tools], "x-guidance": options}
    body = "%json " + json.dumps(schema, ensure_ascii=False)
    fmt = syntax.parser.__module__.rsplit(".", 1)[-1] if syntax else None
    rules = []
    if syntax is None:
        call = body
    elif fmt == "json_tools":
        call = f'{_marker(grammars, syntax.start)} "\\n" {body} "\\n" {_marker(grammars, syntax.end)}'
    elif fmt == "qwen3_coder":
        names = [f"function{i}" for i in range(len(tools))]
        for name, tool in zip(names, tools):
            rules += _xml_function(name, tool["function"], options)
        call = (f'{_marker(grammars, syntax.start)} "\\n" ({" | ".join(names)}) '
                f'{_marker(grammars, syntax.end)}')
    else:
        raise bad_request(f"tool_choice: forcing a tool call needs a grammar of this model's call "
                          f"format ({fmt!r}), which this server does not have yet; use 'auto'",
                          "tool_choice")
    from llguidance import LLMatcher

    start = "call"
    if several:  # bare JSON calls go in one array, which is what the server reads back
        # A newline may close the calls: models write one after a call, and a grammar
        # that read it as the start of another call would force calls until max_tokens.
        start = '"[" call (", " call)* "]"' if syntax is None else 'call ("\\n" call)* "\\n"?'
    return LLMatcher.grammar_from_lark("\n".join([f"start: {start}", f"call: {call}", *rules]) + "\n")


def _xml_function(rule: str, function: dict, options: dict) -> list[str]:
    """Lark rules for one function in Qwen3-Coder's XML call format (Qwen3.5, Qwen3.6):
    `<function=NAME>` then `<parameter=P>` VALUE `</parameter>` per argument, in schema order.

    mlx-lm's parser keeps string values as the raw text and reads other types as JSON:
    strings are free text up to the closing tag (enums and length bounds are kept),
    everything else is JSON of the property's schema.
    """
    params = function.get("parameters") or {}
    required = set(params.get("required") or [])
    parts, rules = [], []
    close = _literal("\n</parameter>\n")
    for j, (name, prop) in enumerate((params.get("properties") or {}).items()):
        value, text, opening = f"{rule}_{j}", _xml_text(prop), _literal(f"<parameter={name}>\n")
        if text:  # free text ends lazily at the closing tag (a greedy lexeme would run past it)
            rules.append(f"{value}[suffix={close}]: {text}")
            part = f"{opening} {value}"
        else:
            rules.append(f"{value}: {_xml_value(prop, options)}")
            part = f"{opening} {value} {close}"
        parts.append(part if name in required else f"({part})?")
    head = _literal(f"<function={function['name']}>\n")
    return [f'{rule}: {head} {" ".join(parts)} "</function>\\n"', *rules]


def _xml_text(prop) -> str | None:
    """The regex of a value the parser keeps as raw text (a string without an enum), else None."""
    if not isinstance(prop, dict) or prop.get("type", "string") != "string" or "enum" in prop:
        return None
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    return f"/(.|\\n){{{low},{'' if high is None else high}}}/"


def _xml_value(prop, options: dict) -> str:
    if isinstance(prop, dict) and isinstance(prop.get("enum"), list) and all(isinstance(v, str) for v in prop["enum"]):
        return " | ".join(_literal(v) for v in prop["enum"])
    return "%json " + json.dumps({**prop, "x-guidance": options}, ensure_ascii=False)


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _marker(grammars: Grammars, text: str) -> str:
    """A markup string in Lark: its token when it is one special token (llguidance matches
    special tokens only by id), else the literal text."""
    ids = grammars.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and grammars.is_special(ids[0]):
        return f"<[{ids[0]}]>"
    return _literal(text)


# ---- request fields -> one grammar ----

async def openai_grammar(state, body, tools: list[dict] | None = None) -> tuple[str, str] | None:
    """(grammar, the field that asked for it) of a chat or completions request, or None.

    `tools` are the tools the template was given (None with tool_choice 'none').
    """
    found = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", json_grammar({"type": "object"}, "response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise bad_request("response_format.json_schema.schema: required for type 'json_schema'",
                              "response_format.json_schema")
        where = "response_format.json_schema.schema"
        found.append((where, json_grammar(spec.schema_, where, strict=bool(spec.strict))))
    so = body.structured_outputs
    for name, value, make in (
        ("guided_json", body.guided_json, lambda v, p: json_grammar(v, p, strict=False)),
        ("guided_regex", body.guided_regex, lambda v, p: regex_grammar(v)),
        ("guided_choice", body.guided_choice, choice_grammar),
        ("guided_grammar", body.guided_grammar, lark_grammar),
        ("structured_outputs.json", so and so.json_, lambda v, p: json_grammar(v, p, strict=False)),
        ("structured_outputs.regex", so and so.regex, lambda v, p: regex_grammar(v)),
        ("structured_outputs.choice", so and so.choice, choice_grammar),
        ("structured_outputs.grammar", so and so.grammar, lark_grammar),
    ):
        if value is not None:
            found.append((name, make(value, name)))
    choice = getattr(body, "tool_choice", None)
    if choice == "required" or isinstance(choice, dict):
        found.append(("tool_choice", await forced_tool_grammar(state, choice, tools,
                                                         several=getattr(body, "parallel_tool_calls", None)
                                                         is not False)))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names}: only one of them can constrain the output", found[1][0])
    return (found[0][1], found[0][0]) if found else None


async def forced_tool_grammar(state, choice, tools: list[dict] | None, *, several: bool) -> str:
    """OpenAI's tool_choice 'required' or {type: function, function: {name}} as a grammar."""
    if not tools:
        raise bad_request("tool_choice: forcing a tool call needs tools", "tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("tool_choice: must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise bad_request(f"tool_choice: no tool named {name!r} among the request's tools", "tool_choice")
        several = False
    await asyncio.to_thread(state.grammars.llg_tokenizer)  # built once (~1-2 s), off the event loop
    return tool_call_grammar(state.grammars, state.tool_syntax, tools, several=several)


def forces_calls(grammar: tuple[str, str] | None) -> bool:
    """Whether the request's grammar is a forced tool call (its output is calls only)."""
    return grammar is not None and grammar[1] == "tool_choice"


async def constrain(state, requests: list, grammar: tuple[str, str] | None) -> None:
    """Give each engine request its own matcher of the grammar (matchers keep per-row state)."""
    if grammar is None:
        return
    from dataclasses import replace

    matchers = await state.grammars.matchers(grammar[0], len(requests), grammar[1])
    for request, matcher in zip(requests, matchers):
        request.params = replace(request.params, grammar=matcher, grammar_text=grammar[0])


async def anthropic_grammar(state, body, tools: list[dict] | None) -> tuple[str, str] | None:
    """Anthropic's tool_choice {type: any | tool} or output_config.format as a grammar, or None."""
    choice = body.tool_choice or {}
    fmt = (body.output_config or {}).get("format")
    forced = choice.get("type") in ("any", "tool")
    if forced and fmt is not None:
        raise bad_request("tool_choice and output_config.format: only one of them can constrain "
                          "the output", "output_config.format")
    if forced:
        several = not choice.get("disable_parallel_tool_use", False)
        if choice["type"] == "tool":
            if not isinstance(choice.get("name"), str):
                raise bad_request("tool_choice.name: required for type 'tool'", "tool_choice.name")
            named = {"type": "function", "function": {"name": choice["name"]}}
            return await forced_tool_grammar(state, named, tools, several=False), "tool_choice"
        return await forced_tool_grammar(state, "required", tools, several=several), "tool_choice"
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise bad_request("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              "output_config.format")
        return json_grammar(fmt["schema"], "output_config.format.schema"), "output_config.format"
    return None
