"""Overload, memory and stalls: the server says no at once, in each API's own error shape, and
keeps serving.

- More requests than slots plus queue: the excess gets a 429 with Retry-After.
- A request whose KV cache could never fit the budget (--kv-memory) gets a 503; one that fits
  alone but not beside the running ones waits for them.
- An engine step past --step-timeout fails the requests in flight (503, or an error event),
  /health says "stalled", and the engine serves again once the step returns.

One live server for the module: qwen3-tiny behind a model wrapper that can be slowed down or
held, 2 slots, a queue of 2 and a 256 KB KV budget (qwen3-tiny's KV is 512 bytes a token,
allocated 256 tokens at a time: one request may hold 512 tokens, two together 256 each).
The watchdog's limit is generous (a loaded CI machine must not trip it) except in the stall
test, which lowers it once the model is held.
"""

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest

from mlxserve.config import EngineConfig
from tests.test_api import sse_data, wait_idle

MODEL = "qwen3-tiny"
STEP_TIMEOUT = 30.0
USER = [{"role": "user", "content": "Say something."}]


class SlowModel:
    """The real model, except that every call sleeps `delay` seconds first, and while `held` is
    set a call blocks until it is cleared (a stuck step); `entered` is set when one blocks."""

    def __init__(self, model):
        self._model = model
        self.delay = 0.0
        self.held = threading.Event()
        self.released = threading.Event()
        self.entered = threading.Event()

    def __call__(self, *args, **kwargs):
        if self.delay:
            time.sleep(self.delay)
        if self.held.is_set():
            self.entered.set()
            self.released.wait(60)
        return self._model(*args, **kwargs)

    def hold(self) -> None:
        self.released.clear()
        self.entered.clear()
        self.held.set()

    def release(self) -> None:
        self.held.clear()
        self.released.set()

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def busy(tiny):
    from conftest import LiveServer

    loaded = tiny(MODEL)
    slow = SlowModel(loaded.model)
    live = LiveServer(dataclasses.replace(loaded, model=slow),
                      EngineConfig(max_num_seqs=2, max_queue=2, kv_memory="256KB", step_timeout=STEP_TIMEOUT))
    live.slow = slow
    yield live
    slow.delay = 0.0
    slow.release()
    live.close()


def chat(max_tokens=200, **extra) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def anthropic(max_tokens=200) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": max_tokens}


def assert_openai_error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code, body
    return body["error"]


def assert_anthropic_error(r, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind, body
    return body["error"]


def settled(server) -> None:
    """Nothing runs, nothing waits, no prefix-cache block is held, and /health says ok."""
    assert wait_idle(server.engine, timeout=30)
    stats = httpx.get(server.base_url + "/cache/stats", timeout=30).json()
    assert stats["prefix_cache"]["in_use_blocks"] == 0
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


# ---- a burst past slots and queue: 429 with Retry-After, at once ----

def test_a_burst_past_slots_and_queue_gets_429_at_once(busy):
    busy.slow.delay = 0.02  # the streams below run at least 4 s: still in flight when the burst comes
    with httpx.Client(base_url=busy.url, timeout=60) as c:
        # Fill the 2 slots and the queue of 2 with streams that run for a while.
        streams = [c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200] * 4

            async def burst():
                async with httpx.AsyncClient(base_url=busy.url, timeout=60) as ac:
                    async def one(path, body):
                        start = time.monotonic()
                        r = await ac.post(path, json=body)
                        return path, r, time.monotonic() - start

                    return await asyncio.gather(*(
                        [one("/v1/chat/completions", chat()) for _ in range(4)]
                        + [one("/v1/messages", anthropic()) for _ in range(4)]
                        + [one("/v1/responses", {"input": "hi", "max_output_tokens": 5}) for _ in range(2)]))

            results = asyncio.run(burst())
            for path, r, seconds in results:
                assert r.headers.get("retry-after") == "1", (path, r.text)
                assert seconds < 5, f"{path} waited {seconds:.1f} s for its 429"
                if path == "/v1/messages":
                    assert "queue is full" in assert_anthropic_error(r, 429, "rate_limit_error")["message"]
                else:
                    assert assert_openai_error(r, 429, "rate_limit_exceeded")["type"] == "rate_limit_error"
            # The streams that got in still stream.
            lines = responses[0].iter_lines()
            assert any(line.startswith("data: {") for line in (next(lines) for _ in range(3)))
        finally:
            busy.slow.delay = 0.0
            for s in streams:
                s.__exit__(None, None, None)
    settled(busy)
    with httpx.Client(base_url=busy.url, timeout=60) as c:  # and the server serves again
        assert c.post("/v1/chat/completions", json=chat(max_tokens=3)).status_code == 200
        assert c.post("/v1/messages", json=anthropic(max_tokens=3)).status_code == 200


# ---- memory: a request that cannot fit gets a 503; one that fits later waits ----

def test_a_request_whose_kv_cannot_fit_gets_503(busy):
    with httpx.Client(base_url=busy.url, timeout=60) as c:
        # 600 tokens take 768 tokens' allocation, 384 KB: over the 256 KB budget even alone.
        error = assert_openai_error(c.post("/v1/chat/completions", json=chat(max_tokens=600)), 503,
                                    "insufficient_memory")
        assert error["param"] == "max_tokens" and "--kv-memory" in error["message"]
        error = assert_openai_error(c.post("/v1/chat/completions", json={**chat(), "max_tokens": None,
                                                                         "max_completion_tokens": 600}),
                                    503, "insufficient_memory")
        assert error["param"] == "max_completion_tokens"
        r = c.post("/v1/messages", json=anthropic(max_tokens=600))
        assert "KV cache" in assert_anthropic_error(r, 503, "overloaded_error")["message"]
        assert "retry-after" not in r.headers  # the same request will not fit later either
        assert_openai_error(c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 600}), 503,
                            "insufficient_memory")
        # A request that names no max_tokens gets what fits: 512 tokens in all.
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 400, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 512 - 400
    settled(busy)


def test_a_request_that_fits_only_alone_waits_for_the_running_one(busy):
    """Two requests of 270 tokens: 256 KB each alone, 512 KB side by side. With 2 free slots
    the second still waits until the first is done; both succeed."""
    body = {"model": MODEL, "prompt": [1] * 240, "max_tokens": 30, "ignore_eos": True}
    seen = []

    def watch(stop):
        while not stop.is_set():
            h = httpx.get(busy.url + "/health", timeout=30).json()
            seen.append((h["running"], h["waiting"]))
            time.sleep(0.01)

    async def both():
        async with httpx.AsyncClient(base_url=busy.url, timeout=120) as ac:
            return await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(2)))

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    busy.slow.delay = 0.03  # each runs at least a second: the second arrives while the first runs
    try:
        results = asyncio.run(both())
    finally:
        busy.slow.delay = 0.0
        stop.set()
        watcher.join()
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 30 for r in results)
    assert (1, 1) in seen  # one ran while the other waited
    assert max(running for running, _ in seen) == 1  # never side by side
    settled(busy)


# ---- the watchdog: a stalled step ----

def test_a_stalled_step_fails_its_requests_and_the_engine_serves_again(busy):
    outcome = {}
    watchdog = busy.engine.watchdog

    def streamed(started):
        with httpx.stream("POST", busy.base_url + "/chat/completions", json=chat(stream=True),
                          timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.set()
            outcome["stream"] = (r.status_code, [first] + sse_data(lines))

    def plain():
        r = httpx.post(busy.base_url + "/chat/completions", json=chat(), timeout=60)
        outcome["plain"] = r

    started = threading.Event()
    threads = [threading.Thread(target=streamed, args=(started,)), threading.Thread(target=plain)]
    busy.slow.delay = 0.02  # 200 tokens take seconds: both still run when the model is held
    threads[0].start()
    assert started.wait(30)  # the stream runs
    threads[1].start()
    deadline = time.monotonic() + 30
    while busy.engine.num_running < 2:  # both run, side by side
        assert time.monotonic() < deadline
        time.sleep(0.01)
    busy.slow.hold()  # the next step never ends on its own
    try:
        assert busy.slow.entered.wait(30)
        watchdog.timeout_s = 1.0  # (the module's limit is 30 s)
        for t in threads:
            t.join(30)
        # Both clients heard while the step was still stuck.
        error = assert_openai_error(outcome["plain"], 503, "engine_stalled")
        assert outcome["plain"].headers["retry-after"] == "1" and "--step-timeout" in error["message"]
        status, events = outcome["stream"]
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_stalled"
        # While it is stuck: /health says so, new requests and cache calls are refused at once.
        with httpx.Client(base_url=busy.url, timeout=10) as c:
            health = c.get("/health")
            assert health.status_code == 503
            info = health.json()
            assert info["status"] == "stalled" and info["step_running_s"] > 1.0
            assert info["step_timeout_s"] == 1.0 and info["stalls"] == 1
            r = c.post("/v1/messages", json=anthropic(max_tokens=3))
            assert "stalled" in assert_anthropic_error(r, 503, "overloaded_error")["message"]
            assert r.headers["retry-after"] == "1"
            assert_openai_error(c.post("/v1/chat/completions", json=chat(max_tokens=3)), 503, "engine_stalled")
            assert_openai_error(c.get("/v1/cache/stats"), 503, "engine_stalled")
    finally:
        busy.slow.delay = 0.0
        busy.slow.release()
    # The step returns; the engine drops the failed requests and serves again.
    deadline = time.monotonic() + 30
    while httpx.get(busy.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not recover"
        time.sleep(0.05)
    watchdog.timeout_s = STEP_TIMEOUT
    info = httpx.get(busy.url + "/health").json()
    assert info["status"] == "ok" and info["last_step_s"] > 1.0 and info["step_running_s"] is None
    r = httpx.post(busy.base_url + "/chat/completions", json=chat(max_tokens=3), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    settled(busy)


# ---- /health ----

def test_health_reports_the_engine_state(busy):
    """ok (200, with the step times); shutting_down while the server drains (503). Stalled is
    above; dead is tests/test_api.py::test_dead_engine_ends_streams_and_fails_health."""
    httpx.post(busy.base_url + "/chat/completions", json=chat(max_tokens=2), timeout=60)
    r = httpx.get(busy.url + "/health")
    info = r.json()
    assert r.status_code == 200 and info["status"] == "ok"
    assert info["steps"] > 0 and 0 < info["last_step_s"] < STEP_TIMEOUT and info["step_timeout_s"] == STEP_TIMEOUT
    assert info["kv_budget_bytes"] == 256 * 1024 and info["running"] == info["waiting"] == 0
    busy.state.draining = True
    try:
        r = httpx.get(busy.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "shutting_down"}
    finally:
        busy.state.draining = False
    assert httpx.get(busy.url + "/health").status_code == 200


# ---- the KV estimate and the budget, without a server ----

@pytest.mark.parametrize("shape", ["qwen3-tiny", "gemma3-tiny", "lfm2-tiny", "qwen3.5-tiny"])
def test_kv_footprint_bounds_the_real_cache(tiny, shape):
    """Full attention, sliding windows, recurrent states: the estimate is never below what the
    cache holds after a chunked prefill and a few decode steps, and is exact for full attention
    (which allocates 256 tokens at a time)."""
    import mlx.core as mx

    from mlxserve.cache.quantized import make_cache
    from mlxserve.cache.sizes import _arrays, kv_footprint

    model = tiny(shape).model
    chunk = 128
    footprint = kv_footprint(model, make_cache(model), chunk)
    for n in (40, 300):
        cache, peak = make_cache(model), 0
        steps = [min(chunk, n - a) for a in range(0, n, chunk)] + [1] * 3
        for size in steps:
            model(mx.zeros((1, size), mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            peak = max(peak, sum(a.nbytes for c in cache for a in _arrays(c.state)))
        estimate = footprint.bytes(n + 3)
        assert estimate >= peak, (n, estimate, peak)
        if not footprint.capped and not footprint.fixed:
            assert estimate == peak


def test_kv_budget_counts_batches_at_their_longest_row():
    from mlxserve.cache.sizes import KVFootprint
    from mlxserve.engine.guard import InsufficientMemoryError, KVBudget

    # 512 bytes a token, allocated 256 tokens (128 KB) at a time; 448 KB: three and a half steps.
    budget = KVBudget(KVFootprint(per_token=512, step=256), 448 * 1024)
    assert budget.admits([], 5000)  # alone, always: the queue must move
    assert budget.admits([200], 200) and budget.admits([200, 200], 200)  # 3 x 128 KB
    assert not budget.admits([300], 10)  # 2 rows padded to 512 tokens: 512 KB (their sum, 384 KB, would fit)
    paged = KVBudget(KVFootprint(per_token=512, step=256), 448 * 1024, per_row=True)  # --kv-layout paged
    assert paged.admits([300], 10) and not paged.admits([300, 10], 300)  # 384 KB; 640 KB
    assert budget.check(100, 600, explicit=True) == 600
    assert budget.check(100, 4000, explicit=False) == 668  # what fits: 768 tokens in all
    with pytest.raises(InsufficientMemoryError, match="--kv-memory"):
        budget.check(100, 669, explicit=True)
    with pytest.raises(InsufficientMemoryError):
        budget.check(800, 10, explicit=False)  # the prompt alone does not fit
