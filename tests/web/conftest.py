"""A headless Debian chromium driven by Selenium, and the real server (default model) it talks to.

The browser is the system's (`apt-get install chromium chromium-driver`, as `.ci/run` does); Selenium
is pointed at its chromedriver so that nothing is downloaded. Without one the tests skip, unless
WEB_TESTS_REQUIRE_CHROMIUM is set (CI), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from clients.server_proc import spawned_server

API_KEY = "web-test-key"
BUDGET = 64
SCREENSHOTS = Path(__file__).parent / "screenshots"


def _binary(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    browser, driver = _binary("chromium", "chromium-browser"), _binary("chromedriver")
    if browser is None or driver is None:
        message = "no chromium and chromedriver (apt-get install chromium chromium-driver)"
        if os.environ.get("WEB_TESTS_REQUIRE_CHROMIUM"):
            pytest.fail(message)
        pytest.skip(message)
    return browser, driver


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """`python -m server` on the default model at a small budget, so a few turns evict."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--kv-budget", str(BUDGET), "--threads", "2", "--api-key", API_KEY]
    with spawned_server("h2o", args, log=log, ready_timeout=300) as url:
        yield url


@pytest.fixture
def browser(chromium):
    """A fresh headless browser per test (empty localStorage); desktop-sized."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1000", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
