"""The playground page in a real headless browser (Debian's chromium, driven by Selenium with the
system chromedriver; nothing is downloaded): send a message, see tokens stream in, and see both
colours (accepted drafts and the target's own tokens) when speculation accepts drafts."""

from __future__ import annotations

import shutil

import pytest
from server_helpers import Server, wait_for

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(scripts/setup.sh --test installs them with apt-get)")


def test_a_message_streams_back_coloured_by_source(tiny_models, tmp_path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    spec = ["--spec-method", "ngram", "--spec-tokens", "3", "--spec-lookup-min", "1"]
    with Server(tiny_models["llama"], *spec) as server:
        options = Options()
        options.binary_location = CHROMIUM
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(DRIVER), options=options)
        try:
            driver.get(server.base + "/")
            driver.find_element(By.ID, "max_tokens").clear()
            driver.find_element(By.ID, "max_tokens").send_keys("120")
            driver.find_element(By.ID, "temperature").send_keys("0")  # greedy: the n-gram drafts get accepted
            box = driver.find_element(By.ID, "input")
            box.send_keys("abcabcabcabcabcabcabcabc")
            driver.find_element(By.ID, "send").click()

            def spans(kind):
                return driver.find_elements(By.CSS_SELECTOR, f".assistant span.{kind}")

            assert wait_for(lambda: len(spans("target")) > 0, timeout=30)  # tokens stream in
            assert wait_for(lambda: driver.find_element(By.ID, "count").text == str(
                len(spans("draft")) + len(spans("target"))) and len(spans("draft")) > 0, timeout=60)
            assert driver.find_element(By.ID, "error").text == ""
            assert float(driver.find_element(By.ID, "al").text) > 1.0
            driver.save_screenshot(str(tmp_path / "playground.png"))
            assert (tmp_path / "playground.png").stat().st_size > 1000
        finally:
            driver.quit()
