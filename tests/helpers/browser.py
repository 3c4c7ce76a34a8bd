"""A headless Chromium driven by selenium for the page tests, with its network log kept.

Debian's ``chromium`` and ``chromium-driver`` (``scripts/setup.sh`` installs them as root); the tests
skip, naming what is missing, where they are not installed. Every request the pages make is read
from Chrome's performance log (DevTools ``Network.requestWillBeSent``), so a test can assert that
nothing left the router's origin.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers.deployment import wait_for

WIDTH, HEIGHT = 1280, 800
MISSING = (
    "the browser tests need Debian's chromium and chromium-driver "
    "(as root: apt-get install chromium chromium-driver; scripts/setup.sh does it) and selenium (the test extra)"
)
FLAGS = (
    "--headless=new",
    "--no-sandbox",  # root in a container
    "--disable-dev-shm-usage",
    "--disable-gpu",
    f"--window-size={WIDTH},{HEIGHT}",
    "--force-device-scale-factor=1",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-extensions",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-component-update",
    "--disable-background-networking",  # the browser's own update and safe-browsing calls
    "--lang=en-US",
)


def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver) executables; skips the test when either or selenium is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip(f"{MISSING}: {'chromium' if not chromium else 'chromedriver'} not found on PATH")
    pytest.importorskip("selenium", reason=MISSING)
    return chromium, driver


class Browser:
    """One headless Chromium (a 1280×800 viewport). ``requests`` grows with every URL the pages
    asked for, read from the performance log by :meth:`network`."""

    def __init__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        chromium, driver = chromium_paths()
        options = Options()
        options.binary_location = chromium
        for flag in FLAGS:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        self.requests: list[str] = []
        self.responses: dict[str, str] = {}  # url -> MIME type of its response

    def quit(self) -> None:
        self.driver.quit()

    def network(self) -> list[str]:
        """The URLs requested since the last call (this call drains Chrome's log; :attr:`requests`
        keeps them all)."""
        new = []
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            params = message.get("params", {})
            if message.get("method") == "Network.requestWillBeSent":
                new.append(params["request"]["url"])
            elif message.get("method") == "Network.responseReceived":
                self.responses[params["response"]["url"]] = params["response"].get("mimeType", "")
        self.requests.extend(new)
        return new

    def foreign_requests(self, *origins: str) -> list[str]:
        """URLs requested since the last look from anywhere but ``origins`` (``http://host:port``);
        data: and blob: URLs are made by the page itself and never leave the browser."""
        allowed = {urlsplit(o)[:2] for o in origins}
        return [u for u in self.network() if not u.startswith(("data:", "blob:")) and urlsplit(u)[:2] not in allowed]

    def open(self, url: str) -> None:
        self.driver.get(url)

    def leave(self) -> None:
        """Go to a blank page and forget the requests so far (a page still polling another
        deployment stops before the next test looks at the log)."""
        self.driver.get("about:blank")
        self.network()

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str) -> list:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait(self, predicate, timeout: float = 60.0, what: str = ""):
        """:func:`tests.helpers.deployment.wait_for` on the page; a vanished element counts as not yet."""
        from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

        def attempt():
            try:
                return predicate()
            except (NoSuchElementException, StaleElementReferenceException):
                return None

        return wait_for(attempt, timeout, interval=0.1, what=what)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def set_value(self, css: str, value) -> None:
        """Set a form field as a person would end up with it, firing its input and change events."""
        self.js(
            "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
            "e.dispatchEvent(new Event('input', {bubbles: true})); e.dispatchEvent(new Event('change', {bubbles: true}));",
            css,
            value,
        )

    def screenshot(self, path: Path) -> Path:
        self.driver.save_screenshot(str(path))
        return path

    def console_errors(self, expected: tuple[str, ...] = ()) -> list[str]:
        """The page's console errors and CSP violations logged since the last call, but those
        containing one of ``expected`` (a 401 the test provoked)."""
        errors = [e["message"] for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]
        return [m for m in errors if not any(x in m for x in expected)]
