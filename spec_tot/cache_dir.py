"""Where spec-tot keeps what it learns about a machine between runs (the engine's
calibration, fetched models, compiled kernels, speculation hit rates)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The project's cache directory: ``$SPEC_TOT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/spec-tot``, else ``~/.cache/spec-tot`` (never inside the installed
    package)."""
    given = os.environ.get("SPEC_TOT_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spec-tot"
