"""The logits of a pass's last position, without projecting the others onto the vocabulary.

A lone request's last prefill pass samples its first token from the last position alone, but
mlx-lm's and mlx-vlm's models run their head (lm_head, or the tied embeddings) over every position
they get, and MLX computes a matmul whole even when one row of it is read. With today's
vocabularies (151k-262k) the head is 10-25% of a 0.6-8B model's work a token, so a 500-token
turn spent that much on logits no one reads. (mlx-lm's generate_step avoids it with a one-token
pass of its own after the prompt: one more pass over the weights.)

These models are built as `head(self.model(...))`, the inner model holding the layers. The inner
model's class gets a subclass whose call, while this thread runs `last_logits` on that model, cuts
its output to the last position, so the head sees one row. The model is never changed during a
call (engines on other threads may share it, as tests do); models built otherwise run as before.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

_active = threading.local()  # .inner: the inner model whose output this thread's call cuts
_subclasses: dict[type, type] = {}


def _last_position(hidden: mx.array) -> mx.array:
    return hidden[:, -1:]


def _cutting(cls: type) -> type:
    """`cls` with a call that returns the last position only while `last_logits` runs on it."""
    if cls in _subclasses.values():
        return cls
    if cls not in _subclasses:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            if getattr(_active, "inner", None) is self and isinstance(out, mx.array) and out.ndim == 3:
                return _last_position(out)
            return out

        _subclasses[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                       "__qualname__": cls.__qualname__})
    return _subclasses[cls]


def head_owner(model) -> nn.Module | None:
    """The module whose call is `head(self.model(...))` (the model, or its `language_model`), made
    ready for `last_logits`; None if the model is built otherwise."""
    m = model if isinstance(model, nn.Module) else getattr(model, "lm", None)  # a VLM's TextModel wraps one
    for _ in range(3):
        if not isinstance(m, nn.Module):
            return None
        inner = m.get("model")  # a child module (a `model` property, as Qwen3.5's wrapper has, is not one)
        if isinstance(inner, nn.Module) and isinstance(inner.get("layers"), list):
            inner.__class__ = _cutting(type(inner))  # same weights, same behaviour outside last_logits
            return m
        m = m.get("language_model")
    return None


def last_logits(model, tokens: mx.array, cache, owner: nn.Module | None, **inputs) -> mx.array:
    """`model(tokens, cache=cache, **inputs)[:, -1, :]`, the head run on the last position only when
    `owner` (from `head_owner(model)`) is given."""
    if owner is None or tokens.shape[-1] == 1:
        return model(tokens, cache=cache, **inputs)[:, -1, :]
    _active.inner = owner["model"]
    try:
        out = model(tokens, cache=cache, **inputs)
    finally:
        _active.inner = None
    return out[:, -1, :]
