"""Set-up for the browser tests: a real headless Chromium driven by Playwright.

Installs what is missing, once per test session, the way that works on these machines: Debian's
`chromium` package (apt-get) and the `playwright` Python package (pip). Never
`playwright install` (it downloads its own browser). `make setup` never does any of this, so
it cannot fail for want of a browser; where nothing can be installed the browser tests skip
and say why. Set UNDERSTUDY_NO_BROWSER_INSTALL=1 to forbid installing (then the tests run
only if both are already there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

_problem: str | None = None
_checked = False


def _run(cmd: list[str], timeout: float) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return done.returncode == 0, " / ".join(tail)


def _install_chromium() -> str | None:
    if Path(CHROMIUM).exists():
        return None
    if shutil.which("apt-get") is None:
        return "no /usr/bin/chromium and no apt-get to install Debian's chromium package"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "no /usr/bin/chromium, and installing it needs root (apt-get install chromium)"
    ok, log = _run(["apt-get", "install", "-y", "-q", "chromium"], timeout=300)
    if not ok:  # the package lists may be missing or stale
        _run(["apt-get", "update", "-q"], timeout=300)
        ok, log = _run(["apt-get", "install", "-y", "-q", "chromium"], timeout=300)
    if not ok or not Path(CHROMIUM).exists():
        return f"could not install Debian's chromium package: {log}"
    return None


def _install_playwright() -> str | None:
    try:
        importlib.import_module("playwright.sync_api")
        return None
    except ImportError:
        pass
    ok, log = _run([sys.executable, "-m", "pip", "install", "-q", "playwright"], timeout=300)
    importlib.invalidate_caches()
    try:
        importlib.import_module("playwright.sync_api")
    except ImportError:
        return f"could not install the playwright Python package: {log}"
    return None


def require_browser() -> None:
    """Make sure Chromium and Playwright are there (installing them if allowed), or skip."""
    global _problem, _checked
    if not _checked:
        _checked = True
        forbid = os.environ.get("UNDERSTUDY_NO_BROWSER_INSTALL") == "1"
        if forbid:
            missing = []
            if not Path(CHROMIUM).exists():
                missing.append(CHROMIUM)
            if importlib.util.find_spec("playwright") is None:
                missing.append("the playwright package")
            if missing:
                _problem = f"UNDERSTUDY_NO_BROWSER_INSTALL=1 and {' and '.join(missing)} missing"
        else:
            _problem = _install_chromium() or _install_playwright()
    if _problem:
        pytest.skip(f"browser tests need a real Chromium: {_problem}")


def launch(playwright):
    """Debian's Chromium, headless, with the flags found to work here."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
