"""The web page's HTTP side: its files at / and /web/*, and the stats it reads
(GET /v1/stats, GET /v1/stats/stream). The page itself runs in test_web_browser.py."""

import json
import threading
import time

import httpx
import pytest


def chat(server, headers=None, max_tokens=6):
    body = {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stats(server, headers=None):
    r = httpx.get(server.base_url + "/stats", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server, until, interval=0.2, during=None, headers=None):
    """Events of /v1/stats/stream until `until(events)` is true; `during(events)` runs after
    each one is read (while the server keeps sending: later events queue up meanwhile)."""
    events = []
    with httpx.stream("GET", server.base_url + "/stats/stream", params={"interval": interval},
                      headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if during is not None:
                    during(events)
                if until(events):
                    break
    return events


def test_the_page_and_its_files_are_served(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for name, kind in (("app.js", "text/javascript"), ("chat.js", "text/javascript"),
                       ("dashboard.js", "text/javascript"), ("style.css", "text/css")):
        # The page loads every file it ships, by relative paths (it works under a path prefix).
        assert f'"web/{name}"' in page
        f = httpx.get(server.url + "/web/" + name)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind), name
        assert len(f.content) > 500
    missing = httpx.get(server.url + "/web/../api/server.py")
    assert missing.status_code == 404
    assert httpx.get(server.url + "/web/secret.txt").json()["error"]["code"] == "not_found"


def test_with_an_api_key_the_page_is_public_and_its_stats_are_not(server, api_key):
    assert httpx.get(server.url + "/").status_code == 200
    assert httpx.get(server.url + "/web/app.js").status_code == 200
    for path in ("/stats", "/stats/stream"):
        r = httpx.get(server.base_url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(server.base_url + path, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401
    assert stats(server, {"Authorization": f"Bearer {api_key}"})["model"] == "qwen3-tiny"


def test_stats_count_what_a_request_did(server):
    before = stats(server)
    assert before["status"] == "ok" and before["engine"]["alive"]
    assert before["engine"]["max_num_seqs"] == 16
    out = chat(server)
    after = stats(server)
    usage = out["usage"]
    q0, q1 = before["requests"], after["requests"]
    assert q1["generation_tokens"] - q0["generation_tokens"] == usage["completion_tokens"]
    assert q1["prompt_tokens"] - q0["prompt_tokens"] == usage["prompt_tokens"]
    finished = out["choices"][0]["finish_reason"]
    assert q1["finished"].get(finished, 0) == q0["finished"].get(finished, 0) + 1
    assert q1["mean_ttft_s"] > 0 and q1["mean_e2e_s"] >= q1["mean_ttft_s"]
    assert q1["http_statuses"]["200"] > q0["http_statuses"]["200"]
    p0, p1 = before["caches"]["prefix_cache"], after["caches"]["prefix_cache"]
    assert p1["queries"] == p0["queries"] + 1
    assert p1["queried_tokens"] - p0["queried_tokens"] == usage["prompt_tokens"]
    assert "vision_cache" not in after["caches"]  # a text-only model has no vision cache
    m = after["memory"]
    assert m["mlx_active_bytes"] > 0 and m["process_rss_bytes"] > 0
    assert m["prefix_cache_bytes"] == p1["bytes"] and m["prefix_cache_budget_bytes"] == p1["budget"]


def test_the_stream_gives_rates_between_snapshots(server):
    done = []

    def ask(events):
        if len(events) == 2:  # after two snapshots; the ones sent meanwhile see it happen
            chat(server, max_tokens=8)
            done.append(time.time())

    events = stream_events(server, lambda ev: done and ev[-1]["time"] > done[0], during=ask)
    assert events[0]["rates"]["generation_tokens_per_s"] is None  # nothing to compare with yet
    assert events[1]["rates"]["prefix_hit_rate"] is None  # no lookup in that interval: a gap, not 0
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    later = [e["rates"] for e in events[2:]]
    # The per-second rates over the intervals that saw the request add up to its tokens.
    assert sum(r["generation_tokens_per_s"] * r["interval_s"] for r in later) == pytest.approx(8)
    assert any(r["generation_tokens_per_s"] > 0 for r in later)
    looked = [r["prefix_hit_rate"] for r in later if r["prefix_hit_rate"] is not None]
    assert len(looked) == 1 and 0 <= looked[0] <= 1  # one request, one lookup


def test_the_stream_refuses_a_bad_interval(server):
    for value in ("0", "61", "fast"):
        r = httpx.get(server.base_url + "/stats/stream", params={"interval": value}, timeout=10)
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_stream_keeps_its_pace_while_the_engine_is_busy(server):
    """A long engine step (a big prefill on a CPU) holds the MLX thread: the stream still
    sends a snapshot each interval, without the cache stats it could not read yet."""
    release = threading.Event()
    busy = server.engine.call(lambda: release.wait(20))
    try:
        start = time.monotonic()
        events = stream_events(server, lambda ev: len(ev) == 3)
        took = time.monotonic() - start
    finally:
        release.set()
    busy.result(10)
    assert took < 3
    assert all(e["caches"] is None for e in events)
    assert all(e["engine"]["alive"] for e in events)
    assert stats(server)["caches"]["prefix_cache"]["enabled"]  # and the engine lives on


def test_the_stream_ends_when_the_server_shuts_down(server):
    """An open dashboard must not hold up a shutdown: the stream ends once draining starts."""
    seen = []

    def drain(i):
        if i == 0:
            server.state.draining = True

    try:
        start = time.monotonic()
        with httpx.stream("GET", server.base_url + "/stats/stream", params={"interval": 0.2},
                          timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                    drain(len(seen) - 1)
        took = time.monotonic() - start
    finally:
        server.state.draining = False
    assert 1 <= len(seen) <= 2 and took < 5


def test_stats_of_a_stopped_engine_say_so(tiny):
    """The dashboard must still draw when the engine is gone: the status says why, and the
    cache stats (read on the engine's thread) are absent instead of an error."""
    from conftest import LiveServer

    live = LiveServer(tiny("qwen3-tiny"))
    try:
        live.engine.stop()
        snap = stats(live)
        assert snap["status"] == "dead" and snap["reason"] == "the engine is not running"
        assert snap["caches"] is None and snap["engine"]["alive"] is False
        assert snap["memory"]["prefix_cache_bytes"] is None
        events = stream_events(live, lambda ev: len(ev) == 2)
        assert [e["status"] for e in events] == ["dead", "dead"]
    finally:
        live.close()
