"""A lone request's last prefill pass projects only its last position onto the vocabulary."""

import threading

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.models import last_logits as module
from mlxserve.models.last_logits import head_owner, last_logits
from mlxserve.models.shapes import SHAPES
from parity import greedy, prompt_of, run

FAMILIES = [k for k in SHAPES if k.endswith("-tiny")]


@pytest.mark.parametrize("shape", FAMILIES)
def test_the_last_positions_logits_are_the_full_passes(tiny, shape, monkeypatch):
    model = tiny(shape).model
    owner = head_owner(model)
    assert owner is not None  # every family served today is built as head(model(...))
    tokens = mx.array([prompt_of(40, 3)])
    full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    cut = []
    real = module._last_position
    monkeypatch.setattr(module, "_last_position", lambda h: cut.append(h.shape) or real(h))
    cache = make_prompt_cache(model)
    last = last_logits(model, tokens, cache, owner)
    assert cut and cut[-1][1] == 40  # the head got the last of the 40 positions alone
    assert last.shape == full.shape and mx.allclose(last, full, atol=1e-4).item()
    # The cache holds the whole pass: the next token continues from all 40.
    step = tokens[:, :1]
    assert mx.allclose(model(step, cache=cache)[:, -1, :],
                       model(mx.concatenate([tokens, step], axis=1), cache=make_prompt_cache(model))[:, -1, :],
                       atol=1e-4).item()
    assert len(cut) == 1  # calls outside last_logits see every position


def test_another_threads_call_sees_every_position(tiny):
    """Engines on other threads may share the model (tests do): the cut is this thread's alone."""
    model = tiny("qwen3-tiny").model
    owner = head_owner(model)
    tokens = mx.array([prompt_of(12, 4)])
    module._active.inner = owner["model"]  # as if this thread were inside last_logits
    try:
        out = []
        other = threading.Thread(target=lambda: out.append(model(tokens, cache=make_prompt_cache(model)).shape))
        other.start()
        other.join()
        assert out == [(1, 12, model.args.vocab_size)]
        assert model(tokens, cache=make_prompt_cache(model)).shape[1] == 1  # this thread: cut
    finally:
        module._active.inner = None


def test_an_engine_answers_the_same_with_it(tiny, monkeypatch):
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine

    loaded = tiny("qwen3-tiny")
    prompts = [prompt_of(30, 7), prompt_of(75, 8)]  # one pass; a chunk, then the last pass
    engine = AsyncEngine(loaded, EngineConfig(prefix_cache=False, prefill_chunk_size=64)).start()
    try:
        sliced = [run(engine, [p], greedy(10))[0][0] for p in prompts]
        monkeypatch.setattr("mlxserve.engine.runner.head_owner", lambda model: None)
        whole = [run(engine, [p], greedy(10))[0][0] for p in prompts]
    finally:
        engine.stop()
    assert sliced == whole
