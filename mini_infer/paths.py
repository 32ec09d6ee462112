"""Where mini-infer keeps what it builds or writes once: compiled kernels and the default model."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MINI_INFER_CACHE, else the XDG cache dir."""
    if explicit := os.environ.get("MINI_INFER_CACHE"):
        return Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mini-infer"
    return Path.home() / ".cache" / "mini-infer"
