"""Offline Python API: `LLM(model).generate(prompts, params)` and `LLM.chat`.

It runs the same AsyncEngine as the server, so a batch of prompts is decoded
with continuous batching.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from dataclasses import dataclass, field

from mlxserve.config import EngineConfig, ModelConfig, split_kwargs
from mlxserve.engine.engine import AsyncEngine
from mlxserve.engine.request import Request, SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    time_to_first_token: float | None = None
    extra: dict = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs


async def collect(stream, prompt_tokens: int) -> CompletionOutput:
    out = CompletionOutput("", [], None, prompt_tokens)
    texts = []
    async for step in stream:
        texts.append(step.new_text)
        out.token_ids += step.new_token_ids
        if step.logprobs is not None:
            out.logprobs = (out.logprobs or []) + step.logprobs
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs
        out.finish_reason = step.finish_reason
        out.cached_tokens = step.cached_tokens
        out.stop_reason = step.stop_reason
        out.time_to_first_token = step.first_token_time
    out.text = "".join(texts)
    return out


_open: "weakref.WeakSet[LLM]" = weakref.WeakSet()


def _stop_at_exit(llm: "LLM") -> None:
    if not _open:
        atexit.unregister(_at_exit)  # once, however many LLMs come and go
        atexit.register(_at_exit)
    _open.add(llm)


def _at_exit() -> None:
    """Before the interpreter's teardown: stop the engines left open (their threads release their
    MLX streams as they end), then release the main thread's (loading made some). MLX leaves each
    thread's streams to that thread (ml-explore/mlx#4327); a script that just ended with an LLM
    still open aborted at exit, code 134."""
    import mlx.core as mx

    for llm in list(_open):
        llm.close()
    if threading.current_thread() is threading.main_thread():
        mx.clear_streams()


class LLM:
    """Load a model and generate from it in-process.

    Keyword arguments are the settings of `mlxserve.config` (ModelConfig and
    EngineConfig), e.g. `LLM("qwen3-0.6b", load_format="dummy", max_num_seqs=8)`.
    """

    def __init__(self, model: str | None = None, **settings):
        from mlxserve.models.load import load, load_draft

        model_cfg, engine_cfg = split_kwargs({"model": model, **settings}, ModelConfig, EngineConfig)
        self.loaded = load(
            model_cfg.model,
            load_format=model_cfg.load_format,
            dtype=model_cfg.dtype,
            quantize_bits=model_cfg.quantize,
            seed=model_cfg.dummy_seed,
        )
        if model_cfg.draft_model:
            load_draft(self.loaded, model_cfg.draft_model, load_format=model_cfg.load_format,
                       dtype=model_cfg.dtype, quantize_bits=model_cfg.quantize, seed=model_cfg.dummy_seed)
        self.tokenizer = self.loaded.tokenizer
        self.engine = AsyncEngine(self.loaded, engine_cfg).start()
        _stop_at_exit(self)

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, prompts: list[list[int]], params, images=None) -> list[CompletionOutput]:
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("params: give one SamplingParams, or one per prompt")
        images = images or [[] for _ in prompts]

        async def run_all():
            streams = [
                self.engine.submit(Request(list(ids), p, images=im)) for ids, p, im in zip(prompts, params, images)
            ]
            return await asyncio.gather(*(collect(s, len(ids)) for s, ids in zip(streams, prompts)))

        return asyncio.run(run_all())

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Complete each prompt (a string or a list of token ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [
            p if not isinstance(p, str) else self.tokenizer.encode(p) for p in prompts
        ]
        return self._run(token_lists, params)

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, *,
             tools=None, chat_template_kwargs=None) -> list[CompletionOutput]:
        """Answer one conversation (a list of messages) or several.

        With a vision-language model, content may be a list of parts:
        {"type": "text", "text": ...}, {"type": "image", "image": <PIL image>},
        {"type": "image_url", "image_url": {"url": ...}}, {"type": "video", "video": [frames]}
        or {"type": "video_url", "video_url": {"url": ...}}.
        """
        from mlxserve.multimodal.prompt import chat_prompt

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            chat_prompt(self.loaded, c, is_cached=self.engine.image_is_cached, tools=tools,
                        chat_template_kwargs=chat_template_kwargs)
            for c in conversations
        ]
        return self._run([ids for ids, _ in prompts], params, [images for _, images in prompts])
