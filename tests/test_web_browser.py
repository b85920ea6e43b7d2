"""The web page in a real browser (Chromium driven by Playwright) against a live server with
a tiny random-weight VLM and --api-key on: the page asks for the key, streams an answer,
sends images by file picker, drop and paste, and its dashboard follows the server.

Skipped, with the reason, where Playwright or a Chromium is missing (`./install.sh --test`
installs both on Debian/Ubuntu). MLXSERVE_CHROMIUM names another Chromium binary.
"""

import base64
import json
import os
import shutil

import httpx
import pytest

from mlxserve.config import EngineConfig
from tests.test_vlm import picture, png_bytes

KEY = "sk-web-test"
MODEL = "qwen2.5-vl-tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


def chromium_path(playwright) -> str:
    for path in (os.environ.get("MLXSERVE_CHROMIUM"), shutil.which("chromium"),
                 shutil.which("chromium-browser"), playwright.chromium.executable_path):
        if path and os.path.exists(path):
            return path
    pytest.skip("no Chromium: apt-get install chromium (or set MLXSERVE_CHROMIUM)")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: "
                                   "pip install '.[test]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(p))
        yield b
        b.close()


@pytest.fixture(scope="module")
def web_server(tiny, browser):  # after the browser: a skip starts no server
    from conftest import LiveServer

    from mlxserve.config import ServerConfig

    live = LiveServer(tiny(MODEL), EngineConfig(block_size=16), ServerConfig(api_key=KEY))
    yield live
    live.close()


@pytest.fixture
def page(browser, web_server):
    """A fresh browser context whose page already holds the key (as after the key dialog)."""
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    context.add_init_script(f"localStorage.setItem('mlxserve.apiKey', {KEY!r})")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors  # no script error on the page


def server_stats(server) -> dict:
    return httpx.get(server.base_url + "/stats", headers=AUTH, timeout=30).json()


def ask(page, text, max_tokens=24):
    """Types a message, sends it and waits for the answer to finish; returns its bubble."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", text)
    before = page.locator(".msg.assistant").count()
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(before)
    answer.locator(".meta").filter(has_text="generated").wait_for(timeout=60_000)
    return answer


def png_file(seed: int) -> dict:
    return {"name": f"picture{seed}.png", "mimeType": "image/png", "buffer": png_bytes(picture(seed))}


def test_the_page_asks_for_the_key_and_streams_an_answer(browser, web_server):
    context = browser.new_context()
    page = context.new_page()
    page.goto(web_server.url + "/")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")  # the first /v1 call got a 401
    page.fill("#key-input", "wrong")
    page.click("#key-ok")
    page.locator("#key-error").filter(has_text="refused").wait_for()  # asked again
    page.fill("#key-input", KEY)
    page.click("#key-ok")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    assert page.locator("#model option").all_inner_texts() == [MODEL]

    # Each change of the answer's text, as the browser saw it while the answer streamed.
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant.streaming .content');
            if (a) window.seen.push(a.textContent.length);
        }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true});
    }""")
    answer = ask(page, "Tell me a story.", max_tokens=40)
    text = answer.locator(".content").evaluate("e => e.textContent")
    seen = page.evaluate("window.seen")
    growing = sorted(set(n for n in seen if n > 0))
    assert len(growing) >= 5, seen  # the text grew piece by piece, not all at the end
    assert growing[-1] <= len(text)
    assert answer.get_attribute("data-completion-tokens") == "40"
    assert answer.get_attribute("data-finish") == "length"

    # The same request without streaming gives the same text: the page's SSE reading
    # loses and adds nothing.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 40, "temperature": 0}
    r = httpx.post(web_server.base_url + "/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == text
    context.close()


def test_images_by_file_drop_and_paste_reach_the_model(page, web_server):
    page.goto(web_server.url + "/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    plain = ask(page, "Describe.")
    text_only = int(plain.get_attribute("data-prompt-tokens"))
    page.click("#clear")

    before = server_stats(web_server)["caches"]["vision_cache"]
    page.set_input_files("#file", files=[png_file(1)])
    # A synthetic drop and a synthetic paste, each with a file, as the browser would make them.
    for seed, how in ((2, "drop"), (3, "paste")):
        data = base64.b64encode(png_bytes(picture(seed))).decode()
        page.evaluate("""([data, how]) => {
            const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], how + '.png', {type: 'image/png'}));
            if (how === 'drop')
                document.querySelector('#messages').dispatchEvent(
                    new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
            else
                document.querySelector('#prompt').dispatchEvent(
                    new ClipboardEvent('paste', {clipboardData: transfer, bubbles: true, cancelable: true}));
        }""", [data, how])
    page.wait_for_function("document.querySelectorAll('#thumbs img').length === 3")
    answer = ask(page, "Describe.")
    assert page.locator("#thumbs img").count() == 0  # sent: the composer is empty again
    assert page.locator(".msg.user .sent-image").count() == 3
    after = server_stats(web_server)["caches"]["vision_cache"]
    assert after["misses"] - before["misses"] == 3  # three new pictures went through the tower
    # Each picture adds its tokens (16 at most here, and markers) to the prompt.
    assert int(answer.get_attribute("data-prompt-tokens")) >= text_only + 3 * 4


def test_the_dashboard_follows_the_server(page, web_server):
    page.goto(web_server.url + "/#dashboard")
    page.locator("#dash-status").filter(has_text="updated").wait_for()
    assert page.locator("#dash-status").inner_text().startswith(MODEL + " · ok")
    generated = page.locator("#t-totals tr[data-key=generation_tokens] td")
    start = int(generated.inner_text())
    assert page.locator("#d-vision").inner_text() != "no vision tower"

    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(png_bytes(picture(9))).decode()}},
        {"type": "text", "text": "What is it?"}]}], "max_tokens": 30, "temperature": 0}
    r = httpx.post(web_server.base_url + "/chat/completions", json=body, headers=AUTH, timeout=60)
    done = r.json()["usage"]["completion_tokens"]

    # Within a few snapshots the totals count the request, the tokens/s chart has drawn it,
    # and the vision cache's hit rate is a number.
    page.wait_for_function(f"+document.querySelector('#t-totals tr[data-key=generation_tokens] td')"
                           f".textContent === {start + done}", timeout=10_000)
    assert page.locator("#c-tps polyline").count() >= 1
    assert page.locator("#d-vision").inner_text().endswith("%")
    finished = page.locator("#t-totals tr[data-key=finished] td").inner_text()
    assert "length" in finished or "stop" in finished
    assert page.locator("#t-models tr").first.inner_text().split("\t")[0] == MODEL
    assert page.locator("#t-models td").first.inner_text().startswith("loaded")  # /v1/models' state
    misses = page.locator("#t-misses tr[data-key=queries] td")
    assert int(misses.inner_text()) >= 1
    memory = page.locator("#t-memory tr[data-key=mlx_active] td").inner_text()
    assert memory.endswith("iB")


def test_reasoning_is_shown_apart_and_errors_are_shown(page, web_server):
    """The page's side of a reasoning model's stream and of errors. The tiny models here do
    not reason, so this test answers /v1/chat/completions itself (Playwright's routing):
    the SSE body a reasoning model's server sends, in OpenAI's chunk shape."""
    def chunk(delta, finish=None):
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    thinking, answer = ["The user ", "greets me", "."], ["Hello", " there!"]
    body = "".join([chunk({"role": "assistant"}), *(chunk({"reasoning_content": t}) for t in thinking),
                    *(chunk({"content": t}) for t in answer), chunk({}, "stop"),
                    "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6,
                                                                    "prompt_tokens_details": {"cached_tokens": 0}}}),
                    "\n\ndata: [DONE]\n\n"])
    replies = [dict(status=200, content_type="text/event-stream", body=body),
               dict(status=200, content_type="text/event-stream",
                    body=chunk({"content": "Hal"}) + 'data: {"error": {"message": "The engine failed."}}\n\n'
                    "data: [DONE]\n\n"),
               dict(status=400, content_type="application/json",
                    body=json.dumps({"error": {"message": "max_tokens is too large", "type": "x",
                                               "param": None, "code": None}}))]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(**replies.pop(0)))
    page.goto(web_server.url + "/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")

    first = ask(page, "Hi")
    reasoning = first.locator(".reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # folded once answered
    assert reasoning.locator(".reasoning-text").text_content() == "".join(thinking)
    assert first.locator(".content").text_content() == "".join(answer)
    assert first.get_attribute("data-finish") == "stop"
    reasoning.locator("summary").click()
    assert reasoning.get_attribute("open") is not None

    page.fill("#prompt", "Again")
    page.press("#prompt", "Enter")
    second = page.locator(".msg.assistant").nth(1)
    second.locator(".error").filter(has_text="The engine failed.").wait_for()
    assert second.locator(".content").text_content() == "Hal"

    page.fill("#prompt", "Once more")
    page.press("#prompt", "Enter")
    third = page.locator(".msg.assistant").nth(2)
    third.locator(".error").filter(has_text="400: max_tokens is too large").wait_for()
    assert not page.locator("#send").is_disabled()  # ready for the next message


def test_models_with_states_are_listed_with_them(page, web_server):
    """A server with several models says each one's state in /v1/models (this one serves a
    single model and says none, so the test answers that route itself): the picker lists
    them all, shows the chosen one's state, and the dashboard's table shows every state."""
    models = {"object": "list", "data": [
        {"id": MODEL, "object": "model", "state": "loaded"},
        {"id": "other-model", "object": "model", "state": "loading"}]}
    page.route("**/v1/models", lambda route: route.fulfill(json=models))
    page.goto(web_server.url + "/")
    page.wait_for_function("document.querySelector('#model').options.length === 2")
    assert page.locator("#model-state").inner_text() == "loaded"
    page.select_option("#model", "other-model")
    assert page.locator("#model-state").inner_text() == "loading"
    page.click("#tab-dashboard")
    rows = page.locator("#t-models tr")
    assert rows.count() == 2
    assert rows.nth(0).locator("td").inner_text() == "loaded"
    assert rows.nth(1).locator("td").inner_text() == "loading"

    # The request carries the chosen model: this server refuses one it does not serve.
    page.click("#tab-chat")
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Enter")
    page.locator(".msg.assistant .error").filter(has_text="404: The model 'other-model' does not exist").wait_for()
