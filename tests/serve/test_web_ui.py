"""The chat page at / in a real browser (Chromium through Playwright) against the tiny model:
streaming, stop, reload, safe markdown, the API-key prompt and error messages."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from nanoqwen.serve.app import ServerConfig, build_app

from .serve_harness import Server, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING: list[str] = []
if importlib.util.find_spec("playwright") is None:
    MISSING.append("playwright (pip install playwright)")
if CHROMIUM is None:
    MISSING.append("chromium on PATH (apt-get install chromium)")
TIMEOUT_MS = 30_000
ANSWER_DONE = ".message.assistant:not(.streaming) .stats:not(:empty)"
STREAMING_TEXT = "document.querySelector('.message.assistant.streaming .body')?.textContent"


@pytest.fixture(scope="module")
def browser():
    if MISSING:
        reason = "browser tests need " + "; ".join(MISSING)
        if os.environ.get("CI") == "true":  # CI must run them, never skip them quietly
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


class Page:
    """A fresh browser context (empty localStorage) on the server's page; collects console
    errors, uncaught exceptions and dialogs."""

    def __init__(self, browser, server: Server) -> None:
        self.context = browser.new_context()
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("dialog", self._dialog)
        self.url = f"{server.url}/"

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def open(self) -> None:
        self.page.goto(self.url)
        self.page.wait_for_function(
            "() => document.getElementById('model-name').textContent !== '…'"
        )

    def settings(self, max_tokens: str, temperature: str = "0") -> None:
        self.page.click("#settings summary")
        self.page.fill("#max-tokens", max_tokens)
        self.page.fill("#temperature", temperature)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def web(browser, tiny_server):
    page = Page(browser, tiny_server)
    yield page
    page.close()


def test_page_and_files_are_served_without_a_key(strict_server):
    page = httpx.get(f"{strict_server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    types = {
        "/web/app.js": "text/javascript",
        "/web/style.css": "text/css",
        "/web/vendor/marked/marked.umd.js": "text/javascript",
        "/web/vendor/dompurify/purify.min.js": "text/javascript",
    }
    for path, content_type in types.items():
        r = httpx.get(f"{strict_server.url}{path}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(content_type), path
    assert httpx.get(f"{strict_server.url}/v1/models").status_code == 401
    missing = httpx.get(f"{strict_server.url}/web/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_no_web_ui_makes_the_page_a_404():
    engine = SimpleNamespace()  # no lifespan runs: the routes are only listed, not served
    app = build_app(engine, SimpleNamespace(tokenizer=None), ServerConfig("m", web_ui=False))
    client = TestClient(app)
    for path in ("/", "/web/app.js"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path


def test_answer_streams_shows_its_speed_and_survives_a_reload(web):
    web.open()
    web.settings(max_tokens="400")
    web.send("Write a long story.")
    web.page.wait_for_function(f"() => ({STREAMING_TEXT} ?? '').length > 0")
    web.page.wait_for_selector(ANSWER_DONE)
    stats = web.page.text_content(".message.assistant .stats")
    assert "TTFT" in stats and "tok/s" in stats and "stopped" not in stats
    answer = web.page.text_content(".message.assistant .body")
    assert answer

    web.page.reload()
    web.page.wait_for_selector(ANSWER_DONE)
    assert web.page.text_content(".message.user .body") == "Write a long story."
    assert web.page.text_content(".message.assistant .body") == answer
    assert web.page.text_content("#conversations .open") == "Write a long story."
    assert web.errors == []


def test_stop_aborts_the_answer_and_frees_the_sequence(web, tiny_server):
    aborted = tiny_server.metrics().get("nanoqwen:request_success_total{abort}", 0)
    web.open()
    web.settings(max_tokens="2000")  # far longer than the test waits
    web.send("Count to a thousand.")
    web.page.wait_for_function(f"() => ({STREAMING_TEXT} ?? '').length > 0")
    web.page.click("#stop")
    web.page.wait_for_selector(ANSWER_DONE)
    assert "stopped" in web.page.text_content(".message.assistant .stats")
    assert web.page.is_visible("#send") and not web.page.is_visible("#stop")
    wait_for(
        tiny_server,
        lambda m: (
            m["nanoqwen:num_requests_running"] == 0
            and m.get("nanoqwen:request_success_total{abort}", 0) == aborted + 1
        ),
        "the server aborting the stopped answer",
    )
    assert web.errors == []


XSS = """\
<script>window.pwned = 1; alert("script")</script>

<img src=x onerror="window.pwned = 2; alert('img')">

Inline <img src=y onerror=alert('inline')> and [a link](javascript:alert('link')).

```python
print("<script>alert('code')</script>")
```
"""


def test_model_output_is_shown_as_text_and_never_runs(web):
    web.open()
    web.page.evaluate(
        """(text) => {
            const probe = document.createElement("div");
            probe.id = "probe";
            document.body.append(probe);
            renderMarkdown(probe, text);
        }""",
        XSS,
    )
    web.page.wait_for_timeout(300)  # time for an onerror to fire, were there one
    probe = web.page.locator("#probe")
    assert probe.locator("script, img, [onerror]").count() == 0
    assert web.page.evaluate("window.pwned") is None
    text = probe.text_content()
    assert "<script>window.pwned = 1;" in text and "<img src=x onerror=" in text
    assert probe.locator("a").get_attribute("href") is None  # javascript: is dropped
    assert probe.locator("pre .copy").count() == 1
    assert "alert('code')" in probe.locator("pre code").text_content()
    assert web.dialogs == [] and web.errors == []


def test_the_page_asks_for_the_key_and_then_works(browser, strict_server, api_key):
    web = Page(browser, strict_server)
    try:
        web.page.goto(web.url)
        web.page.wait_for_selector("#key-dialog[open]")
        web.page.fill("#key-input", "wrong-key")
        web.page.click("#key-save")
        web.page.wait_for_selector("#key-dialog[open]")  # asked again
        web.page.fill("#key-input", api_key)
        web.page.click("#key-save")
        web.page.wait_for_function(
            "() => document.getElementById('model-name').textContent === 'tiny'"
        )
        web.settings(max_tokens="8")
        web.send("hello")
        web.page.wait_for_selector(ANSWER_DONE)
        assert web.page.locator(".message.error").count() == 0
        assert web.page.evaluate("localStorage.getItem('nanoqwen.apiKey')") == api_key
        # The browser logs each 401 itself; nothing else may fail.
        assert all("401" in e for e in web.errors), web.errors
    finally:
        web.close()


def test_a_server_error_shows_in_the_conversation(web):
    web.open()
    web.settings(max_tokens="5000")  # over the tiny model's 2,048-token context
    web.send("hello")
    error = web.page.wait_for_selector(".message.error")
    assert "over the model's context length of 2048 tokens" in error.text_content()
    assert web.page.locator(".message.assistant").count() == 0
    assert web.page.is_visible("#send")
    assert all("400" in e for e in web.errors), web.errors  # the browser logs the 400


def test_an_error_event_in_a_stream_shows_after_the_partial_answer(web):
    # A real server sends one only when its engine fails mid-answer: the stream is faked here.
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "partial "}}]},
        {"choices": [{"index": 0, "delta": {"content": "answer"}}]},
        {"error": {"message": "the engine failed: it was killed", "type": "internal_error"}},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    web.page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body),
    )
    web.open()
    web.send("hello")
    error = web.page.wait_for_selector(".message.error")
    assert "the engine failed: it was killed" in error.text_content()
    assert web.page.text_content(".message.assistant .body").strip() == "partial answer"
    assert web.errors == []
