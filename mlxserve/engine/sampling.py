"""SamplingParams -> a sampler and logits processors for one sequence.

mlx-lm's batch generator takes one sampler and one list of processors per
sequence, so every request keeps its own settings inside a mixed batch.
Samplers carry their own PRNG key instead of using MLX's global random state:
a seeded request then draws the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxserve.engine.grammar import GrammarProcessor
from mlxserve.engine.request import SamplingParams


class Sampler:
    """Draws one token per call from a row of logprobs, with the request's own PRNG key.

    Each call splits the key once, so the n-th token of a request is drawn with
    the n-th key whichever path computes it (solo, batch, or a speculative
    verify pass that draws several tokens at once: see `draws`).
    """

    def __init__(self, params: SamplingParams, vocab_size: int):
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed)
        self.inv_temp = 1.0 / params.temperature
        self.top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self.min_p = params.min_p
        self.top_p = params.top_p

    def _draw(self, logprobs: mx.array, key: mx.array) -> mx.array:
        if self.top_k:
            logprobs = apply_top_k(logprobs, self.top_k)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        return mx.random.categorical(logprobs * self.inv_temp, key=key)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return self._draw(logprobs, draw)

    def draws(self, logprobs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """One token per row of `logprobs` (n, V), row i drawn with the key the i-th of n
        successive calls would use; the sampler's own key does not move. Returns the
        tokens and, per row, the key after that row's draw: setting `key` to keys[m - 1]
        keeps the first m draws, as if only those m calls had been made."""
        key, tokens, keys = self.key, [], []
        for i in range(logprobs.shape[0]):
            key, draw = mx.random.split(key)
            tokens.append(self._draw(logprobs[i:i + 1], draw))
            keys.append(key)
        return mx.concatenate(tokens), keys


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """A sampler for one row of logprobs, or None for greedy.

    None lets the batch share one argmax over all greedy rows.
    """
    if params.greedy:
        return None
    return Sampler(params, vocab_size)


def make_processors(params: SamplingParams, vocab_size: int, eos_token_ids) -> list:
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None,
        repetition_context_size=params.penalty_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.penalty_context_size,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.penalty_context_size,
    )
    if params.grammar is not None:
        # Last, so no bias or penalty can lift a token the grammar rules out.
        processors.append(GrammarProcessor(params.grammar, vocab_size, eos_token_ids))
    return processors


def stop_token_ids(params: SamplingParams, eos_token_ids) -> set[int]:
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return ids


def make_stop_sequences(stop_ids: set[int]) -> StopSequences:
    return StopSequences([(t,) for t in sorted(stop_ids)])


def top_logprobs(row: mx.array, token: int, k: int):
    """(logprob of `token`, [(id, logprob)] of the k best), on the host."""
    chosen = row[token]
    if k == 0:
        return chosen.item(), []
    best = mx.argpartition(-row, kth=k - 1)[:k]
    values = row[best]
    mx.eval(chosen, best, values)
    pairs = sorted(zip(best.tolist(), values.tolist()), key=lambda p: -p[1])
    return chosen.item(), pairs
