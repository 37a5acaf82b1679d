"""The playground page at / in a real browser (Debian's headless chromium, driven by
selenium: a process of its own, so these tests are marked `proc`): a chat of two turns
against examples/omni_dialogue.py served (the second reporting cached tokens), a spoken reply
with a playable audio element, an image generated against examples/image_generation.py
served; a screenshot of each page is kept. Each page shows only the panels of the endpoints
its server's graphs serve (from /v1/models). The server is ``omni serve``'s, in this process
(in a thread of its own), on a loopback port the browser connects to.

Skipped, saying why, only where chromium and chromedriver are not installed (`make test`
installs them where it can: root with apt).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests._wait import wait_until_sync
from tests.serve._inproc import listening_in_a_thread
from tests.serve._server import ROOT

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.proc, pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (make test installs them as root)")]
# where to keep a screenshot of the chat too (the README's docs/playground.png is made so)
KEEP = os.environ.get("OMNI_PLAYGROUND_SCREENSHOT")


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1280,800", "--autoplay-policy=no-user-gesture-required",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def texts(browser, selector: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in browser.find_elements(By.CSS_SELECTOR, selector)]


def send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()


def assistant_metas(browser) -> list[str]:
    return [m for m in texts(browser, ".msg.assistant .meta") if "prompt tokens" in m]


def shown(browser, *ids: str) -> list[bool]:
    """Whether each element is displayed."""
    from selenium.webdriver.common.by import By

    return [browser.find_element(By.ID, i).is_displayed() for i in ids]


PANELS = ("chat-panel", "image-panel", "no-panel")


def test_chat_two_turns_with_cached_tokens_and_a_spoken_reply_in_chromium(
        browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selenium.webdriver.common.by import By

    monkeypatch.setenv("OMNI_DIALOGUE_OUT", str(tmp_path))
    with listening_in_a_thread(ROOT / "examples" / "omni_dialogue.py") as url:
        browser.get(url + "/")
        wait_until_sync(lambda: texts(browser, "#chat-model option"), "the model list")
        assert shown(browser, *PANELS) == [True, False, False]  # no image graph here
        send(browser, "Hello there")
        wait_until_sync(lambda: len(assistant_metas(browser)) == 1, "the first reply")
        send(browser, "And again")
        wait_until_sync(lambda: len(assistant_metas(browser)) == 2, "the second reply")
        metas = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")
        cached = [int(m.get_attribute("data-cached-tokens") or 0) for m in metas]
        assert cached[0] == 0 and cached[1] > 0, cached  # turn 2 reuses turn 1's pages
        browser.find_element(By.ID, "speak").click()
        send(browser, "Say it")
        wait_until_sync(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant audio"),
                        "the spoken reply's audio element")
        duration = browser.execute_script(
            "const a = document.querySelector('.msg.assistant audio');"
            "return new Promise(r => a.readyState >= 1 ? r(a.duration) :"
            " a.addEventListener('loadedmetadata', () => r(a.duration)));")
        assert duration > 0  # the browser decoded the WAV
        assert not texts(browser, ".msg.error")
        browser.save_screenshot(str(tmp_path / "chat.png"))
        if KEEP:
            shutil.copy(tmp_path / "chat.png", KEEP)
        browser.find_element(By.ID, "speak").click()  # text replies again
        prompt_tokens = [_prompt_tokens(m) for m in assistant_metas(browser)]
        # an uploaded image, then a recorded clip (chromium's fake microphone): each adds
        # its placeholder tokens to the prompt
        browser.find_element(By.ID, "image-file").send_keys(str(_png(tmp_path)))
        wait_until_sync(lambda: "image" in texts(browser, "#attached")[0], "the image attached")
        send(browser, "What is this?")
        wait_until_sync(lambda: len(assistant_metas(browser)) == 4, "the reply to the image")
        assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img")
        browser.find_element(By.ID, "record").click()
        wait_until_sync(lambda: browser.execute_script(
            "return recording !== null && recording.chunks.length >= 2"), "a recorded clip")
        browser.find_element(By.ID, "record").click()
        wait_until_sync(lambda: "audio" in texts(browser, "#attached")[0], "the clip attached")
        send(browser, "And this?")
        wait_until_sync(lambda: len(assistant_metas(browser)) == 5, "the reply to the clip")
        assert not texts(browser, ".msg.error"), texts(browser, ".msg.error")
        grown = [_prompt_tokens(m) for m in assistant_metas(browser)][len(prompt_tokens):]
        assert grown[0] > prompt_tokens[-1] + 16 and grown[1] > grown[0] + 16, grown
        assert (tmp_path / "chat.png").stat().st_size > 10_000


def _prompt_tokens(meta: str) -> int:
    return int(meta.split(" prompt tokens")[0])


def _png(folder: Path) -> Path:
    from PIL import Image

    path = folder / "square.png"
    Image.new("RGB", (32, 32), (200, 40, 40)).save(path)
    return path


def test_an_image_is_generated_and_shown_in_chromium(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with listening_in_a_thread(ROOT / "examples" / "image_generation.py") as url:
        browser.get(url + "/")
        wait_until_sync(lambda: texts(browser, "#image-model option"), "the model list")
        assert shown(browser, *PANELS) == [False, True, False]  # no chat graph here
        browser.find_element(By.ID, "image-prompt").send_keys("a red fox in snow")
        browser.find_element(By.ID, "generate").click()
        wait_until_sync(lambda: browser.find_elements(By.CSS_SELECTOR, "#images img"),
                        "the generated image")
        width = browser.execute_script(
            "const i = document.querySelector('#images img');"
            "return new Promise(r => i.complete ? r(i.naturalWidth) :"
            " i.addEventListener('load', () => r(i.naturalWidth)));")
        assert width == 128  # the PNG decoded at the size asked for
        assert "error" not in browser.find_element(By.ID, "status").get_attribute("class")
        browser.save_screenshot(str(tmp_path / "image.png"))
        assert (tmp_path / "image.png").stat().st_size > 10_000


def test_a_server_without_chat_or_image_graphs_shows_neither_panel_in_chromium(
        browser) -> None:
    with listening_in_a_thread(ROOT / "tests" / "serve" / "graphs.py") as url:
        browser.get(url + "/")
        wait_until_sync(lambda: "model(s)" in texts(browser, "#status")[0], "the model list")
        assert shown(browser, *PANELS) == [False, False, True]
        assert shown(browser, "chat-model-label", "image-model-label") == [False, False]
        assert "echo, numbers" in texts(browser, "#graph-names")[0]
