"""`mlxserve bench soak` for a few seconds against the session's tiny server: the report's
structure, and the client's own aborts counted as aborts, never as errors."""

import argparse
import asyncio
import json
import os

import httpx


def soak_args(*argv):
    from mlxserve.bench import soak

    parser = argparse.ArgumentParser()
    soak.add_parser(parser.add_subparsers())
    args = parser.parse_args(["soak", *argv])
    args.endpoint, args.ignore_eos = "chat", True  # as run() sets them, for direct soak_request calls
    return args


def finished(server, reason: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    return sum(int(s.value) for s in families["mlxserve_request_finished"].samples
               if s.name.endswith("_total") and s.labels["reason"] == reason)


def test_soak_writes_a_report_and_aborts_are_not_errors(server, tmp_path):
    aborts_before = finished(server, "abort")
    # The server runs in this process, so its RSS is this process's.
    args = soak_args("--url", server.base_url, "--server-pid", str(os.getpid()), "--streams", "4",
                     "--minutes", "0.1", "--interval", "1", "--prompt-len", "8-48", "--max-tokens", "16-48",
                     "--abort-rate", "0.5", "--out-dir", str(tmp_path))
    code = args.func(args)

    (md,), (js,), (png,) = (list(tmp_path.glob(f"soak-cpu-*.{ext}")) for ext in ("md", "json", "png"))
    data = json.loads(js.read_text())
    assert data["info"]["commit"] and data["info"]["backend"] == "cpu"
    r = data["results"]
    t = r["totals"]
    assert t["aborted"] > 0 and t["ok"] > 0, t
    assert t["errors"] == 0 and t["error_messages"] == [] and r["verdict"]["checks"]["no errors"] is True
    # The aborts reached the server as aborts, and each freed its slot and its cache blocks.
    assert finished(server, "abort") > aborts_before
    assert r["after"]["running"] == 0 and r["after"]["waiting"] == 0 and r["after"]["in_use_blocks"] == 0
    assert r["verdict"]["checks"]["engine idle after the run"] is True

    samples = r["samples"]
    assert len(samples) >= 6 and samples[0]["t"] == 0 and samples[-1]["t"] >= 6
    assert sum(s["requests"] for s in samples) == t["requests"]  # every ended request in exactly one interval
    assert sum(s["aborted"] for s in samples) == t["aborted"]
    for s in samples:
        assert s["rss_bytes"] > 0 and s["mlx_peak_bytes"] >= s["mlx_active_bytes"] > 0
        assert s["prefix_cache_bytes"] is not None and s["vision_cache_bytes"] is None  # a text-only model
    assert any(s["ttft_p50_ms"] > 0 for s in samples[1:])
    for key in ("rss_bytes", "mlx_active_bytes"):
        memory = r["verdict"]["memory"][key]
        assert memory["samples"] >= 3 and memory["flat"] in (True, False), memory
    assert r["verdict"]["outcome"] in ("PASS", "FAIL") and code == (0 if r["verdict"]["outcome"] == "PASS" else 1)

    text = md.read_text()
    assert "commit:" in text and "backend: cpu" in text and f"## Verdict: {r['verdict']['outcome']}" in text
    assert "| server RSS |" in text and "| MLX active memory |" in text and "## Over time" in text
    assert png.stat().st_size > 5000


def test_a_refused_request_is_an_error_unless_expected(server):
    from mlxserve.bench.soak import soak_request

    args = soak_args()
    req = {"prompt": "hello there", "max_tokens": 4, "abort_after": None, "image": None, "reuse": False,
           "repeat": False, "image_first": False}

    async def send(model, expected):
        async with httpx.AsyncClient(timeout=60) as client:
            return await soak_request(client, server.base_url, args, model, req, expected)

    missing = asyncio.run(send("no-such-model", set()))
    assert missing["outcome"] == "error" and missing["error"].startswith("HTTP 404")
    assert asyncio.run(send("no-such-model", {404}))["outcome"] == "refused"
    model = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
    assert asyncio.run(send(model, set()))["outcome"] == "ok"


def test_traffic_mixes_aborts_prefix_reuse_and_repeated_images():
    from mlxserve.bench.soak import Traffic, png_data_url

    args = soak_args("--prompt-len", "20-40", "--max-tokens", "8-16", "--abort-rate", "0.3")
    traffic = Traffic(args, images=True)
    reqs = [traffic.next() for _ in range(300)]
    assert all(20 <= len(r["prompt"].split()) <= 40 and 8 <= r["max_tokens"] <= 16 for r in reqs)
    aborted = [r for r in reqs if r["abort_after"] is not None]
    assert 0.2 < len(aborted) / len(reqs) < 0.4 and all(1 <= r["abort_after"] < r["max_tokens"] for r in aborted)
    reused = [i for i, r in enumerate(reqs) if r["reuse"]]
    assert 0.1 < len(reused) / len(reqs) < 0.3
    for i in reused:  # begins with (at least 15 words of) an earlier prompt
        head = reqs[i]["prompt"].split()[:15]
        assert any(q["prompt"].split()[:15] == head for q in reqs[:i])
    images = [r for r in reqs if r["image"]]
    repeats = [r for r in images if r["repeat"]]
    assert 0.2 < len(images) / len(reqs) < 0.4 and 0.3 < len(repeats) / len(images) < 0.7
    assert {r["image_first"] for r in images} == {True, False}
    first_sent = {r["image"] for r in images if not r["repeat"]}
    assert len(first_sent) == len(images) - len(repeats) and all(64 <= side <= 448 for side, _ in first_sent)
    assert all(r["image"] in first_sent for r in repeats)  # a repeat sends an image sent before
    side, seed = repeats[0]["image"]
    url = png_data_url(side, seed)
    assert url.startswith("data:image/png;base64,") and png_data_url.__wrapped__(side, seed) == url  # same bytes
    # A text-only model gets no images, and the same seed sends the same requests.
    assert not any(Traffic(args, images=False).next()["image"] for _ in range(50))
    again = Traffic(args, images=True)
    assert [again.next() for _ in range(300)] == reqs
