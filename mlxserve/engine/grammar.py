"""Constrained decoding: a logits processor that lets through only what a grammar accepts next.

llguidance (the grammar engine vLLM and SGLang use too) keeps each row's
parser state in an `LLMatcher` and writes the allowed tokens as a bitmask.
The processor is an ordinary mlx-lm logits processor, so constrained and free
rows share one batch and the prefix cache stays on.

The mask for step t depends on the token sampled at step t-1, so it cannot be
computed ahead. What can overlap is the forward pass: the processor starts
step t's forward pass (`async_eval`) before it waits for that token, and the
host fills the mask while the accelerator runs the model.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class MaskStats:
    """Host time spent filling masks, for `mlxserve bench grammar` and /metrics."""

    def __init__(self):
        self.seconds = 0.0
        self.masks = 0

    def reset(self) -> None:
        self.seconds, self.masks = 0.0, 0


mask_stats = MaskStats()


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> mx.array:
    """llguidance's packed bitmask (one bit per token, 32 per int32) as a boolean row."""
    words = mx.array(bitmask)
    bits = (words[..., None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(mx.bool_)


class GrammarProcessor:
    """One row's constraint. Called once per sampled token, in order (mlx-lm's contract).

    The first call sees the prompt's last token as the context's tail; every
    later call sees the token sampled after the call before, which the
    matcher consumes before it computes the next mask.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.async_eval(logits)  # the forward pass runs while the host computes the mask
        if self.calls:
            self.matcher.consume_token(int(tokens[-1].item()))
        self.calls += 1
        start = time.perf_counter()
        fill_next_token_bitmask(self.matcher, self.bitmask)
        if not self.bitmask.any():
            # A matcher in an error state allows nothing; ending the row is the honest way out.
            self._allow_eos()
        mask_stats.seconds += time.perf_counter() - start
        mask_stats.masks += 1
        return mx.where(allowed_tokens(self.bitmask, logits.shape[-1]), logits, -mx.inf)

    def _allow_eos(self) -> None:
        words = self.bitmask.view(np.uint32)
        for t in self.eos_token_ids:
            words[0, t // 32] |= np.uint32(1 << (t % 32))
