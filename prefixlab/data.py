"""Where the shared benchmark data lives (never copied into the repo): $PREFIXLAB_SHARED_DATA or ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """The shared data folder if present, else None (tests then skip with a reason)."""
    env = os.environ.get("PREFIXLAB_SHARED_DATA")
    candidates = [Path(env)] if env else []
    candidates += [_REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    return next((p for p in candidates if p.is_dir()), None)


def shared_file(relative: str) -> Path | None:
    """A file under the shared data folder, or None when it is absent."""
    root = shared_data_dir()
    path = root / relative if root else None
    return path if path is not None and path.is_file() else None
