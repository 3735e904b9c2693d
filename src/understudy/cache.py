"""Where understudy keeps what it derives once per machine: fetched models, converted weights,
compiled kernels. Its own module so that every layer (kernels, models, drafters) can ask for
it without importing another's."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "UNDERSTUDY_CACHE"


def cache_dir() -> Path:
    """The cache root, created if missing.

    `$UNDERSTUDY_CACHE` if set, else `$XDG_CACHE_HOME/understudy`, else `~/.cache/understudy`.
    """
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "understudy"
    else:
        root = Path.home() / ".cache" / "understudy"
    root.mkdir(parents=True, exist_ok=True)
    return root
