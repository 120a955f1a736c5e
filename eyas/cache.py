"""eyas's cache folder: converted models, built kernels and per-CPU measurements live below it.

It is ``$EYAS_CACHE_DIR``, else ``$XDG_CACHE_HOME/eyas``, else ``~/.cache/eyas``. This module imports nothing of
eyas, so every layer may ask for it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("EYAS_CACHE_DIR"):
        return Path(os.environ["EYAS_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "eyas"
    return Path.home() / ".cache" / "eyas"
