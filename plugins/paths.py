"""Where the engine and its plugins keep what they build once per host (compiled kernels,
converted models, chat history): one root, `$RUNTIME_CACHE_DIR`, else
`$XDG_CACHE_HOME/runtime`, else `~/.cache/runtime`."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "RUNTIME_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """The cache root, or the folder `parts` below it (not created)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "runtime")
    return Path(root, *parts)
