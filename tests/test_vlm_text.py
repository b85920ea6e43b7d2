"""Every text-only model type mlx-vlm ships that mlx-lm lacks is served batched and cached with
unchanged tokens through mlx-vlm's own classes (models/vlm_text.py), or one request at a time
uncached where mlx-lm has no copy of its cache classes, or refused at load with its reason.

One test per type, on a tiny random-weight config built from its ModelConfig (2 layers): the
same check as mlx-lm's types (tests/test_architectures.py, tests/parity.py), and causal.
"""

import json

import pytest

from mlxserve.cache.layers import model_specs, spec_kinds
from mlxserve.models.files import ModelLoadError
from mlxserve.models.load import load, save_folder
from mlxserve.models.vlm_architectures import state, vlm_packages
from mlxserve.models.vlm_text import NOT_QUANTIZABLE, PREFIX_LM, VLMText, tiny_text_config

from parity import check_causal, check_served_alike

SETTINGS = dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1, warmup=0)
TYPES = [p for p in vlm_packages() if state(p)[0] == "vlm text"]

# Served one request at a time and uncached, the same tokens still: mlxserve says so at start
# and in /v1/models. A type that starts batching or caching fails.
ALONE_UNCACHED = {
    "deepseek_v4": "its compressed layers pool keys into mlx-vlm's PoolingCache, which mlx-lm has no class of",
    "z1t": "its Z1TCache (running pool sums and a conv window) is mlx-vlm's own class, no copy of mlx-lm's",
}


@pytest.mark.parametrize("model_type", TYPES)
def test_vlm_text_type_is_served_batched_and_cached(model_type, tmp_path):
    loaded = load(model_type, load_format="dummy", progress=False)
    assert isinstance(loaded.model, VLMText) and loaded.vision is None
    check_causal(loaded.model)
    recurrent = "state" in spec_kinds(model_specs(loaded.model))
    serving, stats = check_served_alike(loaded, SETTINGS, tmp_path / "kv", block_granular=recurrent)
    if serving["caches"]:
        assert stats["disabled"] is None and stats["misses"]["unrestorable"] == 0
    limited = model_type in ALONE_UNCACHED
    assert (serving["batches"], serving["caches"]) == (not limited, not limited), serving["limits"]


def test_vlm_text_model_folder_loads_through_mlx_vlm_with_the_same_logits(tmp_path):
    """A model folder (weights under mlx-vlm's names) is read by mlx-vlm's loader (its
    `sanitize`) and served with the logits of the model it was written from."""
    import mlx.core as mx

    written = load("limite", load_format="dummy", progress=False)
    save_folder(written, tmp_path / "limite")
    read = load(str(tmp_path / "limite"), progress=False)
    assert isinstance(read.model, VLMText) and read.config["model_type"] == "limite"
    tokens = mx.array([list(range(100, 130))])
    assert mx.array_equal(written.model(tokens), read.model(tokens)).item()


def test_limite_is_refused_quantized_with_its_reason():
    """Limite reads its weight matrices directly: --quantize is refused at load, not a failed request."""
    with pytest.raises(ModelLoadError) as e:
        load("limite", load_format="dummy", quantize_bits=4, progress=False)
    assert NOT_QUANTIZABLE["limite"] in str(e.value) and "\n" not in str(e.value)


def test_hrm_text_as_a_prefix_lm_is_refused_at_load_with_its_reason(tmp_path):
    """HRM-Text's own setting (prefix_lm true: its prompt attends both ways) is refused as a
    folder (before weights are read) and as a random-weight config; causal, it is served."""
    config = tiny_text_config("hrm_text") | {"prefix_lm": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source, load_format in ((str(tmp_path), "auto"), (str(tmp_path / "config.json"), "dummy")):
        with pytest.raises(ModelLoadError) as e:
            load(source, load_format=load_format, progress=False)
        assert PREFIX_LM in str(e.value) and "\n" not in str(e.value)
