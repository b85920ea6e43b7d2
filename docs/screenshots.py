"""Screenshots of the web page for the README: docs/web-chat.png and docs/web-dashboard.png.

    python3 docs/screenshots.py                      # the embedded default model
    python3 docs/screenshots.py MODEL [serve options] # any model `mlxserve serve` takes

Starts `mlxserve serve` on a free port, asks two questions in the chat, then opens the
dashboard while four requests run at once. Needs Playwright and a Chromium (the same as
tests/test_web_browser.py: `./install.sh --test`); MLXSERVE_CHROMIUM names another binary.
"""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
# (question, max_tokens): short answers, so both turns fit on the screenshot.
QUESTIONS = [("Write a short Python function that tells whether a number is prime.", 110),
             ("Why does it stop at the square root? One sentence.", 50)]
LOAD = "Explain what a prefix cache does in an inference server, in one paragraph."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "mlxserve.cli", "serve", *args, "--port", str(port)],
                            cwd=ROOT, env=env)
    deadline = time.monotonic() + 600  # loading a model on a small CPU takes a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    sys.exit("the server did not start within 10 minutes")


def chromium() -> str | None:
    for path in (os.environ.get("MLXSERVE_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.path.exists(path):
            return path
    return None  # Playwright's own browser, if `playwright install chromium` was run


def ask(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0.2")
    page.fill("#prompt", text)
    before = page.locator(".msg.assistant").count()
    page.press("#prompt", "Enter")
    page.locator(".msg.assistant").nth(before).locator(".meta").filter(has_text="generated").wait_for(
        timeout=600_000)


def load(url: str, model: str, n: int) -> list[threading.Thread]:
    """n streamed requests at once, so the dashboard shows a batch running."""
    body = {"model": model, "messages": [{"role": "user", "content": LOAD}], "max_tokens": 60,
            "stream": True}

    def one():
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for _ in r.iter_bytes():
                pass

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(sys.argv[1:], port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium())
            page = browser.new_page(viewport={"width": 1200, "height": 1040})
            page.goto(url + "/")
            page.wait_for_function("document.querySelector('#model').options.length > 0")
            model = page.input_value("#model")
            for question, max_tokens in QUESTIONS:
                ask(page, question, max_tokens)
            page.screenshot(path=str(ROOT / "docs" / "web-chat.png"))

            page.goto(url + "/#dashboard")  # the same document: the charts keep the chat's seconds
            page.set_viewport_size({"width": 1200, "height": 600})
            threads = load(url, model, 4)
            # Once all four are past their prefill and generating (minutes on a busy CPU).
            page.wait_for_function("document.querySelector('#d-running').textContent === '4' && "
                                   "parseFloat(document.querySelector('#d-tps').textContent) > 0",
                                   timeout=600_000)
            time.sleep(5)
            page.screenshot(path=str(ROOT / "docs" / "web-dashboard.png"))
            for t in threads:
                t.join()
            browser.close()
    finally:
        server.terminate()
        server.wait(60)
    print("wrote docs/web-chat.png and docs/web-dashboard.png")


if __name__ == "__main__":
    main()
