"""Where derived artefacts are cached (token maps, the native kernels' library)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$OPENFLASH_CACHE, else ~/.cache/openflash."""
    root = os.environ.get("OPENFLASH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "openflash"
