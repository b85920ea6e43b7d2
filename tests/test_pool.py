"""The model pool without HTTP (engine/pool.py), the settings of several models
(config.served_models: the command line and --config files), and `mlxserve serve`
with several models, --config and --pin as a user runs it."""

import asyncio
import gc
import json
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import httpx
import pytest

from mlxserve.bench.local import ChildServer, checkout_env, free_port
from mlxserve.config import EngineConfig, ModelConfig, PoolConfig, ServerConfig, served_models
from mlxserve.engine.pool import ModelPool, ModelSpec, separate_disk_tiers

ROOT = Path(__file__).resolve().parent.parent


def spec(name, **engine):
    return ModelSpec(name, ModelConfig(model=name, load_format="dummy"), EngineConfig(**engine))


def test_an_idle_model_unloads_after_its_ttl_and_frees_its_weights():
    pool = ModelPool([ModelSpec("qwen3-tiny", ModelConfig(model="qwen3-tiny", load_format="dummy"),
                                EngineConfig(), ttl=0.3)])
    pool.preload()
    entry = pool.default
    weights = weakref.ref(entry.loaded.model)

    async def scenario():
        await pool.start()
        held = await pool.acquire("qwen3-tiny")
        await asyncio.sleep(0.8)  # held: the ttl counts from the last release
        assert held.state == "loaded"
        pool.release(held)
        for _ in range(100):
            if entry.state == "unloaded":
                break
            await asyncio.sleep(0.05)
        await pool.stop()

    asyncio.run(scenario())
    assert entry.state == "unloaded" and entry.engine is None and entry.loads == 1
    gc.collect()
    assert weights() is None  # nothing kept the model alive


@pytest.fixture
def session_loads(tiny, monkeypatch):
    """Pool loads return the session's tiny models (the weights a dummy load builds),
    so a test can load and unload many times without paying for each load."""
    import importlib

    load_module = importlib.import_module("mlxserve.models.load")  # (the package exports a `load` function)
    models = {n: tiny(n) for n in ("qwen3-tiny", "llama-tiny")}  # built before `load` is replaced
    loads = []

    def load(source, **_):
        loads.append(source)
        return models[source]

    monkeypatch.setattr(load_module, "load", load)
    return loads


def test_the_memory_budget_holds_once_sizes_are_known(session_loads):
    small = {"cache_memory": "1MB"}
    names = ("qwen3-tiny", "llama-tiny")
    probe = ModelPool([spec(n, **small) for n in names])
    probe.preload()
    one = probe.default.nbytes  # weights plus the 1 MB cache budget
    probe.stop_blocking()
    pool = ModelPool([spec(n, **small) for n in names], memory=int(one * 1.5))
    pool.preload()
    qwen, llama = pool.entries.values()

    async def scenario():
        await pool.start()
        # llama's size is not known before its first load (a dummy model has no files): it
        # loads beside qwen, then, over the budget, the idle qwen is unloaded after it.
        pool.release(await pool.acquire("llama-tiny"))
        await asyncio.gather(*(e.task for e in (qwen, llama) if e.state == "unloading"))
        assert (qwen.state, llama.state) == ("unloaded", "loaded")
        # Sizes are known now: qwen's load unloads llama before it starts.
        held = await pool.acquire("qwen3-tiny")
        assert (qwen.state, llama.state) == ("loaded", "unloaded")
        # A model bigger than the budget beside a pinned one can never load: a clear error.
        pool.release(held)
        await pool.pin("qwen3-tiny")
        with pytest.raises(Exception, match="beside the pinned models"):
            await pool.acquire("llama-tiny")
        await pool.stop()

    asyncio.run(scenario())
    assert session_loads == ["qwen3-tiny", "qwen3-tiny", "llama-tiny", "qwen3-tiny"]


def test_pool_settings_are_checked():
    with pytest.raises(ValueError, match="two models are named 'qwen3-tiny'"):
        ModelPool([spec("qwen3-tiny"), spec("qwen3-tiny")])
    with pytest.raises(ValueError, match="at least 1"):
        ModelPool([spec("qwen3-tiny")], max_loaded=0)
    pinned = [ModelSpec(n, ModelConfig(model=n, load_format="dummy"), EngineConfig(), pinned=True)
              for n in ("qwen3-tiny", "llama-tiny")]
    with pytest.raises(ValueError, match="2 models are pinned"):
        ModelPool(pinned, max_loaded=1)


def test_models_sharing_a_disk_cache_folder_get_one_each(tmp_path):
    shared = [spec("qwen3-tiny", disk_cache_dir=str(tmp_path)), spec("org/llama", disk_cache_dir=str(tmp_path)),
              spec("gemma3-tiny", disk_cache_dir=str(tmp_path / "own")), spec("llama-tiny")]
    dirs = [s.engine.disk_cache_dir for s in separate_disk_tiers(shared)]
    assert dirs == [str(tmp_path / "qwen3-tiny"), str(tmp_path / "org--llama"), str(tmp_path / "own"), None]
    alone = [spec("qwen3-tiny", disk_cache_dir=str(tmp_path))]
    assert separate_disk_tiers(alone)[0].engine.disk_cache_dir == str(tmp_path)  # as with one model


# ---- settings: the command line and --config ----

def models_of(sources, path=None, served_model_name=None, **flags):
    model_cfg = ModelConfig(load_format=flags.pop("load_format", "auto"))
    return served_models(sources, model_cfg, EngineConfig(**flags), ServerConfig(served_model_name=served_model_name),
                         PoolConfig(config=str(path) if path else None))


def test_models_come_from_the_command_line_then_the_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nmodel = "llama-tiny"\nalias = "small"\nkv_bits = 8\ncache_memory = "256MB"\n'
                    'ttl = 30\n\n[[models]]\nmodel = "gemma3-tiny"\npinned = true\nload_format = "auto"\n')
    models = models_of(["qwen3-tiny"], path, load_format="dummy", max_num_seqs=4)
    assert [m.model.model for m in models] == ["qwen3-tiny", "llama-tiny", "gemma3-tiny"]
    first, small, gemma = models
    assert (small.entry.alias, small.engine.kv_bits, small.engine.cache_memory, small.entry.ttl) == \
        ("small", 8, "256MB", 30.0)
    assert small.model.load_format == "dummy" and small.engine.max_num_seqs == 4  # the flags' values
    assert gemma.entry.pinned and gemma.model.load_format == "auto" and first.engine.kv_bits is None
    specs = [ModelSpec.of(m, default_ttl=60) for m in models]
    assert [(s.name, s.ttl) for s in specs] == [("qwen3-tiny", 60), ("small", 30.0), ("gemma3-tiny", 60)]
    # No source: the embedded default model, named as a single-model server names it.
    (default,) = models_of([], served_model_name="my-model")
    assert default.model.model is None and default.entry.alias == "my-model"


def test_yaml_files_too(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - model: llama-tiny\n    alias: small\n    kv_bits: 4\n")
    (m,) = models_of([], path)
    assert (m.model.model, m.entry.alias, m.engine.kv_bits) == ("llama-tiny", "small", 4)


@pytest.mark.parametrize("text, why", [
    ('[[models]]\nmodel = "a"\nkv_bit = 8\n', r"models\[0\]: unknown setting 'kv_bit'; known: .*kv_bits"),
    ('[[models]]\nmodel = "a"\nkv_bits = 3\n', r"models\[0\]\.kv_bits: must be one of 4, 8, not 3"),
    ('[[models]]\nmodel = "a"\n[[models]]\nmodel = "b"\npinned = "yes"\n', r"models\[1\]\.pinned: must be true or false"),
    ('[[models]]\nmodel = "a"\nmax_num_seqs = 2.5\n', r"max_num_seqs: must be an integer"),
    ('models = []\n', "non-empty list"),
    ('port = 8000\n[[models]]\nmodel = "a"\n', "must hold `models` only"),
    ('[[models]\n', "not valid TOML"),
])
def test_bad_model_files_say_what_and_where(tmp_path, text, why):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=why):
        models_of([], path)


# ---- mlxserve serve A --config FILE --pin FILE ----

def test_serve_several_models_from_the_command_line_and_a_file(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nmodel = "llama-tiny"\nalias = "small"\nblock_size = 8\n\n'
                      '[[models]]\nmodel = "gemma3-tiny"\npinned = true\n')
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps([{"model": "small", "prompt": list(range(100, 140))}]))
    port = free_port()
    args = ["serve", "--load-format", "dummy", "qwen3-tiny", "--config", str(config), "--pin", str(pins),
            "--max-loaded-models", "2", "--port", str(port), "--log-level", "warning"]
    server = ChildServer([sys.executable, "-m", "mlxserve.cli", *args], port, checkout_env(), "serve")
    proc, url = server.proc, server.base_url
    try:
        server.wait_healthy(180)
        models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert list(models) == ["qwen3-tiny", "small", "gemma3-tiny"]
        # The pin loaded `small` at start; gemma is pinned, so the default made room.
        assert models["gemma3-tiny"]["pinned"] and models["gemma3-tiny"]["state"] == "loaded"
        assert models["small"]["state"] == "loaded" and models["qwen3-tiny"]["state"] == "unloaded"
        (pin,) = httpx.get(url + "/v1/cache/pins").json()["data"]
        assert pin["model"] == "small" and pin["active"] and pin["tokens"] == 40
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "small", "prompt": list(range(100, 145)), "max_tokens": 2, "temperature": 0})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        server.kill()


def test_serve_refuses_a_bad_model_file(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nmodel = "llama-tiny"\nkv_bit = 8\n')
    out = subprocess.run([sys.executable, "-m", "mlxserve.cli", "serve", "--config", str(config)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown setting 'kv_bit'" in out.stderr
