"""The chat page in a real headless chromium against `python -m server` on the default model.

One server for the module (loading the model is the slow part); a fresh browser per test.
Screenshots of the chat and the inspector go to tests/web/screenshots/ (shown in the README).
"""

import re

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from server.settings import DEFAULT_RECALL
from tests.web.conftest import API_KEY, BUDGET, SCREENSHOTS

pytestmark = [pytest.mark.model, pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def until(browser, condition, timeout: float = 60):
    """Wait for condition(browser) to be truthy; returns it."""
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda b: condition(b))


def by_id(browser, element_id: str):
    return browser.find_element(By.ID, element_id)


def open_page(browser, url: str, key: str | None = API_KEY) -> None:
    browser.get(url)
    if key is not None:
        browser.execute_script("localStorage.setItem('h2o-chat.api-key', arguments[0])", key)
        browser.get(url)
    until(browser, lambda b: by_id(b, "model").text or by_id(b, "error").is_displayed())


def settings(browser, **fields) -> None:
    if not by_id(browser, "settings").is_displayed():
        by_id(browser, "toggle-settings").click()
    for name, value in fields.items():
        field = by_id(browser, name.replace("_", "-"))
        field.clear()
        field.send_keys(str(value))


def say(browser, text: str) -> None:
    prompt = by_id(browser, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)  # Enter sends (Shift+Enter would be a new line)


def replies(browser) -> list:
    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")


def done(browser) -> bool:
    return not by_id(browser, "stop").is_displayed() and by_id(browser, "send").is_displayed()


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.M)}


def test_a_missing_or_wrong_key_shows_an_error_never_a_blank_page(browser, server_url):
    open_page(browser, server_url, key=None)
    error = until(browser, lambda b: by_id(b, "error").is_displayed() and by_id(b, "error"))
    assert "needs an API key" in error.text and by_id(browser, "api-key").is_displayed()
    by_id(browser, "api-key").send_keys("wrong-key", Keys.ENTER)
    until(browser, lambda b: "refused" in by_id(b, "error").text)
    say(browser, "Hello?")
    until(browser, lambda b: done(b) and "refused" in by_id(b, "error").text)
    assert not replies(browser) and by_id(browser, "prompt").get_attribute("value") == "Hello?"
    assert by_id(browser, "composer").is_displayed() and by_id(browser, "inspector-title").is_displayed()
    browser.save_screenshot(str(SCREENSHOTS / "api-key-error.png"))

    key = by_id(browser, "api-key")
    key.clear()
    key.send_keys(API_KEY, Keys.ENTER)
    until(browser, lambda b: by_id(b, "model").text and not by_id(b, "error").is_displayed())
    assert browser.execute_script("return localStorage.getItem('h2o-chat.api-key')") == API_KEY


def test_replies_stream_and_the_inspector_shows_kept_and_evicted_tokens(browser, server_url):
    open_page(browser, server_url)
    settings(browser, temperature=0, max_tokens=40)
    say(browser, "Write a short poem about the sea.")
    # Streaming: text appears while the reply is still being generated (Stop is showing).
    until(browser, lambda b: replies(b) and replies(b)[0].text.strip() and by_id(b, "stop").is_displayed())
    until(browser, done, timeout=180)
    say(browser, "Now give me a Python function that reverses a string.")
    until(browser, lambda b: len(replies(b)) == 2 and done(b), timeout=180)
    assert all(r.text.strip() for r in replies(browser))

    session = browser.execute_script("return JSON.parse(localStorage.getItem('h2o-chat.conversation')).sessionId")
    view = httpx.get(f"{server_url}/v1/sessions/{session}/cache", headers=AUTH, timeout=30).json()
    # resident: the row's own tokens (at most the budget) and its recall window (on by default)
    assert len(view["turns"]) == 2 and view["conversation_tokens"] > BUDGET
    assert view["resident_tokens"] <= min(BUDGET + DEFAULT_RECALL, view["conversation_tokens"])
    # The inspector catches up after the turn: the token view of layer 0, head 0 marks exactly what it holds.
    until(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#tokens span")) == view["conversation_tokens"])
    kept = browser.find_elements(By.CSS_SELECTOR, "#tokens span.kept")
    evicted = browser.find_elements(By.CSS_SELECTOR, "#tokens span.evicted")
    # Every token fed is kept or evicted; the last one sampled is not fed yet.
    assert len(kept) == view["resident_tokens"] and len(evicted) == view["conversation_tokens"] - 1 - len(kept)
    assert {k.get_attribute("title").split()[0] for k in kept} == {f"#{p}" for p in view["layers"][0][0]["positions"]}
    assert f"holds {view['resident_tokens']}" in by_id(browser, "cache-summary").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#turns-chart polyline")) == 2

    # Another head, chosen with the keyboard: its own tokens are highlighted.
    layer = by_id(browser, "layer")
    layer.send_keys(Keys.END)  # the last layer
    last = len(view["layers"]) - 1
    until(browser, lambda b: f"Layer {last}," in by_id(b, "head-summary").text)
    kept = browser.find_elements(By.CSS_SELECTOR, "#tokens span.kept")
    assert {k.get_attribute("title").split()[0] for k in kept} == {f"#{p}" for p in view["layers"][last][0]["positions"]}

    # Or with the mouse, on the overview: layer 2, KV head 2 (rows of 8 px under a 12 px header, 26 px of labels).
    canvas = by_id(browser, "heads")
    width, height = canvas.size["width"], canvas.size["height"]
    ActionChains(browser).move_to_element_with_offset(
        canvas, -width / 2 + 26 + (width - 26) * 5 / 6, -height / 2 + 12 + 2.5 * 8).click().perform()
    until(browser, lambda b: "Layer 2, KV head 2:" in by_id(b, "head-summary").text)

    browser.save_screenshot(str(SCREENSHOTS / "chat.png"))
    browser.set_window_size(1280, 2000)  # tall enough for the whole inspector, token view included
    inspector = browser.find_element(By.CSS_SELECTOR, ".inspector")
    until(browser, lambda b: inspector.rect["height"] + inspector.rect["y"] < 2000)
    inspector.screenshot(str(SCREENSHOTS / "inspector.png"))
    browser.set_window_size(390, 844)  # a phone: one column, nothing wider than the screen
    until(browser, lambda b: b.execute_script("return document.documentElement.scrollWidth <= window.innerWidth"))
    browser.save_screenshot(str(SCREENSHOTS / "phone.png"))

    browser.refresh()  # a reload continues the session: the conversation and its cache come back
    until(browser, lambda b: len(replies(b)) == 2 and f"holds {view['resident_tokens']}" in by_id(
        b, "cache-summary").text)


def test_stop_ends_the_generation_on_the_server(browser, server_url):
    open_page(browser, server_url)
    # Greedy: at temperature 1 about one reply in 20 ended within 40 tokens, before the first poll.
    settings(browser, temperature=0, max_tokens=3000)
    cancelled = metrics(server_url).get('h2o_requests_finished_total{reason="cancelled"}', 0)
    for _ in range(3):  # another CPU may round its way to an early end: then ask again in a new chat
        say(browser, "Tell me a very long story about a lighthouse keeper.")
        # Mid-reply the inspector polls a live view of the cache.
        until(browser, lambda b: by_id(b, "live").is_displayed() or done(b) and replies(b), timeout=60)
        if by_id(browser, "live").is_displayed():
            break
        by_id(browser, "new-chat").click()
    assert by_id(browser, "live").is_displayed(), "three replies in a row ended before the inspector's first poll"
    assert metrics(server_url)["h2o_running_sequences"] == 1
    by_id(browser, "stop").click()
    until(browser, done, timeout=10)
    assert "stopped" in replies(browser)[0].find_element(By.XPATH, "..").get_attribute("class")
    until(browser, lambda b: metrics(server_url).get('h2o_requests_finished_total{reason="cancelled"}', 0)
          == cancelled + 1, timeout=10)
    assert metrics(server_url)["h2o_running_sequences"] == 0
    assert metrics(server_url)["h2o_generated_tokens_total"] < 3000  # it stopped long before max_tokens

    by_id(browser, "new-chat").click()
    assert not replies(browser) and by_id(browser, "cache-summary").text == "No conversation yet."
    assert browser.execute_script("return JSON.parse(localStorage.getItem('h2o-chat.conversation'))") == {
        "sessionId": None, "messages": []}


def test_markdown_is_rendered_and_html_is_escaped(browser, server_url):
    open_page(browser, server_url)
    render = """const [text, done] = arguments;
                import('/static/markdown.js').then((m) => done(m.renderMarkdown(text)));"""
    source = "# Title\n**bold** and `x<y`\n\n- one\n- two\n\n```py\nif a < b:\n    pass\n```"
    html = browser.execute_async_script(render, source)
    assert html == ('<h3>Title</h3><p><strong>bold</strong> and <code>x&lt;y</code></p>'
                    '<ul><li>one</li><li>two</li></ul><pre data-lang="py"><code>if a &lt; b:\n    pass</code></pre>')
    hostile = browser.execute_async_script(render, '<img src=x onerror="alert(1)"> [a](javascript:alert(1)) ```\n<b>')
    assert "<img" not in hostile and "<b>" not in hostile and "<a " not in hostile  # text, not markup or a link
    streaming = browser.execute_async_script(render, "Here:\n```js\nlet a = 1;")  # an unclosed fence
    assert streaming == '<p>Here:</p><pre data-lang="js"><code>let a = 1;</code></pre>'
