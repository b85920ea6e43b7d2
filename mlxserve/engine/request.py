"""What a caller hands the engine, and what it gets back.

Plain Python only: the API layer builds these without touching MLX.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from mlxserve.multimodal.prompt import PromptImage

MAX_TOP_LOGPROBS = 20
# Stop strings are matched on the event loop against every token's text, at a cost that grows
# with their number and length (text that may start one is held back up to the longest): these
# bounds keep that small. OpenAI takes 4 strings; clients that send more send a handful.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Every field is honoured per request, also inside a batch whose other
    requests use other settings.
    """

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_context_size: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    # An llguidance LLMatcher (plain Python, one per request: it keeps the row's parser
    # state): only tokens its grammar accepts are sampled. See engine/grammar.py.
    grammar: Any = None
    # Its grammar (llguidance's text), from which an engine in another process makes its own matcher.
    grammar_text: str | None = None
    # Logprobs of the prompt's tokens, with this many best per position (engine/scoring.py).
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.validate()

    def validate(self):
        def bad(name, why):
            raise ValueError(f"{name}: {why}")

        def finite(name):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                bad(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                bad(name, f"must be finite, got {value!r}")
            return value

        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        # max_tokens 0: score the prompt only (nothing else to do without generating).
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < least
        ):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if finite("temperature") < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < finite("top_p") <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0 <= finite("min_p") < 1:
            bad("min_p", f"must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= finite(name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if finite("repetition_penalty") <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.penalty_context_size, int) or self.penalty_context_size < 1:
            bad("penalty_context_size", "must be a positive integer")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                bad("logit_bias", f"bias for token {token} must be in [-100, 100], got {bias}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(s, str) for s in self.stop):
            bad("stop", "must be strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


_request_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_request_ids)}-{time.time_ns() % 10**9}"


@dataclass
class Request:
    """A tokenized generation request."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    arrival_time: float = field(default_factory=time.perf_counter)
    images: list[PromptImage] = field(default_factory=list)  # in prompt order

    def block_extra_keys(self, block_size: int) -> list | None:
        """Per prefix-cache block, the images whose tokens fall in it: ((hash, offset), ...).

        The offset is where the image starts relative to the block, so an
        image's blocks hit only with the same image at the same place.
        """
        if not self.images:
            return None
        n_blocks = -(-len(self.prompt_token_ids) // block_size)
        keys = [[] for _ in range(n_blocks)]
        for im in self.images:
            first, last = im.start // block_size, (im.start + im.num_tokens - 1) // block_size
            for b in range(first, min(last, n_blocks - 1) + 1):
                keys[b].append((im.content_hash, im.start - b * block_size))
        if any(im.whole_prompt for im in self.images):
            # A prompt attended both ways as a whole (PaliGemma's): each token's KV depends on the
            # tokens after it, so a block serves only this same prompt.
            # Keyed as media are, (hash, where it starts relative to the block): the prompt, from 0.
            whole = "prompt:" + hashlib.sha256(array.array("q", self.prompt_token_ids).tobytes()).hexdigest()
            for b, k in enumerate(keys):
                k.append((whole, -b * block_size))
        return [tuple(k) or None for k in keys]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class FirstTokenPhases:
    """Where a request's time to first token went, in seconds; they add up to it."""

    queue: float  # arrival (the API handler's start) to admission: waiting for a slot or the admission window
    prefill: float  # admission to the end of the pass that held the prompt's last chunk
    first_step: float  # that to the first token out of the step that sampled it


@dataclass
class RequestOutput:
    """One step of a request's stream. The last one has `finished` set."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None  # seconds since arrival
    first_token_phases: FirstTokenPhases | None = None  # on the first output
    error: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # With params.prompt_logprobs, on the first output: one per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(RuntimeError):
    """The engine failed a request (an exception in the MLX thread)."""


class EngineStalledError(EngineError):
    """An engine step ran past --step-timeout: the requests in flight were failed, new ones are
    refused until it ends (engine/guard.py)."""


class PromptTooLongError(ValueError):
    """The prompt (plus at least one output token) does not fit the context."""
