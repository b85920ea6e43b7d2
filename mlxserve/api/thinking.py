"""Anthropic's extended thinking: the `thinking` request field, its budget, and thinking blocks.

`thinking: {"type": "enabled", "budget_tokens": N}` turns the template's thinking
on and caps the reasoning at N tokens. The cap is kept with two engine requests
(`BudgetedRun`): the first generates the reasoning and stops at its end marker or
after N tokens; if it was cut, the end marker is appended as if the model had
written it, and a second request on prompt + reasoning + marker writes the answer.
Its prompt extends the first one token for token, so the prefix cache serves the
shared part and only the marker is new to prefill.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace

from mlxserve.api.errors import bad_request
from mlxserve.api.generate import ModelState, Run
from mlxserve.engine.request import Request as EngineRequest

# Anthropic's floor for budget_tokens.
MIN_BUDGET_TOKENS = 1024
THINKING_TYPES = ("enabled", "disabled", "adaptive")


def check_thinking(thinking, max_tokens: int | None = None) -> None:
    """400s, in Anthropic's terms, for a `thinking` field it would refuse."""
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_TYPES:
        raise bad_request("thinking.type: must be one of 'enabled', 'disabled' or 'adaptive'",
                          "thinking.type")
    if thinking["type"] != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise bad_request("thinking.enabled.budget_tokens: Field required (an integer)",
                          "thinking.budget_tokens")
    if budget < MIN_BUDGET_TOKENS:
        raise bad_request(f"thinking.enabled.budget_tokens: Input should be greater than or equal "
                          f"to {MIN_BUDGET_TOKENS}", "thinking.budget_tokens")
    if max_tokens is not None and max_tokens <= budget:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`",
                          "max_tokens")


def template_kwargs(thinking) -> dict | None:
    """The chat template's switch: enabled and adaptive turn thinking on, disabled off."""
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_TYPES:
        return None
    return {"enable_thinking": thinking["type"] != "disabled"}


def budget(thinking) -> int | None:
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return thinking.get("budget_tokens")
    return None


def signature(thinking: str) -> str:
    """An opaque signature of a thinking block (Anthropic's clients pass it back unread)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class BudgetedRun:
    """A Run (for `collect` and the stream) whose reasoning stops after `budget` tokens.

    The outputs of both engine requests come as one request's: completion
    tokens count on, and only the last output is finished.
    """

    def __init__(self, state: ModelState, request: EngineRequest, budget_tokens: int, rename: dict):
        self.state = state
        self.syntax = state.reasoning
        self.requests = [request]
        self.rename = rename
        strings, ids = self.syntax.end_stop
        first = replace(request.params, max_tokens=min(budget_tokens, request.params.max_tokens),
                        stop=strings, stop_token_ids=ids)
        self.runs = [Run(state, [replace(request, params=first)], rename)]
        self.closed = False

    async def __aiter__(self):
        request = self.requests[0]
        tracker = self.syntax.splitter(request.prompt_token_ids)
        ids, last = [], None
        async for _, out in self.runs[0]:
            tracker.feed(out.new_text, out.new_token_ids)
            ids += out.new_token_ids
            if not out.finished:
                yield 0, out
            last = out
        strings, end_ids = self.syntax.end_stop
        ended = last.finish_reason == "stop" and last.stop_reason in (*strings, *end_ids)
        left = request.params.max_tokens - last.completion_tokens
        if not (ended or last.finish_reason == "length") or left <= 0 or self.closed:
            yield 0, last  # the model ended (EOS, a stop sequence) or max_tokens is spent
            return
        # The engine cut a stop string out of the text; a stop token's marker comes from its id.
        bridge = self.syntax.end if ended and isinstance(last.stop_reason, str) else ""
        prompt = request.prompt_token_ids + ids
        if not ended and tracker.in_reasoning:  # cut at the budget: the reasoning ends here
            bridge = self.syntax.close_text
            prompt = prompt + self.state.tokenizer.encode(bridge, add_special_tokens=False)
        yield 0, replace(last, new_text=last.new_text + bridge, finish_reason=None, stop_reason=None)
        answer = replace(request, prompt_token_ids=prompt, request_id=f"{request.request_id}-answer",
                         params=replace(request.params, max_tokens=left))
        self.runs.append(Run(self.state, [answer], self.rename))
        async for _, out in self.runs[1]:
            yield 0, replace(out, prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens,
                             completion_tokens=last.completion_tokens + out.completion_tokens)

    def close(self) -> None:
        self.closed = True
        for run in self.runs:
            run.close()
