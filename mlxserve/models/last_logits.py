"""The logits of a pass's last position, without projecting the others onto the vocabulary.

A lone request's last prefill pass samples its first token from the last position alone, but
mlx-lm's and mlx-vlm's models run their head (lm_head, or the tied embeddings) over every position
they get, and MLX computes a matmul whole even when one row of it is read. With today's
vocabularies (151k-262k) the head is 10-25% of a 0.6-8B model's work a token, so a 500-token
turn spent that much on logits no one reads. (mlx-lm's generate_step avoids it with a one-token
pass of its own after the prompt: one more pass over the weights.)

These models are built as `head(self.model(...))`, the inner model holding the layers; for the
one call, the inner model's output is cut to the last position, so the head sees one row.
Models built otherwise run as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class _LastPosition:
    """Stands in for the inner model during one call: its hidden states, last position only."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        return out[:, -1:] if isinstance(out, mx.array) and out.ndim == 3 else out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def head_owner(model: nn.Module) -> nn.Module | None:
    """The module whose call is `head(self.model(...))` (the model, or its `language_model`), or None."""
    m = model if isinstance(model, nn.Module) else getattr(model, "lm", None)  # a VLM's TextModel wraps one
    for _ in range(3):
        if not isinstance(m, nn.Module):
            return None
        inner = m.get("model")  # a child module (a `model` property, as Qwen3.5's wrapper has, is not one)
        if isinstance(inner, nn.Module) and isinstance(inner.get("layers"), list):
            return m
        m = m.get("language_model")
    return None


def last_logits(model: nn.Module, tokens: mx.array, cache, owner: nn.Module | None, **inputs) -> mx.array:
    """`model(tokens, cache=cache, **inputs)[:, -1, :]`, the head run on the last position only when
    `owner` (from `head_owner(model)`) is given."""
    if owner is None or tokens.shape[-1] == 1:
        return model(tokens, cache=cache, **inputs)[:, -1, :]
    inner = owner["model"]
    owner["model"] = _LastPosition(inner)  # in the module's dict, where its attribute lookup finds it
    try:
        out = model(tokens, cache=cache, **inputs)
    finally:
        owner["model"] = inner
    return out[:, -1, :]
