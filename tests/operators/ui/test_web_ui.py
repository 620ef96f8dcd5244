"""The web UI at ``/``, in a real browser: Debian's chromium driven by Playwright.

Each test starts ``llm-pipeline serve`` (echo engine) as a subprocess and uses the page
as a person would, by labels, roles and the keyboard: a message is answered token by
token with its TTFT shown, Stop aborts the request down to the engine (the in-flight gauge
goes back to 0), with ``--api-key`` the page asks for the key and keeps it for the tab
only, and the status view lists the in-process workers and the last requests' stages.
A screenshot of each view is written to the folder printed in the log
(``$LLM_PIPELINE_ARTIFACTS/ui``, by default under the system's temporary folder).

Playwright never downloads its own browsers here: it drives ``/usr/bin/chromium``
(``.ci/run`` installs the Debian package). Without it these tests skip, except in CI.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="the UI tests need playwright")

from tests.helpers.server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
#: facts.md, "Browsers": what Debian's chromium needs to run headless here
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = (
    Path(
        os.environ.get(
            "LLM_PIPELINE_ARTIFACTS", Path(tempfile.gettempdir()) / "llm-pipeline-artifacts"
        )
    )
    / "ui"
)
TIMEOUT_MS = 15_000

if not CHROMIUM.exists():
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing: .ci/run installs it (apt-get install chromium)")
    pytest.skip(
        f"the UI tests need Debian's chromium at {CHROMIUM}: apt-get install chromium",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # launch() runs chromium on a fresh temporary profile (its --user-data-dir) each time
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A page in a fresh context (its own sessionStorage), failing on any script error."""
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == [], f"script errors on the page: {errors}"


def screenshot(page: Any, name: str, request: pytest.FixtureRequest) -> Path:
    """Save a screenshot of the page and print where it went."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # into the log, as the run goes
            reporter.write_line(f"screenshot of the {name} view: {path}")
    assert path.stat().st_size > 0
    return path


def inflight(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    match = re.search(r"^llm_pipeline_inflight_requests (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match[1])


def wait_until(condition: Any, within: float = 10.0) -> None:
    """Poll ``condition`` (another process's state) until it holds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def answer(page: Any) -> Any:
    return page.locator(".message.assistant").last


def test_a_message_is_answered_token_by_token_with_its_ttft(
    page: Any, request: pytest.FixtureRequest
) -> None:
    server = ServerProcess("--echo-delay-ms", "40")
    try:
        page.goto(server.url + "/")
        model = page.get_by_label("Model")
        sync_api.expect(model.locator("option")).to_have_text(["echo"])
        page.get_by_label("System prompt").fill("Be brief.")
        message = page.get_by_label("Message")
        message.fill("Tell me about pipelines")
        # Watch the answer's text as it changes: each token is a new, longer text.
        page.evaluate(
            """() => {
                window.lengths = [];
                new MutationObserver(() => {
                    const all = document.querySelectorAll('.message.assistant .content');
                    if (all.length) window.lengths.push(all[all.length - 1].textContent.length);
                }).observe(document.getElementById('conversation'),
                           {subtree: true, childList: true, characterData: true});
            }"""
        )
        message.press("Enter")  # the keyboard sends
        reply = answer(page)
        sync_api.expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=TIMEOUT_MS)
        # the TTFT shows while the answer is still streaming
        sync_api.expect(page.get_by_role("button", name="Stop")).to_be_enabled()
        sync_api.expect(reply.locator(".meta")).to_contain_text("tokens/s", timeout=TIMEOUT_MS)
        meta = reply.locator(".meta").inner_text()
        assert re.search(r"TTFT \d+ ms", meta), meta
        assert re.search(r"\d+(\.\d)? tokens/s", meta), meta
        assert float(reply.locator(".meta").get_attribute("data-ttft-ms")) > 0
        lengths = page.evaluate("window.lengths")
        growing = sorted(set(lengths) - {0})
        assert len(growing) >= 10, lengths  # many partial answers, not one at the end
        assert lengths == sorted(lengths)
        text = reply.locator(".content").inner_text()
        assert "Tell me about pipelines" in text  # the echo engine repeats the prompt
        assert "Be brief." in text
        tokens = int(re.search(r"(?<![\d.])(\d+) tokens(?!/)", meta)[1])  # type: ignore[index]
        assert len(growing) <= tokens
        screenshot(page, "chat", request)
        # narrow window: one column, nothing wider than the window
        page.set_viewport_size({"width": 380, "height": 760})
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, "chat-narrow", request)
    finally:
        server.stop()


def test_reasoning_and_tool_calls_are_shown_as_such(page: Any) -> None:
    # The echo engine repeats the prompt: a prompt with a reasoning block and a tool call
    # in the model's markup comes back as reasoning and a call, parsed by the server.
    server = ServerProcess("--reasoning-parser", "think")
    tools = (
        '[{"type": "function", "function": {"name": "get_weather", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}}]'
    )
    try:
        page.goto(server.url + "/")
        sync_api.expect(page.get_by_label("Model").locator("option")).to_have_text(["echo"])
        page.get_by_label("Tools").fill(tools)
        page.get_by_label("Message").fill(
            '<think>pondering the weather</think>Sure. <tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}</tool_call>'
        )
        page.get_by_role("button", name="Send").click()
        reply = answer(page)
        sync_api.expect(reply.locator(".meta")).to_contain_text("finish: tool_calls")
        reasoning = reply.locator(".reasoning")
        sync_api.expect(reasoning).to_be_visible()
        sync_api.expect(reasoning.locator("summary")).to_have_text("Reasoning")
        sync_api.expect(reasoning).to_contain_text("pondering the weather")
        calls = reply.get_by_role("list", name="Tool calls").locator("li")
        sync_api.expect(calls).to_have_count(1)
        sync_api.expect(calls.first).to_contain_text("get_weather")
        sync_api.expect(calls.first.locator(".tool-arguments")).to_have_text('{"city": "Paris"}')
        assert "pondering" not in reply.locator(".content").inner_text()
        assert "<tool_call>{" not in reply.locator(".content").inner_text()
    finally:
        server.stop()


def test_stop_aborts_the_answer_and_the_request_leaves_the_server(page: Any) -> None:
    server = ServerProcess("--echo-delay-ms", "50", "--echo-cycle")
    try:
        page.goto(server.url + "/")
        sync_api.expect(page.get_by_label("Model").locator("option")).to_have_text(["echo"])
        page.get_by_label("Max tokens").fill("2000")  # 100 s of answer
        page.get_by_label("Message").fill("Go on forever")
        page.get_by_role("button", name="Send").click()
        reply = answer(page)
        sync_api.expect(reply.locator(".meta")).to_contain_text("TTFT")
        wait_until(lambda: inflight(server) == 1)
        page.get_by_role("button", name="Stop").click()
        sync_api.expect(reply.locator(".meta")).to_contain_text("stopped")
        wait_until(lambda: inflight(server) == 0)
        sync_api.expect(page.get_by_role("button", name="Stop")).to_be_disabled()
        sync_api.expect(page.get_by_role("button", name="Send")).to_be_enabled()
        assert len(reply.locator(".content").inner_text()) > 0
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_for_the_tab(
    browser: Any, page: Any, request: pytest.FixtureRequest
) -> None:
    server = ServerProcess("--api-key", "sesame", "--echo-delay-ms", "5")
    try:
        # The page itself is open and says nothing about the server; the API is not.
        html = httpx.get(server.url + "/", timeout=5)
        assert html.status_code == 200
        assert "echo" not in html.text
        assert httpx.get(server.url + "/status", timeout=5).status_code == 401
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401

        page.goto(server.url + "/")
        dialog = page.get_by_role("dialog")
        sync_api.expect(dialog).to_be_visible()
        sync_api.expect(page.get_by_label("Model").locator("option")).to_have_count(0)
        screenshot(page, "api-key", request)
        page.get_by_label("API key", exact=True).fill("wrong")
        page.get_by_label("API key", exact=True).press("Enter")
        sync_api.expect(dialog).to_be_visible()  # a wrong key is asked for again
        page.get_by_label("API key", exact=True).fill("sesame")
        page.get_by_role("button", name="Use this key").click()
        sync_api.expect(dialog).to_be_hidden()
        sync_api.expect(page.get_by_label("Model").locator("option")).to_have_text(["echo"])
        page.get_by_label("Message").fill("Hello with a key")
        page.get_by_role("button", name="Send").click()
        sync_api.expect(answer(page).locator(".meta")).to_contain_text("tokens/s")
        assert "Hello with a key" in answer(page).locator(".content").inner_text()
        assert page.evaluate("sessionStorage.getItem('llm-pipeline.api-key')") == "sesame"
        assert page.evaluate("localStorage.length") == 0
        # the key stays with this tab: another tab (context) is asked again
        other = browser.new_context().new_page()
        other.goto(server.url + "/")
        sync_api.expect(other.get_by_role("dialog")).to_be_visible()
        other.context.close()
    finally:
        server.stop()


def test_the_status_view_lists_the_workers_and_the_last_requests_stages(
    page: Any, request: pytest.FixtureRequest
) -> None:
    server = ServerProcess("--decode-workers", "2", "--router", "least-loaded")
    try:
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-request-id": "status-view-1"},
            timeout=10,
        )
        assert reply.status_code == 200
        page.goto(server.url + "/")
        page.get_by_role("link", name="Status").click()
        sync_api.expect(page.get_by_role("heading", name="Status")).to_be_visible()
        rows = page.locator("#workers tbody tr")
        sync_api.expect(rows).to_have_count(2)
        sync_api.expect(rows.nth(0)).to_contain_text("aggregated-0")
        sync_api.expect(rows.nth(1)).to_contain_text("aggregated-1")
        sync_api.expect(rows.nth(0)).to_contain_text("in-process")
        recent = page.locator("#recent .request")
        sync_api.expect(recent).to_have_count(1)
        sync_api.expect(recent.first).to_contain_text("status-view-1")
        stages = recent.first.locator(".stage-name")
        names = stages.all_inner_texts()
        for stage in ("preprocessor", "migration", "backend", "engine"):
            assert stage in names, names
        sync_api.expect(page.locator("#stat-requests")).to_have_text("1")
        sync_api.expect(page.locator("#stat-inflight")).to_have_text("0")
        screenshot(page, "status", request)
        # back to the chat by the keyboard alone
        page.get_by_role("link", name="Chat").focus()
        page.keyboard.press("Enter")
        sync_api.expect(page.get_by_label("Message")).to_be_visible()
    finally:
        server.stop()


def test_no_ui_serves_no_page(page: Any) -> None:
    server = ServerProcess("--no-ui")
    try:
        assert httpx.get(server.url + "/", timeout=5).status_code == 404
        assert httpx.get(server.url + "/status", timeout=5).status_code == 404
        assert httpx.get(server.url + "/ui/app.js", timeout=5).status_code == 404
    finally:
        server.stop()
