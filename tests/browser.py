"""Headless Chromium for the HTML tests: Debian's ``chromium`` and ``chromium-driver``
driven by selenium (no browser download). ``.ci/run`` installs both; where they are
missing, ``skip_reason()`` says why and the tests skip with it.

As root, Chromium needs ``--no-sandbox``; a fresh ``--user-data-dir`` per driver
keeps runs (and engineers sharing a machine) apart; the other flags keep it off
the network.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def skip_reason() -> str | None:
    """Why no browser test can run here, or None."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        return (
            f"no headless browser: {', '.join(missing)} missing "
            "(apt-get install -y chromium chromium-driver; .ci/run does)"
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


class Browser:
    """A headless Chromium window of ``width`` x ``height`` CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 1400):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="yafsdp-chromium-")
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in (*FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"):
            opts.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)

    def open(self, path: Path) -> None:
        self.driver.get(path.resolve().as_uri())

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        """A PNG of the window, or of the whole page (the window grown to its height)."""
        if full_page:
            height = self.js("return document.documentElement.scrollHeight")
            width = self.js("return window.innerWidth")
            self.driver.set_window_size(width, height + 140)  # + the window's chrome
        self.driver.save_screenshot(str(path))

    def close(self) -> None:
        self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
