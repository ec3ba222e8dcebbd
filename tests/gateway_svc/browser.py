"""Headless Chromium (Debian's `chromium` package) driven by Playwright: Playwright cannot download
its own browser here, so it is pointed at the system one with a fresh profile and no network
side-channels (updates, sync, QUIC)."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def available() -> bool:
    return Path(CHROMIUM).exists()


@contextmanager
def browser_page(profile_dir: Path, width: int = 1400, height: int = 900):
    """A page in a fresh Chromium profile; closed with the browser on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile_dir), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": width, "height": height},
        )
        try:
            yield context.new_page()
        finally:
            context.close()
