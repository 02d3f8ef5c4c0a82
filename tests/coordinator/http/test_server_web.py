"""The web chat at `/`, in a real browser: Debian's headless Chromium driven by selenium against
`deltafin-coordinator --local serve` over the tiny checkpoint (a subprocess on 127.0.0.1, with --api-key).

The page's replies at temperature 0 must be the greedy replies the official `openai` client gets for the same
conversation; its stats line, cluster panel (from /v1/status), API-key field, error display and stop button are
checked on the way. The page's time from send to the first streamed character (performance.now(), on the reply's
data-ttft-ms) is logged. Set DELTAFIN_SCREENSHOT=PATH to keep a screenshot of the page after the replies (the
README's is deploy/web-chat.png); DELTAFIN_REQUIRE_BROWSER=1 (.ci/run sets it) fails instead of skipping when
Chromium or its driver is missing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.support.cluster import ServerProcess

log = logging.getLogger(__name__)

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "sk-web-test"
MAX_TOKENS = 16

pytestmark = pytest.mark.slow


def _browser_or_skip() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        why = f"{' and '.join(missing)} missing: apt-get install chromium chromium-driver"
        if os.environ.get("DELTAFIN_REQUIRE_BROWSER"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def server(tiny_dir: Path):
    srv = ServerProcess(tiny_dir, "--local", serve_args=("--api-key", KEY, "--max-active", "1",
                                                                 "--max-context", "8192"))
    yield srv
    srv.stop()


@pytest.fixture
def driver(tmp_path: Path):
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1200,860", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    d = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield d
    d.quit()


def _status(url: str) -> dict:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _text(element) -> str:
    return element.get_property("textContent")  # exactly as set (WebElement.text normalizes whitespace)


def _send(driver, text: str, until: tuple[str, ...] = ("done", "error", "stopped"), timeout: float = 120):
    """Type `text`, send it, wait for its reply to reach a state of `until` (by default: to end); the reply's
    <li>."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    replies = lambda: driver.find_elements(By.CSS_SELECTOR, "#log li.assistant")
    before = len(replies())
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, timeout).until(lambda d: len(replies()) > before)
    li = replies()[-1]
    WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: li.get_attribute("data-state") in until)
    return li


def _reply(li) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    return _text(li.find_element(By.CSS_SELECTOR, ".reasoning .text")), _text(li.find_element(By.CSS_SELECTOR,
                                                                                            ".content"))


def _set(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value + Keys.TAB)  # leaving the field fires its change event (kept in localStorage)


def _greedy(url: str, messages: list[dict], effort: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str, str]:
    """(reasoning, content, finish_reason) of the API's greedy reply."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=max_tokens,
                                       reasoning_effort=effort)
    msg = r.choices[0].message
    return getattr(msg, "reasoning_content", None) or "", msg.content or "", r.choices[0].finish_reason


def test_web_chat_streams_the_greedy_replies_and_shows_the_cluster(server: ServerProcess, driver,
                                                                   tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver.get(server.url + "/")
    assert driver.title == "Deltafin chat"
    panel_error = driver.find_element(By.ID, "cluster-error")
    WebDriverWait(driver, 30).until(lambda d: "401" in _text(panel_error))  # no key yet: said, not swallowed
    box = driver.find_element(By.ID, "prompt")
    box.send_keys("lost")
    driver.find_element(By.ID, "send").click()
    notice = WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#log .error"))[0]
    assert "401" in _text(notice) and "API key" in _text(notice) and box.get_property("value") == "lost"

    _set(driver, "api-key", KEY)
    status = _status(server.url)
    (worker,) = status["workers"]
    start, end = worker["layers"]
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#workers tbody tr"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
    cells = [_text(c) for c in rows[0].find_elements(By.CSS_SELECTOR, "th, td")]
    assert cells[:2] == [worker["name"], f"{start}–{end - 1}"] and cells[3] == "resident"
    assert panel_error.get_property("hidden") and _text(driver.find_element(By.ID, "model-name")) == status["model"]

    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", str(MAX_TOKENS))
    first = "What is a token?"
    li = _send(driver, first)
    assert li.get_attribute("data-state") == "done", _text(li)
    reasoning, content = _reply(li)
    assert (reasoning, content, "length") == _greedy(server.url, [{"role": "user", "content": first}], "low")
    assert reasoning  # tiny's random text: all of it in the think channel, folded in <details>
    assert not driver.find_elements(By.CSS_SELECTOR, "#log .notice")  # the failed try's notice went with it
    folded = li.find_element(By.CSS_SELECTOR, ".reasoning .text")
    assert not folded.is_displayed()
    li.find_element(By.CSS_SELECTOR, ".reasoning summary").click()
    assert folded.is_displayed() and not li.find_element(By.CSS_SELECTOR, ".progress").is_displayed()
    stats = _text(li.find_element(By.CSS_SELECTOR, ".stats"))
    assert re.fullmatch(rf"first token \d+\.\d\d s · \d+\.\d tok/s · {MAX_TOKENS} tokens · prompt \d+ · cut at max "
                        r"tokens", stats), stats
    ttft_ms = float(li.get_attribute("data-ttft-ms"))
    log.info("send -> first streamed character in Chromium: %.1f ms", ttft_ms)
    assert 0 < ttft_ms < 60_000

    Select(driver.find_element(By.ID, "effort")).select_by_value("none")
    second = "And in one word?"
    li2 = _send(driver, second)
    assert li2.get_attribute("data-state") == "done", _text(li2)
    history = [{"role": "user", "content": first},
               {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})},
               {"role": "user", "content": second}]
    assert (*_reply(li2), "length") == _greedy(server.url, history, "none") and _reply(li2)[1]  # all content
    assert not li2.find_element(By.CSS_SELECTOR, ".reasoning").is_displayed()
    ttft2_ms = float(li2.get_attribute("data-ttft-ms"))
    log.info("second turn: send -> first streamed character %.1f ms", ttft2_ms)

    counters = _status(server.url)["counters"]
    assert counters["requests"] == 4 and counters["generated_tokens"] == 4 * MAX_TOKENS  # page 2, API 2
    shown = "//dl[@id='cluster-summary']//dt[.='requests']/following-sibling::dd"  # re-rendered at each poll
    WebDriverWait(driver, 30, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: _text(d.find_element(By.XPATH, shown)) == "4")  # polled after each reply, and every 5 s
    driver.set_window_size(1200, 1040)
    _screenshot(driver, tmp_path)
    _stop_cancels(driver, server.url)
    driver.set_window_size(400, 800)  # narrow: nothing wider than the window
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")


def _stop_cancels(driver, url: str) -> None:
    """Stop on a reply that waits for the one slot (--max-active 1) behind a long API stream: after HEARTBEAT_S
    its stream opens with the server's `: waiting for a slot` comment, which the page shows; Stop aborts the fetch
    and the server drops the request from the queue, while the other stream runs on."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    hog = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hold the slot"}],
                                         max_tokens=7500, stream=True, extra_body={"ignore_eos": True})
    next(iter(hog))  # it holds the slot (and, unread, its socket's buffers fill and hold the generation there)
    li = _send(driver, "Are you busy?", until=("waiting",))
    said = li.find_element(By.CSS_SELECTOR, ".progress span")
    WebDriverWait(driver, 60).until(lambda d: _text(said) == "waiting for a slot")  # the SSE comment
    assert _status(url)["queue"] == {"running": 1, "waiting": 1}
    driver.find_element(By.ID, "stop").click()
    WebDriverWait(driver, 30).until(lambda d: li.get_attribute("data-state") == "stopped")
    assert "stopped" in _text(li.find_element(By.CSS_SELECTOR, ".stats"))
    assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()
    WebDriverWait(driver, 30, poll_frequency=0.2).until(lambda d: _status(url)["queue"]["waiting"] == 0)
    assert _status(url)["queue"]["running"] == 1  # the API stream still generates
    hog.close()
    WebDriverWait(driver, 30, poll_frequency=0.2).until(lambda d: _status(url)["counters"]["cancelled"] == 1)


def _screenshot(driver, tmp_path: Path) -> None:
    shot = tmp_path / "web-chat.png"
    driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DELTAFIN_SCREENSHOT"):
        shutil.copy(shot, os.environ["DELTAFIN_SCREENSHOT"])
