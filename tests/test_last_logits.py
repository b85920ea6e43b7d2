"""A lone request's last prefill pass projects only its last position onto the vocabulary."""

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
    loaded = tiny(shape)
    model = loaded.model
    owner = head_owner(model)
    assert owner is not None  # every family served today is built as head(model(...))
    seen = []
    real = module._LastPosition.__call__
    tokens = mx.array([prompt_of(40, 3)])
    full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    monkeypatch.setattr(module._LastPosition, "__call__", lambda self, *a, **k: seen.append(
        (out := real(self, *a, **k)).shape) or out)
    cache = make_prompt_cache(model)
    last = last_logits(model, tokens, cache, owner)
    assert seen and seen[-1][1] == 1  # the head got one position
    assert last.shape == full.shape and mx.allclose(last, full, atol=1e-4).item()
    # The cache holds the whole pass: the next token continues from all 40.
    step = tokens[:, :1]
    assert mx.allclose(model(step, cache=cache)[:, -1, :],
                       model(mx.concatenate([tokens, step], axis=1), cache=make_prompt_cache(model))[:, -1, :],
                       atol=1e-4).item()
    assert owner["model"] is not None and not isinstance(owner["model"], module._LastPosition)  # put back


def test_an_engine_answers_the_same_with_it(tiny, monkeypatch):
    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine

    loaded = tiny("qwen3-tiny")
    prompts = [prompt_of(30, 7), prompt_of(75, 8)]  # one pass; a chunk, then the last pass
    engine = AsyncEngine(loaded, EngineConfig(prefix_cache=False, prefill_chunk_size=64)).start()
    try:
        sliced = [run(engine, [p], greedy(10))[0][0] for p in prompts]
        monkeypatch.setattr(module, "head_owner", lambda model: None)
        monkeypatch.setattr("mlxserve.engine.runner.head_owner", lambda model: None)
        whole = [run(engine, [p], greedy(10))[0][0] for p in prompts]
    finally:
        engine.stop()
    assert sliced == whole
