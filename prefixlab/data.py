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


def absent(*relative: str) -> str | None:
    """None when every one of these shared data files is present; else, for a skip, the first missing one and how to
    point at the shared data (an unset or mistyped PREFIXLAB_SHARED_DATA)."""
    missing = next((name for name in relative if shared_file(name) is None), None)
    if missing is None:
        return None
    env, root = os.environ.get("PREFIXLAB_SHARED_DATA"), shared_data_dir()
    where = root / missing if root else f"../shared/data/{missing}"
    if env and not Path(env).is_dir():
        return f"PREFIXLAB_SHARED_DATA={env} is not a folder ({where} not present either)"
    return f"{where} not present (set PREFIXLAB_SHARED_DATA to the shared data folder to run this)"
