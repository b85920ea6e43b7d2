"""Every text model type mlx-lm ships is served batched and cached with unchanged tokens, or
refused at load with its reason.

One test per model type in mlx-lm's `mlx_lm/models/` (mlxserve.models.architectures), on
a tiny random-weight config built from its ModelArgs (mlxserve.models.tiny, what
`--load-format dummy <model type>` serves): greedy tokens alone, in batches of 2 and 3
prompts of different lengths, cold, from a full and a partial cache hit, with the cache off
and after a restart from the disk tier are all the same, and no later token changes an
earlier one's logits (tests/parity.py). Types that tests/test_families.py covers with
hand-written configs are left to it. Measured on the 2-core CI-like machine (shared, load
4.5-6): the file takes 4-5 min wall, 256 s of CPU (user + system).
"""

import json

import pytest

from mlxserve.cache.layers import model_specs, spec_kinds
from mlxserve.models.architectures import REFUSED, text_architectures
from mlxserve.models.files import ModelLoadError
from mlxserve.models.load import load
from mlxserve.models.shapes import SHAPES
from mlxserve.models.tiny import tiny_config

from parity import check_causal, check_served_alike
from test_families import CONFIGS as FAMILIES, SHAPES as FAMILY_SHAPES

SETTINGS = dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1, warmup=0)

COVERED = {c["model_type"] for c in FAMILIES.values()} | {SHAPES[s]["model_type"] for s in FAMILY_SHAPES}
TYPES = [t for t in text_architectures() if t not in REFUSED and t not in COVERED]

# Served one request at a time and uncached, the same tokens still (docs/architectures.md):
# mlxserve says so at start and in /v1/models. A type that starts batching or caching fails.
ALONE_UNCACHED = {
    "deepseek_v41": "its LayerCache (a window plus compressed groups) has no batch merge and no block layout",
}


def served(loaded, folder):
    recurrent = "state" in spec_kinds(model_specs(loaded.model))
    serving, stats = check_served_alike(loaded, SETTINGS, folder, block_granular=recurrent)
    if serving["caches"]:
        assert stats["disabled"] is None and stats["misses"]["unrestorable"] == 0
    return serving


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type_is_served_batched_and_cached(model_type, tmp_path):
    loaded = load(model_type, load_format="dummy", progress=False)
    assert loaded.name == model_type
    check_causal(loaded.model)
    serving = served(loaded, tmp_path / "kv")
    limited = model_type in ALONE_UNCACHED
    assert (serving["batches"], serving["caches"]) == (not limited, not limited), serving["limits"]


def test_gemma2_with_one_kv_head_batched_is_alone(tmp_path):
    """Gemma 2 added a batch's mask to grouped scores: with one KV head two requests at once
    failed (HTTP 500, 'Cannot reshape'); with as many requests as KV heads they silently
    took each other's masks (models/mlx_lm_fixes.py)."""
    config = tiny_config("gemma2") | {"num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    served(load(str(tmp_path), load_format="dummy", progress=False), tmp_path / "kv")


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_model_type_is_refused_at_load_with_its_reason(model_type, tmp_path, monkeypatch):
    """As a bare model type and as a model folder's config.json (before weights are read);
    and, let through, it does fail: a type that starts working fails this test."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    for source in (model_type, str(tmp_path)):
        with pytest.raises(ModelLoadError) as e:
            load(source, load_format="dummy" if source == model_type else "auto", progress=False)
        message = str(e.value)
        assert REFUSED[model_type] in message and "\n" not in message

    import mlx.core as mx
    from mlxserve.models import architectures
    from mlxserve.models.dummy import build_dummy

    monkeypatch.setattr(architectures, "REFUSED", {})
    with pytest.raises((SystemExit, RuntimeError)):  # olmo's import exits; the others need Metal
        model, _ = build_dummy(tiny_config(model_type))
        mx.eval(model(mx.array([[1, 2, 3]])))


def test_v1_models_says_how_each_model_is_served(caplog):
    """/v1/models lists a served model's cache layers and whether it batches, caches and
    survives a restart; a model served one request at a time says so there and at start."""
    import httpx

    from conftest import LiveServer

    live = LiveServer(load("deepseek_v41", load_format="dummy", progress=False))
    try:
        card = httpx.get(f"{live.base_url}/models/deepseek_v41").json()
    finally:
        live.close()
    serving = card["serving"]
    assert serving["model_type"] == "deepseek_v41" and serving["layer_kinds"] == {"LayerCache": 4}
    assert (serving["batches"], serving["caches"], serving["survives_restart"]) == (False, False, False)
    assert any(s.startswith("one request at a time: mlx-lm cannot batch its LayerCache") for s in serving["limits"])
    assert "batching off: mlx-lm cannot batch LayerCache layers" in caplog.text
