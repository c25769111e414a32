"""A page in a real headless Chromium (Debian's package, driven by Playwright), for browser tests.

``make test`` installs the package (the Makefile's chromium target). Screenshots go to
``ARTIFACTS`` for a person to look at.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@asynccontextmanager
async def browser_page(height: int = 900, *, page_errors: bool = False) -> AsyncIterator[Any]:
    """A 1360-wide page; on leaving, the test fails if the page's scripts raised (unless
    ``page_errors``: a test that takes the server away on purpose)."""
    from playwright.async_api import async_playwright

    if not CHROMIUM.exists():
        pytest.fail("needs Debian's chromium: apt-get install -y chromium (make test installs it)")
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1360, "height": height})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
        finally:
            await browser.close()
    assert page_errors or errors == [], errors
