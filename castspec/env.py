"""Where castspec keeps files, and the environment switches it reads. A leaf: imports nothing of castspec."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("CASTSPEC_CACHE", Path.home() / ".cache" / "castspec"))
