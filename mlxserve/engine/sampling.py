"""SamplingParams -> a sampler and logits processors for one sequence.

mlx-lm's batch generator takes one sampler and one list of processors per
sequence, so every request keeps its own settings inside a mixed batch.
Samplers carry their own PRNG key instead of using MLX's global random state:
a seeded request then draws the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxserve.engine.grammar import GrammarProcessor
from mlxserve.engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """A sampler for one row of logprobs, or None for greedy.

    None lets the batch share one argmax over all greedy rows.
    """
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    key = [mx.random.key(seed)]
    inv_temp = 1.0 / params.temperature
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0

    def sample(logprobs: mx.array) -> mx.array:
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sample


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
