"""Vision-language models over HTTP: images by data URL, file and http are one cache entry; bad media is a 400."""

import base64
import http.server
import io
import threading
import time

import pytest

from mlxserve.config import EngineConfig
from tests.test_vlm import data_url, picture, png_bytes, video_url


# ---- over HTTP ----


class _Files(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(3)
        return super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_site(tmp_path_factory):
    """A local HTTP server over a temporary folder of pictures."""
    root = tmp_path_factory.mktemp("media")
    handler = lambda *a, **kw: _Files(*a, directory=str(root), **kw)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.handle_error = lambda *a: None  # the slow response's client has gone: a broken pipe
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def vlm_server(tiny, media_site):
    from conftest import LiveServer

    from mlxserve.config import ServerConfig

    root, _ = media_site
    live = LiveServer(tiny("qwen2.5-vl-tiny"), EngineConfig(block_size=16),
                      ServerConfig(allowed_local_media_path=str(root), media_fetch_timeout=1.0,
                                   max_media_bytes=200_000, max_image_pixels=1_000_000))
    yield live
    live.close()


def ask(server, url, **extra):
    import httpx

    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is this?"}]}],
            "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)


def stats(server):
    import httpx

    return httpx.get(server.base_url + "/cache/stats").json()


def test_same_picture_by_data_url_file_and_http_is_one_entry(vlm_server, media_site):
    import openai

    root, site = media_site
    image = picture(7)
    (root / "a.png").write_bytes(png_bytes(image, compress_level=1))
    (root / "b.png").write_bytes(png_bytes(image, compress_level=9))  # other bytes, same pixels
    limits = vlm_server.state.media_limits
    limits.allow_private_urls = True  # the test site is on 127.0.0.1
    try:
        client = openai.OpenAI(base_url=vlm_server.base_url, api_key="unused")
        before = stats(vlm_server)["vision_cache"]
        answers = []
        for url in (data_url(image), (root / "a.png").as_uri(), f"{site}/b.png"):
            r = client.chat.completions.create(
                model="qwen2.5-vl-tiny", max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "Describe the picture."}]}])
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
    finally:
        limits.allow_private_urls = False
    after = stats(vlm_server)["vision_cache"]
    import httpx

    metrics = httpx.get(vlm_server.url + "/metrics").text
    assert f"vision_cache_entries {float(after['entries'])}" in metrics
    assert f"vision_cache_misses_total {float(after['misses'])}" in metrics
    assert f"vision_cache_released_total {float(after['released'])}" in metrics
    # One image: encoded once, then dropped once its KV was cached (later requests restore that).
    assert after["released"] - before["released"] == 1 and after["entries"] == before["entries"]
    assert after["misses"] - before["misses"] == 1
    assert len({a for a, _ in answers}) == 1
    assert answers[0][1] == 0 and answers[1][1] > 0 and answers[2][1] > 0


def test_bad_media_gets_a_400_naming_the_part(vlm_server, media_site, server, tmp_path):
    root, site = media_site
    png = png_bytes(picture(8))
    (root / "big.png").write_bytes(png_bytes(picture(9, (600, 600))))  # > 200 kB of noise
    (root / "slow.png").write_bytes(png)
    outside = tmp_path / "outside.png"
    outside.write_bytes(png)
    flat = io.BytesIO()
    picture(0, (1, 1)).resize((1200, 1200)).save(flat, "PNG")  # 1.44 MP, a few kB
    cases = {
        "not an image": "data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(),
        "truncated": "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode(),
        "bad base64": "data:image/png;base64,@@@",
        "scheme": "ftp://example.com/a.png",
        "too many pixels": "data:image/png;base64," + base64.b64encode(flat.getvalue()).decode(),
        "too many bytes": (root / "big.png").as_uri(),
        "private address": f"{site}/slow.png",
        "outside allowed dirs": outside.as_uri(),
        "traversal": (root / ".." / outside.parent.name / "outside.png").as_uri(),
    }
    before = stats(vlm_server)
    for name, url in cases.items():
        r = ask(vlm_server, url)
        print(name, "->", r.json()["error"]["message"])
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].startswith("messages[0].content[0]"), name
    vlm_server.state.media_limits.allow_private_urls = True
    try:
        r = ask(vlm_server, f"{site}/slow.png")  # the server answers after 3 s; the limit is 1 s
    finally:
        vlm_server.state.media_limits.allow_private_urls = False
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]
    after = stats(vlm_server)
    for cache in ("prefix_cache", "vision_cache"):
        assert after[cache]["bytes"] == before[cache]["bytes"], cache
    # A text-only model refuses images.
    r = ask(server, data_url(picture(1)))
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    # The server still serves.
    assert ask(vlm_server, data_url(picture(1))).status_code == 200


def test_image_example_runs(vlm_server):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MLXSERVE_BASE_URL": vlm_server.base_url}
    out = subprocess.run([sys.executable, str(root / "docs/examples/openai_image.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = [int(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("[")]
    assert second > first  # the second question reuses the image's blocks, not only the text before it


def test_anthropic_client_sends_images(vlm_server):
    import anthropic

    client = anthropic.Anthropic(base_url=vlm_server.url, api_key="unused")
    png = base64.b64encode(png_bytes(picture(21))).decode()
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
               {"type": "text", "text": "What is in this picture?"}]
    first = client.messages.create(model="qwen2.5-vl-tiny", max_tokens=4, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": content}])
    again = client.messages.create(model="qwen2.5-vl-tiny", max_tokens=4, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": content}])
    assert first.content[0].text == again.content[0].text
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="qwen2.5-vl-tiny", messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    bad = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="qwen2.5-vl-tiny", max_tokens=4, messages=[{"role": "user", "content": bad}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.body["error"]["message"]


def test_video_over_http_and_bad_video(vlm_server, tiny):
    import httpx

    from mlxserve.multimodal.media import MediaLimits
    from mlxserve.multimodal.prompt import ImagePartError, prepare_images

    def ask_video(url):
        body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                          {"type": "text", "text": "What happens?"}]}],
                "max_tokens": 3, "temperature": 0}
        return httpx.post(vlm_server.base_url + "/chat/completions", json=body, timeout=60)

    assert ask_video(video_url(seed=3)).status_code == 200
    r = ask_video("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode())
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content[0]")
    with pytest.raises(ImagePartError, match="not video"):  # Gemma 3 takes images only
        prepare_images(tiny("gemma3-vl-tiny").vision, [("part", video_url(), "video")], MediaLimits())


@pytest.mark.parametrize("shape", ["qwen3-vl-tiny", "qwen3.5-vl-tiny"])
def test_generic_video_over_http_matches_mlx_vlm(tiny, shape):
    """A video_url part to Qwen3-VL / Qwen3.5: mlx-vlm's whole-prompt tokens, and a repeat hits the cache."""
    import httpx
    from conftest import LiveServer

    from mlxserve.multimodal.prompt import chat_prompt
    from tests.test_vlm import mlx_vlm_greedy
    from tests.test_vlm_video import clip_url, frames_of, mlx_vlm_video_inputs, video_message

    loaded = tiny(shape)
    url = clip_url(seed=7)
    live = LiveServer(loaded, EngineConfig(block_size=16, prefill_chunk_size=5))
    try:
        body = {"messages": [video_message(url)], "max_tokens": 6, "temperature": 0}
        first, again = (httpx.post(live.base_url + "/chat/completions", json=body, timeout=60) for _ in range(2))
    finally:
        live.close()
    assert first.status_code == again.status_code == 200, first.text
    ids, _ = chat_prompt(loaded, [video_message(url)])
    want = mlx_vlm_greedy(loaded.vision, ids, 6, **mlx_vlm_video_inputs(loaded.vision, frames_of(url)))
    assert first.json()["choices"][0]["message"]["content"] == loaded.tokenizer.decode(want)
    assert again.json()["choices"][0]["message"]["content"] == loaded.tokenizer.decode(want)
    assert first.json()["usage"]["prompt_tokens"] == len(ids)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
