"""OpenAI API: /v1/chat/completions, /v1/completions (/v1/models: api/models.py)."""

from __future__ import annotations

import json
import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api import images
from mlxserve.api.constraints import constrain, forces_calls, openai_grammar
from mlxserve.api.errors import APIError, bad_request, error_body, from_engine
from mlxserve.api.generate import Choice, ClientGone, ModelState, Run, ServerState, collect, usage, visible_logprobs
from mlxserve.api.models import served
from mlxserve.api.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    ImageURL,
)
from mlxserve.api.reasoning import ReasoningSplitter, ReasoningSyntax
from mlxserve.api.sse import DONE, EventTemplate, SSEResponse, event
from mlxserve.api.tokens import clamp
from mlxserve.api.tool_calls import (
    ToolCall,
    ToolCallStream,
    ToolSyntax,
    check_tool_schema,
    openai_tool_call,
    split_text,
)
from mlxserve.engine.request import Request as EngineRequest
from mlxserve.engine.request import SamplingParams

log = logging.getLogger("mlxserve.api")
router = APIRouter()

# nginx's code for "client closed the request": the non-streamed answer had no one to go to.
CLIENT_CLOSED = 499


def state_of(request: Request) -> ServerState:
    return request.app.state.mlx


# ---- request -> engine requests ----

def sampling_params(body: GenerationFields, *, max_tokens, logprobs: bool, top_logprobs: int,
                    seed: int | None, vocab_size: int, rename: dict,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        if vocab_size and not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                              "logit_bias")
        bias[token] = value
    top_k = body.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=body.min_p or 0.0,
            seed=None if seed is None else seed % 2**64,  # the PRNG takes unsigned 64-bit seeds
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise from_engine(e, rename) from None


def engine_requests(state: ModelState, body: GenerationFields, prompts: list[list[int]], *,
                    api_id: str, max_tokens, logprobs: bool, top_logprobs: int, rename: dict,
                    arrival: float, images=(), prompt_logprobs: int | None = None) -> list[EngineRequest]:
    """n requests per prompt, prompt-major, so run index == choice index.

    With a seed, choice j samples with seed + j: n choices with one seed would
    otherwise be n copies of the same text. `arrival` is when the handler started,
    so time to first token includes templating and tokenizing.
    """
    n = body.n or 1
    vocab = state.loaded.vocab_size
    params = [
        sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs,
                        seed=None if body.seed is None else body.seed + j, vocab_size=vocab,
                        rename=rename, prompt_logprobs=prompt_logprobs)
        for j in range(n)
    ]
    if body.user:
        log.debug("%s: user %r", api_id, body.user)  # accepted for clients' abuse tracing
    return [
        EngineRequest(list(ids), params[j], request_id=f"{api_id}-{i * n + j}", arrival_time=arrival,
                      images=list(images))
        for i, ids in enumerate(prompts)
        for j in range(n)
    ]


def check_stream_options(body: GenerationFields) -> bool:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


# ---- chat ----

def check_chat_supported(body: ChatCompletionRequest) -> None:
    """Refuse what this server accepts in the schema but cannot honour."""
    if body.functions is not None or body.function_call is not None:
        raise bad_request("functions: the deprecated functions/function_call fields are not "
                          "supported; pass tools instead", "functions")
    if body.audio is not None or (body.modalities and body.modalities != ["text"]):
        raise bad_request("modalities: this server generates text only", "modalities")
    if body.prediction is not None:
        raise bad_request("prediction: predicted outputs are not supported", "prediction")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    for j, tool in enumerate(body.tools or []):
        check_tool_schema(tool.function.parameters, f"tools[{j}].function.parameters")


def message_text(content, where: str, placeholders=None) -> str:
    """A message's content as one string; image parts become their placeholder text."""
    if isinstance(content, str):
        return content
    return images.content_text(content, placeholders, media_types=("image_url", "video_url"),
                               where=lambda j: f"{where}[{j}]")


def image_sources(messages: list[ChatMessage]) -> list[tuple[str, str, str]]:
    """(where, url, "image" | "video") of every image_url and video_url part, in prompt order."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type in ("image_url", "video_url"):
                    where = f"messages[{i}].content[{j}]"
                    ref = getattr(part, part.type)
                    url = ref.url if isinstance(ref, ImageURL) else ref
                    if not url:
                        raise bad_request(f"{where}: {part.type}.url is required", f"{where}.{part.type}")
                    out.append((where, url, part.type.removesuffix("_url")))
    return out


def template_message(m: ChatMessage, i: int, placeholders=None) -> dict:
    """An OpenAI message as chat templates expect it (Hugging Face conventions)."""
    where = f"messages[{i}].content"
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad_request(f"{where}: required for role {m.role!r}", where)
    out = {
        "role": "system" if m.role == "developer" else m.role,  # templates know no 'developer'
        "content": "" if m.content is None else message_text(m.content, where, placeholders),
    }
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            args = call.function.arguments
            if isinstance(args, str):
                # OpenAI sends arguments as a JSON string; templates print them with
                # `tojson`, which would quote the string a second time.
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise bad_request(f"messages[{i}].tool_calls: arguments of "
                                      f"{call.function.name!r} are not valid JSON",
                                      f"messages[{i}].tool_calls") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def chat_logprobs(state: ModelState, lps) -> list[dict]:
    tb = state.token_bytes

    def entry(token_id, logprob):
        raw = tb.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": clamp(logprob),
                "bytes": list(raw)}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    arrival = time.perf_counter()
    state = await served(request, body.model)
    check_chat_supported(body)
    include_usage = check_stream_options(body)
    sources = image_sources(body.messages)
    prepared = await images.prepare(state, sources, type_name=sources[0][2] + "_url" if sources else "")
    placeholders = images.placeholders(state, prepared)
    messages = [template_message(m, i, placeholders) for i, m in enumerate(body.messages)]
    tools = None
    if body.tools and body.tool_choice != "none":  # 'none': the model is not told of tools
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # gpt-oss's templates read it
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    prompt = await state.render(messages, tools=tools, chat_template_kwargs=template_kwargs)
    grammar = await openai_grammar(state, body, tools)
    prompt_images = images.prompt_images(state, prompt, prepared, "messages")
    use_mct = body.max_completion_tokens is not None
    rename = {"prompt": "messages", "max_tokens": "max_completion_tokens" if use_mct else "max_tokens"}
    api_id = f"chatcmpl-{uuid.uuid4().hex}"
    requests = engine_requests(
        state, body, [prompt], api_id=api_id,
        max_tokens=body.max_completion_tokens if use_mct else body.max_tokens,
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0, rename=rename,
        arrival=arrival, images=prompt_images)
    await constrain(state, requests, grammar)
    run = Run(state, requests, rename)
    n = body.n or 1
    head = {"id": api_id, "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": state.loaded.fingerprint[:16]}
    calls = ToolCalls(state.tool_syntax, tools, state.reasoning, prompt, forced=forces_calls(grammar))
    if body.stream:
        return SSEResponse(chat_events(state, run, head, n, bool(body.logprobs), include_usage, calls),
                           run)
    try:
        choices = await collect(run, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                **calls.message(c),
                "logprobs": {"content": chat_logprobs(state, c.logprobs), "refusal": None}
                if body.logprobs else None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(choices, n),
    })


class ToolCalls:
    """Turns a choice's text into OpenAI's message, with tool_calls when the model made calls.

    Off (text stays content) when the request offered no tools. A model whose
    template has no call markup mlx-lm knows can still answer with a bare JSON call.
    A reasoning model's reasoning is split off first (`reasoning_content`), and
    calls are read from the answer only.
    """

    def __init__(self, syntax: ToolSyntax | None, tools, reasoning: ReasoningSyntax | None = None, prompt=(),
                 forced: bool = False):
        self.tools = tools
        self.forced = forced  # a grammar of calls: text beside them is a cut-off call's end
        self.syntax = syntax if tools else None  # the model's (ModelState.tool_syntax)
        self.reasoning = reasoning
        self.prompt = prompt

    def splitter(self) -> ReasoningSplitter | None:
        return self.reasoning.splitter(self.prompt) if self.reasoning else None

    def message(self, choice: Choice) -> dict:
        """The choice's `message` and `finish_reason`."""
        reasoning, content = None, choice.text
        if self.reasoning:
            reasoning, content = self.splitter().split(choice.texts, choice.token_ids)
        text, calls = split_text(self.syntax, content, self.tools, self.forced) if self.tools else (content, [])
        message = {"role": "assistant", "content": text, "refusal": None}
        if self.reasoning:  # vLLM's and DeepSeek's name, and vLLM's newer one
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if not calls:
            return {"message": message, "finish_reason": choice.finish_reason}
        message["content"] = text or None  # OpenAI: null content beside tool calls
        message["tool_calls"] = [openai_tool_call(c) for c in calls]
        return {"message": message, "finish_reason": finish_with_calls(choice.finish_reason)}

    def stream(self) -> ToolCallStream | None:
        return ToolCallStream(self.syntax, self.tools, self.forced) if self.tools else None


def finish_with_calls(finish_reason: str | None) -> str | None:
    # A cut-off answer ("length") still says so: its calls were complete, the answer was not.
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ChatDeltas:
    """One streamed choice's deltas: content as it comes, each tool call once it is parsed."""

    def __init__(self, stream: ToolCallStream | None):
        self.stream = stream
        self.calls = 0

    def __call__(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool_calls deltas to send now)."""
        if self.stream is None:
            return text, []
        pieces = self.stream.feed(text) + (self.stream.finish() if finished else [])
        deltas = []
        for p in pieces:
            if isinstance(p, ToolCall):
                deltas.append(openai_tool_call(p, index=self.calls))
                self.calls += 1
        return "".join(p for p in pieces if isinstance(p, str)), deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return finish_with_calls(finish_reason) if self.calls else finish_reason


def stream_error(exc: Exception) -> bytes:
    """An error after the status line was sent travels as an SSE event, in OpenAI's shape."""
    if not isinstance(exc, APIError):
        log.exception("stream failed")
        exc = APIError(500, "Internal server error.")
    return event(error_body(exc, anthropic=False))


async def openai_stream(run: Run, base: dict, choices: list[Choice], n: int, include_usage: bool, chunks):
    """What every OpenAI stream shares around its `chunks`: the usage chunk last,
    an error event instead of a broken stream, the run closed, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
        if include_usage:
            yield event({**base, "choices": [], "usage": usage(choices, n)})
    except Exception as e:  # noqa: BLE001 - a bug here must still end the stream properly
        yield stream_error(e)
    finally:
        run.close()
        await chunks.aclose()
    yield DONE


def chat_events(state: ModelState, run: Run, head: dict, n: int, logprobs: bool,
                include_usage: bool, calls: ToolCalls):
    base = {**head, "object": "chat.completion.chunk"}
    if include_usage:
        base["usage"] = None  # OpenAI: null on every chunk but the last

    def chunk(index, delta, finish=None, lps=None):
        return event({**base, "choices": [{"index": index, "delta": delta, "logprobs": lps,
                                           "finish_reason": finish}]})

    # The chunk of most tokens (content only), as chunk(i, {"content": text}) writes it.
    content = [EventTemplate({**base, "choices": [{"index": i, "delta": {"content": EventTemplate.SLOT},
                                                   "logprobs": None, "finish_reason": None}]})
               for i in range(n)]
    choices = [Choice() for _ in range(n)]
    deltas = [ChatDeltas(calls.stream()) for _ in range(n)]
    splits = [calls.splitter() for _ in range(n)]

    async def chunks():
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in run:
            choices[i].add(out)
            reasoning, text = ("", out.new_text) if splits[i] is None else \
                splits[i].feed(out.new_text, out.new_token_ids, out.finished)
            if reasoning:
                yield chunk(i, {"reasoning_content": reasoning, "reasoning": reasoning})
            text, tool_calls = deltas[i](text, out.finished)
            lps = None
            if logprobs:
                lps = {"content": chat_logprobs(state, visible_logprobs(out)), "refusal": None}
            if lps is None:
                if text:
                    yield content[i](text)
            elif text or lps["content"]:
                yield chunk(i, {"content": text}, lps=lps)
            for call in tool_calls:
                yield chunk(i, {"tool_calls": [call]})
            if out.finished:
                yield chunk(i, {}, finish=deltas[i].finish_reason(out.finish_reason))

    return openai_stream(run, base, choices, n, include_usage, chunks())


# ---- legacy completions ----

def check_completion_supported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix: insertion (fill-in-the-middle) is not supported; put the text "
                          "in the prompt instead", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of: ranking several samples by likelihood is not supported; "
                          "use n to get several completions", "best_of")


async def completion_prompts(state: ModelState, prompt) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, strings, token ids or lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    vocab = state.loaded.vocab_size
    for p in prompt:
        if isinstance(p, str):
            out.append((await state.encode(p), p))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None) if vocab else None
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        try:
            out.append((list(p), state.tokenizer.decode(list(p))))
        except Exception:  # noqa: BLE001 - ids the model has but the tokenizer does not (padding rows)
            raise bad_request("prompt: the tokenizer cannot decode these token ids", "prompt") from None
    return out


class LegacyLogprobs:
    """The completions API's logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, state: ModelState, offset: int):
        self.tb = state.token_bytes
        self.offset = offset  # characters before the next token in the choice's text

    def __call__(self, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            token = self.tb.text(lp.token_id)
            top = {self.tb.text(t): clamp(v) for t, v in lp.top}
            top.setdefault(token, clamp(lp.logprob))  # OpenAI: the sampled token is always there
            out["tokens"].append(token)
            out["token_logprobs"].append(clamp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def prompt(self, first_token: int, lps) -> dict:
        """The echoed prompt's entries: the first token has no logprob (null, as OpenAI's)."""
        token = self.tb.text(first_token)
        head = {"tokens": [token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(token)
        rest = self(lps[1:])
        return {k: head[k] + rest[k] for k in head}


def echo_logprobs(state: ModelState, prompt_ids: list[int], echo: str, prompt_lps, generated) -> dict:
    """echo with logprobs: the prompt's entries, then the generated tokens' (from len(echo) on).

    The generated part keeps the stop token that ended the choice, as vLLM does: scorers
    (lm-eval) count on one entry per prompt token plus one per generated token.
    """
    head = LegacyLogprobs(state, 0).prompt(prompt_ids[0], prompt_lps or [None])
    tail = LegacyLogprobs(state, len(echo))(generated)
    return {k: head[k] + tail[k] for k in head}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    state = await served(request, body.model)
    check_completion_supported(body)
    include_usage = check_stream_options(body)
    prompts = await completion_prompts(state, body.prompt)
    n = body.n or 1
    rename = {"top_logprobs": "logprobs", "prompt_logprobs": "logprobs"}
    api_id = f"cmpl-{uuid.uuid4().hex}"
    # echo with logprobs reports the prompt's logprobs too; max_tokens 0 only runs the prompt.
    scored = bool(body.echo) and body.logprobs is not None
    prompt_logprobs = body.logprobs if scored else (0 if body.max_tokens == 0 else None)
    requests = engine_requests(
        state, body, [ids for ids, _ in prompts], api_id=api_id, max_tokens=body.max_tokens,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0, rename=rename,
        arrival=arrival, prompt_logprobs=prompt_logprobs)
    await constrain(state, requests, await openai_grammar(state, body))
    run = Run(state, requests, rename)
    # Text before each choice's completion: the prompt with echo, else nothing.
    echoes = [prompts[i // n][1] if body.echo else "" for i in range(len(requests))]
    head = {"id": api_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": state.loaded.fingerprint[:16]}
    if body.stream:
        return SSEResponse(completion_events(state, run, head, n, echoes, body.logprobs is not None,
                                             include_usage, [p[0] for p in prompts] if scored else None),
                           run)
    try:
        choices = await collect(run, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)

    def logprobs_of(i: int, c: Choice) -> dict | None:
        if body.logprobs is None:
            return None
        if scored:
            return echo_logprobs(state, prompts[i // n][0], echoes[i], c.prompt_logprobs, c.all_logprobs)
        return LegacyLogprobs(state, len(echoes[i]))(c.logprobs)

    return JSONResponse({
        **head,
        "choices": [
            {
                "index": i,
                "text": echoes[i] + c.text,
                "logprobs": logprobs_of(i, c),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(choices, n),
    })


def completion_events(state: ModelState, run: Run, head: dict, n: int, echoes: list[str],
                      logprobs: bool, include_usage: bool, scored_prompts: list[list[int]] | None = None):
    """scored_prompts (echo with logprobs): each choice's echo waits for its prompt's logprobs."""
    base = dict(head)
    if include_usage:
        base["usage"] = None

    def chunk(index, text, finish=None, lps=None):
        return event({**base, "choices": [{"index": index, "text": text, "logprobs": lps,
                                           "finish_reason": finish}]})

    # The chunk of most tokens (text only), as chunk(i, text) writes it.
    texts = [EventTemplate({**base, "choices": [{"index": i, "text": EventTemplate.SLOT, "logprobs": None,
                                                 "finish_reason": None}]})
             for i in range(len(echoes))]
    choices = [Choice() for _ in echoes]
    legacy = [LegacyLogprobs(state, len(e)) for e in echoes]

    async def chunks():
        for i, echo in enumerate(echoes):
            if echo and not scored_prompts:
                yield chunk(i, echo)
        async for i, out in run:
            choices[i].add(out)
            if scored_prompts and out.prompt_logprobs is not None:
                ids = scored_prompts[i // n]
                yield chunk(i, echoes[i], lps=LegacyLogprobs(state, 0).prompt(ids[0], out.prompt_logprobs))
            lps = None
            if logprobs:  # with echo, the stop token keeps its entry (see echo_logprobs)
                lps = legacy[i]((out.logprobs or []) if scored_prompts else visible_logprobs(out))
            if lps is None and not out.finished:
                if out.new_text:
                    yield texts[i](out.new_text)
            elif out.new_text or (lps and lps["tokens"]) or out.finished:
                yield chunk(i, out.new_text, finish=out.finish_reason, lps=lps)

    return openai_stream(run, base, choices, n, include_usage, chunks())
