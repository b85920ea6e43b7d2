"""Shared fixtures: tiny random-weight models of real architectures, loaded once per session."""

import asyncio
import functools

import pytest

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported


@pytest.fixture(autouse=True, scope="module")
def frozen_heap():
    """Each module starts with what is alive frozen (collected first, so no garbage is kept), as a
    server freezes it after loading (engine/pool.py freeze_heap). Each engine's stop runs a full
    collection, which otherwise scanned the libraries' and test modules' ~130k objects every time:
    0.1-0.2 s a stop, 26 s of test_families.py's ~100 s, 35 s of test_architectures.py's ~195 s
    (1.4 s and 3.7 s frozen). A server's stop unfreezes it all (pool.stop): then the next module
    freezes it again."""
    import gc

    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


@functools.lru_cache(maxsize=None)
def tiny_model(shape: str):
    from mlxserve.models.load import load

    return load(shape, load_format="dummy", progress=False)


@pytest.fixture(scope="session")
def tiny():
    """tiny("qwen3-tiny") -> LoadedModel, built once per session."""
    return tiny_model


def run_async(coro):
    return asyncio.run(coro)


# ---- live HTTP servers (tests/test_api.py, tests/test_anthropic.py) ----


class LiveServer:
    """uvicorn serving `create_app` on a free 127.0.0.1 port, in a background thread."""

    def __init__(self, loaded, engine_cfg=None, server_cfg=None, *, pool=None, pins=(), pin_file=None):
        """One model (`loaded`), or several: a ModelPool (`pool`), with `pins` made at start."""
        import socket
        import threading
        import time

        import uvicorn

        from mlxserve.api.server import create_app, create_pool_app
        from mlxserve.config import EngineConfig, ServerConfig
        from mlxserve.engine.engine import AsyncEngine

        if pool is not None:
            self.engine = None
            self.pool = pool
            self.app = create_pool_app(pool, server_cfg or ServerConfig(), pins, pin_file)
        else:
            self.engine = AsyncEngine(loaded, engine_cfg or EngineConfig())
            self.app = create_app(self.engine, loaded, server_cfg or ServerConfig())
            self.pool = self.app.state.mlx.pool
        self.state = self.app.state.mlx
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        # As a deployment waits for /health's warm-up: tests that break or hold the model then
        # break their own requests, not the warm-up's (engine/warmup.py).
        for entry in self.pool.entries.values():
            if entry.engine is not None:
                entry.engine.warmed.wait(120)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.pool.stop_blocking()


@pytest.fixture(scope="session")
def server(tiny):
    """One live server per session: qwen3-tiny with random weights, no API key."""
    from mlxserve.config import EngineConfig

    live = LiveServer(tiny("qwen3-tiny"), EngineConfig(max_num_seqs=16, max_queue=64))
    yield live
    live.close()


@pytest.fixture
def api_key(server):
    """Turns on --api-key on the shared server for one test (the key is read per request)."""
    server.state.server_cfg.api_key = "sk-test-key"
    yield "sk-test-key"
    server.state.server_cfg.api_key = None


@pytest.fixture
def quantized_attention_calls(monkeypatch):
    """A list that grows by one per call of mlx-lm's or mlx-vlm's quantized attention (any thread)."""
    import mlx_lm.models.base as lm_base
    import mlx_vlm.models.base as vlm_base

    calls = []
    for module in (lm_base, vlm_base):
        def counted(*args, _original=module.quantized_scaled_dot_product_attention, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "quantized_scaled_dot_product_attention", counted)
    return calls
