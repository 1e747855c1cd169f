"""Where asyncengine keeps files between runs (converted models, built native kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$ASYNCENGINE_CACHE`, else `$XDG_CACHE_HOME/asyncengine`, else `~/.cache/asyncengine`."""
    explicit = os.environ.get("ASYNCENGINE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "asyncengine"
